"""Scale from zero: a gateway with ``--worker-wait-s`` admits while no worker of the model is
registered (its limits from the model's config, or the last worker seen, kept in Redis); the
requests wait in the queue, and when a worker (and a scheduler) come they complete with the tokens
of a run without faults. None comes in time: each call ends UNAVAILABLE saying so."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import UnavailableError
from pagedserve.local_cluster import LocalCluster
from servicekit.contract.sampling_params import SamplingParams

from helpers.stack import redis_server_binary

from .conftest import PREFIX, start_gateway, start_scheduler, start_worker
from .streams import assert_exactly_the_fault_free_outputs, assert_surviving_pools_all_free, streams_with_a_fault

pytestmark = [pytest.mark.chaos, pytest.mark.service, pytest.mark.slow, pytest.mark.asyncio]

NUM_STREAMS = 8
MAX_TOKENS = 24
PROMPTS = [f"Cold start {i}: the lamps were lit one by one along the quay" for i in range(NUM_STREAMS)]
WORKER_AFTER_S = 10.0
WAIT = ("--worker-wait-s", "120")


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


@pytest.fixture
def cold_cluster(tmp_path):
    redis_server_binary()  # skips when there is none
    cluster = LocalCluster(tmp_path, key_prefix=PREFIX, env={"OMP_NUM_THREADS": "1"})
    cluster.start_redis()
    try:
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


async def _cold_start(cluster: LocalCluster, tiny_model_dir: str, expected, *, scheduler_first: bool) -> None:
    scheduler = start_scheduler(cluster, "scheduler-0") if scheduler_first else None
    gateway = start_gateway(cluster, tiny_model_dir, "gateway-0", WAIT)
    await asyncio.to_thread(cluster.wait_serving, *(p for p in (scheduler, gateway) if p), timeout_s=120)

    async def workers_come_late() -> None:
        await asyncio.sleep(WORKER_AFTER_S)
        procs = [start_worker(cluster, tiny_model_dir, "worker-0")]
        if not scheduler_first:
            procs.append(start_scheduler(cluster, "scheduler-0"))
        await asyncio.to_thread(cluster.wait_serving, *procs, timeout_s=120)

    started = time.monotonic()
    logs = await streams_with_a_fault([gateway.address], PROMPTS, MAX_TOKENS, workers_come_late,
                                      tokens_before_fault=0, finish_within_s=120)
    assert time.monotonic() - started >= WORKER_AFTER_S  # they did wait for the worker
    assert_exactly_the_fault_free_outputs(logs, expected, MAX_TOKENS)
    await assert_surviving_pools_all_free(cluster)


async def test_streams_sent_before_any_worker_complete_once_one_comes(cold_cluster, tiny_model_dir, expected):
    await _cold_start(cold_cluster, tiny_model_dir, expected, scheduler_first=True)


async def test_and_with_the_scheduler_absent_too(cold_cluster, tiny_model_dir, expected):
    await _cold_start(cold_cluster, tiny_model_dir, expected, scheduler_first=False)


async def test_no_worker_within_the_bound_is_unavailable_naming_it(cold_cluster, tiny_model_dir):
    gateway = start_gateway(cold_cluster, tiny_model_dir, "gateway-0", ("--worker-wait-s", "2"))
    plain = start_gateway(cold_cluster, tiny_model_dir, "gateway-1")  # no wait: refused at once
    await asyncio.to_thread(cold_cluster.wait_serving, gateway, plain, timeout_s=120)
    async with AsyncClient(gateway.address, timeout=60, retries=0) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="came within 2 s"):
            await client.generate(PROMPTS[0], max_tokens=4)
        assert 1.5 <= time.monotonic() - started < 30
    async with AsyncClient(plain.address, timeout=60, retries=0) as client:
        with pytest.raises(UnavailableError, match="no worker serving"):
            await client.generate(PROMPTS[0], max_tokens=4)
