"""The gateway's output fan-out (``gateway_service.output_fanout``) against a real Redis: it stops
cleanly with Redis gone, hands a step's records to their readers together, and gives a reader
subscribed while a read is out its stream from the start."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from servicekit.redis_layout import RedisKeys


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
