"""KV-cache block metadata, the free-block queue and the prefix-cache block hash (seed §1.3, §1.4, §1.9).

The blocks themselves (K/V tensors) live on the worker; here a block is only its id, a reference
count, its hash while it is in the prefix cache, and the two links of the free queue.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

BlockHash = bytes  # 32-byte sha256 digest

# Parent of a request's first block. A constant (not a random seed) so that hashes are stable across
# processes; isolation between tenants comes from ``cache_salt``, which enters the first block's hash.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagedserve.block_hash.v1").digest()

_U32 = struct.Struct("<I")


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """sha256 over (parent hash, the block's token ids, extra keys): a chain, so equal hashes mean
    equal *prefixes*, not just equal blocks.

    The serialisation is unambiguous: the parent is a fixed 32 bytes, the token ids are a counted
    array of little-endian int64, the extra keys are length-prefixed. One ``struct`` pack of the
    count and the ids (a ``Struct`` per block length, kept) and one digest call: the scheduler
    hashes a block per 16 decoded tokens per request, so this is on its per-step path.
    """
    n = len(token_ids)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"<I{n}q")
    data = parent_hash + packer.pack(n, *token_ids)
    if extra_keys:
        data += _U32.pack(len(extra_keys)) + extra_keys
    return hashlib.sha256(data).digest()


_PACKERS: dict[int, struct.Struct] = {}


def cache_salt_extra_keys(cache_salt: str | None) -> bytes:
    """The extra keys of a request's first block (only the first: the chain carries it onward)."""
    return b"salt:" + cache_salt.encode("utf-8") if cache_salt else b""


class KVCacheBlock:
    """Metadata of one physical KV-cache block.

    Invariants (checked by the block-pool tests): a block with ``ref_cnt > 0`` is not in the free
    queue; a block with ``ref_cnt == 0`` is in it (except the null block); ``block_hash`` is set
    exactly when the pool's hash map points at this block.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # index into the worker's KV-cache tensors
        self.ref_cnt = 0  # requests whose block table holds this block
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.prev_free: KVCacheBlock | None = None  # free-queue links; None when not in the queue
        self.next_free: KVCacheBlock | None = None
        self.is_null = False  # block 0: reserved, never allocated, never freed

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves (seed §1.4).

    The head is the next block handed out (and, if it is cached, evicted): freed blocks are appended
    at the tail, so eviction is least-recently-freed first. Every operation is O(1) per block and
    allocates nothing; two sentinel blocks remove the boundary cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed). Raises ``IndexError`` when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        assert block is not None
        nxt = block.next_free
        assert nxt is not None
        self._head.next_free = nxt
        nxt.prev_free = self._head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first. Raises ``IndexError`` if fewer."""
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (a prefix-cache hit on a free block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` in order (the first of them is evicted first)."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            assert block.prev_free is None and block.next_free is None, f"{block} is already free"
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail. O(n): for tests and debugging only."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
