"""The pieces behind scaling and fault tolerance, one at a time: KV-aware routing, worker leases,
ownership of pending request entries (refresh, takeover, dead letters), decoding what a request
already delivered, the SDK's failover decisions, and the simulated runner's determinism."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import redis.asyncio as aioredis

from pagedserve.failover import Failover, parse_addresses
from scheduler_service import convert
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.leases import WorkerLeases
from scheduler_service.redis_queue import RedisQueue
from scheduler_service.routing import choose_engine
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from servicekit.contract.worker import WorkerDescription
from servicekit.proto.pb import generation_pb2
from servicekit.redis_keys import SCHEDULER_GROUP, RedisKeys, ensure_request_group
from worker_service.simulated_runner import SimulatedRunner, parse_step_latency

INFO = WorkerDescription(model="m", num_blocks=64, block_size=4, max_model_len=128, vocab_size=1000, eos_token_ids=(2,))
SHARED_PREFIX = list(range(100, 124))  # 6 full blocks of 4


# -- KV-aware routing ----------------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, name: str, load: int = 0, max_num_seqs: int = 4, num_blocks: int = INFO.num_blocks) -> None:
        self.name = name
        info = dataclasses.replace(INFO, num_blocks=num_blocks)
        self.core = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256), info)
        self.load = load

    def fits(self, request: Request) -> bool:
        return self.core.fits(request)  # as WorkerEngine.fits

    def run_to_completion(self, request: Request) -> None:
        """Prefill + one sampled token: its full prompt blocks enter this engine's prefix cache."""
        self.core.add_request(request)
        so = self.core.schedule()
        self.core.update_from_output(so, ModelRunnerOutput(sampled_token_ids={request.request_id: [7]}))


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, seed=1, ignore_eos=True))


def test_routing_prefers_the_worker_holding_the_prefix_even_when_busier():
    cold, warm = FakeEngine("cold", load=0), FakeEngine("warm", load=2)
    warm.run_to_completion(make_request("first", SHARED_PREFIX + [1]))
    engine, hit = choose_engine(make_request("repeat", SHARED_PREFIX + [9, 9]), [cold, warm])
    assert engine is warm and hit == len(SHARED_PREFIX)


def test_routing_without_a_hit_picks_the_least_loaded():
    busy, idle = FakeEngine("busy", load=3), FakeEngine("idle", load=1)
    engine, hit = choose_engine(make_request("new", [5, 6, 7, 8, 9]), [busy, idle])
    assert engine is idle and hit == 0


def test_a_hot_prefix_spills_over_once_its_worker_has_no_free_seat():
    cold, warm = FakeEngine("cold", load=0), FakeEngine("warm", load=0)
    warm.run_to_completion(make_request("first", SHARED_PREFIX + [1]))
    warm.load = warm.core.config.max_num_seqs  # every batch seat taken
    engine, _hit = choose_engine(make_request("repeat", SHARED_PREFIX + [3]), [cold, warm])
    assert engine is cold


def test_a_request_goes_only_to_a_worker_whose_kv_cache_can_hold_it():
    """Workers may differ in KV-cache size: the least loaded one here cannot hold prompt +
    max_tokens at all (its core would refuse the request), so it goes to the one that can."""
    small, large = FakeEngine("small", load=0, num_blocks=4), FakeEngine("large", load=3)
    request = Request("long", SHARED_PREFIX, SamplingParams(max_tokens=8, seed=1, ignore_eos=True))  # 8 blocks
    assert not small.core.fits(request) and large.core.fits(request)
    engine, _hit = choose_engine(request, [small, large])
    assert engine is large
    too_long = Request("too-long", SHARED_PREFIX, SamplingParams(max_tokens=INFO.max_model_len, seed=1))
    assert not large.core.fits(too_long)  # past max_model_len on every worker
    with pytest.raises(InvalidArgumentError, match="max_tokens: prompt \\+ max_tokens \\(32 tokens\\) needs more KV"):
        small.core.add_request(request)


# -- Redis-backed pieces -------------------------------------------------------------------------------


@pytest.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_a_lease_has_one_holder_until_released_or_expired(redis):
    keys = RedisKeys("lease-test:")
    a = WorkerLeases(redis, keys, "sched-a", ttl_s=0.3)
    b = WorkerLeases(redis, keys, "sched-b", ttl_s=0.3)
    assert await a.acquire("w1") and not await b.acquire("w1")
    assert await a.renew(["w1"]) == {"w1": True}
    await b.release("w1")  # not b's: nothing happens
    assert await a.holder("w1") == "sched-a"
    await a.release("w1")
    assert await b.acquire("w1")
    await asyncio.sleep(0.4)  # b stops renewing: the lease expires
    assert await a.acquire("w1")
    assert await b.renew(["w1"]) == {"w1": False}  # b learns it lost the worker


async def admit_entries(redis, keys: RedisKeys, n: int) -> list[str]:
    await ensure_request_group(redis, keys)
    ids = []
    for i in range(n):
        ids.append((await redis.xadd(keys.requests, {"request_id": f"r{i}", "data": b"x"})).decode())
    return ids


async def test_refresh_keeps_a_live_schedulers_entries_and_reports_those_taken_over(redis):
    keys = RedisKeys("refresh-test:")
    ids = await admit_entries(redis, keys, 3)
    mine = RedisQueue(redis, keys, "alive", output_ttl_s=60)
    other = RedisQueue(redis, keys, "other", output_ttl_s=60)
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
    queue = RedisQueue(redis, keys, "s", output_ttl_s=60)
    (entry,) = await queue.pull(1, 10)
    await queue.finish_entries([("r0", convert.error_record("", "given up"))], [entry], reason="too many takeovers")
    (dead_id, fields), = await redis.xrange(keys.dead_letters)
    assert fields[b"request_id"] == b"r0" and fields[b"reason"] == b"too many takeovers"
    assert await redis.xlen(keys.requests) == 0
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 0
    records = [fields[b"data"] for _id, fields in await redis.xrange(keys.output("r0"))]
    assert convert.delivered_outputs(records) == ([], True)


async def test_publish_appends_every_record_in_order_renews_ttls_and_acks_the_finished(redis):
    keys = RedisKeys("publish-test:")
    ids = await admit_entries(redis, keys, 3)
    queue = RedisQueue(redis, keys, "s", output_ttl_s=60)
    await queue.pull(3, 10)
    await queue.publish([("r0", b"a0"), ("r1", b"b0"), ("r0", b"a1")], [])
    await queue.publish([("r2", b"c0"), ("r0", b"a2")], [ids[0], ids[2]])
    await queue.publish([], [])  # nothing: no command
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r0"))] == [b"a0", b"a1", b"a2"]
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r1"))] == [b"b0"]
    assert [f[b"data"] for _id, f in await redis.xrange(keys.output("r2"))] == [b"c0"]
    assert all(0 < ttl <= 60 for ttl in [await redis.ttl(keys.output(r)) for r in ("r0", "r1", "r2")])
    assert [e[0].decode() for e in await redis.xrange(keys.requests)] == [ids[1]]  # the finished are deleted
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 1  # and acknowledged
    await queue.publish([], [ids[1]])  # finishing records may come with no output
    assert await redis.xlen(keys.requests) == 0


async def test_publish_finishes_more_entries_than_one_lua_unpack_takes(redis):
    keys = RedisKeys("publish-many-test:")
    await ensure_request_group(redis, keys)
    pipe = redis.pipeline(transaction=False)
    for i in range(9000):  # a failing engine publishes every entry it holds at once
        pipe.xadd(keys.requests, {"request_id": f"r{i}", "data": b"x"})
    ids = [i.decode() for i in await pipe.execute()]
    queue = RedisQueue(redis, keys, "s", output_ttl_s=60)
    assert len(await queue.pull(9000, 10)) == 9000
    await queue.publish([("r0", b"last")], ids)
    assert await redis.xlen(keys.requests) == 0
    assert (await redis.xpending(keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def test_released_entries_are_taken_over_at_once(redis):
    keys = RedisKeys("release-test:")
    ids = await admit_entries(redis, keys, 2)
    draining = RedisQueue(redis, keys, "draining", output_ttl_s=60)
    other = RedisQueue(redis, keys, "other", output_ttl_s=60)
    await draining.pull(2, 10)
    assert await draining.release(ids, idle_ms=10_000) == ids
    claimed = await other.claim_idle(10_000, 10)
    assert [c.entry.entry_id for c in claimed] == ids
    assert [c.deliveries for c in claimed] == [1, 1]  # a hand-back is not a failed attempt: no retry counted


async def test_release_leaves_entries_that_are_not_ours_any_more(redis):
    keys = RedisKeys("release-theirs-test:")
    ids = await admit_entries(redis, keys, 2)
    stranded = RedisQueue(redis, keys, "stranded", output_ttl_s=60)
    other = RedisQueue(redis, keys, "other", output_ttl_s=60)
    await stranded.pull(2, 10)
    await asyncio.sleep(0.15)
    (taken,) = await other.claim_idle(100, 1)  # the other took the first over meanwhile
    assert taken.entry.entry_id == ids[0] and taken.deliveries == 2
    assert await stranded.release(ids, idle_ms=10_000) == ids[1:]
    pending = await redis.xpending_range(keys.requests, SCHEDULER_GROUP, "-", "+", 10)
    assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"other", 2), (b"stranded", 0)]


# -- what a request already delivered ------------------------------------------------------------------


def record(first_index: int, tokens: list[int], finish: FinishReason | None = None) -> bytes:
    return convert.engine_output_to_record(EngineCoreOutput("r", tokens, first_index, finish))


def test_delivered_outputs_are_read_by_index_and_repeats_are_skipped():
    admission_marker = b""
    records = [admission_marker, record(0, [5, 6]), record(2, [7]), record(1, [6, 7]), record(3, [8])]
    assert convert.delivered_outputs(records) == ([5, 6, 7, 8], False)
    assert convert.delivered_outputs([*records, record(4, [9], FinishReason.LENGTH)]) == ([5, 6, 7, 8], True)


# -- SDK failover --------------------------------------------------------------------------------------


def test_failover_resumes_from_the_next_index_on_the_next_gateway():
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 2, retries=2, timeout=None)
    failover.on_chunk(0, 3)
    failover.on_chunk(3, 2)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "Socket closed") is not None
    assert request.resume_from_index == 5 and failover.address_index == 1
    assert failover.next_try(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2") is not None
    assert failover.address_index == 0
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is None  # retries without progress spent
    assert failover.next_try(grpc.StatusCode.ABORTED, "request failed") is None


def test_a_call_the_grpc_core_failed_under_a_killed_gateway_is_resumed_elsewhere():
    """grpc.aio's status when the C core fails an operation of a call (the SDK writing a GenerateMany
    request into the connection of a gateway just killed): every stream of the call got it and
    raised InternalError (seen with random faults: a gateway and a worker killed as streams start)."""
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 2, retries=2, timeout=None)
    assert failover.next_try(grpc.StatusCode.INTERNAL, "Internal error from Core") is not None
    assert failover.address_index == 1
    assert failover.next_try(grpc.StatusCode.INTERNAL, "internal error: RuntimeError") is None  # the gateway's own


def test_failover_before_any_token_retries_the_request_then_follows_it():
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 1, retries=3, timeout=None)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is not None
    assert not request.HasField("resume_from_index")  # sent again as is (same id)
    assert failover.next_try(grpc.StatusCode.ALREADY_EXISTS, "in use") == 0.0  # the first try got through
    assert request.resume_from_index == 0


def test_failover_respects_the_streams_deadline():
    failover = Failover(generation_pb2.GenerateRequest(request_id="r"), 2, retries=5, timeout=0.1)
    time.sleep(0.1)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is None


def test_gateway_addresses_parse_from_a_list_or_a_comma_string():
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"] == parse_addresses(["a:1", "b:2"])
    with pytest.raises(ValueError):
        parse_addresses("")


# -- SIMULATION runner ---------------------------------------------------------------------------------


def step(runner: SimulatedRunner, core: Scheduler) -> list[EngineCoreOutput]:
    so: SchedulerOutput = core.schedule()
    return core.update_from_output(so, runner.execute_model(so))


def test_simulated_runner_tokens_depend_on_seed_and_position_only():
    """A request resumed elsewhere from its delivered outputs continues with the same tokens."""
    slept: list[float] = []
    params = SamplingParams(max_tokens=6, seed=42, ignore_eos=True)

    def generate(output_token_ids=()) -> list[int]:
        runner = SimulatedRunner(INFO, step_latency=(0.01, 0.001), sleep=slept.append)
        core = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), INFO)
        core.add_request(Request("r", [10, 11, 12], params, output_token_ids=output_token_ids))
        tokens = list(output_token_ids)
        while core.has_unfinished_requests():
            for out in step(runner, core):
                tokens.extend(out.new_token_ids)
        return tokens

    whole = generate()
    assert len(whole) == 6 and generate(whole[:3]) == whole
    assert slept[0] == pytest.approx(0.01 + 0.001 * 3)  # a + b x the first step's 3 prompt tokens
    assert parse_step_latency("0.02,0.0001") == (0.02, 0.0001)
    with pytest.raises(ValueError):
        parse_step_latency("0.02")


async def test_the_output_fanout_stops_cleanly_with_redis_gone(tmp_path, caplog):
    """A gateway drained while Redis is away (or just killed with the rest of a stack) stops
    without an exception: its small wake stream expires on its own."""
    from gateway_service.output_fanout import OutputFanout

    from .conftest import start_redis_server, stop_redis_server

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
