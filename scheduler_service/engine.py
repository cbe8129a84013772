"""The engine loop of one worker (docs/architecture.md, "The path of one request"):

    admit new requests / apply aborts → schedule() → Step → update_from_output() → publish

With asynchronous scheduling (``--async-scheduling``, vLLM's), while a decoding batch's step runs
the next one is planned (``Scheduler.schedule_continuation``) late in it and sent, so the worker
goes from one step to the next without waiting for the round trip; when the next plan depends on
the results (new requests to admit, prefill chunks, memory short), the loop waits for them as above.

One :class:`WorkerEngine` per worker: its own Scheduler core (so its own block pool, decision 4)
and its own Step stream. Aborts and new requests arriving while a step is in flight are applied
between steps, so an aborted request's blocks are free by the end of the step in flight. With a
second step in flight (planned ahead), that step still computes an aborted or stopped request once
more, into blocks already free here: safe, since only a later step of the same stream can reuse
them (the worker runs its steps in order, and a block is read only after its owner wrote it), and
its token is dropped; a request arriving then is admitted by the plan after it.

When the worker is lost (its stream breaks, or the service declares it lost), the engine waits
until every token it produced is published, then hands each unfinished request back to the
service as prompt + delivered outputs (decision 5), to resume on another worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.intake import RequestIntake, RoutedOutputs
from scheduler_service.stream_interval import StreamBatcher
from scheduler_service.worker_client import WorkerClient, WorkerLostError
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.records import OutputRecord
from servicekit.contract.step import EngineCoreOutput, FinishReason, SchedulerOutput
from servicekit.contract.worker import WorkerDescription
from servicekit.proto.queue import engine_output_to_bytes, output_record_to_bytes
from servicekit.serving import cancel_requested

if TYPE_CHECKING:
    from scheduler_service.metrics import RequestMetrics

log = logging.getLogger(__name__)

PUBLISH_RETRY_MAX_S = 2.0  # longest wait between retries of a publish while Redis is away
# Asynchronous scheduling plans the next step when this much of the step in flight is left (its
# expected time: the recent steps'), so the plan reaches the worker before the step ends, and a
# request arriving earlier in the step is admitted without waiting for one more step. A larger
# floor (10 ms) saved lockstep steps in a burst's tail of short steps but, at 4 requests/s (steps
# of ~15 ms), made new requests wait a step more: median TTFT 137-143 -> 154-155 ms.
PLAN_AHEAD_FRACTION = 0.2
PLAN_AHEAD_MIN_S = 0.005


class StepTimeFit:
    """A decode step's time against the tokens it computes (its rows and their drafts): least
    squares over the recent steps, each step weighing ``DECAY`` as much as the one after it. A
    batch's steps vary with its drafts and shrink as requests finish; the average of recent steps
    lags both, and a plan made for a step that ends sooner than expected misses it."""

    DECAY = 0.8
    MIN_STEPS = 4.0  # the weight of the steps seen before a fit is used

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self._n = d * self._n + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def predict(self, tokens: int) -> float | None:
        """Seconds for a step of ``tokens``; None until the recent steps' token counts differ
        enough to fit a slope (or the slope is not positive)."""
        n = self._n
        if n < self.MIN_STEPS:
            return None
        mean_x, mean_y = self._x / n, self._y / n
        var = self._xx / n - mean_x * mean_x
        if var < 1.0:  # (nearly) the same count every step: no slope to fit
            return None
        slope = (self._xy / n - mean_x * mean_y) / var
        if slope <= 0.0:
            return None
        return mean_y + slope * (tokens - mean_x)


def _retrieve(task: asyncio.Task) -> None:
    """Take the outcome of a task nobody awaits any more, so asyncio does not report it."""
    if not task.cancelled():
        task.exception()


def resumable_copy(request: Request) -> Request:
    """A fresh request with the same identity, parameters (seed included) and outputs so far, for
    another worker's core: it recomputes prompt + outputs and continues at the next index."""
    return Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                   arrival_time=request.arrival_time, priority=request.priority, cache_salt=request.cache_salt,
                   output_token_ids=request.output_token_ids, tenant=request.tenant,
                   tenant_weight=request.tenant_weight)


class WorkerEngine:
    """Drives one worker.

    Invariants: ``_entry_ids`` holds exactly the requests handed to this engine and not yet
    published as finished, handed back, or dropped (in the inbox or live in the core); each is
    XACKed once, when its finishing record is published. Every output token a request of the core
    holds has been published once the pipeline in flight (``_publishing``) completes, except at
    most ``stream_interval - 1`` per request held back by ``_batcher`` (published before the
    request is handed back or fails).
    """

    def __init__(self, client: WorkerClient, description: WorkerDescription, core: Scheduler,
                 intake: RequestIntake, *, max_queued: int, on_finished: Callable[[int, int], None],
                 on_lost: Callable[[WorkerEngine, list[tuple[Request, str]]], None] | None = None,
                 metrics: RequestMetrics | None = None, stream_interval: int = 1,
                 async_scheduling: bool = False) -> None:
        self.client = client
        self._async_scheduling = async_scheduling
        self._batcher = StreamBatcher(stream_interval)
        self._metrics = metrics  # queue times and tokens per tenant
        self.address = client.address
        self.worker_id = description.worker_id
        self.description = description
        self.core = core
        self._intake = intake
        self._on_finished = on_finished  # (num finished, num aborted) after each publish
        self._on_lost = on_lost  # (engine, [(request to resume, entry id)]) once the worker is lost
        self._capacity = core.config.max_num_seqs + max_queued  # requests held at most
        self._inbox: list[Request] = []
        self._entry_ids: dict[str, str] = {}  # request id -> its request-stream entry id
        self._aborts: set[str] = set()
        self._drops: set[str] = set()  # taken over by another scheduler: forget, publish nothing
        self._lost_reason: str | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._publishing: asyncio.Task | None = None  # the pipeline in flight
        self.accepting = True  # False while the worker reports NOT_SERVING, or once its health watch ended
        self.draining = False  # the worker reported NOT_SERVING (it drains: finishes what it holds, then stops)
        self.connected = True  # False once the Step stream failed
        self.releasing = False  # True while handing the worker to another scheduler (rebalancing)
        self.num_steps = 0
        self.num_steps_ahead = 0  # of those, sent while the step before ran (asynchronous scheduling)
        # Recent steps' time on the worker (moving averages), for _plan_delay: of decode steps (one
        # token per request), and per token of steps with prefill chunks (0.0: none seen yet).
        self._decode_step_s = 0.0
        self._decode_fit = StepTimeFit()
        self._prefill_token_s = 0.0
        self._head_started = 0.0  # when the worker could start the oldest step in flight
        self.num_routed = 0  # requests routed here
        self.num_routed_prefix_hit = 0  # of those, with a prefix-cache hit here

    # -- called by the service ------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self._entry_ids)

    @property
    def takes_requests(self) -> bool:
        return self.accepting and self.connected and not self.releasing

    @property
    def room(self) -> int:
        """New requests this engine takes now (0 while its worker drains, is lost or released)."""
        if not self.takes_requests:
            return 0
        return max(0, self._capacity - len(self._entry_ids))

    def fits(self, request: Request) -> bool:
        return self.core.fits(request)

    def owns(self, request_id: str) -> bool:
        return request_id in self._entry_ids

    def entries(self) -> dict[str, str]:
        """Request id -> entry id of every request held (a snapshot)."""
        return dict(self._entry_ids)

    def submit(self, request: Request, entry_id: str) -> None:
        self._entry_ids[request.request_id] = entry_id
        self._inbox.append(request)
        self._idle.clear()
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if request_id in self._entry_ids:
            self._aborts.add(request_id)
            self._wake.set()

    def drop(self, request_id: str, entry_id: str) -> None:
        """Forget a request another scheduler took over: no record, no ACK (its entry is not ours)."""
        if self._entry_ids.get(request_id) == entry_id:
            del self._entry_ids[request_id]
            self._drops.add(request_id)
            self._wake.set()
            if not self._entry_ids:
                self._idle.set()

    def mark_lost(self, reason: str) -> None:
        """Declare the worker lost: the loop stops stepping and hands its requests back."""
        if self._lost_reason is None:
            self._lost_reason = reason
            self.connected = False  # no new requests from now on; the loop hands back the held ones
            self.client.break_stream(reason)
            self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # -- the loop -------------------------------------------------------------------------------------

    def _observe_queue_times(self, new_reqs) -> None:
        """Queue time (vLLM's ``request_queue_time_seconds``): arrival at the gateway to the first
        scheduling, once per request; a resumed one (preempted, or moved from a lost worker)
        waited for its worker before and is not counted again."""
        now = time.time()
        for new in new_reqs:
            request = self.core.requests.get(new.request_id)
            if request is not None and not new.output_token_ids and request.num_preemptions == 0:
                self._metrics.queue_time(self.description.model, request.tenant, max(0.0, now - request.arrival_time))

    async def run(self) -> None:
        """Step until cancelled or the worker is lost (then hand every held request back)."""
        core = self.core
        try:
            while not cancel_requested():
                if self._lost_reason is not None:
                    raise WorkerLostError(f"worker {self.address}: {self._lost_reason}")
                # Cleared before admitting: a submit() during the awaits below sets it again, so
                # the wait cannot miss it.
                self._wake.clear()
                await self._admit_and_abort()
                if not core.has_unfinished_requests() and not core.finished_req_ids:
                    if not self._inbox and not self._aborts and not self._drops and self._lost_reason is None:
                        await self._wake.wait()
                    continue
                scheduler_output = core.schedule()
                if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                        and not scheduler_output.preempted_req_ids):
                    # Nothing can run until something changes (defensive: the core admits any
                    # request that fits an empty pool).
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.01)
                    except asyncio.TimeoutError:
                        pass
                    continue
                if self._metrics is not None:
                    self._observe_queue_times(scheduler_output.scheduled_new_reqs)
                await self._run_steps(scheduler_output)
        except WorkerLostError as exc:
            self.connected = False
            if cancel_requested():
                raise asyncio.CancelledError from exc  # shutting down: the requests stay pending in Redis
            planned = self.releasing or self.draining  # handed to another scheduler, or drained
            if self._entry_ids or not planned:
                log.warning("%s; resuming its %d requests elsewhere", exc, len(self._entry_ids))
            else:
                log.info("%s; it held no requests", exc)
            await self._hand_back()
        except Exception:
            # A bug: fail what we hold rather than leave clients waiting; the service reconnects
            # the worker with a fresh core.
            self.connected = False
            log.exception("engine of %s failed; failing its %d requests", self.address, len(self._entry_ids))
            await self._fail_all("scheduler engine failed")
            raise

    async def _run_steps(self, scheduler_output: SchedulerOutput) -> None:
        """Send ``scheduler_output`` and apply its results. With asynchronous scheduling, while a
        step is in flight the one after it is planned (``Scheduler.schedule_continuation``) and
        sent, so the worker goes on without waiting for the round trip, for as long as the plan
        does not depend on results. The plan is made late in the step (``_plan_delay``): a request
        arriving before then is admitted by the next plan, as without pipelining."""
        core, client = self.core, self.client
        await client.send(scheduler_output)  # nothing else in flight: the worker starts it now
        self._head_started = time.perf_counter()
        while scheduler_output is not None:
            following = None
            if not self._async_scheduling:
                runner_output = await client.receive()
            else:
                # a decode step's tokens (None: it has prefill chunks), for the step-time estimates
                # (which only plans ahead use), counted once the step before it is applied, as
                # num_tokens_computed needs
                decode_tokens = core.num_tokens_computed(scheduler_output) \
                    if self._is_decode_step(scheduler_output) else None
                answer = asyncio.ensure_future(client.receive())
                try:
                    delay = self._plan_delay(scheduler_output, decode_tokens)
                    if delay is not None and delay > 0:
                        await asyncio.wait((answer,), timeout=delay)
                    if (delay is not None and not answer.done() and not self._inbox
                            and self._lost_reason is None):
                        following = core.schedule_continuation(scheduler_output)
                        if following is not None:
                            await client.send(following)
                            self.num_steps_ahead += 1
                    runner_output = await answer
                finally:
                    if not answer.done():  # this task fails or is cancelled: the call is going away
                        answer.cancel()
                        answer.add_done_callback(_retrieve)
                now = time.perf_counter()
                # the step's time since the worker could start it
                self._observe_step(scheduler_output, now - self._head_started, decode_tokens)
                self._head_started = now  # the step sent ahead (if any) starts now
            self.num_steps += 1
            outputs = core.update_from_output(scheduler_output, runner_output)
            if self._metrics is not None and core.tenant_usage:
                self._metrics.finished(self.description.model, core.take_tenant_usage())
            await self._publish(self._batcher.take(outputs))
            scheduler_output = following
            if following is not None:
                self._wake.clear()
                await self._admit_and_abort()

    @staticmethod
    def _is_decode_step(step: SchedulerOutput) -> bool:
        """Every scheduled request decodes: one token each, and its draft tokens."""
        drafts = sum(map(len, step.scheduled_spec_decode_tokens.values())) if step.scheduled_spec_decode_tokens else 0
        return step.total_num_scheduled_tokens == len(step.num_scheduled_tokens) + drafts

    def _observe_step(self, step: SchedulerOutput, took: float, decode_tokens: int | None) -> None:
        def averaged(previous: float, value: float) -> float:  # 0.0: nothing seen yet
            return value if not previous else 0.5 * previous + 0.5 * value

        if decode_tokens is not None:
            self._decode_step_s = averaged(self._decode_step_s, took)
            self._decode_fit.add(decode_tokens, took)
        elif step.total_num_scheduled_tokens:
            self._prefill_token_s = averaged(self._prefill_token_s, took / step.total_num_scheduled_tokens)

    def _plan_delay(self, in_flight: SchedulerOutput, decode_tokens: int | None) -> float | None:
        """Seconds to wait before planning the step after ``in_flight``: until a fifth of its
        expected time (at least 5 ms, for the plan to reach the worker) is left. A decode step is
        expected to take what recent decode steps took, fitted to the tokens it computes (its rows
        and their drafts: ``StepTimeFit``); a step with prefill chunks its tokens times
        the recent time per token of such steps (its length varies with them: planned as early as a
        decode step, the plan would miss the requests arriving during a long prefill). None: no
        estimate yet, do not plan ahead. ``decode_tokens``: the tokens ``in_flight`` computes if it is
        a decode step, else None."""
        if decode_tokens is not None:
            expected = self._decode_step_s
            fitted = self._decode_fit.predict(decode_tokens)
            if fitted is not None:  # within half and one and a half of the recent average
                expected = min(max(fitted, 0.5 * expected), 1.5 * expected)
        else:
            expected = max(self._decode_step_s, in_flight.total_num_scheduled_tokens * self._prefill_token_s) \
                if self._prefill_token_s else 0.0
        if not expected:
            return None
        margin = max(PLAN_AHEAD_MIN_S, PLAN_AHEAD_FRACTION * expected)
        return self._head_started + expected - margin - time.perf_counter()

    async def _hand_back(self) -> None:
        """Publish what is pending (aborts included), then give every unfinished request back."""
        try:
            await self._admit_and_abort()
            await self._publish(self._batcher.flush())  # the tokens held back go out first
            if self._publishing is not None:
                await self._publishing
        except Exception as exc:
            log.error("could not publish before handing back the requests of %s: %s", self.address, exc)
        handed = [(resumable_copy(r), self._entry_ids[rid]) for rid, r in self.core.requests.items()
                  if rid in self._entry_ids]
        self._entry_ids.clear()
        self._idle.set()
        if self._on_lost is not None:
            self._on_lost(self, handed)

    async def _fail_all(self, message: str) -> None:
        self._inbox.clear()
        try:
            await self._publish([], [(rid, "", message) for rid in list(self._entry_ids)])
            if self._publishing is not None:
                await self._publishing
        except Exception as exc:
            log.error("could not publish the failure of %d requests: %s", len(self._entry_ids), exc)

    async def _admit_and_abort(self) -> None:
        outputs: list[EngineCoreOutput] = []
        errors: list[tuple[str, str, str]] = []
        if self._drops:
            drops, self._drops = self._drops, set()
            self._inbox = [r for r in self._inbox if r.request_id not in drops]
            self.core.abort(drops)  # frees their blocks; the records are not ours to publish
            self._batcher.forget(drops)
            self._aborts -= drops
        if self._inbox:
            inbox, self._inbox = self._inbox, []
            for request in inbox:
                try:
                    self.core.add_request(request)
                except InvalidArgumentError as exc:
                    errors.append((request.request_id, exc.field, exc.message))
        if self._aborts:
            aborts, self._aborts = self._aborts, set()
            outputs = self.core.abort(aborts)
        if outputs or errors:
            await self._publish(self._batcher.take(outputs), errors)

    async def _publish(self, outputs: list[EngineCoreOutput],
                       errors: list[tuple[str, str, str]] = ()) -> None:
        """One Redis script: every output record, then XACK + delete of the finished requests.
        ``outputs`` are what is due now (step and abort outputs pass through ``_batcher.take`` first).

        The script runs while the next step computes; they go out one at a time, in step
        order (each waits for the previous one), so a request's records stay in index order.
        Records of requests no longer held (dropped) are not published."""
        held = self._entry_ids
        if errors:  # a failing request's held tokens go out before its error record
            outputs = [*outputs, *self._batcher.flush(rid for rid, _field, _message in errors)]
        records = [(o.request_id, engine_output_to_bytes(o)) for o in outputs if o.request_id in held]
        finished_entries = []
        num_aborted = 0
        for o in outputs:
            if o.finish_reason is not None and o.request_id in held:
                finished_entries.append(held.pop(o.request_id))
                num_aborted += o.finish_reason is FinishReason.ABORT
        for rid, field, message in errors:
            if rid in held:
                records.append((rid, output_record_to_bytes(OutputRecord.error(field, message))))
                finished_entries.append(held.pop(rid))
                num_aborted += 1
        routed = self._intake.route(records)  # now: the finished ones are no longer held
        if self._publishing is not None:
            await self._publishing  # re-raises a failed previous publish
        self._publishing = asyncio.create_task(self._send(routed, finished_entries, num_aborted))

    async def _send(self, records: RoutedOutputs, finished_entries: list[str], num_aborted: int) -> None:
        """Publish, retrying while Redis is away (the engine stops stepping meanwhile: the next
        publish waits for this one). A retry after a lost reply may write a step's records twice;
        gateways drop repeated indices."""
        delay = 0.05
        while True:
            try:
                await self._intake.publish_routed(records, finished_entries)
                break
            except RedisError as exc:
                if cancel_requested():
                    raise asyncio.CancelledError from exc
                log.warning("publishing outputs of %s failed (%s); retrying in %.2fs", self.address, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, PUBLISH_RETRY_MAX_S)
        if finished_entries:
            if not self._entry_ids:
                self._idle.set()
            self._on_finished(len(finished_entries), num_aborted)

    async def close(self) -> None:
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)
        await self.client.close()
