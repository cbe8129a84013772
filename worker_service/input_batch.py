"""The persistent batch: every running request's token ids, block table and sampling settings.

State lives in preallocated CPU numpy arrays, one row per request, kept between steps and changed
only by each step's diff (docs/architecture.md, decision 3). A row is given to a request when it arrives and
returned when it finishes or is preempted; rows need not be contiguous (a step gathers the rows it
schedules with one fancy index).

Invariants:
- ``token_ids[row, :num_tokens[row]]`` = prompt + outputs known to this worker (outputs it sampled
  are appended by the runner; the scheduler may still drop them by finishing the request).
- ``block_table[row, :num_blocks[row]]`` is the request's block table; it only grows while the
  request runs (the scheduler's tables are append-only).
- Per-request sampling state that is not one number (the ids banned before ``min_tokens``, the
  logit bias) is built once, when the row is given, and only read by later steps.
"""

from __future__ import annotations

import heapq

import numpy as np

from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import CachedRequestData, NewRequestData
from worker_service.ngram import NgramIndex
from worker_service.sampler import staged_repetition_penalty, staged_temperature
from worker_service.structured_output import StructuredRows

_NO_IDS = np.zeros(0, dtype=np.int64)


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items laid out as consecutive runs of ``counts[i]`` (a step's tokens by sequence, sampling
    positions by request): each item's run and its place in that run (0 .. ``counts[i] - 1``),
    both ``[sum(counts)]`` int64."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]


def min_tokens_banned_ids(params: SamplingParams, eos_token_ids: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """The ids a request may not sample before ``min_tokens`` outputs: its stop token ids and, unless
    ``ignore_eos``, the model's EOS ids; those inside the vocabulary, unique, ascending (int64)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return np.array(sorted(t for t in ids if t < vocab_size), dtype=np.int64)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, *,
                 vocab_size: int, eos_token_ids: tuple[int, ...], structured: StructuredRows | None = None,
                 prompt_lookup: tuple[int, int] | None = None) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        # one spare column: the token sampled at max_model_len is stored before the scheduler stops it
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + outputs
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # as the scheduler last said
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # sampling settings, one column each (gathered per step for the rows that sample)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)  # -1 = off
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.seed = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1 = none
        # top-n of the prompt logprobs still to compute (a request without outputs yet); -1 = none
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.speculable = np.zeros(max_num_reqs, dtype=bool)  # may be given drafts (SamplingParams.speculable)
        # by row: its n-gram index (draft proposals, worker_service.ngram) when speculation is on
        # (``prompt_lookup``: the n-gram sizes) and the request is speculable, else None; built from
        # the row's tokens here, then given each step's sampled tokens by the runner's proposal
        self.prompt_lookup = prompt_lookup
        self.ngram: list[NgramIndex | None] = [None] * max_num_reqs
        self.rows: dict[str, int] = {}  # request id -> row
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs  # by row
        # by row: ids banned while outputs < min_tokens (empty when min_tokens is 0), built in add()
        self.min_tokens_banned: list[np.ndarray] = [_NO_IDS] * max_num_reqs
        # by row: (token ids int64, biases fp32) of its logit_bias inside the vocabulary, or None
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_reqs
        self.num_biased = 0  # rows with a logit_bias: a step looks for them only when some exist
        # by row: the only ids it may sample (int64, inside the vocabulary), or None (every id)
        self.allowed: list[np.ndarray | None] = [None] * max_num_reqs
        self.num_restricted = 0  # rows with allowed ids: a step looks for them only when some exist
        # the grammar matchers of structured-output rows (None: this batch refuses such requests)
        self.structured = structured
        self._free_rows = list(range(max_num_reqs))  # a heap: lowest free row first

    def __len__(self) -> int:
        return len(self.rows)

    def row_of(self, request_id: str) -> int:
        return self.rows[request_id]

    def add(self, new: NewRequestData) -> int:
        """Give ``new`` a row; raises ``ValueError`` if it does not fit (batch full, too long)."""
        if new.request_id in self.rows:
            self.remove(new.request_id)  # a resumed request replaces any stale copy
        num_prompt = len(new.prompt_token_ids)
        num_tokens = num_prompt + len(new.output_token_ids)
        if not self._free_rows:
            raise ValueError(f"persistent batch is full ({self.max_num_reqs} requests); raise max_num_seqs")
        # prompt + outputs within max_model_len was checked where the request entered (servicekit.contract.prompt)
        assert num_tokens <= self.max_model_len, (new.request_id, num_tokens, self.max_model_len)
        if len(new.block_ids) > self.max_blocks_per_req:
            raise ValueError(f"request {new.request_id}: {len(new.block_ids)} blocks exceed {self.max_blocks_per_req}")
        if new.sampling_params.seed is None:
            raise ValueError(f"request {new.request_id}: sampling_params.seed must be set at admission")
        if new.sampling_params.structured_output is not None and self.structured is None:
            raise ValueError(f"request {new.request_id}: this worker has no grammar engine for structured output")
        row = heapq.heappop(self._free_rows)
        self.rows[new.request_id] = row
        self.sampling_params[row] = new.sampling_params
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        p = new.sampling_params
        self.temperature[row] = staged_temperature(p.temperature)
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = staged_repetition_penalty(p.repetition_penalty)
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.seed[row] = p.seed
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.speculable[row] = p.speculable
        if self.prompt_lookup is not None and p.speculable:
            self.ngram[row] = NgramIndex(*self.prompt_lookup, new.prompt_token_ids + new.output_token_ids)
        # A request resumed with outputs published them with its prompt logprobs: none to compute.
        self.num_prompt_logprobs[row] = (-1 if p.prompt_logprobs is None or new.output_token_ids
                                         else p.prompt_logprobs)
        self.min_tokens_banned[row] = (min_tokens_banned_ids(p, self.eos_token_ids, self.vocab_size)
                                       if p.min_tokens else _NO_IDS)
        pairs = [(t, bias) for t, bias in p.logit_bias if t < self.vocab_size]
        if pairs:
            self.logit_bias[row] = (np.array([t for t, _ in pairs], dtype=np.int64),
                                    np.array([bias for _, bias in pairs], dtype=np.float32))
            self.num_biased += 1
        if p.allowed_token_ids:
            self.allowed[row] = np.array([t for t in p.allowed_token_ids if t < self.vocab_size], dtype=np.int64)
            self.num_restricted += 1
        if p.structured_output is not None:
            self.structured.add(row, p.structured_output, new.output_token_ids)
        return row

    def update(self, cached: CachedRequestData) -> None:
        """Append each held request's new block ids and take the scheduler's computed-token counts
        (one fancy index for the counts: a decoding batch adds a block to few of its rows)."""
        if not cached.req_ids:
            return
        rows = self.rows
        index = [rows[rid] for rid in cached.req_ids]  # KeyError: a request this worker does not hold
        for row, rid, new_block_ids in zip(index, cached.req_ids, cached.new_block_ids):
            if new_block_ids:
                start, added = int(self.num_blocks[row]), len(new_block_ids)
                if start + added > self.max_blocks_per_req:
                    raise ValueError(f"request {rid}: block table exceeds {self.max_blocks_per_req} blocks")
                self.block_table[row, start : start + added] = new_block_ids
                self.num_blocks[row] = start + added
        self.num_computed_tokens[index] = cached.num_computed_tokens

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.sampling_params[row] = None
            self.ngram[row] = None
            self.min_tokens_banned[row] = _NO_IDS
            if self.logit_bias[row] is not None:
                self.logit_bias[row] = None
                self.num_biased -= 1
            if self.allowed[row] is not None:
                self.allowed[row] = None
                self.num_restricted -= 1
            if self.structured is not None:
                self.structured.remove(row)
            heapq.heappush(self._free_rows, row)

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """Place draft tokens after ``row``'s known tokens for one step (``num_tokens`` unchanged:
        they are inputs to verify, not tokens of the request); ValueError when the request may not
        have drafts or they would pass ``max_model_len``."""
        start = int(self.num_tokens[row])
        if not self.speculable[row]:
            raise ValueError(f"row {row}: draft tokens for a request whose sampling depends on its outputs")
        if start + len(drafts) > self.max_model_len:
            raise ValueError(f"row {row}: draft tokens past max_model_len ({self.max_model_len})")
        if not all(0 <= t < self.vocab_size for t in drafts):
            raise ValueError(f"row {row}: draft token ids outside the vocabulary ({self.vocab_size})")
        self.token_ids[row, start:start + len(drafts)] = drafts

    def append_token_runs(self, rows: np.ndarray, counts: np.ndarray, token_ids: np.ndarray) -> None:
        """Append ``counts[i]`` tokens to ``rows[i]``, taken in order from ``token_ids`` (a step
        that verified drafts). Rows with drafts have no grammar: the matchers advance by one token."""
        owner, within = ragged(counts)
        each = rows[owner]
        self.token_ids[each, self.num_tokens[each] + within] = token_ids
        self.num_tokens[rows] += counts.astype(self.num_tokens.dtype)
        if self.structured is not None and len(self.structured):
            single = counts == 1
            self.structured.accept(rows[single], token_ids[(np.cumsum(counts) - counts)[single]])

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        if self.structured is not None and len(self.structured):
            self.structured.accept(rows, token_ids)
