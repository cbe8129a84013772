"""The continuous-batching scheduler of one worker (seed §2.4, §2.6, §2.7, §2.9).

One engine step is ``schedule()`` → the worker runs the ``SchedulerOutput`` → ``update_from_output()``.
The scheduler owns request state and the worker's block pool; it reads no clock and draws no
randomness except from the ``seed_rng`` it was handed (docs/architecture.md, decision 1).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.waiting_queue import ORDERED_POLICIES, create_waiting_queue
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.prompt import length_error
from servicekit.contract.scheduling import MIN_PREFILL_CHUNK_TOKENS, SchedulingConfig
from servicekit.contract.step import (
    MAX_DRAFT_TOKENS,
    NO_BLOCK_IDS,
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from servicekit.contract.worker import WorkerDescription

log = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
# Waiting requests (from the head) looked at for a prefix a capped prefill chunk shares with them:
# those admitted in the next steps, at a bounded cost per step.
SHARED_PREFIX_LOOKAHEAD = 64


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for health/metrics endpoints."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests in the waiting queue (preempted ones included)
    kv_cache_usage: float  # fraction of usable blocks held by requests, in [0, 1]
    num_free_blocks: int  # free blocks, evictable cached ones included
    num_total_blocks: int  # usable blocks (null block excluded)
    prefix_cache_hit_rate: float  # hit tokens / looked-up tokens since start
    prefix_cache_queries: int  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens served from the cache
    num_preemptions: int  # preemptions since start


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Invariants:
    - Every live request is in exactly one of ``waiting`` (WAITING / PREEMPTED) and ``running``
      (RUNNING); finished requests are dropped from both and from ``requests`` at once.
    - A step schedules at most ``max_num_batched_tokens`` tokens; at most ``max_num_seqs`` requests
      run; a running request holds blocks for every token it has scheduled.
    - Output tokens are only appended, and each carries its index: nothing delivered is recomputed
      as a new token (a preempted request resumes from prompt + its outputs).
    - A step that preempts admits nothing. Besides saving memory, this keeps prefix hits sound:
      blocks enter the prefix cache when allocated, so a hit may name blocks this step fills, and a
      request preempted after its allocation in this step takes its unwritten blocks out of the
      cache (``KVCacheManager.free``) before any admission could hit them.
    """

    def __init__(self, config: SchedulingConfig, worker: WorkerDescription, *,
                 seed_rng: random.Random | None = None) -> None:
        config = config.for_worker(worker)  # within the worker's limits; -1: the worker's attention cap
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < worker.max_model_len:
            # Without chunking a resumed request (prompt + outputs, up to max_model_len tokens) must
            # fit in one step, or it would wait forever.
            raise InvalidArgumentError(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({worker.max_model_len}) when chunked prefill is off, "
                f"got {config.max_num_batched_tokens}")
        self.config = config  # batching settings
        self.worker = worker  # the worker this scheduler drives (block counts, limits, EOS)
        self.block_size = worker.block_size  # tokens per KV block
        self.max_model_len = worker.max_model_len  # prompt + outputs at most
        self.kv_cache_manager = KVCacheManager(worker.num_blocks, worker.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.waiting = create_waiting_queue(config.policy)  # WAITING and PREEMPTED requests
        self.running: list[Request] = []  # RUNNING requests, in admission order
        self.finished_req_ids: set[str] = set()  # finished/aborted since the last schedule()
        self.num_preemptions = 0  # preemptions since start
        self.tenant_usage: dict[str, list[int]] = {}  # tokens of finished requests per tenant: take_tenant_usage()
        self._seed_rng = seed_rng if seed_rng is not None else random.Random(0)  # seeds for unseeded requests
        self._eos_token_ids = frozenset(worker.eos_token_ids)
        # running requests with draft tokens for the next step (n-gram speculation), by id: the
        # worker's proposals taken by the latest update_from_output, for the token ids as they are since
        self._drafted: dict[str, Request] = {}
        # draft tokens a continuation lets the worker verify per request: the longest proposal
        # seen from it (a worker without speculation proposes none)
        self.own_draft_limit = 0

    # -- admission ------------------------------------------------------------------------------------

    def fits(self, request: Request) -> bool:
        """Whether ``request`` could ever run here: prompt + max_tokens within this worker's
        ``max_model_len`` and its whole KV cache (workers may differ in both; routing sends a
        request only where it fits, and :meth:`add_request` refuses one that does not)."""
        return (length_error(request.num_prompt_tokens, request.max_tokens, self.max_model_len) is None
                and self._kv_capacity_error(request) is None)

    def _kv_capacity_error(self, request: Request) -> InvalidArgumentError | None:
        max_total = request.num_prompt_tokens + request.max_tokens
        kv = self.kv_cache_manager
        if kv.get_num_blocks_needed(max_total) > kv.num_total_blocks:
            return InvalidArgumentError("max_tokens", f"prompt + max_tokens ({max_total} tokens) needs more "
                                                       f"KV blocks than the worker has ({kv.num_total_blocks})")
        return None

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (WAITING). Its prompt passed ``servicekit.contract.prompt.check_prompt``
        where it entered (the gateway, or ``pagedserve.LLM``): the core does not check it again.

        Raises InvalidArgumentError naming ``request_id`` (a live request has that id) or
        ``max_tokens`` (prompt + max_tokens need more KV blocks than the worker has, or no output is
        left to generate). On success the request has a seed and its block hashes.
        """
        rid = request.request_id
        if rid in self.requests:
            raise InvalidArgumentError("request_id", f"a request with id {rid!r} is already running")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"{rid}: only fresh requests can be added, got {request!r}")
        too_big = self._kv_capacity_error(request)  # within max_model_len: checked at entry
        if too_big is not None:
            raise too_big
        if request.num_output_tokens >= request.max_tokens:
            raise InvalidArgumentError("max_tokens", f"the request already has {request.num_output_tokens} "
                                                      f"outputs (max_tokens {request.max_tokens})")
        request.sampling_params = params = request.sampling_params.seeded(self._seed_rng)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self._eos_token_ids
        request.stop_token_set = frozenset(stop)
        if self.config.enable_prefix_caching:
            request.enable_block_hashing(self.block_size)
        self.requests[rid] = request
        self.waiting.add(request)

    # -- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: first the running requests (preempting when blocks run out), then, if
        nothing was preempted, waiting ones in queue order while budget, seats and blocks last.

        The plan is a diff (see ``outputs``): new and resumed requests in full, running ones as new
        block ids. Each scheduled request gets ``num_tokens - num_computed_tokens`` tokens, cut by
        ``long_prefill_token_threshold``, by ``shared_prefill_token_threshold`` when the step is
        shared (another request waits or runs), by ``prefill_chunk_attention_limit`` (the key positions
        a chunk attends grow with its context: see :meth:`_attention_cap`), and by what is left of the
        budget.
        """
        cfg = self.config
        kv = self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        threshold, shared = self._chunk_threshold()
        num_scheduled: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: list[Request] = []
        running = self.running
        # Phase 0 (policy fair): a seat for a tenant below its share, from one above it.
        seat_victim = None
        victim_index = self._fair_seat_victim()
        if victim_index is not None:
            seat_victim = running.pop(victim_index)
            self._preempt(seat_victim)
        due, reserve = self._fair_reserve(threshold, budget) if cfg.policy == "fair" else (None, 0)
        drafted = self._drafts_that_fit(budget, threshold, reserve)
        spec_tokens: dict[str, list[int]] = {}
        others = cfg.shared_prefill_token_threshold or budget  # with ``due``: prefill tokens for the others

        # Phase 1: the running batch. First the leading run of decoding requests (the hot path of a
        # decoding batch: one token each and their drafts, usually room in the last block), then the
        # rest one by one.
        decode_slots = kv.allocate_decode_slots
        new_block_ids = decode_slots(running if len(running) <= budget else running[:budget], bool(drafted),
                                     len(running))
        i = len(new_block_ids)
        if i:
            decoding = running[:i] if i < len(running) else running
            rids = [r.request_id for r in decoding]
            num_scheduled = dict.fromkeys(rids, 1)
            cached_reqs = CachedRequestData(rids, new_block_ids, [r.num_computed_tokens for r in decoding])
            budget -= i
            for rid, request in drafted.items():
                if rid in num_scheduled:
                    budget -= self._schedule_drafts(request, num_scheduled, spec_tokens)
        while i < len(running) and budget > 0:
            request = running[i]
            n = len(request.all_token_ids) - request.num_computed_tokens
            if n == 1:  # decoding: no cap applies; usually its last block has room
                if request.spec_token_ids and len(request.spec_token_ids) >= budget:
                    request.spec_token_ids = []  # no room for them
                served = decode_slots((request,), bool(request.spec_token_ids), len(running))
                if served:
                    rid = request.request_id
                    num_scheduled[rid] = 1
                    budget -= 1 + self._schedule_drafts(request, num_scheduled, spec_tokens)
                    cached_reqs.append(rid, served[0], request.num_computed_tokens)
                    i += 1
                    continue
            n = self._capped(request, request.num_computed_tokens, n, threshold, shared)
            if n > 1:
                n = self._attention_cap(request.num_computed_tokens, n)
                if due is not None:
                    n = min(n, budget - reserve, others)
                    if n <= 0:
                        i += 1
                        continue  # the budget left is kept for a tenant's first chunk (policy fair)
                    others -= n
            if n > budget:
                n = budget
            new_blocks = kv.allocate_slots(request, n)
            while new_blocks is None:
                victim, victim_index = self._pick_victim()
                rid = victim.request_id
                if rid in num_scheduled:  # priority policy: undo its place in this step
                    budget += num_scheduled.pop(rid)
                    cached_reqs.remove(rid)
                    spec_tokens.pop(rid, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
                new_blocks = kv.allocate_slots(request, n)
            if new_blocks is None:
                continue  # ``request`` itself was preempted; running[i] is now the next one
            num_scheduled[request.request_id] = n
            budget -= n
            cached_reqs.append(request.request_id, [b.block_id for b in new_blocks] if new_blocks else NO_BLOCK_IDS,
                               request.num_computed_tokens)
            i += 1

        # Phase 2: admit waiting requests (not in a step that had to preempt: memory is short).
        waiting = self.waiting
        ordered = (cfg.policy in ORDERED_POLICIES and not preempted and bool(waiting) and budget > 0
                   and len(running) < cfg.max_num_seqs)
        if ordered:  # by the cost of admission (waiting_queue.OrderedWaitingQueue)
            waiting.reorder(self._admission_cost)
            num_running = len(running)
        while not preempted and waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            request = waiting.peek()
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            n = self._capped(request, num_computed, request.num_tokens - num_computed, threshold, shared)
            if n > 1:
                n = self._attention_cap(num_computed, n)
                if due is not None and request is not due:
                    if n > others and not cfg.enable_chunked_prefill or others <= 0:
                        break  # the rest of the budget is not for another prompt (policy fair)
                    n = min(n, others)
                    others -= n
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break  # the whole prompt must fit: it waits for a step with room
                n = budget
            if kv.allocate_slots(request, n, computed_blocks, num_computed) is None:
                break  # head-of-line: later requests do not overtake it
            waiting.pop()
            running.append(request)
            request.status = _RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                # The client's prompt tokens the cache served. A request resumed after delivered
                # outputs reported its figure in those outputs: the hit of its recomputation
                # (prompt + delivered tokens) is this engine's business, not the client's usage.
                request.num_cached_tokens = 0 if request.num_output_tokens else num_computed
            rid = request.request_id
            num_scheduled[rid] = n
            budget -= n
            new_reqs.append(NewRequestData(
                rid, list(request.prompt_token_ids), request.output_token_ids,
                request.sampling_params, kv.get_block_ids(rid), num_computed))

        if ordered:
            waiting.passed_over(running[num_running:])
        for request in drafted.values():  # sent (in ``spec_tokens``) or not: either way used up
            request.spec_token_ids = []
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted}
            | ({seat_victim.request_id} if seat_victim is not None else set()),
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        return output

    def schedule_continuation(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after ``in_flight`` before its results are in (asynchronous scheduling,
        as vLLM's ``--async-scheduling``): the worker runs steps in order and appends each sampled
        token to its own copy of the request, so the next step of a decoding batch needs no token
        from here. Returns None, changing nothing that matters, unless the plan ``schedule()``
        would make after ``update_from_output(in_flight, ...)`` is known now: every running request
        was scheduled in ``in_flight`` and samples in it, and no waiting request could take a seat.
        Then each one that can still grow decodes: a continuation (``SchedulerOutput.continuation``)
        computes each request's last token as the worker knows it, and up to ``num_own_drafts``
        draft tokens of the worker's own proposal after it. So a step with draft tokens has a
        continuation too: how many of its drafts are accepted is the worker's to know, and the
        plan holds blocks for all of them and all of the continuation's (a rejected draft's slot is
        rewritten later, as in any step with drafts). ``num_own_drafts`` is the longest proposal
        this worker has made, within the token budget.

        One whose token sampled in ``in_flight`` is certainly its last (``max_tokens``) is left out.
        One that may reach ``max_tokens`` there (its drafts) decodes on: the worker, which knows how
        many were accepted, computes nothing for a request that has all of its ``max_tokens``. A
        request that stops in ``in_flight`` on a stop token computes a token or a few too many:
        ``update_from_output`` drops them (it is finished by then) and the next plan lists it in
        ``finished_req_ids``. Blocks this plan allocates hold tokens not known here, so they enter
        the prefix cache only once those tokens are appended (``cache_blocks`` covers blocks with
        known hashes only). Too few free blocks returns None, allocating nothing (every block a
        request holds must reach the worker in some plan's ``new_block_ids``).

        Call it at most once per step in flight, after the ``update_from_output`` of every step
        before it and before its own."""
        planned = in_flight.num_scheduled_tokens
        running = self.running
        if not planned or not running:
            return None
        if self.waiting and (len(running) < self.config.max_num_seqs or self._fair_seat_victim() is not None):
            return None  # a waiting request may take a seat: schedule() decides, with the results in
        if len(running) > self.config.max_num_batched_tokens:
            return None
        spec = in_flight.scheduled_spec_decode_tokens
        own = self.own_draft_limit if len(running) * (1 + self.own_draft_limit) <= self.config.max_num_batched_tokens \
            else 0
        kv = self.kv_cache_manager
        growing: list[tuple[Request, int, int]] = []  # (request, slots it needs, tokens known)
        num_new_blocks = 0
        for request in running:
            rid = request.request_id
            n = planned.get(rid)
            num_tokens = len(request.all_token_ids)
            if in_flight.continuation:  # its last token, and up to ``num_own_drafts`` drafts
                if n is None or request.num_computed_tokens + 1 != num_tokens:
                    return None
                gained = 1 + in_flight.num_own_drafts  # the most tokens it can gain in flight
            else:
                drafts = len(spec[rid]) if spec and rid in spec else 0
                if n is None or request.num_computed_tokens + n - drafts != num_tokens:
                    # Not in the step (budget), or a partial prefill chunk: schedule() plans it.
                    return None
                gained = 1 + drafts
            if request.num_output_tokens + 1 >= request.max_tokens:
                continue  # its token in flight is its last
            # slots up to its last token after ``in_flight`` and the drafts after that, within
            # the most tokens it can ever hold (if its drafts in flight end it, the worker skips it)
            need = min(num_tokens + gained + own, request.num_prompt_tokens + request.max_tokens) \
                - request.num_computed_tokens
            growing.append((request, need, num_tokens))
            num_new_blocks += kv.get_num_new_blocks(request, need)
        if not growing or num_new_blocks > kv.get_num_free_blocks():
            return None  # memory short: schedule() preempts, with the results in (nothing allocated here)
        cached_reqs = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for request, need, num_tokens in growing:
            rid = request.request_id
            new_blocks = kv.allocate_slots(request, need)
            assert new_blocks is not None  # counted above
            num_scheduled[rid] = 1
            # the tokens known here: no more than the worker will have computed (it uses its own count)
            cached_reqs.append(rid, [b.block_id for b in new_blocks] if new_blocks else NO_BLOCK_IDS, num_tokens)
        output = SchedulerOutput(scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=num_scheduled,
                                 total_num_scheduled_tokens=len(num_scheduled),
                                 finished_req_ids=self.finished_req_ids, continuation=True, num_own_drafts=own)
        self.finished_req_ids = set()
        return output

    def num_tokens_computed(self, step: SchedulerOutput) -> int:
        """Tokens the worker computes in ``step``: those it schedules and, in a continuation, each
        request's own drafts (proposed with the answer before it, up to ``num_own_drafts``). Exact
        between the ``update_from_output`` of the step before ``step`` and ``step``'s own; a
        measure of the step's cost (the engine's timing of plans ahead), nothing else."""
        total = step.total_num_scheduled_tokens
        if step.continuation and step.num_own_drafts:
            own, drafted = step.num_own_drafts, self._drafted
            for rid in step.num_scheduled_tokens:
                request = drafted.get(rid)
                if request is not None:
                    total += min(len(request.spec_token_ids), own)
        return total

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply one step's results: advance ``num_computed_tokens`` by the scheduled counts, append
        sampled tokens, stop and free finished requests.

        Returns one output per request that got tokens or finished. Requests aborted since
        ``schedule()`` are skipped (their tokens dropped). Tokens for a request that did not reach
        the end of its known tokens are ignored; a request that should have sampled but got no
        token recomputes its last token next step (sampling is a pure function of seed and
        position, so the retry samples the same token).
        """
        sampled = model_runner_output.sampled_token_ids
        spec = scheduler_output.scheduled_spec_decode_tokens
        continuation, own = scheduler_output.continuation, scheduler_output.num_own_drafts
        for stale in self._drafted.values():  # drafts for token ids this step may change
            stale.spec_token_ids = []
        drafted: dict[str, Request] = {}
        self._drafted = drafted
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        requests = self.requests
        outputs: list[EngineCoreOutput] = []
        add_output = outputs.append
        finished: list[tuple[Request, RequestStatus]] = []
        fair = self.waiting if self.config.policy == "fair" else None
        # per-request work only some steps have (one test per request for all of it when none)
        extras = fair is not None or bool(prompt_logprobs)
        hash_later: list[Request] = []  # requests whose appended token completed a block
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.status is not _RUNNING:
                continue  # aborted (or replaced) since schedule()
            before = request.num_computed_tokens
            computed = before + n
            all_ids = request.all_token_ids
            num_tokens = len(all_ids)
            if computed >= num_tokens:
                tokens = sampled.get(rid)
                if not tokens:
                    computed = num_tokens - 1  # the worker owes us a sample: redo the last token
                elif spec and rid in spec:
                    # the drafts accepted, then the token sampled after them: the rejected
                    # drafts' positions are computed again (with the right tokens) later
                    k = len(spec[rid])
                    tokens = tokens[:k + 1]
                    computed -= k + 1 - len(tokens)
                elif continuation:  # its last token, the worker's own drafts accepted, one more
                    tokens = tokens[:own + 1]
                    computed += len(tokens) - 1
            else:
                tokens = None  # a partial prefill chunk samples nothing
            request.num_computed_tokens = computed  # full blocks were cached at allocation
            if extras:
                if fair is not None and computed > before:  # the service this step gave its tenant
                    prompt_part = max(0, min(computed, request.num_prompt_tokens) - before)
                    fair.charge(request.tenant, prompt_part, computed - before - prompt_part)
                if prompt_logprobs and rid in prompt_logprobs and request.prompt_logprobs is not None:
                    first, items = prompt_logprobs[rid]
                    if 1 <= first and first + len(items) <= len(request.prompt_logprobs):
                        request.prompt_logprobs[first:first + len(items)] = items
            if not tokens:
                continue

            first_index = num_tokens - request.num_prompt_tokens
            if len(tokens) == 1:  # one sampled token (the hot path): append_output_token in line
                new_tokens = tokens
                token = tokens[0]
                all_ids.append(token)
                status = (request.after_append(token, hash_later) if num_tokens + 1 >= request.next_event_at
                          or token in request.stop_token_set else None)
            else:
                new_tokens = []
                for token in tokens:
                    new_tokens.append(token)
                    status = request.append_output_token(token)
                    if status is not None:
                        break  # tokens after a stop are dropped
            new_logprobs = logprobs[rid][:len(new_tokens)] if logprobs and rid in logprobs else None
            output = EngineCoreOutput(rid, new_tokens, first_index, None, new_logprobs, request.num_cached_tokens)
            if not first_index and request.prompt_logprobs is not None:
                output.prompt_logprobs = self._take_prompt_logprobs(request)
            add_output(output)
            if status is not None:
                output.finish_reason = status.finish_reason()
                finished.append((request, status))
        for request in hash_later:
            request.hash_new_full_blocks()
        if finished:
            for request, status in finished:
                self._finish(request, status)
            self.running = [r for r in self.running if r.status is _RUNNING]
        planned = scheduler_output.num_scheduled_tokens
        for rid, drafts in model_runner_output.spec_token_ids.items():
            # the worker's drafts for the next step of a request that sampled here and goes on,
            # within what it may take
            request = requests.get(rid)
            if request is None or request.status is not _RUNNING or rid not in sampled or rid not in planned:
                continue
            if len(drafts) > self.own_draft_limit:
                self.own_draft_limit = min(len(drafts), MAX_DRAFT_TOKENS)
            drafts = drafts[:request.sampling_params.max_drafts(request.num_output_tokens)]
            if drafts:
                request.spec_token_ids = drafts
                drafted[rid] = request
        return outputs

    def _drafts_that_fit(self, budget: int, threshold: int, reserve: int) -> dict[str, Request]:
        """The requests whose draft tokens (taken by the last ``update_from_output``) this step may
        compute, by id: all of them, or none when they would take tokens the step needs for the
        running requests' next tokens and the waiting head's first chunk (or the fair policy's
        reserve). Drafts are a gain, never a cost to other work."""
        drafted, self._drafted = self._drafted, {}
        if not drafted:
            return drafted
        needed = len(self.running)
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting.peek()
            needed += max(reserve, min(head.num_tokens, threshold or budget))
        if needed + sum(len(r.spec_token_ids) for r in drafted.values()) > budget:
            for request in drafted.values():
                request.spec_token_ids = []
            return {}
        return drafted

    @staticmethod
    def _schedule_drafts(request: Request, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]) -> int:
        """Add ``request``'s draft tokens (if it still has any) to its place in the step being
        planned; returns how many."""
        drafts = request.spec_token_ids
        if drafts:
            num_scheduled[request.request_id] += len(drafts)
            spec_tokens[request.request_id] = drafts
        return len(drafts)

    def take_tenant_usage(self) -> dict[str, list[int]]:
        """Prompt and output tokens of the requests finished (aborted ones included) since the
        last call, per tenant: ``{tenant: [prompt, output]}``; then start over. Counted once, at
        the finish, for metrics (the fair queue's counters are charged step by step). A caller
        that never takes it keeps one entry per tenant seen."""
        usage, self.tenant_usage = self.tenant_usage, {}
        return usage

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list[TokenLogprobs] | None:
        """The prompt logprobs the steps computed, handed out with the first output token (None,
        with a warning, when the worker returned some of them only: a runner that computes none)."""
        computed = request.prompt_logprobs
        assert computed is not None  # the caller's test
        request.prompt_logprobs = None
        entries = [entry for entry in computed[1:] if entry is not None]
        if len(entries) != len(computed) - 1:
            log.warning("request %s: the worker returned %d of %d prompt logprobs; none are sent",
                        request.request_id, len(entries), len(computed) - 1)
            return None
        return entries

    def _admission_cost(self, request: Request) -> int:
        """What admitting ``request`` costs, for the ordered policies (smaller goes first): lpm, minus
        its cached prefix in blocks (the longest first); spf, the tokens left to compute before its
        first token (prompt, and outputs of a preempted one, less the cached prefix)."""
        computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
        if self.config.policy == "lpm":
            return -len(computed_blocks)
        return request.num_tokens - num_computed

    def _chunk_threshold(self) -> tuple[int, bool]:
        """The most tokens one request computes this step (0 = no cap), and whether that is the
        shared cap: the hard cap, tightened to the shared cap while another request waits or runs,
        so a long prompt's chunks keep the step short for newcomers' first tokens and for decoding
        requests' next ones. A prompt alone keeps the whole budget (still within the attention
        cap)."""
        cfg = self.config
        if not cfg.enable_chunked_prefill:
            return 0, False
        threshold = cfg.long_prefill_token_threshold
        shared = cfg.shared_prefill_token_threshold
        if shared and not 0 < threshold <= shared and len(self.running) + len(self.waiting) >= 2:
            return shared, True
        return threshold, False

    def _capped(self, request: Request, context: int, n: int, threshold: int, shared: bool) -> int:
        """``n`` tokens after ``context`` cut by the chunk threshold. The shared cap does not cut a
        prefix the request shares with a request that waits (:meth:`_shared_prefix_end`): those
        wait for that prefix too, and a chunk cut inside it would leave each of them to compute the
        rest again (a block enters the prefix cache when it is allocated for its tokens)."""
        if 0 < threshold < n:
            end = self._shared_prefix_end(request) if shared else 0
            n = max(threshold, min(n, end - context))
        return n

    def _shared_prefix_end(self, request: Request) -> int:
        """Tokens of the longest prefix of full blocks ``request`` shares with one of the first
        ``SHARED_PREFIX_LOOKAHEAD`` waiting requests (0 without prefix caching). Block hashes are
        chained, so two requests share blocks ``[0, j)`` exactly when their hashes at ``j - 1`` are
        equal: a binary search per request."""
        if not self.config.enable_prefix_caching:
            return 0
        hashes = request.block_hashes
        best = 0
        for k, other in enumerate(self.waiting):
            if k >= SHARED_PREFIX_LOOKAHEAD:
                break
            theirs = other.block_hashes
            hi = min(len(hashes), len(theirs))
            if other is request or hi <= best or hashes[best] != theirs[best]:
                continue
            lo = best + 1  # invariant: blocks [0, lo) shared; find the largest such lo <= hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] == theirs[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        return best * self.block_size

    def _attention_cap(self, context: int, n: int) -> int:
        """``n`` cut so that a chunk after ``context`` cached tokens attends at most
        ``prefill_chunk_attention_limit`` key positions in all (token ``i`` of the chunk attends
        ``context + i + 1``: ``m * context + m * (m + 1) / 2`` for ``m`` tokens), never below
        ``MIN_PREFILL_CHUNK_TOKENS``. Attention is what grows with the context; the token caps bound
        the rest of the step. Without chunked prefill a prompt goes whole."""
        limit = self.config.prefill_chunk_attention_limit
        if not limit or not self.config.enable_chunked_prefill:
            return n
        b = 2 * context + 1  # the largest m with m*m + b*m <= 2*limit
        m = (math.isqrt(b * b + 8 * limit) - b) // 2
        return min(n, max(m, MIN_PREFILL_CHUNK_TOKENS))

    # -- aborts, preemption, bookkeeping --------------------------------------------------------------

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish the given live requests with ABORT, waiting or running, and free their blocks now.
        Unknown or already-finished ids are ignored. Returns one output per aborted request."""
        outputs: list[EngineCoreOutput] = []
        from_waiting: list[Request] = []
        from_running = False
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is _RUNNING:
                from_running = True
            else:
                from_waiting.append(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(rid, [], request.num_output_tokens, FinishReason.ABORT, None,
                                            max(request.num_cached_tokens, 0)))
        if from_waiting:
            self.waiting.remove_many(from_waiting)
        if from_running:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks; the caller removes it from its queue/list."""
        request.status = status
        if request.spec_token_ids:
            request.spec_token_ids = []
            self._drafted.pop(request.request_id, None)
        usage = self.tenant_usage.get(request.tenant)
        if usage is None:
            usage = self.tenant_usage[request.tenant] = [0, 0]
        usage[0] += request.num_prompt_tokens
        usage[1] += request.num_output_tokens
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def _pick_victim(self) -> tuple[Request, int]:
        """Remove and return the running request to preempt, with the index it had: fcfs the last
        admitted; the other policies the one with the largest (priority, arrival_time), the latest
        on ties."""
        running = self.running
        if self.config.policy == "fcfs":
            return running.pop(), len(running)
        index = max(range(len(running) - 1, -1, -1), key=lambda k: (running[k].priority, running[k].arrival_time))
        return running.pop(index), index

    def _fair_due(self) -> tuple[Request | None, dict[str, int], dict[str, float]]:
        """Policy fair: the waiting head, when its tenant would still be within its weighted share
        of seats with one more (``max_num_seqs`` × its weight / the weights of the tenants running
        or waiting) and another tenant runs requests, else None; with the seats each tenant holds
        and the tenants' weights."""
        queue = self.waiting
        if self.config.policy != "fair":
            return None, {}, {}
        seats: dict[str, int] = {}
        for request in self.running:
            seats[request.tenant] = seats.get(request.tenant, 0) + 1
        weights = {t: queue.weight(t) for t in seats.keys() | queue.tenants()}
        if not queue:
            return None, seats, weights
        head = queue.peek()
        total, cap = sum(weights.values()), self.config.max_num_seqs
        within = (seats.get(head.tenant, 0) + 1) * total <= cap * weights[head.tenant]
        # ... and only while another tenant runs requests: with one tenant the plan is the
        # priority policy's.
        due = within and any(t != head.tenant for t in seats)
        return (head if due else None), seats, weights

    def _fair_seat_victim(self) -> int | None:
        """Policy fair: the index in ``running`` of the request to preempt for a seat, or None.
        Only when every seat is taken and the waiting head is due a seat (:meth:`_fair_due`): then
        the newest request, of a class no better than the head's, of the tenant furthest above
        its share (seats over weight; ties by name). Tokens already delivered are kept: the victim
        resumes from prompt + outputs. One victim a step; with one tenant there is none."""
        running = self.running
        if len(running) < self.config.max_num_seqs:
            return None
        head, seats, weights = self._fair_due()
        if head is None:
            return None
        total, cap = sum(weights.values()), self.config.max_num_seqs
        over = [(n / weights[t], t) for t, n in seats.items() if t != head.tenant and n * total > cap * weights[t]]
        if not over:
            return None
        tenant = max(over)[1]
        for index in range(len(running) - 1, -1, -1):
            request = running[index]
            if request.tenant == tenant and request.priority >= head.priority:
                return index
        return None

    def _fair_reserve(self, threshold: int, budget: int) -> tuple[Request | None, int]:
        """Policy fair: a waiting head due a seat (:meth:`_fair_due`) when a seat is free for it,
        and the tokens of this step's budget kept for its first chunk; else (None, 0). In such a
        step the other requests' prefill chunks compute at most ``shared_prefill_token_threshold``
        tokens in all (decodes are not held back): otherwise a flood's prompts, admitted first,
        take the step's budget, and the head's first token waits for the longest steps. (Holding
        them to that in every step two tenants share cost the flooding tenant 10 % of its
        throughput and gave the other no better median: benchmarks/tenant_fairness.py.)"""
        if len(self.running) >= self.config.max_num_seqs:
            return None, 0
        head, _, _ = self._fair_due()
        if head is None:
            return None, 0
        reserve = min(head.num_tokens, threshold or budget, budget)
        kv = self.kv_cache_manager
        if kv.get_num_blocks_needed(reserve) > kv.get_num_free_blocks():
            # Its chunk would not get its blocks this step (before prefix hits): a budget kept for it
            # would hold back the running requests' chunks too, and with nothing running to
            # completion no block would ever come free.
            return None, 0
        return head, reserve

    def _preempt(self, request: Request) -> None:
        """Recompute-preemption: free its blocks, forget its progress, put it at the queue front."""
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # -- queries --------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (finished ones are forgotten at once)."""
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue, preempted ones included."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch (at most ``max_num_seqs``)."""
        return len(self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id, or None (finished requests are forgotten)."""
        return self.requests.get(request_id)

    def count_prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of ``request`` this worker's prefix cache holds right now (0 with caching off), for
        placing a request on the worker with the best hit. Changes nothing, ``request`` included."""
        if not self.config.enable_prefix_caching:
            return 0
        probe = request
        if request.hashing_block_size != self.block_size:
            probe = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                            cache_salt=request.cache_salt, output_token_ids=request.output_token_ids,
                            block_size=self.block_size)
        return self.kv_cache_manager.get_computed_blocks(probe)[1]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible (True) when no request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        """A consistent snapshot of queue lengths, KV-cache use and counters (O(1))."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.get_num_free_blocks(),
            num_total_blocks=kv.num_total_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )
