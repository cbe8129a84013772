"""kill -9 a worker, then a scheduler, then a gateway — then restart Redis and freeze a worker —
each while 16 greedy streams are mid-generation, and last a gateway and a worker at once as 16
seeded sampling streams open: every stream completes, each output index arrives exactly once,
the tokens equal the in-process engine's (a run without faults), and every surviving worker's
block pool returns to all free.

One stack of processes for the module (3 workers, 2 schedulers, 2 gateways); each test breaks one
more piece of it and checks what survives.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagedserve.admin import async_scheduler_stats
from pagedserve.local_cluster import LocalCluster
from servicekit.contract.sampling_params import SamplingParams

from .conftest import start_gateway
from .streams import StreamLog, assert_surviving_pools_all_free, busiest_worker
from .streams import assert_exactly_the_fault_free_outputs as assert_outputs
from .streams import streams_with_a_fault as run_streams

pytestmark = [pytest.mark.chaos, pytest.mark.service, pytest.mark.slow, pytest.mark.asyncio]

NUM_STREAMS = 16
MAX_TOKENS = 160
PROMPTS = [f"Stream {i}: the lighthouse keeper counted the ships" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


async def streams_with_a_fault(gateways: list[str], fault) -> list[StreamLog]:
    return await run_streams(gateways, PROMPTS, MAX_TOKENS, fault)


def assert_exactly_the_fault_free_outputs(logs: list[StreamLog], expected: list[list[int]]) -> None:
    assert_outputs(logs, expected, MAX_TOKENS)


async def test_kill_a_worker_mid_generation(chaos_stack: LocalCluster, expected):
    stack = chaos_stack
    gateways = [g.address for g in stack.live("gateway")]

    async def kill_busiest_worker() -> None:
        victim = await busiest_worker(stack)
        stack.kill(victim)

    logs = await streams_with_a_fault(gateways, kill_busiest_worker)
    assert_exactly_the_fault_free_outputs(logs, expected)
    assert len(stack.live("worker")) == 2
    await assert_surviving_pools_all_free(stack)


async def test_kill_a_scheduler_mid_generation(chaos_stack: LocalCluster, expected):
    stack = chaos_stack
    gateways = [g.address for g in stack.live("gateway")]

    async def kill_busiest_scheduler() -> None:
        load = {s.name: (await async_scheduler_stats(s.address)) for s in stack.live("scheduler")}
        victim = max(stack.live("scheduler"), key=lambda s: load[s.name].num_running + load[s.name].num_waiting)
        assert load[victim.name].num_running > 0
        stack.kill(victim)

    logs = await streams_with_a_fault(gateways, kill_busiest_scheduler)
    assert_exactly_the_fault_free_outputs(logs, expected)
    survivor = stack.live("scheduler")
    assert len(survivor) == 1
    assert (await async_scheduler_stats(survivor[0].address)).num_reclaimed > 0
    await assert_surviving_pools_all_free(stack)


async def test_kill_a_gateway_mid_generation(chaos_stack: LocalCluster, expected):
    stack = chaos_stack
    gateways = [g.address for g in stack.live("gateway")]
    first = stack.live("gateway")[0]  # the SDK streams through the first address it is given

    async def kill_first_gateway() -> None:
        stack.kill(first)

    logs = await streams_with_a_fault(gateways, kill_first_gateway)
    assert_exactly_the_fault_free_outputs(logs, expected)
    assert len(stack.live("gateway")) == 1
    await assert_surviving_pools_all_free(stack)


async def test_restart_redis_mid_generation(chaos_stack: LocalCluster, expected):
    """kill -9 Redis and start it again on its append-only file: streams pause, then finish."""
    stack = chaos_stack
    gateways = [g.address for g in stack.live("gateway")]

    async def restart_redis() -> None:
        port = stack.redis.port
        stack.kill(stack.redis)
        await asyncio.sleep(0.5)  # an outage, not just a blip
        await asyncio.to_thread(stack.start_redis, port)

    logs = await streams_with_a_fault(gateways, restart_redis)
    assert_exactly_the_fault_free_outputs(logs, expected)
    await assert_surviving_pools_all_free(stack)


async def test_freeze_a_worker_mid_generation(chaos_stack: LocalCluster, expected):
    """SIGSTOP a worker: its stream stays open but its heartbeats stop; once its registry entry
    expires and it does not answer a health check, its requests resume elsewhere. Thawed, it
    registers again and is driven again with an empty pool."""
    stack = chaos_stack
    gateways = [g.address for g in stack.live("gateway")]
    frozen = []

    async def freeze_busiest_worker() -> None:
        victim = await busiest_worker(stack)
        os.killpg(victim.popen.pid, signal.SIGSTOP)
        frozen.append(victim)

    before = {s.name: await async_scheduler_stats(s.address) for s in stack.live("scheduler")}
    try:
        logs = await streams_with_a_fault(gateways, freeze_busiest_worker)
    finally:
        for victim in frozen:
            os.killpg(victim.popen.pid, signal.SIGCONT)
    assert_exactly_the_fault_free_outputs(logs, expected)
    after = {s.name: await async_scheduler_stats(s.address) for s in stack.live("scheduler")}
    assert sum(after[n].num_resumed - before[n].num_resumed for n in after) > 0  # moved by its scheduler...
    assert all(after[n].num_reclaimed == before[n].num_reclaimed for n in after)  # ...not taken over
    await assert_surviving_pools_all_free(stack)


async def test_seeded_streams_survive_a_gateway_and_a_worker_killed_as_they_open(chaos_stack: LocalCluster, llm,
                                                                                tiny_model_dir):
    """Two faults at the first moment: the gateway the SDK streams through and a worker, killed
    while the calls open (before any token; the SDK was writing into the gateway's connection, so
    grpc.aio may fail the whole GenerateMany call with INTERNAL "Internal error from Core"). Seeded
    sampling streams: a request resumed on another worker samples what the run without faults did."""
    stack = chaos_stack
    added = start_gateway(stack, tiny_model_dir, "gateway-late")  # the earlier tests left one
    await asyncio.to_thread(stack.wait_serving, added, timeout_s=60)
    first, *others = stack.live("gateway")
    per_stream = [dict(temperature=0.9, top_p=0.9, seed=100 + i) if i % 2 else
                  dict(temperature=1.2, top_k=40, seed=7 * i) for i in range(NUM_STREAMS)]
    expected = [o.token_ids for o in llm.generate(PROMPTS, [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs) for kwargs in per_stream])]

    async def kill_a_gateway_and_a_worker() -> None:
        await asyncio.sleep(0)  # one more turn of the loop: the first requests are being written
        stack.kill(first)
        stack.kill(stack.live("worker")[0])

    logs = await run_streams([first.address] + [g.address for g in others], PROMPTS, MAX_TOKENS,
                             kill_a_gateway_and_a_worker, tokens_before_fault=0, per_stream=per_stream)
    assert_outputs(logs, expected, MAX_TOKENS)
    await assert_surviving_pools_all_free(stack)
