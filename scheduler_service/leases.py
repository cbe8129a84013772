"""Worker leases: which scheduler drives which worker (docs/architecture.md, decision 12).

A worker's KV cache mirrors exactly one scheduler's block pool, so exactly one scheduler may drive
it. The lease is ``{prefix}lease:{worker_id}`` holding the driving scheduler's consumer name, set
with NX and a TTL and renewed by its holder every third of the TTL. A scheduler that dies stops
renewing; its leases expire and the workers are free for another scheduler to claim.

The worker's own rule (one Step stream at a time) is the second lock: a scheduler that wins a
lease while the previous holder's stream is still open is refused, releases the lease and tries
again later.
"""

from __future__ import annotations

from servicekit.redis_layout import RedisKeys

# KEYS: lease keys. ARGV: owner, ttl ms. Per key: take it when free, extend it when ours.
# Returns one 1 (held by us now) / 0 (held by another) per key.
_ACQUIRE_LUA = """
local held = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v == false then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    held[i] = 1
  elseif v == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
"""

# KEYS[1]: a lease key. ARGV[1]: owner. Deletes the lease only if ours.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class WorkerLeases:
    """The leases one scheduler (``owner``, its consumer name) holds or wants."""

    def __init__(self, redis, keys: RedisKeys, owner: str, *, ttl_s: float) -> None:
        self._redis = redis
        self._keys = keys
        self.owner = owner
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self._acquire = redis.register_script(_ACQUIRE_LUA)
        self._release = redis.register_script(_RELEASE_LUA)

    async def acquire(self, worker_id: str) -> bool:
        """Take the worker's lease (or extend it if already ours); False when another holds it."""
        return (await self.renew([worker_id]))[worker_id]

    async def renew(self, worker_ids: list[str]) -> dict[str, bool]:
        """Extend our leases; a lease that expired meanwhile is taken again if still free. Maps
        each worker id to whether we hold its lease now."""
        if not worker_ids:
            return {}
        held = await self._acquire(keys=[self._keys.lease(w) for w in worker_ids], args=[self.owner, self.ttl_ms])
        return {w: bool(h) for w, h in zip(worker_ids, held)}

    async def release(self, worker_id: str) -> None:
        """Give the lease up (only if ours), so another scheduler can claim the worker at once."""
        await self._release(keys=[self._keys.lease(worker_id)], args=[self.owner])

    async def holder(self, worker_id: str) -> str | None:
        value = await self._redis.get(self._keys.lease(worker_id))
        return value.decode() if isinstance(value, bytes) else value
