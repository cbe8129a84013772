"""One blocking XREAD loop per gateway for the outputs of all its requests, fanned out to
per-request asyncio queues (docs/architecture.md, decision 10: no per-request connections).

Two ways in, one per reader. The call that admitted a request here is its *live* reader: with
each step's records the schedulers append one entry to the gateway's live stream
(``{prefix}gw:{gateway_id}:live``, named in the request entry's ``LIVE_FIELD``), naming each
record's output stream, so the loop reads one stream a step for all of them whatever their
number. Every other reader — a resume of a request admitted elsewhere (its gateway died), a second
reader of a request, a resume here — reads its request's own output stream from its start: the
XREAD includes the key from the reader's last entry. The live stream cannot serve those: the
schedulers append a request's records only to its admitting gateway's live stream, and only from
the reader's admission on, while a resume needs the records delivered before it joined. The
gateway trims its live stream as it reads it.

A blocking XREAD only sees the keys it was called with, so adding a request wakes the loop by
appending to the gateway's own small wake stream (``{prefix}gw:{gateway_id}:wake``), which every
XREAD includes from the last wake entry it saw: a wake written before the XREAD reaches Redis is
returned at once, so a key added while a call is being sent is never left unread.

Redis away (a restart): the loop retries, and each subscription continues from the last entry it
received once Redis answers again, so a short outage is only a pause for clients. A subscription
that has waited through ``outage_s`` seconds of failed reads fails with UNAVAILABLE (the SDK then
resumes the stream by request id), so no client waits on a dead Redis forever.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from servicekit.contract.errors import ResourceExhaustedError, UnavailableError
from servicekit.redis_layout import DATA_FIELD, LIVE_SEPARATOR, WAKE_FIELD, RedisKeys
from servicekit.serving import cancel_and_wait, cancel_requested

log = logging.getLogger(__name__)

WAKE_MAXLEN = 16
WAKE_TTL_S = 300
LIVE_TRIM_EVERY = 32  # reads of the live stream between two trims of what was read
_DATA, _LIVE_SEPARATOR = DATA_FIELD.encode(), LIVE_SEPARATOR.encode()

# KEYS: streams. ARGV: count, then one entry id per stream. A non-blocking XREAD of every stream
# after its id, as one flat array: key, entry id, the entry's DATA_FIELD ("" if none), ...
# Redis up to 6.2 writes an XREAD reply with one write() per stream (its reply-list nodes), which
# the reader takes in as many socket reads: 64 streams cost the gateway ~400 µs of CPU and Redis
# 62 system calls. A script's flat array goes out in one write (~70 µs to read).
_READ_LUA = f"""
local args = {{'XREAD', 'COUNT', ARGV[1], 'STREAMS'}}
for i = 1, #KEYS do args[#args + 1] = KEYS[i] end
for i = 2, #ARGV do args[#args + 1] = ARGV[i] end
local reply = redis.call(unpack(args))
local out = {{}}
for _, stream in ipairs(reply or {{}}) do
  for _, entry in ipairs(stream[2]) do
    local data, fields = '', entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == '{DATA_FIELD}' then data = fields[i + 1] end
    end
    out[#out + 1] = stream[1]
    out[#out + 1] = entry[1]
    out[#out + 1] = data
  end
end
return out
"""


def _entry_id(entry_id: str | bytes) -> tuple[int, int]:
    """A stream entry id (``"ms-seq"``) as a comparable pair."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


class SlowReaderError(ResourceExhaustedError):
    """A reader fell more than its subscription's ``max_pending`` records behind its stream."""


class Subscription:
    """One reader of one request's output stream, as delivered so far. ``last_id`` is the newest
    entry handed to ``queue`` (a live reader's records come in live-stream order, so it needs
    none). Several calls may read the same stream (a resume next to its
    owner): each has its own subscription and sees every entry once, in order.

    Bounded: at most ``max_pending`` records wait in ``queue`` (0: no bound). A reader that falls
    further behind (its client stopped reading, so its call stopped taking records) gets nothing
    more: ``overflowed`` is set, :class:`SlowReaderError` is queued and ``on_overflow`` called, so
    the call can be ended at once rather than when its client reads again."""

    __slots__ = ("key", "last_id", "listener", "live", "max_pending", "on_overflow", "overflowed", "pending",
                 "queue")

    def __init__(self, key: str, start_id: str = "0-0", *, max_pending: int = 0, on_overflow=None,
                 live: bool = False) -> None:
        self.key = key
        self.live = live  # its records come through the gateway's live stream, ``key`` is not read
        self.last_id = start_id  # not live: the newest entry of ``key`` delivered
        self.queue: asyncio.Queue[list[bytes] | BaseException] = asyncio.Queue()
        self.max_pending = max_pending
        self.pending = 0
        self.overflowed = False
        self.on_overflow = on_overflow
        self.listener = None  # see listen()

    def listen(self, listener) -> None:
        """Hand every delivery (a list of records, or the error that ends the stream) to
        ``listener(item)`` as it happens, in the fanout's task, instead of queueing it for
        :meth:`get`: no task wakes per delivery. What was queued already is handed over first."""
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not isinstance(item, BaseException):
                self.pending -= len(item)
            listener(item)
        self.listener = listener

    def deliver(self, records: list[bytes]) -> None:
        if self.listener is not None:
            self.listener(records)
            return
        if self.overflowed:
            return
        if self.max_pending and self.pending + len(records) > self.max_pending:
            self.overflowed = True
            self.queue.put_nowait(SlowReaderError(
                f"the client fell {self.pending + len(records)} output records behind (limit {self.max_pending}, "
                "--max-buffered-outputs); the request was aborted"))
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self.pending += len(records)
        self.queue.put_nowait(records)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (after what was delivered before it)."""
        if self.listener is not None:
            self.listener(error)
        else:
            self.queue.put_nowait(error)

    async def get(self) -> list[bytes]:
        """Every record delivered since the last call, waiting for at least one."""
        records = await self._take()
        while not self.queue.empty():
            records.extend(await self._take())
        return records

    async def _take(self) -> list[bytes]:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.pending -= len(item)
        return item


class OutputFanout:
    def __init__(self, redis, keys: RedisKeys, gateway_id: str, *, block_ms: int = 1000,
                 count: int = 256, outage_s: float = 10.0) -> None:
        self._redis = redis
        self._block_ms = block_ms
        self._outage_s = outage_s  # failed reads for this long fail the subscriptions waiting
        self._count = count  # entries per stream per XREAD
        self.wake_key = keys.gateway_wake(gateway_id)
        self.live_key = keys.gateway_live(gateway_id)
        self._subs: dict[bytes, list[Subscription]] = {}  # stream key -> its readers
        self._task: asyncio.Task | None = None
        self._read = redis.register_script(_READ_LUA)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="output-fanout")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        try:
            await self._redis.delete(self.wake_key, self.live_key)
        except RedisError as exc:  # Redis away as the gateway stops: both streams expire on their own
            log.warning("could not delete %s and %s (%s); they expire on their own", self.wake_key, self.live_key, exc)

    def subscribe(self, key: str, *, max_pending: int = 0, on_overflow=None, live: bool = False) -> Subscription:
        """Start delivering ``key``'s entries (from its beginning), at most ``max_pending`` waiting
        (see :class:`Subscription`). ``live``: the caller is admitting the request now with
        ``live_key`` as its live stream, so its records come that way only. The caller then writes
        to the wake stream (the admission and join scripts of ``gateway_service.admission`` do) so a blocked
        XREAD restarts."""
        sub = Subscription(key, max_pending=max_pending, on_overflow=on_overflow, live=live)
        self._subs.setdefault(key.encode(), []).append(sub)
        return sub

    async def wake(self) -> None:
        """Restart a blocked XREAD so that it reads a key just subscribed (what the admission and
        join scripts do for an output stream; a reader of another stream, such as a stored
        response's event log, calls this after :meth:`subscribe`)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {WAKE_FIELD: "1"}, maxlen=WAKE_MAXLEN, approximate=True)
        pipe.expire(self.wake_key, WAKE_TTL_S)
        await pipe.execute()

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to ``sub`` only; other readers of the same stream go on."""
        key = sub.key.encode()
        readers = self._subs.get(key, [])
        if sub in readers:
            readers.remove(sub)
        if not readers:
            self._subs.pop(key, None)

    def _all_subs(self) -> list[Subscription]:
        return [sub for readers in self._subs.values() for sub in readers]

    async def _run(self) -> None:
        wake, live = self.wake_key.encode(), self.live_key.encode()
        wake_last: str | bytes = "0-0"
        live_last: str | bytes = "0-0"
        live_reads = 0
        loop = asyncio.get_running_loop()
        down_since: float | None = None
        while not cancel_requested():
            streams: dict[bytes, str | bytes] = {wake: wake_last, live: live_last}
            for key, readers in self._subs.items():
                # Each key read by its readers that are not live, from the one furthest behind;
                # the others skip what they already have.
                positions = [sub.last_id for sub in readers if not sub.live]
                if positions:
                    streams[key] = positions[0] if len(positions) == 1 else min(positions, key=_entry_id)
            try:
                reply = await self._redis.xread(streams, count=self._count, block=self._block_ms)
                live_entries = []
                read = []
                for key, entries in reply or ():
                    if key == live:
                        live_entries = entries
                    else:
                        read.append((key, [(entry_id, fields.get(_DATA, b"")) for entry_id, fields in entries]))
                if len(reply or ()) == 1 and len(streams) > 2:
                    read += await self._rest_of_the_step(streams, reply[0])
            except RedisError as exc:
                now = loop.time()
                if down_since is None:
                    down_since = now
                    log.warning("reading output streams failed: %s; retrying", exc)
                if now - down_since >= self._outage_s:
                    self.fail_all(UnavailableError(
                        f"Redis unreachable for {now - down_since:.0f}s ({type(exc).__name__}); resume later"))
                    down_since = now
                await asyncio.sleep(0.2)
                continue
            if down_since is not None:
                log.info("reading output streams again after %.1fs", loop.time() - down_since)
                down_since = None
                await self._fail_vanished()
            if live_entries:
                live_last = live_entries[-1][0]
                self._deliver_live(live_entries)
                live_reads += 1
                if live_reads % LIVE_TRIM_EVERY == 0:
                    await self._trim_live(live_last)
            for key, entries in read:
                if key == wake:
                    wake_last = entries[-1][0]
                    continue
                asked = streams[key]  # the reply holds the entries after this one
                for sub in self._subs.get(key, ()):  # none: a request that ended meanwhile
                    if sub.live:
                        continue  # the live stream brings these
                    if sub.last_id == asked:  # the reader the read was made for: all of them are new
                        new = entries
                    else:
                        after = _entry_id(sub.last_id)
                        if after < _entry_id(asked):
                            # Subscribed while the read was out (its position came from a reader
                            # now gone): these entries are not the next ones it needs. The next
                            # read starts from it.
                            continue
                        new = [(entry_id, data) for entry_id, data in entries if _entry_id(entry_id) > after]
                    if new:
                        sub.last_id = new[-1][0]
                        sub.deliver([data for _id, data in new])

    def _deliver_live(self, entries: list) -> None:
        """Hand the records of live-stream entries (fields ``"{output stream} {entry id}"`` -> the
        record, in the order they were published) to the live readers of their streams. Each
        entry is new (the live stream is read from the last one), so each record goes once."""
        subs = self._subs
        for _entry, fields in entries:
            for name, data in fields.items():
                key = name.rpartition(_LIVE_SEPARATOR)[0]
                for sub in subs.get(key, ()):  # none: a request that ended, or is read by a resume here
                    if sub.live:
                        sub.deliver([data])

    async def _trim_live(self, read_up_to: str | bytes) -> None:
        """Drop the live stream's entries before ``read_up_to`` (read already; nobody else reads it)."""
        try:
            await self._redis.xtrim(self.live_key, minid=read_up_to)
        except RedisError as exc:  # the next trim takes them too
            log.debug("trimming %s failed: %s", self.live_key, exc)

    async def _rest_of_the_step(self, streams: dict, first: tuple) -> list:
        """What the output streams other than ``first``'s hold now. Redis up to 7.0 answers a blocked
        multi-key XREAD with the one stream whose entry woke it, though the scheduler's script
        appended one to every stream of the step at once: read the others at once (no wait, in one
        script: see ``_READ_LUA``), before delivering any, so a step's records reach the calls
        together (one GenerateMany response per step, not two). The live stream is left to the
        next read (its entry, if the step made one, is returned at once)."""
        key, entries = first
        live = self.live_key.encode()
        rest = {k: v for k, v in streams.items() if k != live}
        if key != live:
            rest[key] = entries[-1][0]  # after what came
        if len(rest) <= 1:  # the wake stream alone
            return []
        flat = await self._read(keys=list(rest), args=[self._count, *rest.values()])
        grouped: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for i in range(0, len(flat), 3):
            grouped.setdefault(flat[i], []).append((flat[i + 1], flat[i + 2]))
        return list(grouped.items())

    async def _fail_vanished(self) -> None:
        """After an outage: a request whose output stream is gone (Redis came back without its last
        writes, or without its data) fails with UNAVAILABLE instead of waiting forever."""
        subs = self._all_subs()
        if not subs:
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            for sub in subs:
                pipe.exists(sub.key)
            exists = await pipe.execute()
        except RedisError:
            return  # down again: checked after the next recovery
        for sub, found in zip(subs, exists):
            if not found:
                log.warning("%s vanished in the Redis restart", sub.key)
                sub.fail(UnavailableError("the request was lost in a Redis restart; retry it"))

    def fail_all(self, error: BaseException) -> None:
        """Fail every current subscription (their streams end with ``error``): Redis away too long,
        or a drain whose grace passed."""
        for sub in self._all_subs():
            sub.fail(error)
