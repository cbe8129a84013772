"""Stored responses of the Responses API, in Redis, readable and resumable from every gateway
(docs/architecture.md, decision 18): no gateway is special, any may die.

A response is four keys (``servicekit.redis_layout``, ``response*``), all expiring after the
gateway's ``--response-ttl-s``:

- the object (JSON): as created, then, once finished, as finished;
- its meta (a hash): the owner's key digest, the request id, the request as the chat path reads it
  (so any gateway rebuilds the same input, whose digests a resume must match), the input items, the
  conversation items (what a follow-up's ``previous_response_id`` continues), the fixed part of the
  object, and ``cancelled`` once a cancel was asked;
- its event log (a stream, entry id ``0-{sequence_number + 1}``): every reader replays it;
- the lease of its producer (SET NX PX, renewed): the one gateway that writes the log.

Writing is fenced: :meth:`ResponseStore.append` adds events only while the writer holds the lease
and only right after the log's last event, in one script, so two gateways never both write a
sequence number, and the finished object is written with the last events, atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from servicekit.contract.errors import NotFoundError
from servicekit.redis_layout import DATA_FIELD, RedisKeys

LEASE_MS = 3000  # a producer that stops renewing is taken over this long after its last renewal

# KEYS: events, lease, object, meta. ARGV: lease token, the sequence number of the first event,
# TTL seconds, the finished object's JSON ("" while not finished), then the events' JSON.
# Returns 1 when written, -1 when the lease is not the writer's (or the response was deleted), -2
# when the log does not end right before the first event.
_APPEND_LUA = f"""
if redis.call('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local next_seq = 0
if #last > 0 then next_seq = tonumber(string.match(last[1][1], '-(%d+)$')) end
if next_seq ~= tonumber(ARGV[2]) then return -2 end
for i = 5, #ARGV do
  redis.call('XADD', KEYS[1], '0-' .. (next_seq + i - 4), '{DATA_FIELD}', ARGV[i])
end
local ttl = tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[3], ARGV[4], 'EX', ttl)
  redis.call('EXPIRE', KEYS[4], ttl)
  redis.call('DEL', KEYS[2])
end
return 1
"""
# KEYS: lease. ARGV: token, lease ms. Renews the lease if it is the token's (1), else 0.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
# KEYS: lease. ARGV: token. Gives the lease up if it is the token's.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: meta. Marks a cancel asked, if the response still exists.
_CANCEL_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'cancelled', '1')
return 1
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A stored response's meta (see the module's docstring)."""

    response_id: str
    owner: str
    request_id: str
    chat: dict
    input_items: list[dict]
    conversation: list[dict]
    head: dict
    cancelled: bool = False


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"response {response_id!r} is unknown, expired, deleted, or made with another API key")


class ResponseStore:
    def __init__(self, redis, keys: RedisKeys, *, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self.ttl_s = ttl_s
        self._append = redis.register_script(_APPEND_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._release = redis.register_script(_RELEASE_LUA)
        self._cancel = redis.register_script(_CANCEL_LUA)

    def events_key(self, response_id: str) -> str:
        return self._keys.response_events(response_id)

    async def create(self, meta: StoredResponse, lease_token: str) -> None:
        """Store a new response (its object is ``meta.head``), its lease held by ``lease_token``."""
        keys, rid = self._keys, meta.response_id
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(keys.response_meta(rid), mapping={
            "owner": meta.owner, "request_id": meta.request_id, "chat": json.dumps(meta.chat),
            "input": json.dumps(meta.input_items), "conversation": json.dumps(meta.conversation),
            "head": json.dumps(meta.head)})
        pipe.expire(keys.response_meta(rid), self.ttl_s)
        pipe.set(keys.response(rid), json.dumps(meta.head), ex=self.ttl_s)
        pipe.set(keys.response_lease(rid), lease_token, px=LEASE_MS)
        await pipe.execute()

    async def load(self, response_id: str, owner: str) -> StoredResponse:
        """The response's meta; NotFoundError when it is gone or belongs to another key (one answer
        for both: no caller learns which ids exist)."""
        fields = await self._redis.hgetall(self._keys.response_meta(response_id))
        fields = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                  for k, v in fields.items()}
        if not fields or fields.get("owner") != owner or "head" not in fields:
            raise _not_found(response_id)
        return StoredResponse(response_id, owner, fields["request_id"], json.loads(fields["chat"]),
                              json.loads(fields["input"]), json.loads(fields["conversation"]),
                              json.loads(fields["head"]), fields.get("cancelled") == "1")

    async def object(self, response_id: str) -> dict:
        """The stored object: as created until it finished, then as finished."""
        raw = await self._redis.get(self._keys.response(response_id))
        if raw is None:
            raise _not_found(response_id)
        return json.loads(raw)

    async def events(self, response_id: str) -> list[dict]:
        """The response's log, in order."""
        entries = await self._redis.xrange(self._keys.response_events(response_id))
        return [json.loads(fields[DATA_FIELD.encode()]) for _id, fields in entries]

    async def next_seq(self, response_id: str) -> int:
        """The sequence number the log's next event will have."""
        last = await self._redis.xrevrange(self._keys.response_events(response_id), count=1)
        if not last:
            return 0
        entry_id = last[0][0]
        return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).rpartition("-")[2])

    async def append(self, response_id: str, lease_token: str, events: list[dict], final: dict | None) -> int:
        """Append ``events`` (their first numbered the log's next) and, with ``final``, the finished
        object (the lease then ends). Returns 1, or -1 (the lease is not ours) or -2 (the log moved)."""
        keys = self._keys
        return int(await self._append(
            keys=[keys.response_events(response_id), keys.response_lease(response_id), keys.response(response_id),
                  keys.response_meta(response_id)],
            args=[lease_token, events[0]["sequence_number"], self.ttl_s, json.dumps(final) if final else "",
                  *(json.dumps(e, separators=(",", ":")) for e in events)]))

    async def claim(self, response_id: str, lease_token: str) -> bool:
        """Take the production of a response whose producer is gone (no lease)."""
        return bool(await self._redis.set(self._keys.response_lease(response_id), lease_token, nx=True, px=LEASE_MS))

    async def renew(self, response_id: str, lease_token: str) -> bool:
        return bool(await self._renew(keys=[self._keys.response_lease(response_id)], args=[lease_token, LEASE_MS]))

    async def release(self, response_id: str, lease_token: str) -> None:
        await self._release(keys=[self._keys.response_lease(response_id)], args=[lease_token])

    async def request_cancel(self, response_id: str) -> None:
        await self._cancel(keys=[self._keys.response_meta(response_id)])

    async def cancel_requested(self, response_id: str) -> bool:
        return await self._redis.hget(self._keys.response_meta(response_id), "cancelled") in (b"1", "1")

    async def exists(self, response_id: str) -> bool:
        return bool(await self._redis.exists(self._keys.response_meta(response_id)))

    async def delete(self, response_id: str) -> None:
        keys = self._keys
        await self._redis.delete(keys.response(response_id), keys.response_meta(response_id),
                                 keys.response_events(response_id), keys.response_lease(response_id))
