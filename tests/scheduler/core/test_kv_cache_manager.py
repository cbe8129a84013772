"""KVCacheManager: allocation, prefix hits, freeing order, stats."""

from __future__ import annotations

import random

import pytest

from scheduler_service.core import KVCacheManager

from .helpers import make_request


def make_manager(num_blocks=9, block_size=4, enable_caching=True):
    return KVCacheManager(num_blocks, block_size, enable_caching)


def compute(manager, request, num_tokens):
    """Play one step: allocate, then (as update_from_output does) advance and cache."""
    blocks, hit = manager.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
    new = manager.allocate_slots(request, num_tokens, blocks, hit)
    assert new is not None
    request.num_computed_tokens = hit + request.num_computed_tokens + num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return hit


def test_seed_prefix_sharing_example():
    """Seed §1.6: A = [b0, b1, b2], B = [b0, b1, b3]; ref counts 2, 2, 1, 1; freeing A then B."""
    m = make_manager()
    shared = list(range(100, 108))
    a = make_request(prompt_token_ids=shared + [1, 2, 3, 4], block_size=4)
    b = make_request(prompt_token_ids=shared + [5, 6, 7, 8], block_size=4)
    compute(m, a, 12)
    assert compute(m, b, 4) == 8  # two blocks shared
    blocks_a, blocks_b = m.get_blocks(a.request_id), m.get_blocks(b.request_id)
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] is not blocks_b[2]
    b0, b1, b2, b3 = blocks_a + blocks_b[2:]
    assert [x.ref_cnt for x in (b0, b1, b2, b3)] == [2, 2, 1, 1]

    free_before = m.get_num_free_blocks()
    m.free(a)
    assert [x.ref_cnt for x in (b0, b1, b2, b3)] == [1, 1, 0, 1]
    assert m.get_num_free_blocks() == free_before + 1
    m.free(b)
    assert [x.ref_cnt for x in (b0, b1, b2, b3)] == [0, 0, 0, 0]
    tail = [x.block_id for x in m.block_pool.free_block_queue][-4:]
    assert tail == [b2.block_id, b3.block_id, b1.block_id, b0.block_id]  # tails evicted first, prefix last
    assert m.get_num_free_blocks() == 8
    m.block_pool.check_invariants()


def test_hit_never_covers_the_last_token():
    m = make_manager()
    prompt = list(range(100, 108))
    compute(m, make_request(prompt_token_ids=prompt, block_size=4), 8)
    same = make_request(prompt_token_ids=prompt, block_size=4)
    blocks, hit = m.get_computed_blocks(same)
    assert hit == 4 and len(blocks) == 1
    one_more = make_request(prompt_token_ids=prompt + [1], block_size=4)
    assert m.get_computed_blocks(one_more)[1] == 8


def test_full_blocks_are_cached_when_allocated_for_the_tokens_that_fill_them():
    m = make_manager()
    prompt = list(range(100, 109))
    a = make_request(prompt_token_ids=prompt, block_size=4)
    assert m.allocate_slots(a, 6) is not None  # a first chunk: block 0 full, block 1 half
    assert m.get_computed_blocks(make_request(prompt_token_ids=prompt, block_size=4))[1] == 4
    a.num_computed_tokens = 6
    assert m.allocate_slots(a, 2) == []  # fills block 1 without a new block: cached all the same
    assert m.get_computed_blocks(make_request(prompt_token_ids=prompt, block_size=4))[1] == 8
    m.block_pool.check_invariants()


def test_a_filler_freed_before_its_step_ran_takes_its_unwritten_blocks_out_of_the_cache():
    """Preempted after its allocation in the same schedule(): no step writes those blocks."""
    m = make_manager()
    prompt = list(range(100, 113))
    a = make_request(prompt_token_ids=prompt, block_size=4)
    compute(m, a, 4)  # block 0 computed by an earlier step
    assert m.allocate_slots(a, 8) is not None  # blocks 1, 2 cached, their step not run yet
    probe = make_request(prompt_token_ids=prompt, block_size=4)
    assert m.get_computed_blocks(probe)[1] == 12
    block_1 = m.get_blocks(a.request_id)[1]
    m.free(a)
    assert m.get_computed_blocks(probe)[1] == 4  # only the written block stays a hit
    assert block_1.block_hash is None and block_1.ref_cnt == 0
    m.block_pool.check_invariants()


def test_freeing_after_the_step_ran_keeps_every_computed_block_cached():
    m = make_manager()
    prompt = list(range(100, 113))
    a = make_request(prompt_token_ids=prompt, block_size=4)
    compute(m, a, 13)
    m.free(a)
    assert m.get_computed_blocks(make_request(prompt_token_ids=prompt + [1], block_size=4))[1] == 12


def test_allocation_fails_without_changes_when_blocks_run_out():
    m = make_manager(num_blocks=4)  # 3 usable
    a = make_request(8, block_size=4)
    compute(m, a, 8)
    b = make_request(8, block_size=4)
    assert m.allocate_slots(b, 8) is None
    assert m.get_block_ids(b.request_id) == [] and m.get_num_free_blocks() == 1
    assert [blk.block_id for blk in m.allocate_slots(b, 4)] == [3]
    assert m.allocate_slots(a, 1) is None  # a needs a 3rd block: none left
    m.block_pool.check_invariants()


def test_evictable_cached_blocks_count_as_free_but_not_the_ones_being_hit():
    m = make_manager(num_blocks=4)  # 3 usable
    prompt = list(range(100, 109))
    a = make_request(prompt_token_ids=prompt, block_size=4)
    compute(m, a, 9)
    m.free(a)
    assert m.get_num_free_blocks() == 3 and len(m.block_pool.cached_blocks) == 2
    # same prompt: hits 2 free cached blocks and needs 1 more -> fits exactly
    b = make_request(prompt_token_ids=prompt, block_size=4)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    assert m.allocate_slots(b, 1, blocks, hit) is not None
    assert m.get_num_free_blocks() == 0 and m.get_block_ids(b.request_id)[:2] == [blk.block_id for blk in blocks]
    m.free(b)
    # a request whose hit blocks are all the pool has cannot also take them as new blocks
    c = make_request(prompt_token_ids=prompt + list(range(200, 204)), block_size=4)  # 13 tokens: 4 blocks
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 8 and m.get_num_free_blocks() == 3
    assert m.allocate_slots(c, 5, blocks, hit) is None  # 2 hit + 2 new > 3
    assert [blk.ref_cnt for blk in blocks] == [0, 0] and m.get_block_ids(c.request_id) == []
    m.block_pool.check_invariants()


def test_stats_and_usage():
    m = make_manager()
    prompt = list(range(100, 109))
    compute(m, make_request(prompt_token_ids=prompt, block_size=4), 9)
    compute(m, make_request(prompt_token_ids=prompt, block_size=4), 1)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (18, 8)
    assert m.prefix_cache_hit_rate == 8 / 18
    assert m.usage == 4 / 8  # 3 blocks + 1 block, the first two shared


def test_caching_disabled_never_hits():
    m = make_manager(enable_caching=False)
    prompt = list(range(100, 109))
    compute(m, make_request(prompt_token_ids=prompt, block_size=4), 9)
    assert m.get_computed_blocks(make_request(prompt_token_ids=prompt, block_size=4)) == ([], 0)
    assert m.prefix_cache_hit_rate == 0.0


def test_free_is_idempotent():
    m = make_manager()
    a = make_request(5, block_size=4)
    compute(m, a, 5)
    m.free(a)
    m.free(a)
    assert m.get_num_free_blocks() == 8


def _decoding_pool(num_blocks, seed):
    """A manager whose requests all decode (prompts computed, one output token appended), with
    lengths that put their next token at every place in a block. Finished requests left their
    blocks cached and free first, with the same contents as some decoding requests' blocks (tokens
    from a small alphabet), and some decoding requests cache behind (hashing turned on after
    their allocation), so the order of evictions and cachings shows in the cache."""
    rng = random.Random(seed)
    manager = make_manager(num_blocks=num_blocks, block_size=4)
    for k in range(4):  # finished: their blocks free and cached, at the head of the free queue
        done = make_request(request_id=f"f{k}", prompt_token_ids=[rng.randrange(1, 3) for _ in range(8)], block_size=4)
        if manager.allocate_slots(done, done.num_tokens) is not None:
            done.num_computed_tokens = done.num_tokens
            manager.free(done)
    requests = []
    for k in range(12):
        late = k % 4 == 1
        # (a late one's next token fills or starts a block: a token in the middle of one caches
        # nothing in the decode path, by design, where allocate_slots would catch up)
        length = rng.choice((3, 4, 7, 8, 11)) if late else rng.randrange(3, 12)
        prompt = [rng.randrange(1, 3) for _ in range(length)]
        request = make_request(request_id=f"r{k}", prompt_token_ids=prompt, block_size=None if late else 4)
        if manager.allocate_slots(request, request.num_tokens) is None:
            break
        request.num_computed_tokens = request.num_tokens
        if late:
            request.enable_block_hashing(4)
        request.append_output_token(rng.randrange(1, 3))
        requests.append(request)
    return manager, requests


def _state(manager):
    pool = manager.block_pool
    return ({rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
            dict(manager.num_cached_blocks), {h: b.block_id for h, b in pool.cached_blocks.items()},
            [b.block_id for b in pool.free_block_queue])


@pytest.mark.parametrize("num_blocks", [60, 30, 24])  # room for all, or too little part of the way
@pytest.mark.parametrize("seed", range(8))
def test_decode_slots_match_one_allocation_per_request(num_blocks, seed):
    batched, requests = _decoding_pool(num_blocks, seed)
    one_by_one, twins = _decoding_pool(num_blocks, seed)
    if num_blocks > 24:  # (24: the setup itself reuses most of them)
        assert any(b.block_hash is not None for b in batched.block_pool.free_block_queue)  # evictions happen
    got = batched.allocate_decode_slots(requests)
    expected = []
    for request in twins:
        new = one_by_one.allocate_slots(request, 1)
        if new is None:
            break
        expected.append([b.block_id for b in new])
    assert got == expected
    assert _state(batched) == _state(one_by_one)
    batched.block_pool.check_invariants()
