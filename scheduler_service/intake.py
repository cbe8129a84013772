"""The scheduler's side of the Redis request stream (the gateway's is ``gateway_service.admission``):
the requests it takes in, the output streams it writes, the abort stream it follows, and the
pending entries it keeps, reclaims or gives up. Transport only: records arrive and leave as bytes
(``servicekit.proto.queue`` encodes them).

Backpressure stays in Redis (docs/operations.md, "Scaling"): :meth:`RequestIntake.pull` is only called for as many
requests as the scheduler has room for; the rest wait in the stream, where gateways see the
backlog and refuse new work with RESOURCE_EXHAUSTED past their limit.

Ownership of a request = its entry in the consumer group's pending list (PEL). A live scheduler
resets the idle time of every entry it holds (:meth:`refresh_pending`) well within the reclaim
idle time, so only a dead (or Redis-partitioned) scheduler's entries go idle long enough for
another scheduler to take them over (:meth:`claim_idle`, XAUTOCLAIM). Each takeover counts as a
delivery; past the retry limit the request is dead-lettered (:meth:`dead_letter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import ResponseError

from servicekit.redis_layout import (
    CONSUMER_FIELD,
    DATA_FIELD,
    DELIVERIES_FIELD,
    LIVE_FIELD,
    LIVE_SEPARATOR,
    REASON_FIELD,
    REQUEST_ID_FIELD,
    SCHEDULER_GROUP,
    RedisKeys,
    ensure_request_group,
)

DEAD_LETTERS_MAXLEN = 10_000

# KEYS[1]: requests stream. ARGV: group, consumer, entry ids...
# Resets the idle time of the given entries that are still pending for this consumer (XCLAIM
# JUSTID does not count a delivery) and returns the ids that are not: finished, or taken over by
# another scheduler. One script, so an entry cannot be taken between the check and the claim.
_REFRESH_LUA = """
local lost = {}
local claim = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then claim[#claim + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
if #claim > 5 then
  claim[#claim + 1] = 'JUSTID'
  redis.call(unpack(claim))
end
return lost
"""

# KEYS[1]: requests stream. ARGV: group, consumer, idle ms, entry ids...
# Hands entries back to the group: each one still pending for this consumer is marked idle for
# ``idle ms`` (so any scheduler's next claim pass takes it) with its delivery count lowered by one,
# so the takeover that follows does not count as a retry: a graceful hand-back is not a failure.
# Entries no longer ours (finished, or taken over) are left alone. Returns the ids released.
_RELEASE_LUA = """
local released = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    local count = math.max(tonumber(p[1][4]) - 1, 0)
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'RETRYCOUNT', count, 'JUSTID')
    released[#released + 1] = ARGV[i]
  end
end
return released
"""

# KEYS[1]: requests stream. ARGV: group, consumer, min idle ms, start id, count.
# XAUTOCLAIM plus each claimed entry's delivery count (XAUTOCLAIM itself does not return it).
# Returns {next start id, entries, delivery counts}; an entry deleted while pending is nil
# (Redis 6.2) or absent (7.0+).
_CLAIM_LUA = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local entries, counts = {}, {}
for _, e in ipairs(r[2]) do
  if e then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    entries[#entries + 1] = e
    counts[#counts + 1] = p[1] and p[1][4] or 1
  end
end
return {r[1], entries, counts}
"""

ENTRY_BATCH = 500  # entry ids per script call (Lua's unpack has a stack limit)
LIVE_FIELDS_MAX = 1000  # fields of one live-stream entry at most (the same limit)

# KEYS[1]: requests stream, KEYS[2 .. 1 + m]: m gateways' live streams, then one output stream per
# record. ARGV: group, TTL seconds, n, then n finished entry ids, then m, then m counts (the records
# of each live stream, in order: the first count records go to the first live stream, and so on;
# the records after them to none), then one record per output stream.
# A step's outputs in one command: each record appended to its stream and the stream's TTL renewed,
# each live stream given one entry with its records ("{output stream} {entry id}" -> record, with
# LIVE_SEPARATOR between), then
# the finished requests' entries acknowledged and deleted. A script runs whole or not at all (as
# MULTI/EXEC did), and packing one command costs a fraction of a pipeline of 2 per record.
_PUBLISH_LUA = f"""
local n = tonumber(ARGV[3])
local m = tonumber(ARGV[4 + n])
local first_record = 5 + n + m
local k = 2 + m
for g = 1, m + 1 do
  local count = #KEYS - k + 1
  if g <= m then count = tonumber(ARGV[4 + n + g]) end
  local fields = {{}}
  for _ = 1, count do
    local data = ARGV[first_record + k - 2 - m]
    local id = redis.call('XADD', KEYS[k], '*', '{DATA_FIELD}', data)
    redis.call('EXPIRE', KEYS[k], ARGV[2])
    if g <= m then
      fields[#fields + 1] = KEYS[k] .. '{LIVE_SEPARATOR}' .. id
      fields[#fields + 1] = data
      if #fields >= {LIVE_FIELDS_MAX} then
        redis.call('XADD', KEYS[1 + g], '*', unpack(fields))
        fields = {{}}
      end
    end
    k = k + 1
  end
  if #fields > 0 then
    redis.call('XADD', KEYS[1 + g], '*', unpack(fields))
  end
  if g <= m then redis.call('EXPIRE', KEYS[1 + g], ARGV[2]) end
end
for first = 4, 3 + n, {ENTRY_BATCH} do
  local last = math.min(first + {ENTRY_BATCH - 1}, 3 + n)
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
  redis.call('XDEL', KEYS[1], unpack(ARGV, first, last))
end
return #KEYS - 1 - m
"""


@dataclass(frozen=True, slots=True)
class RequestEntry:
    entry_id: str  # the request stream entry, XACKed + deleted when the request finishes
    request_id: str
    data: bytes  # an EngineRequest
    live: str = ""  # the admitting gateway's live stream ("" for none): its records go there too


@dataclass(frozen=True, slots=True)
class RoutedOutputs:
    """A step's records in the publish script's order: first ``counts[i]`` records for each
    gateway live stream ``live_keys[i]``, then those of requests without one."""

    outputs: list[tuple[str, bytes]]  # (request id, EngineOutput)
    live_keys: list[str]
    counts: list[int]


@dataclass(frozen=True, slots=True)
class ClaimedEntry:
    """An entry taken over from an idle (dead) scheduler."""

    entry: RequestEntry
    deliveries: int  # times the entry was handed to a scheduler, this takeover included


_REQUEST_ID, _DATA, _LIVE = REQUEST_ID_FIELD.encode(), DATA_FIELD.encode(), LIVE_FIELD.encode()


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry(entry_id, fields) -> RequestEntry:
    if isinstance(fields, list):  # a script's reply: flat [field, value, ...]
        fields = dict(zip(fields[::2], fields[1::2]))
    return RequestEntry(_str(entry_id), _str(fields.get(_REQUEST_ID, b"")), fields.get(_DATA, b""),
                        _str(fields.get(_LIVE, b"")))


class RequestIntake:
    def __init__(self, redis, keys: RedisKeys, consumer: str, *, output_ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self.consumer = consumer  # this scheduler's name in the consumer group
        self._output_ttl_s = output_ttl_s
        self._publish = redis.register_script(_PUBLISH_LUA)
        self._refresh = redis.register_script(_REFRESH_LUA)
        self._claim = redis.register_script(_CLAIM_LUA)
        self._release = redis.register_script(_RELEASE_LUA)
        self._claim_cursor = "0-0"
        # Request id -> the live stream of the gateway that admitted it, for the requests this
        # scheduler holds (see ``keep_live``).
        self.live: dict[str, str] = {}

    async def pull(self, count: int, block_ms: int) -> list[RequestEntry]:
        """Up to ``count`` requests never delivered to any scheduler, waiting at most ``block_ms``.
        Recreates the consumer group if Redis lost it (a restart without persistence)."""
        try:
            reply = await self._redis.xreadgroup(
                SCHEDULER_GROUP, self.consumer, {self._keys.requests: ">"}, count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await ensure_request_group(self._redis, self._keys)
            return []
        entries = []
        for _stream, items in reply or ():
            for entry_id, fields in items:
                if not fields:  # deleted while pending
                    continue
                entries.append(_entry(entry_id, fields))
        return entries

    def keep_live(self, entry: RequestEntry) -> None:
        """Remember where ``entry``'s records go besides its output stream (its gateway's live stream)."""
        if entry.live:
            self.live[entry.request_id] = entry.live

    def forget_live(self, held: set[str]) -> None:
        """Forget the live streams of requests no longer held (``held``: the request ids still are)."""
        self.live = {rid: key for rid, key in self.live.items() if rid in held}

    def route(self, outputs: list[tuple[str, bytes]]) -> RoutedOutputs:
        """Where each (request id, EngineOutput) goes besides its output stream: its gateway's live
        stream, if it has one. Decided when a step's records are made, not when they are sent: a
        request that finished in the step is no longer held, so ``forget_live`` may drop it before
        a retried publish goes out, and its live reader reads nothing but the live stream."""
        live = self.live
        if not live:
            return RoutedOutputs(outputs, [], [])
        groups: dict[str, list[tuple[str, bytes]]] = {}
        for record in outputs:
            groups.setdefault(live.get(record[0], ""), []).append(record)
        plain = groups.pop("", [])
        return RoutedOutputs([record for records in groups.values() for record in records] + plain,
                             list(groups), [len(records) for records in groups.values()])

    async def publish(self, outputs: list[tuple[str, bytes]], finished_entry_ids: list[str]) -> None:
        """:meth:`publish_routed` of ``route(outputs)``."""
        await self.publish_routed(self.route(outputs), finished_entry_ids)

    async def publish_routed(self, routed: RoutedOutputs, finished_entry_ids: list[str]) -> None:
        """In one script: append each (request id, EngineOutput) to its output stream and renew
        the stream's TTL, and the records of each gateway's requests to its live stream as one
        entry; XACK and delete the request entries of finished requests. Atomic, so a scheduler
        that dies mid-publish leaves either all of a step's records or none."""
        outputs = routed.outputs
        if not outputs and not finished_entry_ids:
            return
        keys = self._keys
        await self._publish(
            keys=[keys.requests, *routed.live_keys, *(keys.output(request_id) for request_id, _data in outputs)],
            args=[SCHEDULER_GROUP, self._output_ttl_s, len(finished_entry_ids), *finished_entry_ids,
                  len(routed.live_keys), *routed.counts, *(data for _request_id, data in outputs)])

    # -- ownership of pending entries ---------------------------------------------------------------

    async def refresh_pending(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of the entries this scheduler still owns; return the ones it does
        not own any more (finished meanwhile, or taken over by another scheduler)."""
        return await self._per_batch(self._refresh, entry_ids)

    async def claim_idle(self, min_idle_ms: int, count: int) -> list[ClaimedEntry]:
        """Take over up to ``count`` entries idle for ``min_idle_ms`` or longer (their scheduler
        stopped refreshing them: it died). Walks the pending list with a cursor across calls."""
        next_id, entries, counts = await self._claim(
            keys=[self._keys.requests],
            args=[SCHEDULER_GROUP, self.consumer, min_idle_ms, self._claim_cursor, count])
        self._claim_cursor = _str(next_id)
        return [ClaimedEntry(_entry(e[0], e[1]), int(n)) for e, n in zip(entries, counts)]

    async def release(self, entry_ids: list[str], idle_ms: int) -> list[str]:
        """Hand entries back to the group: mark those still ours idle for ``idle_ms`` so any
        scheduler with room takes them over at its next claim pass (a draining scheduler's
        unfinished requests; those of a scheduler left without a worker). The takeover does not
        count as a delivery. Returns the ids released (the others were not ours any more)."""
        return await self._per_batch(self._release, entry_ids, idle_ms)

    async def _per_batch(self, script, entry_ids: list[str], *args) -> list[str]:
        """Run an entry script (ARGV: group, consumer, ``args``, entry ids...) over ``entry_ids`` in
        batches; the ids it returns, concatenated."""
        out: list[str] = []
        for i in range(0, len(entry_ids), ENTRY_BATCH):
            batch = entry_ids[i:i + ENTRY_BATCH]
            reply = await script(keys=[self._keys.requests], args=[SCHEDULER_GROUP, self.consumer, *args, *batch])
            out.extend(_str(x) for x in reply)
        return out

    async def read_outputs(self, request_ids: list[str]) -> list[list[bytes] | None]:
        """Each request's output records so far (EngineOutput bytes, in order), or None when its
        output stream is gone (expired: nobody waits for it any more)."""
        if not request_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.xrange(self._keys.output(rid))
        replies = await pipe.execute()
        return [[fields.get(_DATA, b"") for _id, fields in items] if items else None for items in replies]

    async def finish_entries(self, outputs: list[tuple[str, bytes]], entries: list[ClaimedEntry | RequestEntry],
                             *, reason: str = "") -> None:
        """Publish final records (as :meth:`publish` does: to the live streams of their gateways
        too) and ACK + delete the entries; with ``reason``, first copy each entry to the dead-letter
        stream (a request given up after too many attempts). A scheduler that dies between the two
        leaves the entry pending: the next takeover gives it up again (a second dead-letter copy)."""
        plain = [item.entry if isinstance(item, ClaimedEntry) else item for item in entries]
        if reason:
            pipe = self._redis.pipeline(transaction=True)
            for item, entry in zip(entries, plain):
                pipe.xadd(self._keys.dead_letters, {
                    REQUEST_ID_FIELD: entry.request_id, DATA_FIELD: entry.data, REASON_FIELD: reason,
                    DELIVERIES_FIELD: str(getattr(item, "deliveries", 1)), CONSUMER_FIELD: self.consumer},
                    maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
            await pipe.execute()
        for entry in plain:
            self.keep_live(entry)
        await self.publish(outputs, [entry.entry_id for entry in plain])

    # -- aborts ---------------------------------------------------------------------------------------

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
                rid = fields.get(_REQUEST_ID)
                if rid:
                    ids.append(_str(rid))
        return ids, after_id
