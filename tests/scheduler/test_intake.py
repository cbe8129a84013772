"""The scheduler's side of the request stream (``scheduler_service.intake``): ownership of pending
request entries (refresh, takeover, release, dead letters) and publishing a step's records."""

from __future__ import annotations

import asyncio

from scheduler_service.intake import RequestIntake
from servicekit.contract.records import OutputRecord, delivered_outputs
from servicekit.proto.queue import output_record_from_bytes, output_record_to_bytes
from servicekit.redis_layout import SCHEDULER_GROUP, RedisKeys, ensure_request_group


async def admit_entries(redis, keys: RedisKeys, n: int) -> list[str]:
    await ensure_request_group(redis, keys)
    ids = []
    for i in range(n):
        ids.append((await redis.xadd(keys.requests, {"request_id": f"r{i}", "data": b"x"})).decode())
    return ids


async def test_refresh_keeps_a_live_schedulers_entries_and_reports_those_taken_over(redis):
    keys = RedisKeys("refresh-test:")
    ids = await admit_entries(redis, keys, 3)
    mine = RequestIntake(redis, keys, "alive", output_ttl_s=60)
    other = RequestIntake(redis, keys, "other", output_ttl_s=60)
    assert [e.entry_id for e in await mine.pull(3, 10)] == ids
    await asyncio.sleep(0.15)
    assert await mine.refresh_pending(ids) == []  # every entry's idle time is reset...
    assert await other.claim_idle(100, 10) == []  # ...so none looks abandoned
    await asyncio.sleep(0.15)
    await mine.refresh_pending(ids[:2])  # the third is not refreshed (as if we had died)
    claimed = await other.claim_idle(100, 10)
    assert [c.entry.entry_id for c in claimed] == ids[2:] and claimed[0].deliveries == 2
    assert await mine.refresh_pending(ids) == ids[2:]  # it is not ours any more
    pending = await redis.xpending_range(keys.requests, SCHEDULER_GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 1, 2]  # refreshing counts no delivery


async def test_a_dead_letter_ends_the_request_for_its_client_and_keeps_the_entry(redis):
    keys = RedisKeys("dead-test:")
    (entry_id,) = await admit_entries(redis, keys, 1)
    intake = RequestIntake(redis, keys, "s", output_ttl_s=60)
    (entry,) = await intake.pull(1, 10)
    refusal = output_record_to_bytes(OutputRecord.error("", "given up"))
    await intake.finish_entries([("r0", refusal)], [entry], reason="too many takeovers")
    (dead_id, fields), = await redis.xrange(keys.dead_letters)
    assert fields[b"request_id"] == b"r0" and fields[b"reason"] == b"too many takeovers"
    assert await redis.xlen(keys.requests) == 0
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 0
    records = [fields[b"data"] for _id, fields in await redis.xrange(keys.output("r0"))]
    assert delivered_outputs([output_record_from_bytes(data) for data in records]) == ([], True)


async def test_publish_appends_every_record_in_order_renews_ttls_and_acks_the_finished(redis):
    keys = RedisKeys("publish-test:")
    ids = await admit_entries(redis, keys, 3)
    intake = RequestIntake(redis, keys, "s", output_ttl_s=60)
    await intake.pull(3, 10)
    await intake.publish([("r0", b"a0"), ("r1", b"b0"), ("r0", b"a1")], [])
    await intake.publish([("r2", b"c0"), ("r0", b"a2")], [ids[0], ids[2]])
    await intake.publish([], [])  # nothing: no command
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r0"))] == [b"a0", b"a1", b"a2"]
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r1"))] == [b"b0"]
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r2"))] == [b"c0"]
    assert all(0 < ttl <= 60 for ttl in [await redis.ttl(keys.output(r)) for r in ("r0", "r1", "r2")])
    assert [e[0].decode() for e in await redis.xrange(keys.requests)] == [ids[1]]  # the finished are deleted
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 1  # and acknowledged
    await intake.publish([], [ids[1]])  # finishing records may come with no output
    assert await redis.xlen(keys.requests) == 0


async def test_publish_finishes_more_entries_than_one_lua_unpack_takes(redis):
    keys = RedisKeys("publish-many-test:")
    await ensure_request_group(redis, keys)
    pipe = redis.pipeline(transaction=False)
    for i in range(9000):  # a failing engine publishes every entry it holds at once
        pipe.xadd(keys.requests, {"request_id": f"r{i}", "data": b"x"})
    ids = [i.decode() for i in await pipe.execute()]
    intake = RequestIntake(redis, keys, "s", output_ttl_s=60)
    assert len(await intake.pull(9000, 10)) == 9000
    await intake.publish([("r0", b"last")], ids)
    assert await redis.xlen(keys.requests) == 0
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def test_released_entries_are_taken_over_at_once(redis):
    keys = RedisKeys("release-test:")
    ids = await admit_entries(redis, keys, 2)
    draining = RequestIntake(redis, keys, "draining", output_ttl_s=60)
    other = RequestIntake(redis, keys, "other", output_ttl_s=60)
    await draining.pull(2, 10)
    assert await draining.release(ids, idle_ms=10_000) == ids
    claimed = await other.claim_idle(10_000, 10)
    assert [c.entry.entry_id for c in claimed] == ids
    assert [c.deliveries for c in claimed] == [1, 1]  # a hand-back is not a failed attempt: no retry counted


async def test_release_leaves_entries_that_are_not_ours_any_more(redis):
    keys = RedisKeys("release-theirs-test:")
    ids = await admit_entries(redis, keys, 2)
    stranded = RequestIntake(redis, keys, "stranded", output_ttl_s=60)
    other = RequestIntake(redis, keys, "other", output_ttl_s=60)
    await stranded.pull(2, 10)
    await asyncio.sleep(0.15)
    (taken,) = await other.claim_idle(100, 1)  # the other took the first over meanwhile
    assert taken.entry.entry_id == ids[0] and taken.deliveries == 2
    assert await stranded.release(ids, idle_ms=10_000) == ids[1:]
    pending = await redis.xpending_range(keys.requests, SCHEDULER_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"other", 2), (b"stranded", 0)]
