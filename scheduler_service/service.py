"""The scheduler service: pulls requests from Redis while it has room, routes each to the least
loaded worker engine, follows the abort stream, keeps its worker connections up, and reports
stats.

Tasks (all on one event loop):
- intake: XREADGROUP from ``{prefix}requests`` for at most the engines' free room (backpressure
  stays in Redis);
- aborts: XREAD of ``{prefix}aborts``; an abort for a request not pulled yet is remembered, so the
  request is dropped when it arrives;
- supervisor: connects the workers given by address (or found in the registry) and reconnects lost
  ones, one WorkerEngine each;
- one engine loop per worker (``scheduler_service.engine``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from pagedserve.redis_keys import RedisKeys, ensure_request_group
from pagedserve.registry import list_workers
from scheduler_service import convert
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import InvalidParameterError
from scheduler_service.core.scheduler import Scheduler, SchedulerStats
from scheduler_service.engine import WorkerEngine
from scheduler_service.redis_queue import QueueEntry, RedisQueue
from scheduler_service.settings import SchedulerSettings
from scheduler_service.worker_client import WorkerLostError, connect

log = logging.getLogger(__name__)

RECENT_ABORTS_MAX = 100_000  # aborts remembered for requests not pulled yet
RECENT_ABORTS_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class WorkerStatsView:
    address: str
    model: str
    connected: bool
    num_steps: int
    core: SchedulerStats | None


@dataclass(frozen=True, slots=True)
class ServiceStats:
    num_finished: int
    num_aborted: int
    workers: list[WorkerStatsView]


class SchedulerApp:
    """A running scheduler. ``redis`` may be injected; otherwise built from the settings."""

    def __init__(self, settings: SchedulerSettings, redis=None) -> None:
        self.settings = settings
        self.keys = RedisKeys(settings.key_prefix)
        self._redis = redis
        self._owns_redis = redis is None
        self.queue: RedisQueue | None = None
        self.lifecycle = None
        self.engines: dict[str, WorkerEngine] = {}  # by worker address
        self._engine_tasks: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._capacity = asyncio.Event()  # set when engines may have room again
        self._backlog: collections.deque[tuple[QueueEntry, convert.QueuedRequest]] = collections.deque()
        self._recent_aborts: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._rng = random.Random()
        self._draining = False
        self._refused: set[str] = set()  # addresses whose last connect failed (logged once)
        self.num_finished = 0
        self.num_aborted = 0
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        from scheduler_service.grpc_server import build_server

        s = self.settings
        if self._redis is None:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(s.redis_url)
        await ensure_request_group(self._redis, self.keys)
        self.queue = RedisQueue(self._redis, self.keys, s.consumer, output_ttl_s=s.output_ttl_s)
        self.lifecycle = build_server(self)
        self.port = self.lifecycle.bind(f"{s.host}:{s.port}")
        await self.lifecycle.start()
        abort_cursor = await self.queue.last_abort_id()  # before intake: no abort slips between
        self._tasks = [
            asyncio.create_task(self._supervise(), name="supervisor"),
            asyncio.create_task(self._follow_aborts(abort_cursor), name="aborts"),
            asyncio.create_task(self._intake(), name="intake"),
        ]
        log.info("scheduler %s on %s:%d, workers: %s", s.consumer, s.host, self.port,
                 ", ".join(s.workers) or "from the Redis registry")

    async def wait_for_workers(self, n: int = 1, timeout_s: float = 60.0) -> None:
        """Return once ``n`` workers are connected (tests and `pagedserve serve` use it)."""
        deadline = time.monotonic() + timeout_s
        while sum(e.connected for e in self.engines.values()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {n} workers connected after {timeout_s}s")
            await asyncio.sleep(0.05)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop pulling, go NOT_SERVING, let held requests finish within the grace period, stop.
        Requests still unfinished stay pending in Redis, un-ACKed, for another scheduler."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self._draining = True
        self._capacity.set()
        if self.lifecycle is not None:
            await self.lifecycle.drain(grace, self._wait_engines_idle)
        tasks = [*self._tasks, *self._engine_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines.values():
            await engine.close()
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()

    async def _wait_engines_idle(self) -> None:
        for engine in list(self.engines.values()):
            await engine.wait_idle()

    # -- stats ----------------------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        return ServiceStats(self.num_finished, self.num_aborted, [
            WorkerStatsView(e.address, e.description.info.model, e.connected, e.num_steps, e.core.stats())
            for e in self.engines.values()])

    def _count_finished(self, num_finished: int, num_aborted: int) -> None:
        self.num_finished += num_finished
        self.num_aborted += num_aborted
        self._capacity.set()

    # -- workers --------------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        s = self.settings
        while True:
            for address, task in list(self._engine_tasks.items()):
                if task.done():  # worker lost: forget it, reconnect below if still wanted
                    del self._engine_tasks[address]
                    if not task.cancelled() and task.exception() is not None:
                        log.error("engine of %s stopped", address, exc_info=task.exception())
                    await self.engines.pop(address).close()
            try:
                wanted = list(s.workers) if s.workers else [
                    r.address for r in await list_workers(self._redis, self.keys)]
            except RedisError as exc:
                log.warning("worker registry unreadable: %s", exc)
                wanted = []
            for address in wanted:
                if address not in self.engines and not self._draining:
                    await self._connect(address)
            self._route_backlog()
            await asyncio.sleep(s.discovery_interval_s)

    async def _connect(self, address: str) -> None:
        s = self.settings
        try:
            client, description = await connect(address, timeout_s=5.0)
        except (grpc.aio.AioRpcError, WorkerLostError, asyncio.TimeoutError) as exc:
            level = logging.DEBUG if address in self._refused else logging.WARNING
            log.log(level, "cannot drive worker %s: %s", address, exc)
            self._refused.add(address)
            return
        self._refused.discard(address)
        info = description.info
        config = SchedulerConfig(
            max_num_batched_tokens=min(s.max_num_batched_tokens or description.max_num_batched_tokens,
                                       description.max_num_batched_tokens),
            max_num_seqs=min(s.max_num_seqs or description.max_num_seqs, description.max_num_seqs),
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            enable_chunked_prefill=s.enable_chunked_prefill,
            enable_prefix_caching=s.enable_prefix_caching, policy=s.policy)
        try:
            core = Scheduler(config, info, seed_rng=random.Random(self._rng.getrandbits(64)))
        except ValueError as exc:  # settings that cannot work with this worker (InvalidParameterError)
            log.error("cannot drive worker %s with these settings: %s", address, exc)
            await client.close()
            return
        engine = WorkerEngine(client, description, core, self.queue,
                              max_queued=s.max_queued_per_worker or config.max_num_seqs,
                              on_finished=self._count_finished)
        self.engines[address] = engine
        self._engine_tasks[address] = asyncio.create_task(engine.run(), name=f"engine {address}")
        self._tasks.append(asyncio.create_task(
            client.watch_health(lambda serving, e=engine: self._on_worker_health(e, serving)),
            name=f"health {address}"))
        log.info("driving worker %s (%s): %d KV blocks of %d tokens, max_model_len %d, batch %d seqs / %d tokens",
                 address, info.model, info.num_blocks, info.block_size, info.max_model_len,
                 config.max_num_seqs, config.max_num_batched_tokens)
        self._capacity.set()

    def _on_worker_health(self, engine: WorkerEngine, serving: bool) -> None:
        if engine.accepting != serving:
            log.info("worker %s %s", engine.address, "accepts requests" if serving else "is draining")
        engine.accepting = serving
        if serving:
            self._capacity.set()

    # -- intake ---------------------------------------------------------------------------------------

    async def _intake(self) -> None:
        s = self.settings
        while not self._draining:
            room = sum(e.room for e in self.engines.values())
            if room <= 0 or self._backlog:
                self._capacity.clear()
                try:
                    await asyncio.wait_for(self._capacity.wait(), s.poll_block_ms / 1000)
                except asyncio.TimeoutError:
                    pass
                self._route_backlog()
                continue
            try:
                entries = await self.queue.pull(min(room, 256), s.poll_block_ms)
            except RedisError as exc:
                log.warning("pulling requests failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            now = time.time()
            for entry in entries:
                await self._admit(entry, now)

    async def _admit(self, entry: QueueEntry, now: float) -> None:
        try:
            queued = convert.queued_request_from_record(entry.data)
        except (InvalidParameterError, DecodeError) as exc:
            field = getattr(exc, "field", "")
            log.warning("refusing malformed request %s: %s", entry.request_id, exc)
            await self._finish_unstarted(entry, field, str(exc))
            return
        rid = queued.request.request_id
        if self._recent_aborts.pop(rid, None) is not None:
            await self._finish_unstarted(entry, "", "aborted before it was scheduled")
            return
        if queued.deadline and queued.deadline < now:
            await self._finish_unstarted(entry, "", "deadline passed before it was scheduled")
            return
        self._backlog.append((entry, queued))
        self._route_backlog()

    def _route_backlog(self) -> None:
        """Hand pulled requests to engines: the least loaded one whose max_model_len fits."""
        while self._backlog:
            engines = [e for e in self.engines.values() if e.connected and e.accepting]
            if not engines:
                return  # no worker yet: keep them (pending in Redis, ours) until one connects
            entry, queued = self._backlog.popleft()
            fitting = [e for e in engines if e.fits(queued.request)] or engines
            min(fitting, key=lambda e: e.load).submit(queued.request, entry.entry_id)

    async def _finish_unstarted(self, entry: QueueEntry, field: str, message: str) -> None:
        """Publish a final ABORT record for a request never handed to a worker, and ACK it."""
        records = [(entry.request_id, convert.error_record(field, message))] if entry.request_id else []
        await self.queue.publish(records, [entry.entry_id])
        self._count_finished(1, 1)

    # -- aborts ---------------------------------------------------------------------------------------

    async def _follow_aborts(self, cursor: str) -> None:
        while True:
            try:
                ids, cursor = await self.queue.read_aborts(cursor, self.settings.poll_block_ms)
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
        for i, (entry, queued) in enumerate(self._backlog):
            if queued.request.request_id == request_id:
                del self._backlog[i]
                asyncio.create_task(self._finish_unstarted(entry, "", "aborted before it was scheduled"))
                return
        # Not pulled yet (or not ours): remember it, bounded in size and age.
        now = time.monotonic()
        recent = self._recent_aborts
        recent[request_id] = now
        while recent and (len(recent) > RECENT_ABORTS_MAX
                          or next(iter(recent.values())) < now - RECENT_ABORTS_TTL_S):
            recent.popitem(last=False)
