"""The gateway's live stream: the scheduler's publish script appends each step's records of the
requests a gateway admitted to that gateway's live stream too (one entry a step, naming each
record's output stream and entry id there), and the gateway's fan-out reads the admitting calls'
records from that one stream, never from their requests' own streams. With a real Redis, the
real publish script and the real fan-out."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway_service.output_fanout import OutputFanout
from scheduler_service.intake import RequestEntry, RequestIntake
from servicekit.redis_layout import RedisKeys, ensure_request_group


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
