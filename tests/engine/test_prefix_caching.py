"""Prefix caching: a request sharing a prefix with an earlier one, or with one admitted in the same
step, reports the hit, and the tokens do not depend on whether caching is on."""

from __future__ import annotations

import pytest
from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams

PREFIX_LEN = 64
PREFIX_SHARED = 32  # the system prompt's two full 16-token blocks


def test_shared_prefix_is_reported_and_outputs_match_without_caching(tiny_llama):
    prefix, tail_a, tail_b = random_prompts([PREFIX_LEN, 10, 13], seed=21)
    first, second = prefix + tail_a, prefix + tail_b
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)

    cached = LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=16, enable_prefix_caching=True)
    a = cached.generate([first], params)[0]
    b, c = cached.generate([second, second], [params, sampled])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == PREFIX_LEN  # four full blocks of the shared prefix
    assert c.num_cached_tokens >= PREFIX_LEN
    assert cached.scheduler.stats().prefix_cache_hits >= PREFIX_LEN

    plain = LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=16, enable_prefix_caching=False)
    a2 = plain.generate([first], params)[0]
    b2, c2 = plain.generate([second, second], [params, sampled])
    assert (a2.num_cached_tokens, b2.num_cached_tokens, c2.num_cached_tokens) == (0, 0, 0)
    assert (a.token_ids, b.token_ids, c.token_ids) == (a2.token_ids, b2.token_ids, c2.token_ids)


def test_repeated_prompt_hits_all_but_the_last_block(tiny_llama):
    prompt = random_prompts([70], seed=4)[0]
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 64 and again.token_ids == first.token_ids


@pytest.mark.parametrize("budget", [None, 40])  # one step for every prompt, or chunks over steps
@pytest.mark.parametrize("backend", ["cpu", "triton"])  # triton: under TRITON_INTERPRET=1 (tests/conftest.py)
def test_prompts_admitted_together_share_their_prefix_and_match_caching_off(backend, budget, tiny_llama):
    """Copies of one prompt and prompts with one system prefix, all admitted in one step: the later
    ones hit blocks the first fills in that same forward pass, and greedy tokens do not change."""
    system, tail_a, tail_b = random_prompts([32, 5, 7], seed=31)
    prompts = [system + tail_a] * 3 + [system + tail_b]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, block_size=16, attention_backend=backend, device="cpu")
    if budget is not None:
        engine["max_num_batched_tokens"] = budget

    cached = LLM(tiny_llama.path, enable_prefix_caching=True, **engine)
    if backend == "triton":
        assert cached.runner.attention_backend == "triton"
    shared = cached.generate(prompts, params)
    plain = LLM(tiny_llama.path, enable_prefix_caching=False, **engine).generate(prompts, params)

    assert [o.token_ids for o in shared] == [o.token_ids for o in plain]
    assert shared[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in shared[1:]] == [PREFIX_SHARED] * 3
