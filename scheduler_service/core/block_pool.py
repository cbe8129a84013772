"""The block pool of one worker: every block preallocated, reference counts, the prefix cache (seed §1.3, §1.6)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler_service.core.kv_cache_utils import BlockHash, FreeBlockQueue, KVCacheBlock


class BlockPool:
    """Owns all KV-cache blocks of one worker.

    Invariants (asserted where cheap, checked in full by ``check_invariants`` in tests):
    - Block 0 is the null block: never in the free queue, never handed out.
    - Every other block is either in the free queue with ``ref_cnt == 0`` or held (``ref_cnt > 0``).
    - ``cached_blocks[h].block_hash == h`` for every entry, and a block has a hash only while it is
      in ``cached_blocks``. A free block may stay cached (evictable) until it is handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.enable_caching = enable_caching  # False: nothing is ever put in cached_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]  # index == block_id
        self.null_block = self.blocks[0]  # reserved; never allocated
        self.null_block.is_null = True
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])  # head = next evicted
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}  # prefix cache: hash -> its block

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached-but-unreferenced (evictable) ones included."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block with this hash, or None. Changes nothing (``touch`` claims it)."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt == 1``.

        A handed-out block that was still cached loses its hash (it is evicted from the prefix cache)
        because its contents are about to be overwritten. Raises ``ValueError`` if too few are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached = self.cached_blocks
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit). A block that was free leaves
        the free queue, so it can no longer be evicted while referenced."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free-queue tail in the given
        order, so callers pass a request's blocks tail first: its last blocks are evicted first and its
        prefix (the part most likely shared) stays cached longest. Cached blocks keep their hash."""
        to_free: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"{block} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                to_free.append(block)
        self.free_block_queue.append_n(to_free)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache under
        ``block_hashes[i]``. Only call it for full blocks whose KV is computed, or will be by the
        step being planned (the KV-cache manager's invariants say why that is enough).

        A block already cached (a hit) is left alone. When another block already holds the same hash
        (two requests computed the same prefix at once), the first one stays the cached copy and this
        one stays uncached: the map never names two blocks per hash.
        """
        if not self.enable_caching:
            return
        cached = self.cached_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take these blocks out of the prefix cache (their KV will not be written after all). A block
        that is not the cached copy of its hash, or has none, is left alone; references are unchanged."""
        cached = self.cached_blocks
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None and cached.get(block_hash) is block:
                del cached[block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is held (else returns False, changes nothing),
        so no running request loses blocks it relies on."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check for tests; raises AssertionError on the first violation."""
        in_queue = set()
        for block in self.free_block_queue:
            assert block.block_id not in in_queue, f"{block} twice in the free queue"
            in_queue.add(block.block_id)
            assert block.ref_cnt == 0, f"{block} is in the free queue but referenced"
            assert not block.is_null, "null block in the free queue"
        assert len(in_queue) == self.free_block_queue.num_free_blocks, "free count out of sync"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                assert block.block_id in in_queue, f"{block} has no reference but is not free"
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, f"{block} hash not in map"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"map entry names {block} under another hash"
