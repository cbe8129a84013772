"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): every prompt token after the first scored
by the model, as transformers scores it, however the prompt was chunked, cached or preempted."""

from __future__ import annotations

import pytest
import torch
from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams
from servicekit.contract.errors import InvalidArgumentError


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: log-softmax of transformers' logits at positions 0..P-2 (they score tokens 1..P-1)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(hf_model, prompt: list[int], entries, num_top: int) -> None:
    reference = hf_prompt_logprobs(hf_model, prompt)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row, token = reference[position], prompt[position + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert len(entry.top) == num_top
        best = row.topk(num_top)
        for (top_id, top_lp), ref_id, ref_lp in zip(entry.top, best.indices.tolist(), best.values.tolist()):
            assert top_lp == pytest.approx(ref_lp, abs=1e-3)
            assert top_id == ref_id or abs(row[top_id].item() - ref_lp) < 1e-3  # a tie may list either


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # 16 tokens a step: a 40-token prompt is scored over three chunks
    return LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=8, dtype="float32", max_num_batched_tokens=16)


def test_prompt_logprobs_match_transformers_over_chunks(llm, tiny_llama):
    prompt = random_prompts([40], seed=11)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    check_against_hf(tiny_llama.hf, prompt, out.prompt_logprobs, 3)
    assert out.logprobs is None  # sampled tokens' logprobs are a separate ask


def test_a_cached_prompt_is_computed_again_to_score_it(llm, tiny_llama):
    prompt = random_prompts([33], seed=12)[0]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (first,) = llm.generate([prompt], greedy)
    (again,) = llm.generate([prompt], greedy)
    assert again.num_cached_tokens == 32 and again.prompt_logprobs is None  # the prefix cache serves it ...
    (scored,) = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                      prompt_logprobs=0))
    assert scored.num_cached_tokens == 0  # ... but not a request that scores its prompt
    check_against_hf(tiny_llama.hf, prompt, scored.prompt_logprobs, 0)
    assert scored.token_ids == first.token_ids


def test_batched_with_other_requests_and_preempted(tiny_llama):
    """Requests with and without prompt logprobs in one batch, in a pool so small that some are
    preempted and recompute their prompts: each scored prompt still matches, once."""
    engine = LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=8, dtype="float32", num_blocks=14,
                 max_num_batched_tokens=32)
    prompts = random_prompts([20, 27, 9, 30], seed=13)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=n if i % 2 == 0 else None)
              for i, n in enumerate([2, 0, 1, 0])]
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.stats().num_preemptions > 0
    for prompt, p, out in zip(prompts, params, outputs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_against_hf(tiny_llama.hf, prompt, out.prompt_logprobs, p.prompt_logprobs)
        assert len(out.token_ids) == 24


def test_one_token_prompt_has_no_entries_and_bounds_are_checked(llm):
    (out,) = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.prompt_logprobs == []
    with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_a_request_resumed_after_its_first_token_scores_nothing_again():
    """Its prompt logprobs went out with that token: a copy resumed elsewhere (failover, takeover)
    neither computes nor holds them, so it may take prefix-cache hits again."""
    from scheduler_service.core.request import Request

    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    fresh = Request("a", [1, 2, 3], params)
    resumed = Request("a", [1, 2, 3], params, output_token_ids=[7])
    assert fresh.prompt_logprobs == [None, None, None] and resumed.prompt_logprobs is None
