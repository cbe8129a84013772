"""Prefix caching: a request sharing a 64-token prefix with an earlier one reports the hit, and the
tokens do not depend on whether caching is on."""

from __future__ import annotations

from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams

PREFIX_LEN = 64


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
