"""The gateway's writes to Redis: admitting a request (queue-limit check, request entry, the
output stream's first entry, and the fan-out wake-up, in one round trip) and abort notices."""

from __future__ import annotations

from gateway_service.output_fanout import WAKE_MAXLEN, WAKE_TTL_S
from servicekit.contract.errors import AlreadyExistsError, ResourceExhaustedError
from servicekit.redis_keys import SCHEDULER_GROUP, RedisKeys

ABORTS_MAXLEN = 10_000

# KEYS: requests stream, the request's output stream, the gateway's wake stream
# ARGV: group, max queued (0 = no limit), request id, EngineRequest bytes, output TTL seconds,
#       wake stream max length, wake stream TTL seconds
# Returns 0 when admitted, -1 when the queue is full, -2 when the request id is in use.
# Queue depth = entries not yet delivered to any scheduler: finished requests are deleted from the
# stream, so XLEN minus the group's pending count is what waits.
_ADMIT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -2 end
local limit = tonumber(ARGV[2])
if limit > 0 then
  local waiting = redis.call('XLEN', KEYS[1]) - redis.call('XPENDING', KEYS[1], ARGV[1])[1]
  if waiting >= limit then return -1 end
end
redis.call('XADD', KEYS[2], '*', 'data', '')
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('XADD', KEYS[1], '*', 'request_id', ARGV[3], 'data', ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'w', '1')
redis.call('EXPIRE', KEYS[3], ARGV[7])
return 0
"""


class RequestQueue:
    def __init__(self, redis, keys: RedisKeys, *, max_queued: int, output_ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._max_queued = max_queued
        self._output_ttl_s = output_ttl_s
        self._admit = redis.register_script(_ADMIT_LUA)

    async def admit(self, request_id: str, record: bytes, wake_key: str) -> None:
        """Enqueue one EngineRequest. Raises ResourceExhaustedError past the queue limit and
        AlreadyExistsError when the request id has an output stream already."""
        keys = self._keys
        result = await self._admit(
            keys=[keys.requests, keys.output(request_id), wake_key],
            args=[SCHEDULER_GROUP, self._max_queued, request_id, record, self._output_ttl_s, WAKE_MAXLEN, WAKE_TTL_S])
        if result == -1:
            raise ResourceExhaustedError(f"the request queue is full ({self._max_queued} waiting); retry later")
        if result == -2:
            raise AlreadyExistsError(f"request_id {request_id!r} is already in use")

    async def exists(self, request_id: str) -> bool:
        return bool(await self._redis.exists(self._keys.output(request_id)))

    async def abort(self, request_id: str) -> None:
        await self._redis.xadd(self._keys.aborts, {"request_id": request_id},
                               maxlen=ABORTS_MAXLEN, approximate=True)
