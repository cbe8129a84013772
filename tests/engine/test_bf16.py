"""bf16 on the CPU: the engine runs end to end in bf16 (weights, activations, KV cache), greedy tokens
agree with fp32 on SmolLM2's chat prompts for most prompts, and the KV budget buys twice the blocks.

bf16 cannot match fp32 token for token: its weights are rounded to 8 significant bits, so where two
candidates' logits are closer than that rounding moves them, greedy decoding may take the other one
and the continuation diverges from there. The agreement figure is printed (``-s`` shows it)."""

from __future__ import annotations

import pytest
import torch
from worker.factories import hf_greedy, random_prompts

from pagedserve import LLM, SamplingParams

NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0)


def agreement(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens ``other`` shares with ``reference``."""
    return [next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            for want, got in zip(reference, other, strict=True)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_tiny_model_runs_in_bf16_with_a_bf16_cache(tiny_llama, backend):
    prompts = random_prompts([3, 40, 100], seed=5)
    fp32 = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="float32", attention_backend=backend,
               kv_cache_memory="4MiB")
    bf16 = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="bfloat16", attention_backend=backend,
               kv_cache_memory="4MiB")

    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.runner.model.embed.weight.dtype == torch.bfloat16
    assert bf16.info.num_blocks == 2 * fp32.info.num_blocks  # half the bytes per block
    reference = [hf_greedy(tiny_llama.hf, p, NUM_TOKENS) for p in prompts]
    outputs = [o.token_ids for o in bf16.generate(prompts, GREEDY)]
    assert [len(o) for o in outputs] == [NUM_TOKENS] * len(prompts)
    # a random tiny model has flat logits, so only the first tokens are expected to agree
    assert all(n >= 1 for n in agreement(reference, outputs)), agreement(reference, outputs)


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_bf16_greedy_agrees_with_fp32_on_most_chat_prompts(smollm2):
    from engine.test_greedy_parity import SMOL_QUESTIONS

    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
               for q in SMOL_QUESTIONS]
    fp32 = LLM("smollm2-135m", hf_model=smollm2.hf, skip_tokenizer_init=True, dtype="float32")
    bf16 = LLM("smollm2-135m", hf_model=smollm2.hf, skip_tokenizer_init=True, dtype="bfloat16")

    reference = [o.token_ids for o in fp32.generate(prompts, GREEDY)]
    outputs = [o.token_ids for o in bf16.generate(prompts, GREEDY)]

    shared = agreement(reference, outputs)
    identical = sum(n == NUM_TOKENS for n in shared)
    print(f"bf16 vs fp32 greedy: {identical}/{len(prompts)} prompts identical for {NUM_TOKENS} tokens; "
          f"leading tokens shared per prompt: {shared}")
    assert 2 * identical > len(prompts), shared  # most prompts
    assert min(shared) >= 4, shared  # and every answer starts the same way


def test_bf16_logits_keep_fp32_precision_at_the_top(tiny_llama):
    from worker_service.loader import load_model
    from worker_service.models.llama import REFINED_LOGITS

    model = load_model(tiny_llama.path, hf_model=tiny_llama.hf, dtype="bfloat16").model
    hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    exact = hidden.float() @ weight.float().T  # the same bf16 operands, fp32 throughout

    logits = model.compute_logits(hidden)

    assert logits.dtype == torch.float32
    top = exact.topk(REFINED_LOGITS // 2, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_plain_greedy_steps_take_each_rows_argmax_without_the_fp32_logits(tiny_llama, monkeypatch):
    """A bf16 engine's greedy requests (drafts verified too) get the very tokens the fp32 logits and the
    sampler give, without those logits being made; a request that needs them (logprobs) still has them."""
    from worker_service.models.llama import LlamaForCausalLM

    prompts = random_prompts([3, 40, 100, 7], seed=11)
    # a prompt that repeats itself: n-gram drafts, verified in the same steps
    prompts.append((prompts[1][:12] * 4)[:45])
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run():
        llm = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="bfloat16", kv_cache_memory="4MiB",
                  enable_prefix_caching=False, num_speculative_tokens=3)
        return [o.token_ids for o in llm.generate(prompts, greedy)], llm

    from worker_service.model_runner import ModelRunner

    drafts = []  # draft tokens the steps verified
    execute = ModelRunner.execute_model

    def counted(self, plan):
        drafts.append(sum(map(len, plan.scheduled_spec_decode_tokens.values())))
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute_model", counted)
    made = []
    compute_logits = LlamaForCausalLM.compute_logits
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits",
                        lambda self, hidden, out=None: made.append(hidden.shape[0]) or compute_logits(self, hidden, out))
    fast, llm = run()
    from paged_kernels import cpu_fused

    assert not made or not cpu_fused.available()  # every step took the argmax alone (the C selection)
    assert sum(drafts) > 0  # ... draft rows among them
    monkeypatch.setattr(LlamaForCausalLM, "greedy_token_ids", lambda self, hidden: None)
    long_way, _ = run()
    assert made and fast == long_way
    monkeypatch.undo()
    with_logprobs = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))[0]
    assert with_logprobs.token_ids == fast[0][:4] and len(with_logprobs.logprobs) == 4
