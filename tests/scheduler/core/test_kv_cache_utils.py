"""The free-block queue and the chained block hash."""

from __future__ import annotations

import hashlib

import pytest

from scheduler_service.core.kv_cache_utils import ROOT_BLOCK_HASH, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def ids(queue):
    return [b.block_id for b in queue]


def make_queue(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_popleft_takes_from_the_head_and_append_puts_at_the_tail():
    blocks, q = make_queue(4)
    assert ids(q) == [0, 1, 2, 3] and len(q) == 4
    b = q.popleft()
    assert b is blocks[0] and b.prev_free is None and b.next_free is None
    q.append(b)
    assert ids(q) == [1, 2, 3, 0]


def test_popleft_n_and_append_n_keep_order():
    blocks, q = make_queue(5)
    taken = q.popleft_n(3)
    assert [b.block_id for b in taken] == [0, 1, 2] and ids(q) == [3, 4] and len(q) == 2
    q.append_n(taken[::-1])
    assert ids(q) == [3, 4, 2, 1, 0] and len(q) == 5
    assert q.popleft_n(0) == []
    with pytest.raises(IndexError):
        q.popleft_n(6)


def test_remove_from_the_middle_the_head_and_the_tail():
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3] and len(q) == 2
    with pytest.raises(ValueError):
        q.remove(blocks[2])  # not in the queue any more


def test_empty_queue():
    blocks, q = make_queue(1)
    q.popleft()
    assert ids(q) == [] and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()
    q.append(blocks[0])
    assert ids(q) == [0]


def test_double_append_is_caught():
    blocks, q = make_queue(2)
    with pytest.raises(AssertionError):
        q.append(blocks[0])


def test_block_hash_is_a_chain_over_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert len(h1) == 32 and h1 == hash_block_tokens(ROOT_BLOCK_HASH, (1, 2, 3, 4))
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8])
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4], b"salt:a") != h1
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4], b"salt:a") != hash_block_tokens(
        ROOT_BLOCK_HASH, [1, 2, 3, 4], b"salt:b")
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2]) != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 0])


@pytest.mark.parametrize("tokens, extra", [([], b""), ([7], b""), (list(range(40_000, 40_016)), b""),
                                           ([1, 2**40, 3], b"salt:tenant-a")])
def test_block_hash_is_sha256_of_the_documented_bytes(tokens, extra):
    # Hashes name blocks across processes and versions (routing, resumes): the bytes are fixed as
    # the parent, a u32 count, the ids as little-endian int64, then a u32-counted extra key.
    data = ROOT_BLOCK_HASH + len(tokens).to_bytes(4, "little")
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    if extra:
        data += len(extra).to_bytes(4, "little") + extra
    assert hash_block_tokens(ROOT_BLOCK_HASH, tokens, extra) == hashlib.sha256(data).digest()
    assert hash_block_tokens(ROOT_BLOCK_HASH, tuple(tokens), extra) == hashlib.sha256(data).digest()
