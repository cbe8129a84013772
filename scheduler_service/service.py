"""The scheduler service: pulls requests from Redis while it has room, places each on one of its
workers (KV-aware: longest prefix-cache hit, then least loaded), follows the abort stream, keeps
the requests it holds owned, takes over those of dead schedulers, and reports stats.

Tasks (all on one event loop):
- intake: XREADGROUP from ``{prefix}requests`` for at most the engines' free room (backpressure
  stays in Redis);
- aborts: XREAD of ``{prefix}aborts``; an abort for a request not pulled yet is remembered, so the
  request is dropped when it arrives (or when it is taken over from a dead scheduler);
- pending keeper: every ``reclaim_interval_s`` resets the idle time of every entry this scheduler
  holds, then takes over entries idle for ``reclaim_idle_s`` (their scheduler died): each resumes
  from prompt + the outputs its output stream already holds; one taken over more than
  ``max_retries`` times goes to the dead-letter stream and its client gets an error;
- the worker pool (``scheduler_service.workers``): leases, discovery, one engine loop per worker.

A worker lost mid-generation hands its requests back (prompt + delivered outputs); they resume on
another worker of this scheduler. With none left, they go back to the consumer group when another
scheduler drives a worker (it claims them at its next pending pass: within ``reclaim_interval_s``),
or wait here until a worker joins (docs/architecture.md, decision 5).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from scheduler_service.core import compiled
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import SchedulerStats
from scheduler_service.engine import WorkerEngine
from scheduler_service.intake import ClaimedEntry, RequestEntry, RequestIntake
from scheduler_service.metrics import RequestMetrics, SchedulerCollector
from scheduler_service.routing import choose_engine
from scheduler_service.config import SchedulerConfig
from scheduler_service.workers import WorkerPool
from servicekit import redis_client
from servicekit.contract.errors import DeadlineExceededError, InvalidArgumentError
from servicekit.contract.records import OutputRecord, delivered_outputs
from servicekit.metrics import MetricsPort
from servicekit.proto.queue import output_record_from_bytes, output_record_to_bytes, request_record_from_bytes
from servicekit.redis_layout import RedisKeys, ensure_request_group
from servicekit.serving import cancel_and_wait, cancel_requested
from servicekit.tls import describe as describe_link

log = logging.getLogger(__name__)

RECENT_ABORTS_MAX = 100_000  # aborts remembered for requests not pulled yet
RECENT_ABORTS_TTL_S = 600.0
CLAIM_BATCH_MAX = 64  # entries taken over per pass at most


@dataclass(frozen=True, slots=True)
class WorkerStatsView:
    address: str
    model: str
    connected: bool
    num_steps: int
    core: SchedulerStats | None
    worker_id: str = ""
    num_routed: int = 0
    num_routed_prefix_hit: int = 0
    releasing: bool = False
    num_steps_ahead: int = 0  # of num_steps, planned and sent while the step before ran


@dataclass(frozen=True, slots=True)
class ServiceStats:
    num_finished: int
    num_aborted: int
    workers: list[WorkerStatsView]
    num_resumed: int = 0  # requests handed back by a lost worker and placed again
    num_reclaimed: int = 0  # entries taken over from dead schedulers
    num_dead_lettered: int = 0  # requests given up after too many takeovers
    num_taken_over: int = 0  # requests this scheduler held that another one took over
    num_worker_failovers: int = 0  # workers lost while holding requests


class SchedulerApp:
    """A running scheduler. ``redis`` may be injected; otherwise built from the settings."""

    def __init__(self, settings: SchedulerConfig, redis=None) -> None:
        self.settings = settings
        self.keys = RedisKeys(settings.key_prefix)
        self._redis = redis
        self._owns_redis = redis is None
        self.intake: RequestIntake | None = None
        self.pool: WorkerPool | None = None
        self.lifecycle = None
        self._tasks: list[asyncio.Task] = []
        self._capacity = asyncio.Event()  # set when engines may have room again
        self._backlog: collections.deque[tuple[Request, str]] = collections.deque()  # (request, entry id)
        self._recent_aborts: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Held by whatever changes the idle time of our pending entries (refresh, hand-back), so a
        # refresh that read the backlog before a hand-back cannot make a handed-back entry busy.
        self._pending_lock = asyncio.Lock()
        self._draining = False
        self.num_finished = 0
        self.num_aborted = 0
        self.num_resumed = 0
        self.num_reclaimed = 0
        self.num_dead_lettered = 0
        self.num_taken_over = 0
        self.num_worker_failovers = 0
        self.metrics: MetricsPort | None = None
        self.metrics_port = -1  # -1: /metrics not served
        self.port = 0

    @property
    def engines(self) -> dict[str, WorkerEngine]:
        return self.pool.engines if self.pool is not None else {}

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        from scheduler_service.grpc_server import build_server

        s = self.settings
        if self._redis is None:
            self._redis = redis_client.connect(s)
            await redis_client.check_credentials(self._redis, s)
        await ensure_request_group(self._redis, self.keys)
        self.intake = RequestIntake(self._redis, self.keys, s.consumer, output_ttl_s=s.output_ttl_s)
        self.lifecycle = build_server(self)
        # The admin server uses the scheduler's certificate; with a CA, its clients need one too.
        self.port = self.lifecycle.bind(f"{s.host}:{s.port}", s.tls if s.tls_cert_file else None)
        await self.lifecycle.start()
        self.lifecycle.registry.register(SchedulerCollector(self.stats))
        self.metrics = MetricsPort(self.lifecycle.registry, name="scheduler")
        self.metrics_port = await self.metrics.start(s.host, s.metrics_port)
        self.pool = WorkerPool(s, self._redis, self.keys, self.intake, admin_address=f"{s.host}:{self.port}",
                               on_change=self._on_pool_change, on_lost=self._resume_lost,
                               on_finished=self._count_finished, stranded=lambda: len(self._backlog),
                               on_starving=self._hand_back_backlog,
                               metrics=RequestMetrics(self.lifecycle.registry, s.max_tenant_labels))
        abort_cursor = await self.intake.last_abort_id()  # before intake: no abort slips between
        await self.pool.start()
        self._tasks = [
            asyncio.create_task(self._follow_aborts(abort_cursor), name="aborts"),
            asyncio.create_task(self._intake(), name="intake"),
            asyncio.create_task(self._keep_pending(), name="pending-keeper"),
        ]
        token = bool(s.internal_token)
        served = describe_link(s.tls if s.tls_cert_file else None, token=token)  # the admin server's side
        log.info("scheduler %s on %s:%d (%s), workers: %s (%s); takes over requests idle for %.1fs, at most %d times; "
                 "core: %s", s.consumer, s.host, self.port, served, ", ".join(s.workers) or "from the Redis registry",
                 describe_link(s.tls, token=token), s.reclaim_idle_s, s.max_retries, compiled.describe())

    async def wait_for_workers(self, n: int = 1, timeout_s: float = 60.0) -> None:
        """Return once ``n`` workers are connected (tests and `pagedserve serve` use it)."""
        await self.pool.wait_connected(n, timeout_s)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop pulling, go NOT_SERVING, let held requests finish within the grace period, stop.
        Requests still unfinished stay pending in Redis, marked idle so another scheduler takes
        them over at its next pass (resuming from what they delivered)."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self._draining = True
        self._capacity.set()
        if self.lifecycle is not None:
            await self.lifecycle.drain(grace, self._wait_engines_idle)
        await cancel_and_wait(self._tasks)
        if self.metrics is not None:
            await self.metrics.stop()
        leftover = list(self._held_entries())
        if self.pool is not None:
            await self.pool.stop()
        if leftover:
            try:
                async with self._pending_lock:
                    await self.intake.release(leftover, int(self.settings.reclaim_idle_s * 1000))
                log.info("handed %d unfinished requests to the other schedulers", len(leftover))
            except RedisError as exc:
                log.warning("could not hand back %d requests (they are taken over once idle): %s",
                            len(leftover), exc)
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()

    async def _wait_engines_idle(self) -> None:
        while self._backlog:
            await asyncio.sleep(0.05)
        for engine in list(self.engines.values()):
            await engine.wait_idle()

    # -- stats ----------------------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        return ServiceStats(self.num_finished, self.num_aborted, [
            WorkerStatsView(e.address, e.description.model, e.connected, e.num_steps, e.core.stats(),
                            e.worker_id, e.num_routed, e.num_routed_prefix_hit, e.releasing, e.num_steps_ahead)
            for e in self.engines.values()],
            self.num_resumed, self.num_reclaimed, self.num_dead_lettered, self.num_taken_over,
            self.num_worker_failovers)

    def _count_finished(self, num_finished: int, num_aborted: int) -> None:
        self.num_finished += num_finished
        self.num_aborted += num_aborted
        self._capacity.set()

    def _on_pool_change(self) -> None:
        self._capacity.set()
        self._route_backlog()

    # -- intake ---------------------------------------------------------------------------------------

    async def _intake(self) -> None:
        s = self.settings
        while not self._draining and not cancel_requested():
            room = self.pool.room
            if room <= 0 or self._backlog:
                self._capacity.clear()
                try:
                    await asyncio.wait_for(self._capacity.wait(), s.poll_block_ms / 1000)
                except asyncio.TimeoutError:
                    pass
                self._route_backlog()
                continue
            try:
                entries = await self.intake.pull(min(room, 256), s.poll_block_ms)
            except RedisError as exc:
                log.warning("pulling requests failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            now = time.time()
            for entry in entries:
                await self._admit(entry, now)

    async def _admit(self, entry: RequestEntry, now: float, delivered: list[int] | None = None) -> None:
        """Place one request entry (new, or taken over with ``delivered`` outputs)."""
        self.intake.keep_live(entry)  # its records, a refusal's included, also go to its gateway's live stream
        try:
            record = request_record_from_bytes(entry.data)
            request = Request(record.request_id, record.prompt_token_ids, record.sampling_params,
                              arrival_time=record.arrival_time, priority=record.priority,
                              cache_salt=record.cache_salt or None, output_token_ids=delivered or (),
                              tenant=record.tenant, tenant_weight=record.tenant_weight)
        except (InvalidArgumentError, DecodeError) as exc:
            field = getattr(exc, "field", "")
            log.warning("refusing malformed request %s: %s", entry.request_id, exc)
            await self._finish_unstarted(entry.entry_id, entry.request_id, field, str(exc))
            return
        rid = request.request_id
        if self._holds(rid):
            # Delivered to us again: after a Redis failover the group's delivery cursor can be older
            # than what we pulled (the promoted replica lacked the last deliveries). Ours already.
            log.info("request %s delivered again (a Redis failover?): already held here", rid)
            return
        if self._recent_aborts.pop(rid, None) is not None:
            await self._finish_unstarted(entry.entry_id, rid, "", "aborted before it was scheduled")
            return
        if record.deadline and record.deadline < now:
            await self._finish_unstarted(entry.entry_id, rid, "", "deadline passed before it was scheduled",
                                         code=DeadlineExceededError.code)
            return
        if delivered is not None:
            self._backlog.appendleft((request, entry.entry_id))  # older than anything new
        else:
            self._backlog.append((request, entry.entry_id))
        self._route_backlog()

    def _holds(self, request_id: str) -> bool:
        return (any(engine.owns(request_id) for engine in self.engines.values())
                or any(request.request_id == request_id for request, _ in self._backlog))

    def _route_backlog(self) -> None:
        """Hand waiting requests to engines (``scheduler_service.routing``); with no engine taking
        requests they stay here, pending in Redis and ours, until one connects."""
        if self.pool is None:
            return
        while self._backlog:
            engines = self.pool.routable()
            if not engines:
                return
            request, entry_id = self._backlog.popleft()
            engine, hit = choose_engine(request, engines)
            engine.num_routed += 1
            engine.num_routed_prefix_hit += hit > 0
            engine.submit(request, entry_id)

    def _resume_lost(self, engine: WorkerEngine, handed: list[tuple[Request, str]]) -> None:
        """A worker was lost: its requests (prompt + delivered outputs) go first in line."""
        if handed:
            log.info("resuming %d requests of lost worker %s", len(handed), engine.address)
            self.num_worker_failovers += 1
        self.num_resumed += len(handed)
        self._backlog.extendleft(reversed(handed))
        self._capacity.set()
        self._route_backlog()

    async def _finish_unstarted(self, entry_id: str, request_id: str, field: str, message: str,
                                code: str | None = None) -> None:
        """Publish a final ABORT record (its client gets ``code``) for a request never handed to a
        worker, and ACK it."""
        record = output_record_to_bytes(OutputRecord.error(field, message, code))
        records = [(request_id, record)] if request_id else []
        try:
            await self.intake.publish(records, [entry_id])
        except RedisError as exc:  # still pending and ours: taken over (and refused again) later
            log.warning("could not refuse request %s: %s", request_id, exc)
            return
        self._count_finished(1, 1)

    # -- pending entries: keep ours, take over the dead's ---------------------------------------------

    def _held_entries(self) -> dict[str, tuple[str, WorkerEngine | None]]:
        """Entry id -> (request id, engine holding it or None for the backlog)."""
        held: dict[str, tuple[str, WorkerEngine | None]] = {}
        for engine in self.engines.values():
            for rid, entry_id in engine.entries().items():
                held[entry_id] = (rid, engine)
        for request, entry_id in self._backlog:
            held[entry_id] = (request.request_id, None)
        return held

    async def _keep_pending(self) -> None:
        s = self.settings
        while not cancel_requested():
            await asyncio.sleep(s.reclaim_interval_s)
            try:
                await self._refresh_pending()
                self.intake.forget_live({rid for rid, _engine in self._held_entries().values()})
                if not self._draining and self.pool.room > 0:
                    await self._reclaim()
            except RedisError as exc:
                log.warning("keeping pending requests failed: %s", exc)

    async def _refresh_pending(self) -> None:
        """Reset the idle time of what we hold; forget what another scheduler took over from us
        (we were too slow, e.g. cut off from Redis past the idle time): it resumes there."""
        async with self._pending_lock:
            held = self._held_entries()
            if not held:
                return
            lost = await self.intake.refresh_pending(list(held))
        for entry_id in lost:
            rid, engine = held[entry_id]
            if engine is not None:
                if engine.entries().get(rid) != entry_id:
                    continue  # finished meanwhile
                engine.drop(rid, entry_id)
            else:
                before = len(self._backlog)
                self._backlog = collections.deque(x for x in self._backlog if x[1] != entry_id)
                if len(self._backlog) == before:
                    continue
            self.num_taken_over += 1
            log.warning("request %s was taken over by another scheduler", rid)

    async def _hand_back_backlog(self) -> None:
        """No engine of ours takes requests and another scheduler drives a worker: hand what waits
        here back to the consumer group, marked idle, so a scheduler with room takes it over (from
        prompt + delivered outputs) at its next pending pass instead of after ``reclaim_idle_s``.
        Entries leave the backlog before the release (nothing here refreshes them again); if
        Redis is away they come back and the next supervisor pass tries again."""
        if not self._backlog or self._draining:
            return
        handed, self._backlog = self._backlog, collections.deque()
        async with self._pending_lock:
            try:
                released = await self.intake.release([entry_id for _r, entry_id in handed],
                                                    int(self.settings.reclaim_idle_s * 1000))
            except RedisError as exc:
                log.warning("could not hand %d requests back to the group: %s", len(handed), exc)
                self._backlog.extendleft(reversed(handed))
                return
        log.info("no worker here while another scheduler drives one: handed %d requests back to the group",
                 len(released))

    async def _reclaim(self) -> None:
        s = self.settings
        claimed = await self.intake.claim_idle(int(s.reclaim_idle_s * 1000), min(self.pool.room, CLAIM_BATCH_MAX))
        held = self._held_entries()
        claimed = [c for c in claimed if c.entry.entry_id not in held]  # ours already (a late refresh)
        if not claimed:
            return
        self.num_reclaimed += len(claimed)
        limit = 1 + s.max_retries
        give_up = [c for c in claimed if c.deliveries > limit]
        if give_up:
            await self._dead_letter(give_up)
        taken = [c for c in claimed if c.deliveries <= limit]
        outputs = await self.intake.read_outputs([c.entry.request_id for c in taken])
        done: list[ClaimedEntry] = []
        now = time.time()
        for c, records in zip(taken, outputs):
            if records is None:
                log.info("request %s taken over, but its output stream expired: dropped", c.entry.request_id)
                done.append(c)
                continue
            delivered, finished = delivered_outputs([output_record_from_bytes(data) for data in records])
            if finished:
                done.append(c)  # its scheduler died between publishing the end and the ACK
                continue
            log.info("request %s taken over (delivery %d): resuming after %d delivered tokens",
                     c.entry.request_id, c.deliveries, len(delivered))
            await self._admit(c.entry, now, delivered)
        if done:
            await self.intake.finish_entries([], done)

    async def _dead_letter(self, entries: list[ClaimedEntry]) -> None:
        reason = f"given up after {self.settings.max_retries} takeovers"
        record = output_record_to_bytes(OutputRecord.error("", f"request failed: {reason}"))
        records = [(c.entry.request_id, record) for c in entries if c.entry.request_id]
        await self.intake.finish_entries(records, entries, reason=reason)
        for c in entries:
            log.error("request %s %s (delivered %d times): moved to %s", c.entry.request_id, reason,
                      c.deliveries, self.keys.dead_letters)
        self.num_dead_lettered += len(entries)
        self._count_finished(len(entries), len(entries))

    # -- aborts ---------------------------------------------------------------------------------------

    async def _follow_aborts(self, cursor: str) -> None:
        while not cancel_requested():
            try:
                ids, cursor = await self.intake.read_aborts(cursor, self.settings.poll_block_ms)
            except RedisError as exc:
                log.warning("reading aborts failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for rid in ids:
                self._abort(rid)

    def _abort(self, request_id: str) -> None:
        for engine in self.engines.values():
            if engine.owns(request_id):
                engine.abort(request_id)
                return
        for i, (request, entry_id) in enumerate(self._backlog):
            if request.request_id == request_id:
                del self._backlog[i]
                asyncio.create_task(self._finish_unstarted(entry_id, request_id, "", "aborted before it was scheduled"))
                return
        # Not pulled yet (or not ours): remember it, bounded in size and age.
        now = time.monotonic()
        recent = self._recent_aborts
        recent[request_id] = now
        while recent and (len(recent) > RECENT_ABORTS_MAX
                          or next(iter(recent.values())) < now - RECENT_ABORTS_TTL_S):
            recent.popitem(last=False)
