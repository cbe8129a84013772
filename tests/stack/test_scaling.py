"""Horizontal scaling, in-process: a scheduler with no worker finds the first one at once, a worker
started while the stack serves takes requests, repeats of a shared prefix are routed to the worker
that caches it, two schedulers share the request stream with a worker each, and a request taken
over too often is dead-lettered with an error for its client. Each test builds its own stack under
its own key prefix."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import AbortedError
from servicekit.redis_layout import SCHEDULER_GROUP, RedisKeys

from .test_drain import start_worker

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]


async def poll(condition, timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting until {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(prefix: str, redis_url: str, hf_tokenizer, model: str, *, schedulers: int = 1,
                  workers: tuple[str, ...] = (), workers_each: list[tuple[str, ...]] | None = None,
                  **scheduler_settings):
    """Scheduler(s) finding workers in the registry (or driving ``workers``, or scheduler i
    driving ``workers_each[i]``) and a gateway."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig

    scheduler_settings.setdefault("discovery_interval_s", 0.1)
    apps = [SchedulerApp(SchedulerConfig(
        redis_url=redis_url, key_prefix=prefix, port=0, workers=workers_each[i] if workers_each else workers,
        poll_block_ms=200, consumer=f"{prefix}scheduler-{i}", **scheduler_settings))
        for i in range(schedulers)]
    for app in apps:
        await app.start()
    gateway = GatewayApp(GatewayConfig(model=model, port=0, http_port=0, redis_url=redis_url, key_prefix=prefix,
                                         read_block_ms=200, registry_refresh_s=0.2), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        yield apps, f"127.0.0.1:{gateway.port}"
    finally:
        await gateway.drain(1)
        for app in apps:
            await app.drain(1)


def by_address(app) -> dict:
    return {w.address: w for w in app.stats().workers}


async def test_a_worker_started_while_serving_takes_requests(tiny_model_dir, hf_model, hf_tokenizer, redis_server):
    prefix = "grow:"
    first = await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url, step_delay_s=0.01)
    second = None
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir) as ([scheduler], address):
            await scheduler.wait_for_workers(1)
            async with AsyncClient(address, timeout=60) as client:
                early = [asyncio.create_task(client.generate(f"early {i}", max_tokens=200, ignore_eos=True))
                         for i in range(6)]
                await poll(lambda: scheduler.stats().workers[0].core.num_running == 6, 10, "the early requests run")
                second = await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url)
                await scheduler.wait_for_workers(2, timeout_s=10)
                late = [asyncio.create_task(client.generate(f"late {i}", max_tokens=20, ignore_eos=True))
                        for i in range(4)]
                completions = await asyncio.gather(*early, *late)
            stats = by_address(scheduler)
        assert all(c.finish_reason == "length" for c in completions)
        assert stats[second.address].num_routed == 4  # the least loaded worker took every late request
        assert stats[first.address].num_routed == 6
    finally:
        for worker in (first, second):
            if worker is not None:
                await worker.drain(1)


async def test_a_scheduler_without_a_worker_finds_the_first_one_at_once(tiny_model_dir, hf_model, hf_tokenizer,
                                                                        redis_server):
    # Scaled to zero, requests wait for the first worker; the scheduler does not wait out its
    # discovery interval (30 s here) to find it.
    prefix = "seek:"
    worker = None
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir,
                           discovery_interval_s=30.0) as ([scheduler], address):
            await asyncio.sleep(0.5)  # a pass or two found nothing
            worker = await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url)
            await scheduler.wait_for_workers(1, timeout_s=3)
            async with AsyncClient(address, timeout=60) as client:
                assert len((await client.generate("hello", max_tokens=4, ignore_eos=True)).token_ids) == 4
    finally:
        if worker is not None:
            await worker.drain(1)


async def test_repeats_of_a_shared_prefix_go_to_the_worker_that_caches_it(tiny_model_dir, hf_model, hf_tokenizer,
                                                                         redis_server):
    prefix = "affinity:"
    workers = [await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url) for _ in range(2)]
    system_prompt = list(range(1000, 1096))  # 6 KV blocks of 16 tokens, shared by every request
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir,
                           workers=tuple(w.address for w in workers)) as ([scheduler], address):
            await scheduler.wait_for_workers(2)
            async with AsyncClient(address, timeout=60) as client:
                await client.generate(system_prompt + [5], max_tokens=4, ignore_eos=True)
                holder = next(w for w in scheduler.stats().workers if w.num_routed == 1).address
                repeats = [await client.generate(system_prompt + [6 + i, 7], max_tokens=4, ignore_eos=True)
                           for i in range(5)]
            stats = by_address(scheduler)
        assert stats[holder].num_routed == 6 and stats[holder].num_routed_prefix_hit == 5
        assert all(r.usage.cached_prompt_tokens == len(system_prompt) for r in repeats)
        assert stats[holder].core.prefix_cache_hit_rate > 0.5  # reported in stats
        other = next(a for a in stats if a != holder)
        assert stats[other].num_routed == 0
    finally:
        for worker in workers:
            await worker.drain(1)


async def test_two_schedulers_share_the_request_stream_each_driving_its_own_worker(
        tiny_model_dir, hf_model, hf_tokenizer, redis_server):
    prefix = "pair:"
    workers = [await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url) for _ in range(2)]
    redis = aioredis.from_url(redis_server.url)
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir, schedulers=2) as (apps, address):
            await poll(lambda: all(len(app.engines) == 1 for app in apps), 10, "each scheduler drives one worker")
            holders = {(await redis.get(RedisKeys(prefix).lease(w.settings.worker_id))).decode() for w in workers}
            assert holders == {app.settings.consumer for app in apps}  # one lease each, no worker shared
            async with AsyncClient(address, timeout=60) as client:
                for wave in range(4):
                    completions = await asyncio.gather(*(client.generate(f"wave {wave} {i}", max_tokens=8)
                                                         for i in range(4)))
                    assert all(len(c.token_ids) > 0 for c in completions)
            finished = [app.stats().num_finished for app in apps]
        assert sum(finished) == 16 and min(finished) > 0  # both consumed the one stream
    finally:
        await redis.aclose()
        for worker in workers:
            await worker.drain(1)


async def test_a_scheduler_whose_workers_are_gone_hands_its_requests_to_one_that_has_a_worker(
        tiny_model_dir, hf_model, hf_tokenizer, redis_server):
    """Two schedulers, each driving the worker it was given (``--workers``); the worker of the one
    running requests stops at once (no grace). Its scheduler has no worker left and hands its
    requests back to the group; the other claims them at its next pending pass and they finish."""
    prefix = "static-handback:"
    workers = [await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url, step_delay_s=0.01)
               for _ in range(2)]
    live = list(workers)
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir, schedulers=2,
                           workers_each=[(w.address,) for w in workers], reclaim_idle_s=2) as (apps, address):
            for app in apps:
                await app.wait_for_workers(1)
            running = [lambda app=app: app.stats().workers[0].core.num_running for app in apps]
            async with AsyncClient(address, timeout=60) as client:
                tasks = [asyncio.create_task(client.generate(f"static {i}", max_tokens=64, ignore_eos=True))
                         for i in range(8)]
                await poll(lambda: sum(r() for r in running) == 8, 10, "every request runs")
                victim = max(range(2), key=lambda i: running[i]())
                held = running[victim]()
                await workers[victim].drain(0)
                live.remove(workers[victim])
                completions = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            survivor = apps[1 - victim].stats()
        assert [len(c.token_ids) for c in completions] == [64] * 8
        assert all(c.finish_reason == "length" for c in completions)
        assert survivor.num_reclaimed >= held  # taken over from the group, not left stranded
    finally:
        for worker in live:
            await worker.drain(1)


async def test_a_request_taken_over_too_often_is_dead_lettered_and_its_client_gets_an_error(
        tiny_model_dir, hf_model, hf_tokenizer, redis_server):
    prefix = "poison:"
    keys = RedisKeys(prefix)
    worker = await start_worker(prefix, tiny_model_dir, hf_model, redis_server.url)
    redis = aioredis.from_url(redis_server.url)
    try:
        async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir, schedulers=0) as (_, address):
            async with AsyncClient(address, timeout=30) as client:
                stream = client.stream("doomed", max_tokens=8)
                pending = asyncio.create_task(stream.__anext__())
                await poll_async(lambda: redis.xlen(keys.requests), 10)
                # Two schedulers that died holding it: delivered to one, taken over by the next.
                await redis.xreadgroup(SCHEDULER_GROUP, "ghost-1", {keys.requests: ">"}, count=1)
                (entry_id, _), = await redis.xrange(keys.requests)
                await redis.xclaim(keys.requests, SCHEDULER_GROUP, "ghost-2", 0, [entry_id])
                async with serving(prefix, redis_server.url, hf_tokenizer, tiny_model_dir, max_retries=1,
                                   reclaim_idle_s=0.5) as ([scheduler], _unused):
                    with pytest.raises(AbortedError, match="given up"):
                        await asyncio.wait_for(pending, 20)
                    assert scheduler.stats().num_dead_lettered == 1
        (_id, fields), = await redis.xrange(keys.dead_letters)
        assert fields[b"deliveries"] == b"3" and await redis.xlen(keys.requests) == 0
    finally:
        await redis.aclose()
        await worker.drain(1)


async def poll_async(count, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await count():
        if loop.time() > deadline:
            raise TimeoutError("nothing arrived")
        await asyncio.sleep(0.02)
