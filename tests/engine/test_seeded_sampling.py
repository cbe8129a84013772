"""Sampling randomness is a pure function of (seed, output position): a seeded request samples the
same tokens alone, inside a batch, when chunked or preempted; unseeded ones follow the engine seed."""

from __future__ import annotations

import pytest
from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams

SEEDED = SamplingParams(max_tokens=32, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
OTHERS = [
    SamplingParams(max_tokens=20, temperature=0.0),
    SamplingParams(max_tokens=40, temperature=1.0, seed=7),
    SamplingParams(max_tokens=12, temperature=0.7, min_p=0.1, seed=8),
    SamplingParams(max_tokens=33, temperature=1.2, repetition_penalty=1.3, seed=9),
    SamplingParams(max_tokens=25, temperature=0.5, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(max_tokens=30, temperature=1.0, top_k=5, logprobs=3),
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5),
    SamplingParams(max_tokens=28, temperature=1.0, top_p=0.5, seed=1234),
    SamplingParams(max_tokens=22, temperature=0.8, seed=10, logit_bias={5: 5.0, 17: -100.0}),
]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([23, 3, 50, 9, 31, 70, 12, 5, 44, 17], seed=11)


def seeded_tokens(llm: LLM, prompts, together: bool) -> list[int]:
    if not together:
        return llm.generate([prompts[0]], SEEDED)[0].token_ids
    outputs = llm.generate(prompts, [SEEDED, *OTHERS])
    return outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_request_is_the_same_alone_and_in_a_batch_of_eight(tiny_llama, prompts, dtype):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype=dtype)
    alone = seeded_tokens(llm, prompts, together=False)
    assert len(alone) == 32 and len(set(alone)) > 5  # it really sampled
    assert seeded_tokens(llm, prompts, together=True) == alone
    # chunked prefill and preemption change the batches, not the tokens
    chunked = LLM(tiny_llama.path, skip_tokenizer_init=True, max_num_batched_tokens=16, dtype=dtype)
    assert seeded_tokens(chunked, prompts, together=True) == alone
    small = LLM(tiny_llama.path, skip_tokenizer_init=True, num_blocks=14, block_size=8, dtype=dtype)
    assert seeded_tokens(small, prompts, together=True) == alone
    assert small.scheduler.stats().num_preemptions > 0


def test_different_seeds_give_different_samples(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True)
    a, b = llm.generate([prompts[0]] * 2, [SEEDED, SEEDED.with_seed(99)])
    assert a.token_ids != b.token_ids


def test_unseeded_requests_follow_the_engine_seed(tiny_llama, prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0)

    def run(seed: int) -> list[list[int]]:
        llm = LLM(tiny_llama.path, skip_tokenizer_init=True, seed=seed)
        return [o.token_ids for o in llm.generate(prompts[:3], params)]

    first = run(5)
    assert run(5) == first
    assert run(6) != first


def test_allowed_token_ids_restrict_sampling_and_stay_batch_invariant(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True)
    allowed = (3, 42, 99, 500)
    restricted = SamplingParams(max_tokens=24, temperature=1.0, seed=6, ignore_eos=True, allowed_token_ids=allowed)
    alone = llm.generate([prompts[3]], restricted)[0].token_ids
    assert set(alone) <= set(allowed) and len(set(alone)) > 1
    together = llm.generate(prompts[3:] + prompts[:3], [restricted, SEEDED, *OTHERS[:8]])
    assert together[0].token_ids == alone  # the others in the batch change nothing
    assert not set(together[1].token_ids) <= set(allowed)  # and the mask stays on its own row
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=[500, 99])
    assert set(llm.generate([prompts[3]], greedy)[0].token_ids) <= {99, 500}


def test_logit_bias_bans_and_forces_tokens_and_stays_batch_invariant(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = llm.generate([prompts[1]], greedy)[0].token_ids
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            logit_bias={t: -100.0 for t in set(plain)})
    assert not set(llm.generate([prompts[1]], banned)[0].token_ids) & set(plain)
    forced = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate([prompts[1]], forced)[0].token_ids == [42] * 12
    biased = OTHERS[-1]
    alone = llm.generate([prompts[2]], biased)[0].token_ids
    assert 17 not in alone and len(set(alone)) > 5
    together = llm.generate(prompts[2:] + prompts[:2], [biased, SEEDED, *OTHERS[:-1]])
    assert together[0].token_ids == alone


def test_parameters_past_float32_sample_as_their_limits_never_a_nan(tiny_llama, prompts):
    """A temperature or repetition penalty that float32 cannot hold (1e39 is inf there, 1e-300 is 0)
    gave NaN scores that argmax picked: a banned token, one outside allowed_token_ids, EOS before
    min_tokens. Tiny temperatures sample greedily; huge ones as at MAX_TEMPERATURE."""
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="float32")
    eos = tiny_llama.hf.config.eos_token_id
    batch = [prompts[0], prompts[2]]

    def tokens(**params) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=8, seed=3, **params))]

    huge = tokens(temperature=1e39, allowed_token_ids=[3, 4, 5])
    assert all(set(row) <= {3, 4, 5} and len(row) == 8 for row in huge)
    assert huge == tokens(temperature=1e30, allowed_token_ids=[3, 4, 5])
    assert tokens(temperature=1e300, top_k=5) == tokens(temperature=1e30, top_k=5)
    with_min = llm.generate(batch, SamplingParams(max_tokens=8, min_tokens=6, temperature=1e39, seed=3,
                                                  logit_bias={eos: 100.0}))
    assert all(len(o.token_ids) >= 6 and eos not in o.token_ids[:6] for o in with_min)
    greedy = tokens(temperature=0.0)
    assert tokens(temperature=1e-40) == tokens(temperature=1e-6) == greedy
    assert tokens(temperature=0.0, repetition_penalty=1e-300) == tokens(temperature=0.0, repetition_penalty=1e-6)
    assert tokens(temperature=0.0, repetition_penalty=1e300) == tokens(temperature=0.0, repetition_penalty=1e6)
