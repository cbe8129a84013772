"""Chaos-test fixtures: the services as real processes (``pagedserve.local_cluster``) around one
redis-server with its append-only file on, with short fault-detection times (heartbeats, leases
and the reclaim idle time of 2 s) so faults are handled within seconds. Processes are killed with
SIGKILL: no drain, no goodbye.

The tiny model, its tokenizer and the in-process reference engine are the service tests' fixtures
(``tests/services/conftest.py``; ``tests/`` is on ``sys.path`` through the root conftest).
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.local_cluster import LocalCluster
from services.conftest import (  # noqa: F401  (fixtures re-exported for this folder)
    DTYPE,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    hf_model,
    hf_tokenizer,
    llm,
    redis_server_binary,
    tiny_model_dir,
)

PREFIX = "chaos:"
FAULT_TIMES = ["--lease-ttl-s", "2", "--reclaim-idle-s", "2", "--discovery-interval-s", "0.25"]
STEP_DELAY_S = "0.01"  # throttles generation so every kill lands mid-generation


def start_worker(cluster: LocalCluster, model_dir: str, name: str):
    return cluster.start("worker", name, [
        "--model", model_dir, "--dtype", DTYPE, "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--heartbeat-ttl-s", "2", "--step-delay-s", STEP_DELAY_S, "--worker-id", name])


def start_scheduler(cluster: LocalCluster, name: str):
    return cluster.start("scheduler", name, ["--consumer", name, *FAULT_TIMES])


def start_gateway(cluster: LocalCluster, model_dir: str, name: str):
    return cluster.start("gateway", name, ["--model", model_dir, "--registry-refresh-s", "0.5"])


async def wait_for_async(condition, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll an async ``condition()`` until true, failing with ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting until {what}")
        await asyncio.sleep(interval_s)


@pytest.fixture(scope="module")
def chaos_stack(tiny_model_dir, tmp_path_factory):
    """Redis (AOF on) + 3 workers + 2 schedulers (finding workers in the registry, a fair share
    each) + 2 gateways, as processes."""
    redis_server_binary()  # skips when there is none
    cluster = LocalCluster(tmp_path_factory.mktemp("chaos"), key_prefix=PREFIX, env={"OMP_NUM_THREADS": "1"})
    try:
        cluster.start_redis()
        workers = [start_worker(cluster, tiny_model_dir, f"worker-{i}") for i in range(3)]
        schedulers = [start_scheduler(cluster, f"scheduler-{i}") for i in range(2)]
        gateways = [start_gateway(cluster, tiny_model_dir, f"gateway-{i}") for i in range(2)]
        cluster.wait_serving(*workers, *schedulers, *gateways, timeout_s=120)
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        cluster = item.funcargs.get("chaos_stack")
        if cluster is not None:  # the services' logs explain most chaos failures
            report.sections.append(("service logs", cluster.logs()))
    return report
