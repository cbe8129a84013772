"""``pagedserve worker``: one model worker — weights, KV cache, forward passes — behind gRPC.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`~worker_service.config.WorkerConfig` once, here. With a Redis URL the worker registers itself
under ``{prefix}workers:{worker_id}`` and keeps the entry alive with a heartbeat, so schedulers can
find it and gateways can learn the model's limits.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from servicekit import redis_client
from servicekit.flags import service_parser, settings_kwargs
from servicekit.metrics import MetricsPort
from servicekit.redis_layout import RedisKeys
from servicekit.registry import Heartbeat
from servicekit.serving import is_loopback, service_main
from servicekit.tls import describe as describe_link
from worker_service.config import ModelRunnerConfig, WorkerConfig
from worker_service.metrics import WorkerCollector

log = logging.getLogger("pagedserve.worker")

class WorkerApp:
    """A running worker: model runner + gRPC server (+ registry heartbeat). ``runner`` may be
    injected (tests share one loaded model); otherwise it is built from ``settings.runner``.
    ``whole_process``: the worker is all its process runs (``pagedserve worker``), so it may pin the
    process's threads (``--bind-cpu-threads``); a worker started inside another program never does."""

    def __init__(self, settings: WorkerConfig, runner=None, *, whole_process: bool = False) -> None:
        self.settings = settings
        self._runner = runner
        self._whole_process = whole_process
        self.servicer = None
        self.lifecycle = None
        self._heartbeat: Heartbeat | None = None
        self._redis = None
        self.address = ""
        self.metrics: MetricsPort | None = None
        self.metrics_port = -1  # -1: /metrics not served

    async def start(self) -> None:
        from worker_service.grpc_server import WorkerServicer, build_server

        s = self.settings
        # Every torch call of this process runs on this one thread, loading included: each thread
        # that enters OpenMP gets a team of its own, and two teams on the same cores cost the steps
        # ~12 % on 2 CPU cores (measured: 1.65 cores busy instead of 1.99).
        runner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        loop = asyncio.get_running_loop()
        if self._runner is None and s.simulate_step_latency is not None:
            from worker_service.simulated_runner import build_simulated_runner

            log.warning("SIMULATION: no model runs on this worker; each step sleeps %.4f s + %.6f s per token "
                        "and returns made-up tokens (benchmarks/scale.py)", *s.simulate_step_latency)
            self._runner = await loop.run_in_executor(runner_thread, functools.partial(
                build_simulated_runner, s.runner.model, step_latency=s.simulate_step_latency,
                num_blocks=s.runner.num_blocks or 4096, block_size=s.runner.block_size,
                max_model_len=s.runner.max_model_len))
        if self._runner is None:
            from worker_service.model_runner import ModelRunner

            self._runner = await loop.run_in_executor(runner_thread, ModelRunner, s.runner)
            if self._whole_process and s.bind_cpu_threads and self._runner.device.type == "cpu":
                from worker_service.cpu_affinity import bind_worker_threads

                log.info("%s", await loop.run_in_executor(runner_thread, bind_worker_threads))
        self.servicer = WorkerServicer(
            self._runner, worker_id=s.worker_id, max_num_seqs=s.runner.max_num_seqs,
            max_num_batched_tokens=s.runner.max_num_batched_tokens, step_delay_s=s.step_delay_s,
            executor=runner_thread)
        if redis_client.uses_redis(s):  # first: wrong credentials stop the worker before it listens
            self._redis = redis_client.connect(s)
            await redis_client.check_credentials(self._redis, s)
        if not s.tls.enabled and not s.internal_token and not is_loopback(s.host):
            log.warning("no TLS and no internal token: anyone who reaches %s:%d may drive this worker", s.host, s.port)
        self.lifecycle = build_server(self.servicer, internal_token=s.internal_token)
        port = self.lifecycle.bind(f"{s.host}:{s.port}", s.tls)
        await self.lifecycle.start()
        self.address = s.address_for(port)
        info = self._runner.info
        self.lifecycle.registry.register(WorkerCollector(self.servicer, info, self.address))
        self.metrics = MetricsPort(self.lifecycle.registry, name="worker")
        self.metrics_port = await self.metrics.start(s.host, s.metrics_port)
        if redis_client.uses_redis(s):
            record = info.at(worker_id=s.worker_id, address=self.address)
            self._heartbeat = Heartbeat(self._redis, RedisKeys(s.key_prefix), record, s.heartbeat_ttl_s)
            await self._heartbeat.start()
        log.info("worker %s serving %s on %s (%d KV blocks of %d tokens, max_model_len %d, attention %s; %s)",
                 s.worker_id, info.model, self.address, info.num_blocks, info.block_size, info.max_model_len,
                 getattr(self._runner, "attention_backend", "simulated"),
                 describe_link(s.tls, token=bool(s.internal_token)))

    async def _wait_idle_then_stop(self) -> None:
        try:
            await self.servicer.wait_idle()
        finally:  # idle, or the grace ran out: the server stops next
            self.servicer.stopping = True

    @property
    def info(self):
        """The runner's WorkerDescription (model, KV blocks, limits)."""
        return self._runner.info

    async def drain(self, grace_s: float | None = None) -> None:
        """Leave the registry, go NOT_SERVING, let held requests finish, stop."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        if self.lifecycle is not None:
            await self.lifecycle.drain(grace, self._wait_idle_then_stop)
        if self.servicer is not None:
            self.servicer.close()
        if self.metrics is not None:
            await self.metrics.stop()
        if self._redis is not None:
            await self._redis.aclose()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return service_parser(
        "pagedserve worker",
        "Run one model worker: loads the model, allocates the paged KV cache and serves the "
                    "internal Worker gRPC API (Describe, Step stream, Reset) plus grpc.health.v1 and "
                    "reflection. A scheduler drives it; with --redis-url it registers itself so schedulers "
                    "and gateways find it. SIGTERM: leave the registry, report NOT_SERVING, finish held "
                    "requests within --drain-grace-s, exit.", env, ModelRunnerConfig, WorkerConfig)


def settings_from_args(args: argparse.Namespace) -> WorkerConfig:
    kwargs = settings_kwargs(WorkerConfig, args)
    if kwargs.get("simulate_step_latency") and "worker_id" not in kwargs:
        kwargs["worker_id"] = "sim-" + uuid.uuid4().hex[:8]
    return WorkerConfig(runner=ModelRunnerConfig(**settings_kwargs(ModelRunnerConfig, args)), **kwargs)


def make_app(settings: WorkerConfig) -> WorkerApp:
    runner = settings.runner
    if runner.tune_malloc and runner.device in (None, "cpu") and settings.simulate_step_latency is None:
        from worker_service import cpu_memory

        # Before any thread of the process exists (gRPC's, the model runner's): all then allocate
        # from the main heap (cpu_memory.tune_malloc says why).
        cpu_memory.tune_malloc(one_heap=True)
    return WorkerApp(settings, whole_process=True)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("worker", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
