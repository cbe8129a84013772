"""Property test: random allocate / prefix-hit / free / evict sequences keep the pool consistent."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_service.core import KVCacheManager, Request

BLOCK_SIZE = 4
NUM_BLOCKS = 17  # 16 usable: small enough that requests compete and cached blocks get evicted
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 5], [7] * 13]


class KVCacheMachine(RuleBasedStateMachine):
    """Model: live requests (each with its computed-token count), raw block grabs, and the content
    each block holds (the chained hash of the prefix written into it, None while partial)."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.pool = self.manager.block_pool
        self.live: dict[str, Request] = {}
        self.raw: list[list] = []  # blocks taken straight from the pool (they evict cached blocks)
        self.content: dict[int, bytes | None] = {}
        self.count = 0

    def _written(self, request: Request) -> None:
        """The step computed the request's scheduled tokens: record content, cache full blocks."""
        self.manager.cache_blocks(request, request.num_computed_tokens)
        blocks = self.manager.get_blocks(request.request_id)
        for i in range(request.num_computed_tokens // BLOCK_SIZE):
            self.content[blocks[i].block_id] = request.block_hashes[i]

    def _unchanged_after_failure(self, free_before: int) -> None:
        assert self.pool.get_num_free_blocks() == free_before

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=10),
          chunk=st.integers(1, 40))
    def admit(self, prefix, suffix, chunk):
        prompt = (prefix + suffix) or [0]
        self.count += 1
        request = Request(f"r{self.count}", prompt, block_size=BLOCK_SIZE)
        blocks, hit = self.manager.get_computed_blocks(request)
        assert hit <= request.num_tokens - 1 and hit == len(blocks) * BLOCK_SIZE
        for i, block in enumerate(blocks):
            assert self.content.get(block.block_id) == request.block_hashes[i], "hit on a block with other KV"
        chunk = min(chunk, request.num_tokens - hit)
        free_before = self.pool.get_num_free_blocks()
        new_blocks = self.manager.allocate_slots(request, chunk, blocks, hit)
        if new_blocks is None:
            self._unchanged_after_failure(free_before)
            assert self.manager.get_blocks(request.request_id) == []
            return
        for block in new_blocks:
            self.content[block.block_id] = None
        request.num_computed_tokens = hit + chunk
        self.live[request.request_id] = request
        self._written(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 12), new_tokens=st.lists(st.integers(0, 3), max_size=6))
    def extend(self, data, n, new_tokens):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(new_tokens or [0])  # sampled (or speculated) tokens
        n = min(n, request.num_tokens - request.num_computed_tokens)
        free_before = self.pool.get_num_free_blocks()
        new_blocks = self.manager.allocate_slots(request, n)
        if new_blocks is None:
            self._unchanged_after_failure(free_before)
            return
        for block in new_blocks:
            self.content[block.block_id] = None
        request.num_computed_tokens += n
        self._written(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.free(request)

    @rule(k=st.integers(1, 8))
    def evict(self, k):
        if k > self.pool.get_num_free_blocks():
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(k)
            return
        blocks = self.pool.get_new_blocks(k)
        for block in blocks:
            assert block.block_hash is None
            self.content[block.block_id] = None
        self.raw.append(blocks)

    @precondition(lambda self: self.raw)
    @rule()
    def release(self):
        self.pool.free_blocks(reversed(self.raw.pop()))

    @rule()
    def reset_prefix_cache(self):
        assert self.manager.reset_prefix_cache() == (not self.live and not self.raw)

    @invariant()
    def pool_is_consistent(self):
        self.pool.check_invariants()  # free queue <-> ref 0, hash map <-> block hashes
        expected = Counter(b.block_id for r in self.live for b in self.manager.get_blocks(r))
        expected.update(b.block_id for blocks in self.raw for b in blocks)
        used = 0
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == expected[block.block_id], f"{block}: expected {expected[block.block_id]} refs"
            used += block.ref_cnt > 0
        assert used + self.pool.get_num_free_blocks() == self.pool.num_usable_blocks
        for rid, request in self.live.items():
            assert len(self.manager.get_blocks(rid)) == -(-request.num_computed_tokens // BLOCK_SIZE)
        for block_hash, block in self.pool.cached_blocks.items():
            assert self.content.get(block.block_id) == block_hash, "cached block holds other KV"


KVCacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
