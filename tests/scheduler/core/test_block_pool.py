"""BlockPool: reference counts, the free queue order, the prefix cache (seed §1.3, §1.6)."""

from __future__ import annotations

import pytest

from scheduler_service.core import BlockPool


def free_ids(pool):
    return [b.block_id for b in pool.free_block_queue]


def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3] and pool.get_num_free_blocks() == 3 and pool.num_usable_blocks == 3
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored
    pool.check_invariants()


def test_free_appends_blocks_reaching_zero_in_the_given_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.touch(blocks[:2])  # shared by a second holder
    assert [b.ref_cnt for b in blocks] == [2, 2, 1, 1]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3] and [b.ref_cnt for b in blocks] == [1, 1, 0, 0]
    pool.free_blocks(reversed(blocks[:2]))
    assert free_ids(pool) == [4, 3, 2, 1] and pool.usage == 0.0
    with pytest.raises(AssertionError):
        pool.free_blocks([blocks[0]])  # freed twice
    pool.check_invariants()


def test_cached_free_block_is_revived_by_touch_and_evicted_when_reused():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"], 0, 2)
    assert pool.cached_blocks == {b"h0": a, b"h1": b}
    pool.free_blocks([b, a])
    assert pool.get_cached_block(b"h0") is a and pool.get_num_free_blocks() == 3  # free but cached
    pool.touch([a])  # a hit: leaves the free queue
    assert a.ref_cnt == 1 and free_ids(pool) == [3, 2]
    taken = pool.get_new_blocks(2)  # reuses b: its hash goes
    assert [x.block_id for x in taken] == [3, 2]
    assert b.block_hash is None and pool.cached_blocks == {b"h0": a}
    pool.check_invariants()


def test_a_hash_names_one_block_only():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)  # computed the same prefix concurrently
    assert pool.cached_blocks == {b"same": a} and b.block_hash is None
    pool.check_invariants()


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert pool.reset_prefix_cache() is False and pool.cached_blocks
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and a.block_hash is None
    pool.check_invariants()


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert pool.cached_blocks == {} and a.block_hash is None
