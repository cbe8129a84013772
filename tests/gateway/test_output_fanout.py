"""The gateway's output fan-out (``gateway_service.output_fanout``) against a real Redis.

The loop: it stops cleanly with Redis gone, hands a step's records to their readers together, and
gives a reader subscribed while a read is out its stream from the start.

The live stream: the scheduler's publish script appends each step's records of the requests a
gateway admitted to that gateway's live stream too (one entry a step, naming each record's output
stream and entry id there), and the fan-out reads the admitting calls' records from that one
stream, never from their requests' own streams. With the real publish script and the real
fan-out."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway_service.output_fanout import OutputFanout
from scheduler_service.intake import RequestEntry, RequestIntake
from servicekit.redis_layout import RedisKeys, ensure_request_group


async def test_the_output_fanout_stops_cleanly_with_redis_gone(tmp_path, caplog):
    """A gateway drained while Redis is away (or just killed with the rest of a stack) stops
    without an exception: its small wake stream expires on its own."""
    from gateway_service.output_fanout import OutputFanout

    from helpers.stack import start_redis_server, stop_redis_server

    server = start_redis_server(tmp_path)
    client = aioredis.Redis(port=server.port, socket_connect_timeout=1)
    fanout = OutputFanout(client, RedisKeys("gone:"), "gw", block_ms=50)
    fanout.start()
    await asyncio.sleep(0.2)
    stop_redis_server(server)

    await fanout.stop()

    assert "could not delete gone:gw:gw:wake" in caplog.text
    await client.aclose()


async def test_a_steps_records_reach_the_readers_together(redis_server):
    """The scheduler appends a step's records to every stream in one script; a blocked multi-key
    XREAD may return only the stream that woke it (Redis up to 7.0): the fanout reads the rest at
    once, so every reader has its record before any other task runs (one GenerateMany response a
    step, not two)."""
    from gateway_service.output_fanout import OutputFanout

    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("together:")
    fanout = OutputFanout(client, keys, "gw", block_ms=2000)
    loop = asyncio.get_running_loop()
    delivered = 0
    seen_by_the_next_task: list[int] = []  # records delivered when a task scheduled at a delivery ran

    def listener(item) -> None:
        nonlocal delivered
        if delivered == sum(seen_by_the_next_task[-1:]):  # the first delivery since the last look
            loop.call_soon(lambda: seen_by_the_next_task.append(delivered))
        delivered += len(item)

    for i in range(5):
        fanout.subscribe(keys.output(f"r{i}")).listen(listener)
    fanout.start()
    try:
        for step in range(1, 4):
            await client.xadd(fanout.wake_key, {"w": "1"})
            await asyncio.sleep(0.2)  # the fanout blocks on every stream again
            pipe = client.pipeline(transaction=True)
            for i in range(5):
                pipe.xadd(keys.output(f"r{i}"), {"data": b""})
            await pipe.execute()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if delivered == 5 * step:
                    break
        assert seen_by_the_next_task == [5, 10, 15]
    finally:
        await fanout.stop()
        await client.aclose()


async def test_a_reader_subscribed_while_a_read_is_out_gets_its_stream_from_the_start(redis_server):
    """The SDK's retry of a request another gateway admitted before dying: the retry's admission is
    refused (ALREADY_EXISTS) after its reader got a few records, and the resume (a new reader) joins
    at once, while the fanout's read of that stream is out from the refused reader's position. The
    entries that read returns must not be handed to the new reader as its next ones: it got index 0
    and then index 9 (the records between never reached the client, seen with random faults)."""
    from gateway_service.output_fanout import OutputFanout

    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("late-reader:")
    key = keys.output("r")
    fanout = OutputFanout(client, keys, "gw", block_ms=5000)
    fanout.start()
    try:
        for i in range(3):
            await client.xadd(key, {"data": b"%d" % i})
        refused = fanout.subscribe(key)
        await client.xadd(fanout.wake_key, {"w": "1"})
        assert await asyncio.wait_for(refused.get(), 5) == [b"0", b"1", b"2"]
        await asyncio.sleep(0.2)  # the fanout blocks on the stream from the refused reader's position
        fanout.unsubscribe(refused)
        resumed = fanout.subscribe(key)  # no wake: the read that is out returns with the next record
        await client.xadd(key, {"data": b"3"})
        got: list[bytes] = []
        try:
            while len(got) < 4:
                got += await asyncio.wait_for(resumed.get(), 2)
        except TimeoutError:
            pass  # what arrived is checked below
        assert got == [b"0", b"1", b"2", b"3"]  # not [b"3"]
    finally:
        await fanout.stop()
        await client.aclose()


# -- the live stream ------------------------------------------------------------------------------

async def _collect(sub, into: list, n: int, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(into) < n and loop.time() < deadline:
        try:
            into.extend(await asyncio.wait_for(sub.get(), deadline - loop.time()))
        except TimeoutError:
            break


async def test_the_publish_script_appends_each_gateways_records_to_its_live_stream(redis_server):
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("live-publish:")
    await ensure_request_group(client, keys)
    intake = RequestIntake(client, keys, "s", output_ttl_s=60)
    for rid, gateway in [("a", "g1"), ("b", "g2"), ("c", "g1")]:
        intake.keep_live(RequestEntry("0-1", rid, b"", keys.gateway_live(gateway)))
    try:
        await intake.publish([("a", b"a0"), ("b", b"b0"), ("c", b"c0"), ("d", b"d0"), ("a", b"a1")], [])

        for rid, records in [("a", [b"a0", b"a1"]), ("b", [b"b0"]), ("c", [b"c0"]), ("d", [b"d0"])]:
            assert [f[b"data"] for _id, f in await client.xrange(keys.output(rid))] == records
        ids = {rid: [i for i, _f in await client.xrange(keys.output(rid))] for rid in "abcd"}
        (_id, g1), = await client.xrange(keys.gateway_live("g1"))
        assert list(g1.items()) == [  # in publish order, with the entry ids of the output streams
            (keys.output("a").encode() + b" " + ids["a"][0], b"a0"),
            (keys.output("c").encode() + b" " + ids["c"][0], b"c0"),
            (keys.output("a").encode() + b" " + ids["a"][1], b"a1")]
        (_id, g2), = await client.xrange(keys.gateway_live("g2"))
        assert list(g2.values()) == [b"b0"]
        assert 0 < await client.ttl(keys.gateway_live("g1")) <= 60

        intake.forget_live({"b"})  # a, c and d are no longer held
        assert intake.live == {"b": keys.gateway_live("g2")}
    finally:
        await client.aclose()


async def test_a_live_reader_gets_every_record_once_and_never_reads_its_own_stream(redis_server):
    """Records published by the scheduler's script reach the admitting call through the live
    stream, each once and in order; its request's key is never in the blocking read. A second
    reader of the same request (a resume next to it) reads the request's stream and gets every
    record too."""
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("live-reader:")
    await ensure_request_group(client, keys)
    fanout = OutputFanout(client, keys, "gw", block_ms=2000)
    intake = RequestIntake(client, keys, "s", output_ttl_s=60)
    read_keys: list[list[bytes]] = []
    xread = client.xread

    async def spy(streams, **kwargs):
        read_keys.append(list(streams))
        return await xread(streams, **kwargs)

    client.xread = spy
    rids = [f"r{i}" for i in range(4)]
    owners = [fanout.subscribe(keys.output(rid), live=True) for rid in rids]
    for rid in rids:
        intake.keep_live(RequestEntry("0-1", rid, b"", fanout.live_key))
    fanout.start()
    try:
        await client.xadd(fanout.wake_key, {"w": "1"})
        await asyncio.sleep(0.2)
        resumed = None
        for step in range(6):
            if step == 3:
                resumed = fanout.subscribe(keys.output("r0"))
                await client.xadd(fanout.wake_key, {"w": "1"})
            await intake.publish([(rid, f"{rid}:{step}".encode()) for rid in rids], [])
            await asyncio.sleep(0.1)
        got = [[] for _ in rids]
        for sub, into in zip(owners, got):
            await _collect(sub, into, 6)
        assert got == [[f"{rid}:{step}".encode() for step in range(6)] for rid in rids]
        again: list[bytes] = []
        await _collect(resumed, again, 6)
        assert again == [f"r0:{step}".encode() for step in range(6)]
        own_keys = {keys.output(rid).encode() for rid in rids}
        assert all(not own_keys & set(streams) - {keys.output("r0").encode()} for streams in read_keys)
        assert keys.output("r0").encode() in read_keys[-1]  # the resume's
    finally:
        await fanout.stop()
        await client.aclose()


async def test_a_retried_publish_reaches_the_live_stream_of_a_request_forgotten_meanwhile(redis_server):
    """A step's records are routed when they are made: a request that finished in the step is no
    longer held, so the scheduler may forget its live stream before a publish retried after a
    Redis error goes out; the retry still appends its last record there (its admitting call reads
    nothing else)."""
    client = aioredis.Redis(port=redis_server.port)
    keys = RedisKeys("live-retry:")
    await ensure_request_group(client, keys)
    intake = RequestIntake(client, keys, "s", output_ttl_s=60)
    intake.keep_live(RequestEntry("0-1", "r", b"", keys.gateway_live("g")))
    try:
        routed = intake.route([("r", b"last")])
        intake.forget_live(set())  # r finished: no longer held
        await intake.publish_routed(routed, [])

        (_id, fields), = await client.xrange(keys.gateway_live("g"))
        assert list(fields.values()) == [b"last"]
    finally:
        await client.aclose()
