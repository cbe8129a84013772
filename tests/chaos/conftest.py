"""Chaos-test fixtures: the services as real processes (``pagedserve.local_cluster``) around one
redis-server with its append-only file on, with short fault-detection times (heartbeats, leases
and the reclaim idle time of 2 s) so faults are handled within seconds. Processes are killed with
SIGKILL: no drain, no goodbye.

The tiny model, its tokenizer and the in-process reference engine are the suite's shared fixtures
(``tests/helpers/stack.py``, given to every folder by the root conftest).
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.local_cluster import LocalCluster
from servicekit.tls import TlsFiles

from helpers.stack import DTYPE, MAX_NUM_SEQS, NUM_BLOCKS, redis_server_binary

PREFIX = "chaos:"
FAULT_TIMES = ["--lease-ttl-s", "2", "--reclaim-idle-s", "2", "--discovery-interval-s", "0.25"]
STEP_DELAY_S = "0.01"  # throttles generation so every kill lands mid-generation


def start_worker(cluster: LocalCluster, model_dir: str, name: str):
    return cluster.start("worker", name, [
        "--model", model_dir, "--dtype", DTYPE, "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--heartbeat-ttl-s", "2", "--step-delay-s", STEP_DELAY_S, "--worker-id", name])


def start_scheduler(cluster: LocalCluster, name: str):
    return cluster.start("scheduler", name, ["--consumer", name, *FAULT_TIMES])


def start_gateway(cluster: LocalCluster, model_dir: str, name: str, args: tuple[str, ...] = ()):
    return cluster.start("gateway", name, ["--model", model_dir, "--registry-refresh-s", "0.5", *args])


async def wait_for_async(condition, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll an async ``condition()`` until true, failing with ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting until {what}")
        await asyncio.sleep(interval_s)


def start_cluster(workdir, model_dir: str, *, num_workers: int, num_schedulers: int,
                  num_gateways: int, redis_ha: bool = False, tls: TlsFiles | None = None,
                  gateway_args: tuple[str, ...] = ()) -> LocalCluster:
    """Redis (AOF on; with ``redis_ha`` a primary + one replica + three Sentinels that fail over
    after 1 s of silence) + workers + schedulers (finding workers in the registry, a fair share
    each) + gateways (with ``gateway_args`` besides), as processes, all SERVING; with ``tls`` every
    link but Redis is TLS (mutual between scheduler and worker). On failure the cluster is stopped
    and its logs printed."""
    redis_server_binary()  # skips when there is none
    cluster = LocalCluster(workdir, key_prefix=PREFIX, env={"OMP_NUM_THREADS": "1"}, tls=tls)
    try:
        if redis_ha:
            cluster.start_redis_ha(num_replicas=1, num_sentinels=3, down_after_ms=1000, failover_timeout_ms=3000)
        else:
            cluster.start_redis()
        workers = [start_worker(cluster, model_dir, f"worker-{i}") for i in range(num_workers)]
        schedulers = [start_scheduler(cluster, f"scheduler-{i}") for i in range(num_schedulers)]
        gateways = [start_gateway(cluster, model_dir, f"gateway-{i}", gateway_args) for i in range(num_gateways)]
        cluster.wait_serving(*workers, *schedulers, *gateways, timeout_s=120)
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def chaos_stack(tiny_model_dir, tmp_path_factory):
    """3 workers + 2 schedulers + 2 gateways for the module (each test breaks one more piece)."""
    cluster = start_cluster(tmp_path_factory.mktemp("chaos"), tiny_model_dir, num_workers=3, num_schedulers=2,
                            num_gateways=2)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def new_cluster(tiny_model_dir, tmp_path):
    """A factory of clusters of the given shape for one test, stopped after it."""
    clusters: list[LocalCluster] = []

    def make(*, num_workers: int, num_schedulers: int, num_gateways: int = 1, redis_ha: bool = False) -> LocalCluster:
        workdir = tmp_path / f"cluster-{len(clusters)}"
        workdir.mkdir()
        cluster = start_cluster(workdir, tiny_model_dir, num_workers=num_workers,
                                num_schedulers=num_schedulers, num_gateways=num_gateways, redis_ha=redis_ha)
        clusters.append(cluster)
        return cluster

    make.clusters = clusters
    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        clusters = [v for v in item.funcargs.values() if isinstance(v, LocalCluster)]
        clusters += getattr(item.funcargs.get("new_cluster"), "clusters", [])
        logs = "\n".join(c.logs() for c in clusters)
        if logs:  # the services' logs explain most chaos failures
            report.sections.append(("service logs", logs))
    return report
