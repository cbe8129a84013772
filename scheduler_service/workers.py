"""The workers one scheduler drives: discovery, leases, liveness and rebalancing.

A supervisor pass runs every ``discovery_interval_s`` (every ``SEEKING_INTERVAL_S`` while the
scheduler drives no worker):

- forget engines whose worker was lost (their requests were handed back already) and release
  their leases;
- find workers: the ``--workers`` list, or the Redis registry (schedulers register in both modes). In registry mode a scheduler
  claims free workers only up to its fair share, ``ceil(live workers / live schedulers)`` (both
  from the registry), and hands workers beyond its share back gracefully (no new requests; once
  empty, stream closed and lease released) so a newly started scheduler gets workers too (the last
  worker a scheduler drives is never handed over: it keeps serving);
- a scheduler left without a worker that takes requests (its workers died) while another live
  scheduler drives one hands the requests it holds back to the consumer group
  (``on_starving``), where a scheduler with room claims them at its next pending pass (within
  ``reclaim_interval_s``), not after the idle-reclaim time. With fewer workers than schedulers this
  is how work moves; with as many or more, the fair share then brings it a worker too. When no
  scheduler drives a worker, it keeps its requests until a worker joins: they wait, never fail;
- a driven worker whose registry entry expired (heartbeats stopped) is probed; unreachable, it is
  declared lost and its requests resume elsewhere;
- claim: take the worker's lease (``scheduler_service.leases``), then open its Step stream.

Leases are renewed every third of their TTL by a task of their own; a lease found taken by another
scheduler means this one must stop driving that worker. A lost worker wakes the supervisor at once,
so the hand-back above does not wait for the next pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from redis.exceptions import RedisError

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine import WorkerEngine
from scheduler_service.intake import RequestIntake
from scheduler_service.leases import WorkerLeases
from scheduler_service.config import SchedulerConfig
from scheduler_service.worker_client import LeaseRefusedError, WorkerLostError, connect
from servicekit.contract.worker import WorkerDescription
from servicekit.redis_layout import RedisKeys
from servicekit.registry import Heartbeat, SchedulerRecord, list_schedulers, list_workers
from servicekit.serving import cancel_and_wait, cancel_requested

if TYPE_CHECKING:
    from scheduler_service.metrics import RequestMetrics

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
SEEKING_INTERVAL_S = 0.25  # supervisor passes while no worker is driven (a registry scan each)
PROBE_TIMEOUT_S = 2.0


class WorkerPool:
    """One WorkerEngine per driven worker, by address.

    Callbacks into the service: ``on_change()`` when room may have appeared (a worker connected or
    became ready), ``on_lost(engine, handed)`` with the requests of a lost worker,
    ``on_finished(n, n_aborted)`` after each publish with finished requests, ``await
    on_starving()`` when no engine takes requests while another scheduler drives a worker (the
    service hands what it holds back to the group), ``stranded()``: requests the service holds
    that no engine takes.
    """

    def __init__(self, settings: SchedulerConfig, redis, keys: RedisKeys, intake: RequestIntake, *,
                 admin_address: str, on_change: Callable[[], None],
                 on_lost: Callable[[WorkerEngine, list[tuple[Request, str]]], None],
                 on_finished: Callable[[int, int], None], stranded: Callable[[], int] = lambda: 0,
                 on_starving: Callable[[], Awaitable[None]] | None = None,
                 metrics: RequestMetrics | None = None) -> None:
        self.settings = settings
        self._metrics = metrics
        self._redis = redis
        self._keys = keys
        self._intake = intake
        self._on_change = on_change
        self._on_lost = on_lost
        self._on_finished = on_finished
        self._stranded = stranded
        self._on_starving = on_starving
        self._wake = asyncio.Event()  # a worker was lost: run the supervisor pass now
        self.leases = WorkerLeases(redis, keys, settings.consumer, ttl_s=settings.lease_ttl_s)
        self._record = SchedulerRecord(settings.consumer, admin_address, 0)
        self._heartbeat = Heartbeat(redis, keys, self._record, settings.lease_ttl_s,
                                    key=keys.scheduler(settings.consumer))
        self.engines: dict[str, WorkerEngine] = {}
        self._engine_tasks: dict[str, asyncio.Task] = {}
        self._side_tasks: dict[str, asyncio.Task] = {}  # health watch per address
        self._connecting: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._rng = random.Random()
        self._refused: set[str] = set()  # addresses whose last connect failed (logged once)
        self.draining = False

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._heartbeat.start()
        except RedisError as exc:  # Redis away at start: the heartbeat task keeps trying
            log.warning("could not register the scheduler: %s", exc)
        self._tasks = [asyncio.create_task(self._supervise(), name="supervisor"),
                       asyncio.create_task(self._renew_leases(), name="leases")]

    async def stop(self) -> None:
        """Stop everything; leases are released so other schedulers can claim the workers at once."""
        self.draining = True
        await cancel_and_wait([*self._tasks, *self._engine_tasks.values(), *self._side_tasks.values(),
                               *self._connecting.values()])
        await self._heartbeat.stop()
        for engine in list(self.engines.values()):
            await engine.close()
            await self._release(engine.worker_id)
        self.engines.clear()

    # -- queries --------------------------------------------------------------------------------------

    def routable(self) -> list[WorkerEngine]:
        """Engines that take new requests now."""
        return [e for e in self.engines.values() if e.takes_requests]

    @property
    def room(self) -> int:
        return sum(e.room for e in self.engines.values())

    async def wait_connected(self, n: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while sum(e.connected for e in self.engines.values()) < n:
            if loop.time() > deadline:
                raise TimeoutError(f"fewer than {n} workers connected after {timeout_s}s")
            await asyncio.sleep(0.05)

    # -- supervisor -----------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        while not cancel_requested():
            self._wake.clear()  # a loss during the pass below runs the next one at once
            try:
                await self._supervise_once()
            except Exception:  # never let the supervisor die: log and try again next pass
                if cancel_requested():
                    break
                log.exception("supervisor pass failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self._pass_interval())
            except asyncio.TimeoutError:
                pass

    def _pass_interval(self) -> float:
        """Seconds to the next supervisor pass: ``discovery_interval_s``, shorter while this
        scheduler drives no worker (at start, or scaled to zero with requests waiting in Redis: the
        first worker to register is found within SEEKING_INTERVAL_S, not a whole interval later)."""
        interval = self.settings.discovery_interval_s
        return min(interval, SEEKING_INTERVAL_S) if not self.engines else interval

    async def _supervise_once(self) -> None:
        await self._reap()
        s = self.settings
        others_serve, live = False, set()
        if s.workers:
            candidates = [(address, None) for address in s.workers]
            share = len(s.workers)
        else:
            found = await self._discover()
            if found is None:
                return  # registry unreadable: change nothing
            candidates, share, others_serve, live = found
        if not self.draining:
            driving = sum(not e.releasing for e in self.engines.values()) + len(self._connecting)
            for address, _worker_id in candidates:
                if driving >= share:
                    break
                if address in self.engines or address in self._connecting:
                    continue
                self._connecting[address] = asyncio.create_task(self._connect(address), name=f"connect {address}")
                driving += 1
            if not s.workers:
                self._rebalance(share, live)
            if not self.routable() and self._on_starving is not None:
                if s.workers:  # no registry scan this pass: read the other schedulers' records now
                    others_serve = await self._others_serve()
                if others_serve:
                    await self._on_starving()
        for engine in list(self.engines.values()):
            if engine.releasing and engine.connected and engine.load == 0:  # lost ones are reaped
                log.info("handing worker %s back (rebalancing)", engine.address)
                await self._retire(engine)
        # Workers that take (or will take) new requests: one being handed over does not count.
        num_workers = sum(e.connected and not e.releasing for e in self.engines.values())
        await self._heartbeat.update(SchedulerRecord(self._record.consumer, self._record.address, num_workers,
                                                     0 if num_workers else self._stranded()))

    async def _discover(self) -> tuple[list[tuple[str, str]], int, bool, set[str]] | None:
        """Free registered workers (no lease, or ours) in a per-scheduler order, this scheduler's
        fair share, whether another live scheduler drives a worker (as of its last pass), and the
        ids of the registered workers; also probes driven workers whose registry entry expired."""
        try:
            records = await list_workers(self._redis, self._keys)
            schedulers = await list_schedulers(self._redis, self._keys)
            holders = await self._redis.mget([self._keys.lease(r.worker_id) for r in records]) if records else []
        except RedisError as exc:
            log.warning("worker registry unreadable: %s", exc)
            return None
        live = {r.worker_id for r in records}
        lost = [e for e in self.engines.values() if e.connected and e.worker_id not in live]
        if lost:
            await asyncio.gather(*(self._probe(e) for e in lost))
        num_schedulers = max(1, len({r.consumer for r in schedulers} | {self.settings.consumer}))
        others_serve = self._any_other_serves(schedulers)
        share = math.ceil(len(records) / num_schedulers)
        me = self.settings.consumer.encode()
        free: list[WorkerDescription] = [r for r, h in zip(records, holders) if h is None or h == me]
        self._rng.shuffle(free)  # two schedulers starting together do not race for the same worker
        return [(r.address, r.worker_id) for r in free], share, others_serve, live

    def _any_other_serves(self, schedulers: list[SchedulerRecord]) -> bool:
        """Whether another live scheduler drove a worker that takes requests at its last pass."""
        return any(r.num_workers > 0 for r in schedulers if r.consumer != self.settings.consumer)

    async def _others_serve(self) -> bool:
        try:
            return self._any_other_serves(await list_schedulers(self._redis, self._keys))
        except RedisError as exc:
            log.warning("scheduler registry unreadable: %s", exc)
            return False

    async def _probe(self, engine: WorkerEngine) -> None:
        """A driven worker left the registry: lost unless it still answers its health check. One
        that answers NOT_SERVING is draining (it leaves the registry on purpose, finishes what it
        holds, then stops): expected, not worth a warning."""
        serving = await engine.client.check_health(PROBE_TIMEOUT_S)
        if serving is None:
            engine.mark_lost("it drained and stopped" if engine.draining
                             else "heartbeats stopped and the worker does not answer")
        elif serving:
            log.warning("worker %s answers but its registry entry expired (its Redis link is down?)",
                        engine.address)

    def _rebalance(self, share: int, live: set[str]) -> None:
        """Over the fair share, hand the least loaded worker back, one per pass, once its requests
        finish (at once when it has none). Only workers in the registry (``live`` ids) count: one
        whose entry expired is being probed, not rebalanced. A worker being handed over is kept
        when it is the last one connected (the others died meanwhile): better drive it than strand
        the requests that wait here."""
        connected = [e for e in self.engines.values() if e.connected]
        active = [e for e in connected if not e.releasing and e.worker_id in live]
        if not active:
            for engine in connected:
                if engine.releasing:
                    log.info("keeping worker %s (no other worker left)", engine.address)
                    engine.releasing = False
                    self._on_change()
            return
        if len(active) <= share:
            return
        engine = min(active, key=lambda e: e.load)
        engine.releasing = True
        if engine.load == 0:
            log.info("driving %d workers, fair share %d: releasing %s now", len(active), share, engine.address)
            engine.mark_lost("released to another scheduler (rebalancing)")
        else:
            log.info("driving %d workers, fair share %d: releasing %s once its %d requests finish",
                     len(active), share, engine.address, engine.load)

    async def _reap(self) -> None:
        """Forget engines whose loop ended (worker lost: requests already handed back)."""
        for address, task in list(self._engine_tasks.items()):
            if task.done():
                if not task.cancelled() and task.exception() is not None:
                    log.error("engine of %s stopped", address, exc_info=task.exception())
                await self._retire(self.engines[address])

    async def _retire(self, engine: WorkerEngine) -> None:
        address = engine.address
        task = self._engine_tasks.pop(address, None)
        if task is not None and not task.done():
            await cancel_and_wait([task])
        side = self._side_tasks.pop(address, None)
        if side is not None:
            side.cancel()
        self.engines.pop(address, None)
        await engine.close()
        await self._release(engine.worker_id)

    async def _release(self, worker_id: str) -> None:
        try:
            await self.leases.release(worker_id)
        except RedisError as exc:  # it expires on its own
            log.warning("could not release the lease of worker %s: %s", worker_id, exc)

    # -- leases ---------------------------------------------------------------------------------------

    async def _renew_leases(self) -> None:
        period = self.settings.lease_ttl_s / 3
        while not cancel_requested():
            await asyncio.sleep(period)
            engines = [e for e in self.engines.values() if e.connected]
            try:
                held = await self.leases.renew([e.worker_id for e in engines])
            except RedisError as exc:
                log.warning("renewing worker leases failed: %s", exc)
                continue
            for engine in engines:
                if not held.get(engine.worker_id, True):
                    engine.mark_lost("its lease is held by another scheduler")

    # -- connecting -----------------------------------------------------------------------------------

    async def _connect(self, address: str) -> None:
        try:
            await self._connect_inner(address)
        finally:
            self._connecting.pop(address, None)

    async def _connect_inner(self, address: str) -> None:
        s = self.settings
        claimed: list[str] = []

        async def claim(description) -> bool:
            if await self.leases.acquire(description.worker_id):
                claimed.append(description.worker_id)
                return True
            return False

        try:
            client, description = await connect(address, timeout_s=CONNECT_TIMEOUT_S, claim=claim,
                                                tls=s.tls, token=s.internal_token)
        except LeaseRefusedError as exc:
            log.debug("%s", exc)
            return
        except (grpc.aio.AioRpcError, WorkerLostError, asyncio.TimeoutError, RedisError) as exc:
            level = logging.DEBUG if address in self._refused else logging.WARNING
            reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.log(level, "cannot drive worker %s: %s", address, reason)
            self._refused.add(address)
            for worker_id in claimed:
                await self._release(worker_id)
            return
        self._refused.discard(address)
        if self.draining:
            await client.close()
            await self._release(description.worker_id)
            return
        info = description
        try:  # the scheduling settings within what this worker states (SchedulingConfig.for_worker)
            core = Scheduler(s.scheduling, info, seed_rng=random.Random(self._rng.getrandbits(64)))
        except ValueError as exc:  # settings that cannot work with this worker (InvalidArgumentError)
            log.error("cannot drive worker %s with these settings: %s", address, exc)
            await client.close()
            await self._release(description.worker_id)
            return
        engine = WorkerEngine(client, description, core, self._intake,
                              max_queued=s.max_queued_per_worker or core.config.max_num_seqs,
                              on_finished=self._on_finished, on_lost=self._engine_lost,
                              metrics=self._metrics, stream_interval=s.stream_interval,
                              async_scheduling=s.async_scheduling)
        self.engines[address] = engine
        self._engine_tasks[address] = asyncio.create_task(engine.run(), name=f"engine {address}")
        self._side_tasks[address] = asyncio.create_task(
            client.watch_health(lambda serving, e=engine: self._on_worker_health(e, serving)),
            name=f"health {address}")
        log.info("driving worker %s (%s, id %s): %d KV blocks of %d tokens, max_model_len %d, "
                 "batch %d seqs / %d tokens", address, info.model, description.worker_id, info.num_blocks,
                 info.block_size, info.max_model_len, core.config.max_num_seqs, core.config.max_num_batched_tokens)
        self._on_change()

    def _engine_lost(self, engine: WorkerEngine, handed: list[tuple[Request, str]]) -> None:
        self._on_lost(engine, handed)
        self._wake.set()  # reap it and, if no worker is left here, hand the requests back now

    def _on_worker_health(self, engine: WorkerEngine, serving: bool | None) -> None:
        if serving is None:  # the watch ended: the worker is gone (its Step stream says how), not draining
            engine.accepting = False
            return
        if engine.accepting != serving and engine.connected:
            log.info("worker %s %s", engine.address, "accepts requests" if serving else "is draining")
        engine.accepting = serving
        engine.draining = not serving
        if serving:
            self._on_change()
