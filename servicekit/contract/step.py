"""What crosses the seam between the scheduler core and a worker, in both directions.

``SchedulerOutput`` is a *diff* (docs/architecture.md, decision 3): a worker keeps each running request's token
ids and block table between steps, so a step carries new requests in full and, for requests the
worker already holds, only their newly allocated block ids and computed-token counts.

Invariants a worker may rely on:
- A request id appears at most once among ``scheduled_new_reqs`` and ``scheduled_cached_reqs.req_ids``
  per step.
- Block tables are append-only while a request runs: ``new_block_ids`` extend the table.
- A preempted request is dropped by the worker (its id is in ``preempted_req_ids``); when it runs
  again it arrives as a new request carrying prompt + every output token it already has.
- ``finished_req_ids`` lists requests finished or aborted since the previous step; the worker drops
  them. A request is never both scheduled and in ``finished_req_ids`` in one step. It may name
  requests the worker does not hold (aborted while waiting or preempted): a worker ignores those.
- A new request's ``num_computed_tokens`` (a prefix-cache hit) covers blocks whose KV an earlier
  step computed or *this* step computes for another request (blocks enter the prefix cache when
  they are allocated). So a worker writes the K/V of every scheduled token of a layer before any
  attention of that layer reads the cache; it never reorders that within a step.
- A request samples a token in a step exactly when the step's tokens reach the end of its known
  token ids (``num_computed_tokens + num_scheduled_tokens == len(all token ids)``); a partial prefill
  chunk samples nothing.
- Draft tokens (``scheduled_spec_decode_tokens``, n-gram speculation) extend a decoding request's
  known token ids for this step only: the step computes its last token and the ``k`` drafts after
  it (``num_scheduled_tokens == 1 + k``), samples at each of those ``k + 1`` positions exactly as it
  would one at a time, and returns the sampled tokens up to and including the first that differs
  from its draft (all ``k + 1`` when every draft matched). The scheduler then takes the rejected
  drafts' positions back from ``num_computed_tokens``; their KV slots are rewritten by later steps.
  Only requests whose next token depends on nothing but the logits and the position get drafts
  (``SamplingParams.speculable``), so verification samples what one-token steps sample, sampled
  requests included (fp32: bit for bit; bf16 results vary with a batch's shapes, as they always do,
  and a request's rows over its own prefix may run on AMX tiles: within bf16 rounding). A worker
  proposes drafts with a step's answer (``ModelRunnerOutput.spec_token_ids``); the scheduler
  schedules them, within ``SamplingParams.max_drafts``, in the request's next step or not at all.
- A *continuation* (``continuation``, asynchronous scheduling) is planned before the results of
  the step sent just before it: every request in it is held and decodes. The worker computes each
  one's last token as it knows it after that step (``num_computed_tokens`` there is the tokens
  the scheduler knows, a lower bound: the worker's own count of known tokens less one is the
  one that holds), and after it up to ``num_own_drafts`` draft tokens of its own proposal from
  that step's answer, within ``SamplingParams.max_drafts``, verified as above
  (``num_scheduled_tokens`` stays 1: the answer's token count says how many were accepted).
  A request that has all of its ``max_tokens`` after that step (its drafts there were accepted)
  is skipped: nothing computed, nothing sampled. The plan's blocks cover every position such a
  step may compute.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from servicekit.contract.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id (or, at the gateway, a stop string)
    LENGTH = "length"  # max_tokens or the model's max length
    ABORT = "abort"  # aborted by the client, a deadline or an operator

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class NewRequestData:
    """A request the worker does not hold yet (first scheduled, or resumed after preemption/failover)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # outputs it already has (resumed requests); all ids = prompt + these
    sampling_params: SamplingParams  # seed always set by admission
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # tokens whose KV is already in those blocks (prefix-cache hit)


MAX_DRAFT_TOKENS = 16  # the most draft tokens a request verifies in one step (a worker's proposal at most)

NO_BLOCK_IDS: list[int] = []  # a held request's new block ids when it got none: one shared list, never changed


@dataclass(slots=True)
class CachedRequestData:
    """The requests the worker already holds, only what changed, as columns (as vLLM's): entry ``i``
    of each list belongs to request ``req_ids[i]``. One object per step rather than one per
    request: a step of a thousand decoding requests builds three lists, and the wire carries them
    as packed columns (``servicekit.proto.step``)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Sequence[int]] = field(default_factory=list)  # appended to its block table; read only
    num_computed_tokens: list[int] = field(default_factory=list)  # tokens whose KV was computed before this step

    def append(self, request_id: str, new_block_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.req_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def remove(self, request_id: str) -> None:
        """Take ``request_id``'s entry out (a request preempted after it was planned)."""
        i = self.req_ids.index(request_id)
        del self.req_ids[i], self.new_block_ids[i], self.num_computed_tokens[i]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: which requests run, how many tokens each, and what changed since last step."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # request id -> draft tokens to verify after its last token (only requests that have some)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # planned before the previous step's results: each request decodes from its last token as the
    # worker knows it, with up to ``num_own_drafts`` drafts of the worker's own (module docstring)
    continuation: bool = False
    num_own_drafts: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of one sampled token plus the top-n alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first, n = SamplingParams.logprobs
    rank: int = 0  # the token's rank in the distribution (1 = most likely); 0 = not computed


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a worker returns for one step: sampled tokens of the requests that sampled."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # only where asked for
    # request id -> (prompt index of the first entry, logprobs of the prompt tokens from there) for
    # requests with SamplingParams.prompt_logprobs whose prompt this step computed (no output yet):
    # the logits at position p give the entry of prompt token p + 1; a partial chunk has some too.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> draft tokens for its next step (n-gram speculation), proposed from its tokens
    # after this step's: only for requests that sampled and have a match
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, gc=False):
    """What one step produced for one request, as the scheduler reports it to clients.

    A msgspec struct, not a dataclass (as vLLM's): a step makes one per request that sampled, and
    msgspec builds one in ~70 ns against a slots dataclass's ~170 (1,024 decoding requests: a tenth
    of the scheduler core's step). ``gc=False``: it holds no reference back to anything that could
    hold it, so the cyclic collector need not track it."""

    request_id: str
    new_token_ids: list[int]
    first_index: int  # output index of new_token_ids[0]: indices are never reused (failover relies on it)
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first scheduling
    # with the first output token (first_index 0) of a request with SamplingParams.prompt_logprobs:
    # one entry per prompt token after the first (the first has no context)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

