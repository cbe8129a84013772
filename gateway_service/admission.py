"""The gateway's side of the Redis request stream (the scheduler's is ``scheduler_service.intake``):
admitting a request (queue-limit check, request entry, the output stream's first entry, and the
fan-out wake-up, in one round trip), joining and leaving a request's readers (resumes are checked
against what was admitted), and abort notices.

The output stream's first entry (the admission marker, empty ``data``) also keeps the digests of
the admitted prompt tokens and sampling parameters and of the API key that admitted it (its
owner), so they live exactly as long as the outputs a resume could read: only the owner's key may
resume (read) the request, and so only its own readers can abort it by leaving.
``{prefix}readers:{request_id}`` counts the calls reading the request, on any gateway: the last one
to leave before the request finished aborts it, so a resumer that gives up never cuts off the
owner (or another resumer) still reading.

Durable admissions (``replica_wait_ms`` > 0): when the primary has replicas, ``admit`` returns
only once one of them acknowledged the admission (``WAIT 1``, on the connection that wrote it), so
a failover to that replica cannot lose a request its client was told was admitted. A replica
that does not answer within ``replica_wait_ms`` does not fail the admission (a lagging replica is
not worth refusing work over, and a dead one is not promoted): it is counted in
``num_unreplicated`` and logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from dataclasses import dataclass

from gateway_service.output_fanout import WAKE_MAXLEN, WAKE_TTL_S
from servicekit.contract.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.proto.sampling import sampling_params_to_bytes
from servicekit.redis_layout import (
    DATA_FIELD,
    LIVE_FIELD,
    OWNER_FIELD,
    PARAMS_DIGEST_FIELD,
    PROMPT_DIGEST_FIELD,
    REQUEST_ID_FIELD,
    SCHEDULER_GROUP,
    WAKE_FIELD,
    RedisKeys,
)

log = logging.getLogger(__name__)

ABORTS_MAXLEN = 10_000
# How often the number of the primary's replicas is read again (INFO replication): WAIT is only
# worth sending when there is a replica to answer it, else it would hold every admission for its
# whole timeout.
REPLICAS_RECHECK_S = 1.0

# KEYS: requests stream, the request's output stream, the gateway's wake stream, readers counter
# ARGV: group, max queued (0 = no limit), request id, EngineRequest bytes, output TTL seconds,
#       wake stream max length, wake stream TTL seconds, prompt digest, params digest, owner (the
#       digest of the API key that admitted it; "" without keys), the gateway's live stream (the
#       request entry's LIVE_FIELD: where schedulers also append its records)
# Returns 0 when admitted, -1 when the queue is full, -2 when the request id is in use.
# Queue depth = entries not yet delivered to any scheduler: finished requests are deleted from the
# stream, so XLEN minus the group's pending count is what waits.
_ADMIT_LUA = f"""
if redis.call('EXISTS', KEYS[2]) == 1 then return -2 end
local limit = tonumber(ARGV[2])
if limit > 0 then
  local waiting = redis.call('XLEN', KEYS[1]) - redis.call('XPENDING', KEYS[1], ARGV[1])[1]
  if waiting >= limit then return -1 end
end
redis.call('XADD', KEYS[2], '*', '{DATA_FIELD}', '', '{PROMPT_DIGEST_FIELD}', ARGV[8], '{PARAMS_DIGEST_FIELD}', ARGV[9],
           '{OWNER_FIELD}', ARGV[10])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('SET', KEYS[4], 1, 'EX', ARGV[5])
redis.call('XADD', KEYS[1], '*', '{REQUEST_ID_FIELD}', ARGV[3], '{DATA_FIELD}', ARGV[4], '{LIVE_FIELD}', ARGV[11])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', '{WAKE_FIELD}', '1')
redis.call('EXPIRE', KEYS[3], ARGV[7])
return 0
"""

# KEYS: the request's output stream, readers counter, the gateway's wake stream
# ARGV: prompt digest, params digest, readers TTL seconds, wake stream max length, wake stream TTL,
#       owner (the caller's API key digest)
# Returns -1 when the output stream is gone or was admitted by another key (one answer for both:
# no caller learns which ids exist); else the names of the digests that differ from the admitted
# ones (empty: joined as one more reader). A marker whose owner is "" belongs to callers without a key.
_JOIN_LUA = f"""
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if #first == 0 then return -1 end
local fields, marker = first[1][2], {{}}
for i = 1, #fields, 2 do marker[fields[i]] = fields[i + 1] end
if marker['{OWNER_FIELD}'] ~= ARGV[6] then return -1 end
local differ = {{}}
if marker['{PROMPT_DIGEST_FIELD}'] ~= ARGV[1] then table.insert(differ, 'prompt') end
if marker['{PARAMS_DIGEST_FIELD}'] ~= ARGV[2] then table.insert(differ, 'sampling_params') end
if #differ > 0 then return differ end
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', '{WAKE_FIELD}', '1')
redis.call('EXPIRE', KEYS[3], ARGV[5])
return {{}}
"""

# KEYS: readers counter, aborts stream
# ARGV: request id, aborts max length, "1" when the leaving reader did not see the request finish
# Returns the readers left. The last reader out of an unfinished request publishes its abort; a
# counter already gone (expired) counts as no other reader.
_LEAVE_LUA = f"""
local left = redis.call('DECR', KEYS[1])
if left > 0 then return left end
redis.call('DEL', KEYS[1])
if ARGV[3] == '1' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', '{REQUEST_ID_FIELD}', ARGV[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class RequestDigests:
    """What a resume must repeat: digests of the prompt's token ids and of the sampling
    parameters as the client gave them (before the gateway seeds them)."""

    prompt: str
    params: str


def request_digests(prompt_token_ids: list[int], params: SamplingParams) -> RequestDigests:
    """Digests of what a resume must repeat; the params' deterministic wire form is hashed, so
    equal parameters give equal digests on any gateway."""
    prompt = hashlib.sha256(array("I", prompt_token_ids).tobytes()).hexdigest()[:32]
    return RequestDigests(prompt=prompt, params=hashlib.sha256(sampling_params_to_bytes(params)).hexdigest()[:32])


class Admission:
    def __init__(self, redis, keys: RedisKeys, *, max_queued: int, output_ttl_s: int,
                 replica_wait_ms: int = 0) -> None:
        self._redis = redis
        self._keys = keys
        self._max_queued = max_queued
        self._output_ttl_s = output_ttl_s
        self._replica_wait_ms = replica_wait_ms  # 0: admissions do not wait for a replica
        self._num_replicas = 0
        self._replicas_read_at = float("-inf")
        self.num_replicated = 0  # admissions a replica acknowledged before admit returned
        self.num_unreplicated = 0  # admissions acknowledged with replicas present but none answering in time
        self._queued: list[tuple[dict, asyncio.Future]] = []  # admissions not yet sent
        self._sender: asyncio.Task | None = None  # the task sending them (_send_admissions)
        self._admit = redis.register_script(_ADMIT_LUA)
        self._join = redis.register_script(_JOIN_LUA)
        self._leave = redis.register_script(_LEAVE_LUA)

    async def admit(self, request_id: str, record: bytes, digests: RequestDigests, wake_key: str,
                    owner: str, live_key: str) -> None:
        """Enqueue one EngineRequest owned by the API key digest ``owner``, its caller being its
        first reader; ``live_key``: the gateway's live stream, where schedulers also append the
        request's records (``RedisKeys.gateway_live``). Raises
        ResourceExhaustedError past the queue limit and AlreadyExistsError when the request id has
        an output stream already (nothing is written then). With replicas present and waiting on,
        returns once a replica holds the admission (or ``replica_wait_ms`` passed).

        Admissions made while another batch is on its way to Redis go together in the next one
        (:meth:`_send_admissions`): a burst of requests costs a few round trips on one connection,
        not a connection each (opening 60 of them under a busy CPU took 200 ms)."""
        keys = self._keys
        admission = {
            "keys": [keys.requests, keys.output(request_id), wake_key, keys.readers(request_id)],
            "args": [SCHEDULER_GROUP, self._max_queued, request_id, record, self._output_ttl_s, WAKE_MAXLEN, WAKE_TTL_S,
                     digests.prompt, digests.params, owner, live_key]}
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._queued.append((admission, answer))
        if self._sender is None:
            self._sender = loop.create_task(self._send_admissions())
        result, acknowledged = await answer
        if acknowledged is not None and result == 0:
            self._count_replicas(request_id, acknowledged)
        if result == -1:
            raise ResourceExhaustedError(f"the request queue is full ({self._max_queued} waiting); retry later")
        if result == -2:
            raise AlreadyExistsError(f"request_id {request_id!r} is already in use")

    async def _send_admissions(self) -> None:
        """Send what is queued, one pipeline a batch (plus ``WAIT 1`` on the same connection when
        admissions wait for a replica), until nothing is; each admission gets its own answer or
        error (a connection lost fails the whole batch, as it would each command alone)."""
        batch: list[tuple[dict, asyncio.Future]] = []
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    results, acknowledged = await self._pipelined([admission for admission, _ in batch])
                except Exception as exc:  # RedisError above all: every caller of the batch sees it
                    for _, answer in batch:
                        if not answer.done():
                            answer.set_exception(exc)
                    continue
                for (_, answer), result in zip(batch, results):
                    if answer.done():  # its caller was cancelled (the admission itself ran)
                        continue
                    if isinstance(result, Exception):
                        answer.set_exception(result)
                    else:
                        answer.set_result((result, acknowledged))
        finally:
            self._sender = None
            for _, answer in (*batch, *self._queued):  # unanswered only when cancelled (the gateway stopping)
                if not answer.done():
                    answer.cancel()
            self._queued = []

    async def _pipelined(self, admissions: list[dict]) -> tuple[list, int | None]:
        """Run ``admissions`` in one round trip; their results (an exception for one Redis refused)
        and, when waiting for a replica, how many acknowledged them all."""
        waiting = await self._replicas_present()
        async with self._redis.pipeline(transaction=False) as pipe:
            for admission in admissions:
                await self._admit(**admission, client=pipe)
            if waiting:
                # WAIT counts the replication offset of its own connection's last write: the
                # pipeline's, so every admission above.
                pipe.wait(1, self._replica_wait_ms)
            results = await pipe.execute(raise_on_error=False)
        if not waiting:
            return results, None
        acknowledged = results.pop()
        return results, (0 if isinstance(acknowledged, Exception) else acknowledged)

    async def _replicas_present(self) -> bool:
        """Whether admissions should wait for a replica: waiting is on and the primary had a
        replica at the last look (at most ``REPLICAS_RECHECK_S`` ago)."""
        if not self._replica_wait_ms:
            return False
        now = time.monotonic()
        if now - self._replicas_read_at >= REPLICAS_RECHECK_S:
            info = await self._redis.info("replication")
            self._num_replicas = int(info.get("connected_slaves", 0))
            self._replicas_read_at = now
        return self._num_replicas > 0

    def _count_replicas(self, request_id: str, acknowledged: int) -> None:
        if acknowledged >= 1:
            self.num_replicated += 1
            return
        self.num_unreplicated += 1
        self._replicas_read_at = float("-inf")  # the replica may be gone: look again next time
        log.warning("request %s admitted, but no replica acknowledged it within %d ms: a failover now could lose "
                    "it", request_id, self._replica_wait_ms)

    async def join(self, request_id: str, digests: RequestDigests, wake_key: str, owner: str = "") -> None:
        """Become one more reader of an admitted request (a resume) owned by ``owner``. Raises
        NotFoundError when its outputs are gone or another key owns it, InvalidArgumentError naming
        the first input that differs from the admitted request (nothing is written then)."""
        keys = self._keys
        result = await self._join(
            keys=[keys.output(request_id), keys.readers(request_id), wake_key],
            args=[digests.prompt, digests.params, self._output_ttl_s, WAKE_MAXLEN, WAKE_TTL_S, owner])
        if result == -1:
            raise NotFoundError(f"request {request_id!r} is unknown, its outputs expired, or another API key "
                                "admitted it")
        if result:
            differ = [name.decode() if isinstance(name, bytes) else name for name in result]
            raise InvalidArgumentError(
                differ[0], f"differs from the admitted request {request_id!r} ({' and '.join(differ)} differ); "
                           "a resume must repeat the original input and sampling parameters")

    async def leave(self, request_id: str, *, abort: bool) -> None:
        """One reader is done; with ``abort`` (it left before the request finished) the last
        reader out aborts the request."""
        await self._leave(keys=[self._keys.readers(request_id), self._keys.aborts],
                          args=[request_id, ABORTS_MAXLEN, "1" if abort else "0"])

    async def abort(self, request_id: str) -> None:
        await self._redis.xadd(self._keys.aborts, {REQUEST_ID_FIELD: request_id},
                               maxlen=ABORTS_MAXLEN, approximate=True)
