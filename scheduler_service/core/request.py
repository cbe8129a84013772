"""One generation request as the scheduler tracks it (seed §2.2)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from scheduler_service.core.kv_cache_utils import ROOT_BLOCK_HASH, BlockHash, cache_salt_extra_keys, hash_block_tokens
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason, TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 1  # in the waiting queue, never scheduled (or resumed after failover)
    RUNNING = 2  # in the running batch; the worker holds it
    PREEMPTED = 3  # was running, blocks freed, back in the waiting queue; recomputes from scratch
    FINISHED_STOPPED = 4  # EOS or a stop token id
    FINISHED_LENGTH = 5  # max_tokens or the model's max length
    FINISHED_ABORTED = 6  # aborted by the client, a deadline or an operator

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* states (they are ordered after PREEMPTED)."""
        return status > RequestStatus.PREEMPTED

    def finish_reason(self) -> FinishReason | None:
        """The client-facing reason of a finished status, None for a live one."""
        return _FINISH_REASONS.get(self)


_STOPPED, _LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


NEVER = 1 << 62  # a token count no request reaches


class Request:
    """A request's tokens, progress and scheduling keys.

    Invariants:
    - ``all_token_ids == prompt_token_ids + output_token_ids``; output tokens are only appended.
    - ``0 <= num_computed_tokens <= num_tokens``: tokens whose KV is in the request's blocks. There
      is no prefill/decode phase field: a request is prefilling while ``num_computed_tokens <
      num_prompt_tokens``, and the scheduler only compares these counts (seed §2.8).
    - Once hashing is enabled, ``block_hashes[i]`` is the chained hash of full block ``i`` of
      ``all_token_ids``, for every full block (kept up to date as tokens are appended).
    - A request created with ``output_token_ids`` (failover, resume) continues after them: the next
      output index is ``len(output_token_ids)``, and ``max_tokens`` counts them too.

    ``block_size`` starts block hashing at construction; otherwise ``Scheduler.add_request`` starts
    it with the worker's block size (when prefix caching is on).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority", "cache_salt",
        "status", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "block_hashes", "max_tokens", "stop_token_set", "all_token_ids", "_stop_from", "_length_at",
        "_block_size", "_first_extra_keys", "prompt_logprobs", "tenant", "tenant_weight",
        "spec_token_ids", "_next_hash_at", "next_event_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
        block_size: int | None = None,
        tenant: str = "",
        tenant_weight: float = 0.0,
    ) -> None:
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.request_id = request_id  # unique among live requests of a scheduler
        self.prompt_token_ids = list(prompt_token_ids)  # never mutated after construction
        self.sampling_params = params  # seed filled in at admission when it was None
        self.arrival_time = arrival_time  # given by the caller: the core reads no clock
        self.priority = priority  # lower is scheduled sooner (policy "priority")
        self.cache_salt = cache_salt  # isolates this request's prefix-cache entries (per tenant)
        self.tenant = tenant  # whose share it counts against (policy "fair"); "" for all others
        self.tenant_weight = tenant_weight  # the tenant's weight in fair shares; 0: not given (1, or the queue's)
        self.status = RequestStatus.WAITING  # lifecycle: WAITING -> RUNNING (<-> PREEMPTED) -> FINISHED_*
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is computed (or hit in the prefix cache)
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until scheduled
        self.num_preemptions = 0  # times this request lost its blocks and started over
        self.block_hashes: list[BlockHash] = []  # chained hash per full block (once hashing is on)
        self.max_tokens = params.max_tokens  # cached for the hot path
        self.stop_token_set: frozenset[int] = frozenset(params.stop_token_ids)  # + EOS, set at admission
        # A plain attribute (hot path); only ``append_output_token(s)`` may change it. The outputs
        # (delivered ones first, then generated ones) are its tail: ``output_token_ids``.
        self.all_token_ids = self.prompt_token_ids + list(output_token_ids)  # prompt + outputs
        # the token counts at which a stop token counts (min_tokens) and at which max_tokens stops
        self._stop_from = self.num_prompt_tokens + params.min_tokens
        self._length_at = self.num_prompt_tokens + params.max_tokens
        # the token count that needs more than an append: a block to hash, or max_tokens reached
        self.next_event_at = self._length_at
        # SamplingParams.prompt_logprobs: by prompt index, filled as steps compute them (index 0 has
        # none) and handed out with the first output token; None when not asked for or handed out.
        # While set the request takes no prefix-cache hit (every prompt position is computed).
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None and not output_token_ids
            else None)
        # Draft tokens for the next step (n-gram speculation), as the worker proposed them with the
        # tokens of the step that appended this request's last ones: valid for the token ids as
        # they are then; not outputs.
        self.spec_token_ids: list[int] = []
        self._block_size = 0  # 0: block hashing off
        self._next_hash_at = NEVER  # the token count that completes the next block to hash
        self._first_extra_keys = cache_salt_extra_keys(cache_salt)  # only the first block's hash
        if block_size is not None:
            self.enable_block_hashing(block_size)

    # -- tokens ---------------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, delivered ones included; also the index of the next output."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The outputs so far, delivered ones included (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_output_token(self, token_id: int) -> RequestStatus | None:
        """Append one sampled token (the hot path), hash the block it completes, if any, and return
        the finished status it brings, or None: STOP on a token of ``stop_token_set`` (EOS unless
        ignore_eos, and the stop token ids) once ``min_tokens`` outputs exist — also as the last
        token max_tokens allows, as vLLM checks (the stop token then reads as one) — else LENGTH at
        max_tokens (admission made prompt + max_tokens <= max_model_len, so this also stops at the
        model's length). The caller applies the status.

        The scheduler's decode loop does the same in line: it appends to ``all_token_ids`` and
        calls :meth:`after_append` only when the new count reaches ``next_event_at`` or the token
        is a stop token (else the status is None), with the hashing deferred to the loop's end."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        if len(tokens) >= self.next_event_at or token_id in self.stop_token_set:
            return self.after_append(token_id)
        return None

    def after_append(self, token_id: int, hash_later: list[Request] | None = None) -> RequestStatus | None:
        """The rest of :meth:`append_output_token` once ``token_id`` is appended: hash the block it
        completes, return the status it brings.

        ``hash_later``: instead of hashing now, add this request to that list; the caller calls
        :meth:`hash_new_full_blocks` on each before ``block_hashes`` is read, and appends no other
        token to it meanwhile. (The scheduler's update of a large batch hashes ~1 request in 16 a
        step: one run of hashes after the loop keeps that code and data warm, ~5 % of the step
        at 1,024 requests.)"""
        n = len(self.all_token_ids)
        if n >= self._next_hash_at:
            if hash_later is None:
                self.hash_new_full_blocks()
            else:
                hash_later.append(self)
        if token_id in self.stop_token_set and n >= self._stop_from:
            return _STOPPED
        if n >= self._length_at:
            return _LENGTH
        return None

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens; hashes every block they complete (when hashing is on)."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= self._next_hash_at:
            self.hash_new_full_blocks()

    # -- block hashes ---------------------------------------------------------------------------------

    def enable_block_hashing(self, block_size: int) -> None:
        """Start keeping ``block_hashes`` for blocks of ``block_size`` tokens (idempotent for one size)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if self._block_size and self._block_size != block_size:
            raise ValueError(f"block hashing already on with block_size {self._block_size}")
        self._block_size = block_size
        self.hash_new_full_blocks()

    @property
    def hashing_block_size(self) -> int:
        """The block size ``block_hashes`` are computed for; 0 while hashing is off."""
        return self._block_size

    def hash_new_full_blocks(self) -> None:
        """Hash every full block not hashed yet (a no-op when hashing is off or all are)."""
        bs = self._block_size
        if not bs:
            return
        tokens = self.all_token_ids
        hashes = self.block_hashes
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if i else ROOT_BLOCK_HASH
            extra = self._first_extra_keys if i == 0 else b""
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))
        self._next_hash_at = (len(hashes) + 1) * bs
        self.next_event_at = min(self._next_hash_at, self._length_at)

    # -- status ---------------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        """True once stopped, length-capped or aborted."""
        return self.status > RequestStatus.PREEMPTED

    def get_finish_reason(self) -> FinishReason | None:
        """The client-facing finish reason, None while live."""
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens})")
