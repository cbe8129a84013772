"""Per-request block tables on top of one BlockPool: allocation, prefix-cache hits, freeing (seed §1.5, §1.9)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.kv_cache_utils import KVCacheBlock
from scheduler_service.core.request import Request
from servicekit.contract.step import NO_BLOCK_IDS


class KVCacheManager:
    """Maps each request to its blocks (its block table) in one worker's pool.

    Invariants:
    - A request's block table is append-only from its first allocation until ``free`` (the worker
      relies on it: a step only sends the new block ids).
    - A request holds ``cdiv(tokens scheduled so far, block_size)`` blocks; after draft tokens it did
      not keep (n-gram speculation), possibly more: those blocks are filled by its next tokens.
    - A full block enters the prefix cache when it is allocated for the tokens that fill it (as in
      vLLM), not after the step that computes it: a request admitted in the same step may then point
      at blocks another request of that step fills. That is sound because a worker writes the K/V of
      the whole batch in each layer before any attention of that layer reads the cache
      (``ForwardContext.attend``), and steps run in order on one worker.
    - So a cached block's KV is "written or being written by the step being planned". The one way
      it would never be written is its filler leaving that step's plan before the step runs
      (preempted after its allocation in the same ``schedule()``). ``free`` therefore uncaches a
      request's own blocks past ``request.num_computed_tokens`` (the KV earlier steps computed):
      nobody else can hold them, since hits are only claimed at admission and ``schedule()`` admits
      nothing in a step that preempted. Freeing a request whose step did run, before
      ``update_from_output`` (an abort in between), only loses those cache entries, never KV.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size  # tokens per block
        self.enable_caching = enable_caching  # prefix caching on/off
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # request id -> its block table
        self.num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already in the cache
        self.num_hit_blocks: dict[str, int] = {}  # request id -> leading blocks claimed as a hit at admission
        self.prefix_cache_queries = 0  # prompt(+output) tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    # -- queries --------------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.usage

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.block_pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included."""
        return self.block_pool.get_num_free_blocks()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens since start (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (the live list: do not mutate); empty if it holds none."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a new list)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``allocate_slots(request, num_new_tokens)`` takes from the pool for a request
        that already holds its table (no prefix hit to claim)."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, self.get_num_blocks_needed(request.num_computed_tokens + num_new_tokens) - held)

    # -- allocation -----------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request`` as (blocks, num tokens). Changes nothing.

        The hit never covers the request's last token (at most ``num_tokens - 1`` tokens): that token
        must be computed to produce the logits of the next one. A request still owed its prompt
        logprobs gets no hit.
        """
        if not self.enable_caching or request.prompt_logprobs is not None:
            return [], 0  # a request scoring its prompt computes every position of it
        hashes = request.block_hashes
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(hashes))
        cached = self.block_pool.cached_blocks
        blocks: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_decode_slots(self, requests: Sequence[Request], with_drafts: bool = False,
                              draft_reserve: int = 0) -> list[Sequence[int]]:
        """``allocate_slots(request, 1)`` for each of the leading run of ``requests`` that are
        decoding (one token left to compute, their block table held) and that the pool can serve:
        the hot path of a decoding batch, where the last block usually has room and no block fills.
        ``with_drafts``: room for ``request.spec_token_ids`` too, computed with its token, unless
        they need blocks of their own and fewer than ``draft_reserve`` free blocks would be left
        then (drafts never take the block another request's next token needs: their
        ``spec_token_ids`` are emptied instead). Returns
        the ids of the blocks each got (the shared ``NO_BLOCK_IDS`` when none: do not mutate it), as
        long as that run: the first request not decoding, or not served, and those after it got
        nothing. A request without drafts whose token starts a block takes it here, in line:
        what ``allocate_slots(request, 1)`` does for it, without that call's general path."""
        new_block_ids: list[Sequence[int]] = []
        add = new_block_ids.append
        bs = self.block_size
        tables = self.req_to_blocks
        num_cached = self.num_cached_blocks if self.enable_caching else None
        pool = self.block_pool
        for request in requests:
            num_required_tokens = request.num_computed_tokens + 1
            if len(request.all_token_ids) != num_required_tokens:
                break  # not decoding
            if num_required_tokens % bs > 1 and not (with_drafts and request.spec_token_ids):
                # its token goes in the block of the one before it, which it does not fill: that
                # block is held (computed tokens always are), and nothing is new to cache
                add(NO_BLOCK_IDS)
                continue
            rid = request.request_id
            if with_drafts and request.spec_token_ids:
                with_them = num_required_tokens + len(request.spec_token_ids)
                extra = -(-with_them // bs) - max(len(tables[rid]), -(-num_required_tokens // bs))
                if extra > 0 and pool.free_block_queue.num_free_blocks - extra < draft_reserve:
                    request.spec_token_ids = []
                else:
                    num_required_tokens = with_them
            table = tables[rid]
            if num_required_tokens == len(table) * bs + 1:  # its token starts a block
                if not pool.free_block_queue.num_free_blocks:
                    break
                block = pool.get_new_blocks(1)[0]
                table.append(block)
                add([block.block_id])
            elif num_required_tokens > len(table) * bs:
                new_blocks = self.allocate_slots(request, num_required_tokens - request.num_computed_tokens)
                if new_blocks is None:
                    break
                add([b.block_id for b in new_blocks])
                continue  # (allocate_slots cached what its tokens fill)
            else:
                add(NO_BLOCK_IDS)
            if num_cached is not None and num_required_tokens // bs > num_cached[rid]:
                self.cache_blocks(request, num_required_tokens)
        return new_block_ids

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens +
        num_new_computed_tokens`` and return the newly allocated blocks ([] when none were needed).

        ``new_computed_blocks`` (from ``get_computed_blocks``, only at admission) are claimed as the
        start of the table. Returns None, changing nothing, when the pool cannot supply the blocks;
        free cached blocks count as free, except those this very call claims as a hit. On success the
        blocks these tokens fill are entered in the prefix cache at once (see the class invariants).
        """
        rid = request.request_id
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(rid)
        num_required_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_required_tokens // bs)
        if req_blocks is not None and not new_computed_blocks:
            # Hot path: a running request; usually the last block still has room.
            num_new_blocks = num_required - len(req_blocks)
            new_blocks: list[KVCacheBlock] = []
            if num_new_blocks > 0:
                pool = self.block_pool
                if num_new_blocks > pool.free_block_queue.num_free_blocks:
                    return None
                new_blocks = pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
            if self.enable_caching:  # the step may fill the last held block without a new one
                self.cache_blocks(request, num_required_tokens)
            return new_blocks

        assert not (req_blocks and new_computed_blocks), "prefix hits are only claimed at admission"
        assert len(new_computed_blocks) * bs == num_new_computed_tokens or not self.enable_caching
        num_held = len(req_blocks) if req_blocks else 0
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        pool = self.block_pool
        if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_blocks[rid] = self.num_hit_blocks[rid] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self.cache_blocks(request, num_required_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's full blocks within its first ``num_tokens`` tokens in the prefix cache.
        ``allocate_slots`` calls it for the tokens it made room for; call it directly only for tokens
        whose KV is computed or scheduled in the step being planned."""
        rid = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(rid)
        if num_cached is None or num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], request.block_hashes, num_cached, num_full)
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (its tail is evicted before its shared prefix).
        Idempotent: a request holding no blocks is a no-op.

        Blocks this request entered in the prefix cache past ``request.num_computed_tokens`` (the
        KV earlier steps computed, or its hit) leave the cache first: if the request is being
        dropped from the step being planned, no step will ever write them (see the class invariants).
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        num_cached = self.num_cached_blocks.pop(rid, 0)
        num_hits = self.num_hit_blocks.pop(rid, 0)
        if not blocks:
            return
        # Hits are others' blocks (written or being written for them), never this request's to undo.
        num_written = max(request.num_computed_tokens // self.block_size, num_hits)
        if num_cached > num_written:
            self.block_pool.uncache_blocks(blocks[num_written:num_cached])
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible (True) when no request holds blocks."""
        return self.block_pool.reset_prefix_cache()
