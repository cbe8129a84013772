"""Sampler: exact greedy, counter-based randomness, and the distribution each filter samples from.

Statistical tests draw one token per (seed, position) pair from fixed toy logits and compare the
frequencies with the expected distribution (Pearson chi-square against a p = 1e-4 critical value).
Seeds are fixed, so the tests are deterministic; the bounds only say the sampler is right.
"""

from __future__ import annotations

import math

import pytest
import torch

from worker_service.sampler import (
    UNIFORM_BITS,
    Sampler,
    SamplingMetadata,
    apply_filters,
    gumbel_noise,
    uniform_noise,
    unit_interval,
)

TOY_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
NUM_DRAWS = 20_000
# chi-square critical values at p = 1e-4 by degrees of freedom
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def meta_for(n: int, *, temperature: float = 1.0, seed0: int = 0, **extra) -> SamplingMetadata:
    meta = SamplingMetadata(
        temperature=torch.full((n,), temperature),
        seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64) // 7,  # several positions per seed
        positions=torch.arange(n, dtype=torch.int64) % 7,
    )
    for key, value in extra.items():
        setattr(meta, key, value)
    return meta


def draw(logits: torch.Tensor, n: int = NUM_DRAWS, **kwargs) -> torch.Tensor:
    """Token counts of ``n`` draws from ``logits`` ([V]), one per (seed, position) pair."""
    meta = meta_for(n, **kwargs)
    tokens = Sampler()(logits.expand(n, -1).clone(), meta).token_ids
    return torch.bincount(tokens, minlength=logits.shape[0]).double()


def assert_matches(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    n = counts.sum()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"sampled tokens outside the support: {counts.tolist()}"
    expected = expected_probs[support].double() * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return
    assert chi2 < CHI2_CRIT[dof], f"chi2 {chi2:.1f} (dof {dof}); counts {counts.tolist()}, expected {expected.tolist()}"


def test_greedy_is_exact_argmax_first_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    out = Sampler()(logits, meta_for(2, temperature=0.0))
    assert out.token_ids.tolist() == [1, 0]


def test_plain_greedy_means_nothing_but_each_rows_argmax_is_needed():
    ids = torch.tensor([0]), torch.tensor([3])
    assert meta_for(3, temperature=0.0).plain_greedy
    assert meta_for(3, temperature=0.0, top_k=torch.full((3,), 2), top_p=torch.full((3,), 0.5)).plain_greedy
    assert not meta_for(3, temperature=0.7).plain_greedy
    for field, value in [("max_num_logprobs", 0), ("logit_bias", (*ids, torch.tensor([1.0]))),
                         ("repetition_penalty", torch.full((3,), 1.2)), ("presence_penalty", torch.ones(3)),
                         ("frequency_penalty", torch.ones(3)), ("banned_tokens", ids), ("allowed_tokens", ids),
                         ("grammar_mask", (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32)))]:
        assert not meta_for(3, temperature=0.0, **{field: value}).plain_greedy, field


def test_noise_is_a_pure_function_of_seed_position_and_token():
    seeds = torch.tensor([7, 7, 8, 7])
    positions = torch.tensor([3, 4, 3, 3])
    u = uniform_noise(seeds, positions, 1000)
    assert torch.equal(u[0], u[3])  # same (seed, position): same noise, wherever the row sits
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    alone = uniform_noise(seeds[1:2], positions[1:2], 1000)
    assert torch.equal(alone[0], u[1])


def test_uniform_noise_is_uniform_and_in_open_interval():
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).flatten()
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=16, min=0.0, max=1.0).double()
    expected = u.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.0  # dof 15, p ~ 1e-4
    assert abs(float(u.mean()) - 0.5) < 0.005
    g = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(float(g.mean()) - 0.5772) < 0.02  # Euler–Mascheroni constant


def test_the_extreme_uniforms_stay_inside_the_open_interval_and_their_noise_finite():
    """The largest and smallest bit patterns: with 24 bits the largest rounded to 1.0 in fp32, its
    Gumbel noise was +inf, and a removed token's -inf + inf = NaN won the argmax."""
    u = unit_interval(torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1]))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and len(set(u.tolist())) == 4
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()


def test_a_removed_token_is_never_sampled_whatever_its_noise():
    """Every token but one at -inf (a grammar, allowed_token_ids): over many seeds and positions
    the one token is always sampled, also where another's noise is the largest there is."""
    logits = torch.full((256, 49152), float("-inf"))
    logits[:, 7] = 0.0
    meta = meta_for(256, temperature=1.0)
    meta.seeds = torch.arange(256, dtype=torch.int64) * 7919
    meta.positions = torch.arange(256, dtype=torch.int64)
    assert set(Sampler()(logits, meta).token_ids.tolist()) == {7}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    counts = draw(TOY_LOGITS, temperature=temperature)
    assert_matches(counts, torch.softmax(TOY_LOGITS / temperature, dim=-1))


def test_top_k_samples_renormalised_top_k():
    k = 3
    counts = draw(TOY_LOGITS, top_k=torch.full((NUM_DRAWS,), k))
    expected = torch.softmax(TOY_LOGITS, -1)
    expected[k:] = 0
    assert_matches(counts, expected / expected.sum())


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.softmax(TOY_LOGITS, -1)
    top_p = float(probs[:3].sum()) - 0.01  # the first three tokens are needed to reach it
    counts = draw(TOY_LOGITS, top_p=torch.full((NUM_DRAWS,), top_p))
    expected = probs.clone()
    expected[3:] = 0
    assert_matches(counts, expected / expected.sum())


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.softmax(TOY_LOGITS, -1)
    min_p = 0.5  # keeps p >= p_max / 2: logit >= 2 - ln 2 -> tokens 0 and 1
    counts = draw(TOY_LOGITS, min_p=torch.full((NUM_DRAWS,), min_p))
    expected = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    assert int((expected > 0).sum()) == 2
    assert_matches(counts, expected / expected.sum())


def test_filters_combine_per_row_and_off_values_change_nothing():
    scores = TOY_LOGITS.expand(3, -1).clone()
    out = apply_filters(scores, top_k=torch.tensor([8, 2, 8]), top_p=torch.tensor([1.0, 1.0, 0.5]),
                        min_p=torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(out[0], TOY_LOGITS)
    assert torch.isfinite(out[1]).tolist() == [True, True] + [False] * 6
    assert int(torch.isfinite(out[2]).sum()) >= 1
    assert bool(torch.isfinite(out[2, 0]))  # the most likely token always survives


def test_top_p_tiny_keeps_only_the_best_token():
    counts = draw(TOY_LOGITS, n=500, top_p=torch.full((500,), 1e-6))
    assert counts[0] == 500


def test_mixed_batch_rows_are_independent_of_each_other():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0]),
                            seeds=torch.tensor([1, 2, 3, 4, 5, 6]), positions=torch.tensor([0, 5, 9, 2, 4, 5]),
                            top_k=torch.tensor([100, 10, 100, 100, 100, 100]))
    batch = Sampler()(logits, meta).token_ids
    for i in range(6):
        single = SamplingMetadata(temperature=meta.temperature[i : i + 1], seeds=meta.seeds[i : i + 1],
                                  positions=meta.positions[i : i + 1], top_k=meta.top_k[i : i + 1])
        assert Sampler()(logits[i : i + 1], single).token_ids.item() == batch[i].item()
    assert batch[0] == logits[0].argmax() and batch[3] == logits[3].argmax()


def test_repetition_penalty_follows_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    meta = meta_for(1, temperature=0.0, repetition_penalty=torch.tensor([2.0]),
                    prompt_token_ids=torch.tensor([[0, 4]]),  # 4 = padding (vocab size)
                    output_token_ids=torch.tensor([[1, 4]]))
    from worker_service.sampler import apply_penalties

    out = apply_penalties(logits, meta)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive / p, negative * p, unseen unchanged
    # greedy picks the argmax of the penalised logits: a tie at 1.0 -> first index
    assert Sampler()(logits, meta).token_ids.item() == 0


def test_presence_and_frequency_penalties_use_output_counts_only():
    from worker_service.sampler import apply_penalties

    logits = torch.zeros(1, 5)
    meta = meta_for(1, temperature=0.0, presence_penalty=torch.tensor([0.5]),
                    frequency_penalty=torch.tensor([0.25]),
                    prompt_token_ids=torch.tensor([[3, 3, 3]]),
                    output_token_ids=torch.tensor([[1, 1, 2, 5, 5]]))
    out = apply_penalties(logits, meta)
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0, 0.0]]


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[0.0, 10.0, 9.0]])
    meta = meta_for(1, temperature=0.0, banned_tokens=(torch.tensor([0]), torch.tensor([1])))
    assert Sampler()(logits, meta).token_ids.item() == 2
    meta = meta_for(200, temperature=1.0, banned_tokens=(torch.arange(200), torch.full((200,), 1)))
    tokens = Sampler()(logits.expand(200, -1).clone(), meta).token_ids
    assert 1 not in tokens.tolist()


def test_logit_bias_is_added_to_its_rows_only_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 10.0, 9.0], [0.0, 10.0, 9.0]])
    bias = (torch.tensor([0, 0]), torch.tensor([1, 0]), torch.tensor([-100.0, 2.0]))
    meta = meta_for(2, temperature=0.0, logit_bias=bias, max_num_logprobs=1)
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [2, 1]  # row 0: token 1 pushed below token 2; row 1 untouched
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[[0, 1], [2, 1]])
    assert logits[0, 1] == 10.0  # the caller's logits are not changed in place
    forced = meta_for(300, temperature=1.0, logit_bias=(torch.arange(300), torch.full((300,), 0), torch.full((300,), 100.0)))
    assert set(Sampler()(logits[:1].expand(300, -1).clone(), forced).token_ids.tolist()) == {0}


def test_allowed_tokens_restrict_only_their_rows_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0], [0.0, 10.0, 9.0, 1.0]])
    # row 1 only may sample 0 or 2; row 0 is free
    allowed = (torch.tensor([1, 1]), torch.tensor([0, 2]))
    meta = meta_for(2, temperature=0.0, allowed_tokens=allowed, max_num_logprobs=1)
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [1, 2]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 2]])
    assert logits[1, 1] == 10.0  # the caller's logits are not changed in place
    many = meta_for(300, temperature=1.5, allowed_tokens=(torch.arange(300).repeat_interleave(2),
                                                          torch.tensor([0, 3]).repeat(300)))
    tokens = Sampler()(logits[:1].expand(300, -1).clone(), many).token_ids.tolist()
    assert set(tokens) == {0, 3}  # both allowed ids drawn, nothing else


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    meta = meta_for(2, temperature=0.0, max_num_logprobs=2, repetition_penalty=torch.tensor([1.0, 100.0]),
                    prompt_token_ids=torch.tensor([[4], [2]]), output_token_ids=torch.tensor([[4], [4]]))
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids.tolist() == [1, 3]  # row 1: token 2 is penalised away
    assert torch.allclose(out.logprobs, raw[[0, 1], [1, 3]])  # logprob of the sampled token, unpenalised
    assert out.top_token_ids.tolist() == [[1, 2], [2, 3]]
    assert torch.allclose(out.top_logprobs, raw.topk(2).values)
    assert math.isclose(float(out.top_logprobs[0, 0]), float(raw[0, 1]), rel_tol=1e-6)
