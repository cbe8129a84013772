"""The registries in Redis: ``{prefix}workers:{worker_id}`` and ``{prefix}schedulers:{consumer}``
hashes, each kept alive by its owner's heartbeat (a TTL refreshed every ``ttl / 3`` seconds).

A worker started with a Redis URL registers itself here; the entry expires when the worker dies
(or stops beating). Schedulers started without ``--workers`` find their workers here, and
gateways learn the served model's name and limits here (the smallest ``max_model_len`` over live
workers of the model), so a gateway needs no flag that could disagree with the workers.

Schedulers register too, so each can compute its fair share of the workers (live workers / live
schedulers) before claiming one with a lease (``scheduler_service.leases``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from servicekit.contract.worker import WorkerDescription
from servicekit.redis_layout import RedisKeys

log = logging.getLogger(__name__)


_WORKER_INTS = ("num_blocks", "block_size", "max_model_len", "vocab_size", "max_num_seqs", "max_num_batched_tokens",
                "prefill_chunk_attention_limit")


def worker_to_hash(worker: WorkerDescription) -> dict[str, str]:
    """A worker's registry entry (``{prefix}workers:{worker_id}``), as a Redis hash."""
    h = {name: str(getattr(worker, name)) for name in _WORKER_INTS}
    h.update(worker_id=worker.worker_id, address=worker.address, model=worker.model,
             eos_token_ids=",".join(map(str, worker.eos_token_ids)))
    return h


def worker_from_hash(h: dict) -> WorkerDescription:
    h = {_s(k): _s(v) for k, v in h.items()}
    return WorkerDescription(
        model=h["model"], eos_token_ids=tuple(int(t) for t in h["eos_token_ids"].split(",") if t),
        worker_id=h["worker_id"], address=h["address"],
        **{name: int(h[name]) for name in _WORKER_INTS})


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True, slots=True)
class SchedulerRecord:
    """What a scheduler publishes about itself."""

    consumer: str  # its name in the request stream's consumer group
    address: str  # its admin (stats / health) server
    num_workers: int = 0  # workers it drives
    num_stranded: int = 0  # requests it holds that no worker of its own can take (it has none)

    def to_hash(self) -> dict[str, str]:
        return {"consumer": self.consumer, "address": self.address, "num_workers": str(self.num_workers),
                "num_stranded": str(self.num_stranded)}

    @classmethod
    def from_hash(cls, h: dict) -> SchedulerRecord:
        h = {_s(k): _s(v) for k, v in h.items()}
        return cls(consumer=h["consumer"], address=h["address"], num_workers=int(h["num_workers"]),
                   num_stranded=int(h["num_stranded"]))


async def _list_hashes(redis, pattern: str, parse) -> list:
    names = sorted([k async for k in redis.scan_iter(match=pattern, count=200)])
    if not names:
        return []
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    records = []
    for name, h in zip(names, await pipe.execute()):
        if not h:
            continue  # expired between SCAN and HGETALL
        try:
            records.append(parse(h))
        except (KeyError, ValueError):
            log.warning("skipping malformed registry record %s", _s(name))
    return records


async def list_workers(redis, keys: RedisKeys) -> list[WorkerDescription]:
    """Every live worker's record, in key order (records that fail to parse are skipped)."""
    return await _list_hashes(redis, keys.worker_pattern, worker_from_hash)


async def list_schedulers(redis, keys: RedisKeys) -> list[SchedulerRecord]:
    """Every live scheduler's record, in key order."""
    return await _list_hashes(redis, keys.scheduler_pattern, SchedulerRecord.from_hash)


def _to_hash(record: WorkerDescription | SchedulerRecord) -> dict[str, str]:
    return worker_to_hash(record) if isinstance(record, WorkerDescription) else record.to_hash()


class Heartbeat:
    """Keeps one registry record alive in Redis until stopped (then deletes it). ``record`` is a
    WorkerDescription (under its worker key) or a SchedulerRecord (``key`` given); the record may
    be replaced with :meth:`update`."""

    def __init__(self, redis, keys: RedisKeys, record, ttl_s: float, *, key: str | None = None) -> None:
        self._redis = redis
        self._key = key if key is not None else keys.worker(record.worker_id)
        self._record = record
        self._ttl_ms = max(1000, int(ttl_s * 1000))
        self._task: asyncio.Task | None = None

    async def update(self, record) -> None:
        """Replace the record; a changed one is written at once (else at the next beat)."""
        if record == self._record:
            return
        self._record = record
        if self._task is not None:
            try:
                await self._beat()
            except Exception as exc:
                log.warning("registry update failed: %s", exc)

    async def start(self) -> None:
        await self._beat()  # registered before start() returns: callers can rely on it
        self._task = asyncio.create_task(self._run(), name="registry-heartbeat")

    async def _beat(self) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key, mapping=_to_hash(self._record))
        pipe.pexpire(self._key, self._ttl_ms)
        await pipe.execute()

    async def _run(self) -> None:
        from servicekit.serving import cancel_requested

        while not cancel_requested():
            await asyncio.sleep(self._ttl_ms / 3000)
            try:
                await self._beat()
            except Exception as exc:  # Redis away: keep trying, the entry expires meanwhile
                log.warning("registry heartbeat of %s failed: %s", self._key, exc)

    async def stop(self) -> None:
        from servicekit.serving import cancel_and_wait

        await cancel_and_wait([self._task])
        self._task = None
        try:
            await self._redis.delete(self._key)
        except Exception as exc:
            log.warning("could not remove worker record %s: %s", self._key, exc)
