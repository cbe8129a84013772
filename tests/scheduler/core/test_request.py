"""Request: status order, token bookkeeping, incremental block hashes."""

from __future__ import annotations

import pytest

from scheduler_service.core import FinishReason, Request, RequestStatus, SamplingParams
from scheduler_service.core.kv_cache_utils import ROOT_BLOCK_HASH, hash_block_tokens

from .helpers import make_request


def test_status_order_and_finished_states():
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert finished == [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED]
    assert [s.finish_reason() for s in finished] == [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT]
    assert RequestStatus.RUNNING.finish_reason() is None


def test_tokens_and_counts():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=2.5, priority=1)
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token_ids(7)
    r.append_output_token_ids([8, 9])
    assert r.output_token_ids == [7, 8, 9] and r.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert r.prompt_token_ids == [1, 2, 3] and r.num_cached_tokens == -1
    assert r.status == RequestStatus.WAITING and not r.is_finished and r.get_finish_reason() is None


def test_delivered_outputs_are_part_of_the_tokens():
    r = Request("r", [1, 2], output_token_ids=[5, 6])
    assert r.all_token_ids == [1, 2, 5, 6] and r.num_output_tokens == 2 and r.num_prompt_tokens == 2


def test_block_hashes_grow_as_blocks_fill_and_match_a_fresh_computation():
    r = make_request(prompt_token_ids=[1, 2, 3, 4, 5, 6], block_size=4)
    assert r.block_hashes == [hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])]
    r.append_output_token_ids(7)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([8, 9, 10, 11, 12])
    fresh = make_request(prompt_token_ids=list(range(1, 13)), block_size=4)
    assert len(r.block_hashes) == 3 and r.block_hashes == fresh.block_hashes


def test_cache_salt_changes_every_hash_of_the_chain():
    plain = make_request(prompt_token_ids=list(range(8)), block_size=4)
    salted = make_request(prompt_token_ids=list(range(8)), block_size=4, cache_salt="t")
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes, strict=True))


def test_block_size_cannot_change():
    r = make_request(8, block_size=4)
    r.enable_block_hashing(4)
    with pytest.raises(ValueError):
        r.enable_block_hashing(8)


@pytest.mark.parametrize(
    ("params", "tokens", "statuses"),
    [
        (dict(stop_token_ids=(42,)), [7, 42], [None, RequestStatus.FINISHED_STOPPED]),
        (dict(stop_token_ids=(42,), min_tokens=2), [42, 42], [None, RequestStatus.FINISHED_STOPPED]),
        (dict(), [7, 7, 7], [None, None, RequestStatus.FINISHED_LENGTH]),
        (dict(stop_token_ids=(42,)), [7, 7, 42], [None, None, RequestStatus.FINISHED_STOPPED]),
    ],
)
def test_append_output_token_statuses_and_hashes(params, tokens, statuses):
    # a 3-token prompt in 2-token blocks: every append completes a block or starts one, and the last
    # allowed token (max_tokens 3) is also a block's first
    r = make_request(prompt_token_ids=[1, 2, 3], block_size=2, max_tokens=3, **params)
    got = [r.append_output_token(t) for t in tokens]
    assert got == statuses
    fresh = make_request(prompt_token_ids=[1, 2, 3, *tokens], block_size=2)
    assert r.block_hashes == fresh.block_hashes and r.output_token_ids == tokens
    assert r.next_event_at > r.num_tokens or r.next_event_at == r.num_prompt_tokens + 3
