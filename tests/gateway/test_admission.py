"""Admissions (``gateway_service.admission``) against a real Redis: a burst goes in a few
pipelines over one connection, and each caller still gets its own answer — its entry, or its own
error (a full queue, a request id in use, Redis gone), whatever the others of its batch got."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway_service.admission import Admission, request_digests
from servicekit.contract.errors import AlreadyExistsError, ResourceExhaustedError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.redis_layout import SCHEDULER_GROUP, RedisKeys, ensure_request_group

DIGESTS = request_digests([1, 2, 3], SamplingParams(max_tokens=4))


def admit(admission: Admission, keys: RedisKeys, request_id: str):
    return admission.admit(request_id, f"record {request_id}".encode(), DIGESTS, keys.gateway_wake("g"), "owner",
                           keys.gateway_live("g"))


class CountingPipelines:
    """The client, counting the pipelines run through it and the commands in each."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def pipeline(self, *args, **kwargs):
        pipe = self.client.pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a, **k):
            self.sizes.append(len(pipe.command_stack))
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe


async def test_a_burst_of_admissions_goes_in_few_round_trips_on_one_connection(redis_server):
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("burst:")
    counting = CountingPipelines(client)
    admission = Admission(counting, keys, max_queued=0, output_ttl_s=60)
    try:
        await asyncio.gather(*(admit(admission, keys, f"r{i}") for i in range(64)))

        assert sum(counting.sizes) == 64
        assert len(counting.sizes) <= 3, counting.sizes  # the first alone, then the rest together
        assert len(client.connection_pool._available_connections) + len(client.connection_pool._in_use_connections) == 1
        entries = await client.xrange(keys.requests)
        assert [e[1][b"data"] for e in entries] == [f"record r{i}".encode() for i in range(64)]  # in call order
        for i in range(64):
            assert await client.exists(keys.output(f"r{i}"), keys.readers(f"r{i}")) == 2
    finally:
        await client.aclose()


async def test_each_admission_of_a_batch_gets_its_own_answer(redis_server):
    """A batch holding a request id already in use and more requests than the queue takes: those
    callers alone are refused, by name; the others are admitted."""
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("own:")
    await ensure_request_group(client, keys)
    admission = Admission(client, keys, max_queued=3, output_ttl_s=60)
    try:
        await admit(admission, keys, "taken")
        results = await asyncio.gather(*(admit(admission, keys, rid) for rid in ("a", "taken", "b", "c", "d")),
                                       return_exceptions=True)

        assert results[0] is None and results[2] is None  # admitted: 3 waiting with "taken"
        assert isinstance(results[1], AlreadyExistsError) and "'taken'" in str(results[1])
        assert all(isinstance(r, ResourceExhaustedError) for r in results[3:])
        assert await client.xlen(keys.requests) == 3
        assert not await client.exists(keys.output("c"), keys.output("d"))
        # the queue drains: the next admission fits again
        await client.xreadgroup(SCHEDULER_GROUP, "s", {keys.requests: ">"}, count=3)
        await admit(admission, keys, "c")
    finally:
        await client.aclose()


async def test_a_cancelled_caller_leaves_the_rest_of_its_batch_admitted(redis_server):
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("cancel:")
    admission = Admission(client, keys, max_queued=0, output_ttl_s=60)
    try:
        first = asyncio.ensure_future(admit(admission, keys, "first"))
        await asyncio.sleep(0)  # its batch is on its way: the next ones queue behind it
        calls = [asyncio.ensure_future(admit(admission, keys, f"r{i}")) for i in range(5)]
        await asyncio.sleep(0)
        calls[2].cancel()
        await first
        done = await asyncio.gather(*calls, return_exceptions=True)

        assert isinstance(done[2], asyncio.CancelledError)
        assert [d for i, d in enumerate(done) if i != 2] == [None] * 4
        # queued before the cancel, so sent: a caller that needs to know awaits it shielded
        # (GenerationService._landed) and leaves it as an unfinished reader
        assert await client.xlen(keys.requests) == 6
    finally:
        await client.aclose()


async def test_redis_gone_fails_every_caller_of_the_batch_and_the_next_batch_runs(tmp_path):
    from helpers.stack import start_redis_server, stop_redis_server

    server = start_redis_server(tmp_path)
    client = aioredis.Redis(port=server.port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    keys = RedisKeys("gone:")
    admission = Admission(client, keys, max_queued=0, output_ttl_s=60)
    try:
        await admit(admission, keys, "before")
        stop_redis_server(server)
        results = await asyncio.gather(*(admit(admission, keys, f"r{i}") for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        with pytest.raises(RedisConnectionError):  # a later call makes its own attempt
            await admit(admission, keys, "after")
    finally:
        await client.aclose()


async def test_stopping_the_sender_answers_every_waiting_caller(redis_server):
    """The gateway stopping cancels the sending task: the batch in flight and those queued behind
    it end cancelled, none waits forever."""
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("stop:")
    admission = Admission(client, keys, max_queued=0, output_ttl_s=60)
    try:
        in_flight = asyncio.ensure_future(admit(admission, keys, "in-flight"))
        await asyncio.sleep(0)  # the sender takes it and awaits Redis
        queued = asyncio.ensure_future(admit(admission, keys, "queued"))
        await asyncio.sleep(0)
        admission._sender.cancel()
        done = await asyncio.wait_for(asyncio.gather(in_flight, queued, return_exceptions=True), 5)
        assert all(isinstance(d, asyncio.CancelledError) for d in done), done
        await admit(admission, keys, "after")  # a new sender starts for the next admission
        assert await client.exists(keys.output("after"))
    finally:
        await client.aclose()
