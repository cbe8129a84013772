"""The n-gram index a worker proposes draft tokens from (``worker_service.ngram``)."""

from __future__ import annotations

import random

import pytest

from worker_service.ngram import NgramIndex


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    index = NgramIndex(2, 3, [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2])
    assert index.propose(3) == [3, 4, 5]  # "1 2" last seen before at 4..5, followed by 3 4 5


def test_the_longest_suffix_that_occurred_wins():
    # "2 8 1" occurred at 4..6 (then 5); "8 1" also at 1..2 (then 9): the 3-gram decides
    assert NgramIndex(1, 3, [7, 8, 1, 9, 2, 8, 1, 5, 2, 8, 1]).propose(1) == [5]


def test_no_draft_for_a_suffix_never_seen_and_at_most_k():
    assert NgramIndex(2, 2, [1, 2, 3, 4]).propose(4) == []
    index = NgramIndex(2, 2, [1, 2, 1, 2])
    assert index.propose(4) == [1, 2]  # only what exists after the match
    assert index.propose(1) == [1]
    assert index.propose(0) == []


def test_growing_the_tokens_matches_building_the_index_afresh():
    rng = random.Random(0)
    tokens = [rng.choice([3, 4, 5, 6]) for _ in range(300)]
    grown = NgramIndex(2, 3, tokens[:1])
    for end in range(2, len(tokens) + 1):
        grown.extend(tokens[end - 1:end])
        if end % 3:  # proposals now and then: the index catches up on what it skipped
            continue
        assert grown.propose(4) == NgramIndex(2, 3, tokens[:end]).propose(4) == naive(tokens[:end], 2, 3, 4), end


def naive(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
