"""The scheduler's side of Redis: the request stream it consumes, the output streams it writes,
the abort stream it follows. Transport only: records arrive and leave as bytes
(``scheduler_service.convert`` encodes them).

Backpressure stays in Redis (DESIGN.md): :meth:`RedisQueue.pull` is only called for as many
requests as the scheduler has room for; the rest wait in the stream, where gateways see the
backlog and refuse new work with RESOURCE_EXHAUSTED past their limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.redis_keys import SCHEDULER_GROUP, RedisKeys


@dataclass(frozen=True, slots=True)
class QueueEntry:
    entry_id: str  # the request stream entry, XACKed + deleted when the request finishes
    request_id: str
    data: bytes  # an EngineRequest


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisQueue:
    def __init__(self, redis, keys: RedisKeys, consumer: str, *, output_ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self.consumer = consumer  # this scheduler's name in the consumer group
        self._output_ttl_s = output_ttl_s

    async def pull(self, count: int, block_ms: int) -> list[QueueEntry]:
        """Up to ``count`` requests never delivered to any scheduler, waiting at most ``block_ms``."""
        reply = await self._redis.xreadgroup(
            SCHEDULER_GROUP, self.consumer, {self._keys.requests: ">"}, count=count, block=block_ms)
        entries = []
        for _stream, items in reply or ():
            for entry_id, fields in items:
                if not fields:  # deleted while pending
                    continue
                entries.append(QueueEntry(_str(entry_id), _str(fields.get(b"request_id", b"")),
                                          fields.get(b"data", b"")))
        return entries

    async def publish(self, outputs: list[tuple[str, bytes]], finished_entry_ids: list[str]) -> None:
        """In one pipeline: append each (request id, EngineOutput) to its output stream and renew
        the stream's TTL; XACK and delete the request entries of finished requests."""
        if not outputs and not finished_entry_ids:
            return
        keys, ttl = self._keys, self._output_ttl_s
        pipe = self._redis.pipeline(transaction=False)
        for request_id, data in outputs:
            key = keys.output(request_id)
            pipe.xadd(key, {"data": data})
            pipe.expire(key, ttl)
        if finished_entry_ids:
            pipe.xack(keys.requests, SCHEDULER_GROUP, *finished_entry_ids)
            pipe.xdel(keys.requests, *finished_entry_ids)
        await pipe.execute()

    async def last_abort_id(self) -> str:
        """The id to follow the abort stream from (its newest entry, or the beginning)."""
        newest = await self._redis.xrevrange(self._keys.aborts, count=1)
        return _str(newest[0][0]) if newest else "0-0"

    async def read_aborts(self, after_id: str, block_ms: int) -> tuple[list[str], str]:
        """Request ids aborted after ``after_id`` (waiting at most ``block_ms``), and the new cursor."""
        reply = await self._redis.xread({self._keys.aborts: after_id}, count=1024, block=block_ms)
        ids: list[str] = []
        for _stream, items in reply or ():
            for entry_id, fields in items:
                after_id = _str(entry_id)
                rid = fields.get(b"request_id")
                if rid:
                    ids.append(_str(rid))
        return ids, after_id
