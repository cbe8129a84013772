"""The offline API: prompt forms, per-prompt params, finish reasons, logprobs, errors, chat."""

from __future__ import annotations

import time

import pytest
import torch
from worker.factories import hf_greedy, random_prompts

from pagedserve import LLM, SamplingParams
from servicekit.contract.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=8, dtype="float32")


def test_single_and_batched_token_prompts(llm):
    p1, p2 = random_prompts([6, 9], seed=1)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (one,) = llm.generate(p1, params)
    both = llm.generate([p1, p2], params)
    assert one.token_ids == both[0].token_ids and len(both) == 2
    assert one.prompt_token_ids == p1 and one.prompt is None and one.text == ""
    assert one.finish_reason == "length" and len(one.token_ids) == 5


def test_per_prompt_params_and_stop_tokens(llm, tiny_llama):
    p1, p2 = random_prompts([7, 7], seed=2)
    first = hf_greedy(tiny_llama.hf, p1, 3)
    outputs = llm.generate([p1, p2], [SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first[2]]),
                                      SamplingParams(max_tokens=2, temperature=0.0)])
    assert outputs[0].token_ids == first and outputs[0].finish_reason == "stop"
    assert len(outputs[1].token_ids) == 2 and outputs[1].finish_reason == "length"
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([p1, p2], [SamplingParams()])


def test_each_output_carries_its_timings(llm):
    """TTFT and TPOT of the in-process engine come from ``RequestOutput.metrics`` (benchmarks/serve.py --llm)."""
    short, long = random_prompts([4, 40], seed=4)
    before = time.monotonic()
    outputs = llm.generate([short, long], [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    after = time.monotonic()
    for out in outputs:
        m = out.metrics
        assert before <= m.arrival_time < m.first_token_time <= m.last_token_time <= m.finished_time <= after
    quick, slow = (o.metrics for o in outputs)
    assert quick.finished_time < slow.finished_time  # 2 tokens end steps before 6 do
    assert slow.first_token_time < slow.last_token_time  # five more steps after the first token


def test_logprobs_one_per_token(llm):
    (out,) = llm.generate(random_prompts([5], seed=3), SamplingParams(max_tokens=4, temperature=0.0, logprobs=2,
                                                                       ignore_eos=True))
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top) == 2 and lp.top[0][0] == token  # greedy: the best one
        assert lp.logprob <= 0.0


def test_invalid_requests_raise_before_anything_runs(llm):
    good = random_prompts([4], seed=4)[0]
    with pytest.raises(InvalidArgumentError, match="prompt"):
        llm.generate([good, [10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError, match="prompt: token ids must be integers, got 1.5"):
        llm.generate([good, [1.5, 2]], SamplingParams(max_tokens=2))  # was: run as [1, 2]
    with pytest.raises(InvalidArgumentError, match="prompt: must be Unicode text"):
        llm.generate(["\ud800"], SamplingParams(max_tokens=2))
    assert not llm.scheduler.has_unfinished_requests()
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer")
    assert llm.generate([good], SamplingParams(max_tokens=2))[0].finish_reason is not None


def test_progress_bar_is_opt_in(llm, capsys):
    prompts = random_prompts([3, 4], seed=5)
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=True)
    assert "generate" in capsys.readouterr().err
    llm.generate(prompts, SamplingParams(max_tokens=2))
    assert "generate" not in capsys.readouterr().err


def test_unsupported_model_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    from worker_service.models import UnsupportedModelError

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_text_and_chat(smollm2):
    llm = LLM("smollm2-135m", hf_model=smollm2.hf, max_model_len=1024, dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (chat,) = llm.chat(messages, params)
    template = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.prompt == template and "<|im_start|>assistant" in template
    assert chat.prompt_token_ids == smollm2.tokenizer.encode(template, add_special_tokens=False)
    with torch.inference_mode():  # transformers stops at EOS too, and keeps it
        ids = torch.tensor([chat.prompt_token_ids])
        expected = smollm2.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert chat.token_ids == expected[0, ids.shape[1]:].tolist()
    assert chat.finish_reason == ("stop" if chat.token_ids[-1] == 2 else "length")
    assert "Paris" in chat.text
    (text,) = llm.generate("The capital of France is", params)
    assert text.text == smollm2.tokenizer.decode(text.token_ids, skip_special_tokens=True) and text.text
    assert llm.info.eos_token_ids == (2,) and llm.info.vocab_size == 49152
