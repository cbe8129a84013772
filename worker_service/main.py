"""``pagedserve worker``: one model worker — weights, KV cache, forward passes — behind gRPC.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`WorkerSettings` once, here. With a Redis URL the worker registers itself
under ``{prefix}workers:{worker_id}`` and keeps the entry alive with a heartbeat, so schedulers can
find it and gateways can learn the model's limits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.flags import add_common_flags, add_flag
from pagedserve.redis_keys import RedisKeys
from pagedserve.registry import Heartbeat, WorkerRecord
from pagedserve.serving import service_main
from worker_service.config import ATTENTION_BACKENDS, DTYPES, ModelRunnerConfig
from worker_service.loader import describe_auto_dtype

log = logging.getLogger("pagedserve.worker")

DEFAULT_PORT = 50061


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    runner: ModelRunnerConfig  # what to load and how big the KV cache and batch are
    host: str = "127.0.0.1"  # interface to listen on
    port: int = DEFAULT_PORT  # 0 picks a free port
    advertise_address: str = ""  # host:port schedulers dial; "" = derived from host and port
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # registry key suffix
    redis_url: str = ""  # "" = do not register
    key_prefix: str = "ps:"
    heartbeat_ttl_s: float = 10.0  # registry entry lifetime; refreshed every third of it
    drain_grace_s: float = 30.0
    step_delay_s: float = 0.0  # testing: sleep after each step (throttles generation for chaos tests)
    # SIMULATION (benchmarks/scale.py only): (a, b) replaces the model by a sleep of a + b x tokens.
    simulate_step_latency: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.heartbeat_ttl_s < 1:
            raise ValueError(f"heartbeat_ttl_s: must be >= 1, got {self.heartbeat_ttl_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s: must be >= 0, got {self.drain_grace_s}")
        if self.step_delay_s < 0:
            raise ValueError(f"step_delay_s: must be >= 0, got {self.step_delay_s}")
        RedisKeys(self.key_prefix)  # validates the prefix

    def address_for(self, port: int) -> str:
        """The address to advertise once listening on ``port``."""
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostbyname(socket.gethostname())  # reachable from other containers
        return f"{host}:{port}"


class WorkerApp:
    """A running worker: model runner + gRPC server (+ registry heartbeat). ``runner`` may be
    injected (tests share one loaded model); otherwise it is built from ``settings.runner``."""

    def __init__(self, settings: WorkerSettings, runner=None) -> None:
        self.settings = settings
        self._runner = runner
        self.servicer = None
        self.lifecycle = None
        self._heartbeat: Heartbeat | None = None
        self._redis = None
        self.address = ""

    async def start(self) -> None:
        from worker_service.grpc_server import WorkerServicer, build_server

        s = self.settings
        if self._runner is None and s.simulate_step_latency is not None:
            from worker_service.simulated_runner import build_simulated_runner

            log.warning("SIMULATION: no model runs on this worker; each step sleeps %.4f s + %.6f s per token "
                        "and returns made-up tokens (benchmarks/scale.py)", *s.simulate_step_latency)
            self._runner = await asyncio.to_thread(
                build_simulated_runner, s.runner.model, step_latency=s.simulate_step_latency,
                num_blocks=s.runner.num_blocks or 4096, block_size=s.runner.block_size,
                max_model_len=s.runner.max_model_len)
        if self._runner is None:
            from worker_service.model_runner import ModelRunner

            self._runner = await asyncio.to_thread(ModelRunner, s.runner)
        self.servicer = WorkerServicer(
            self._runner, worker_id=s.worker_id, max_num_seqs=s.runner.max_num_seqs,
            max_num_batched_tokens=s.runner.max_num_batched_tokens, step_delay_s=s.step_delay_s)
        self.lifecycle = build_server(self.servicer)
        port = self.lifecycle.bind(f"{s.host}:{s.port}")
        await self.lifecycle.start()
        self.address = s.address_for(port)
        info = self._runner.info
        if s.redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(s.redis_url)
            record = WorkerRecord(
                worker_id=s.worker_id, address=self.address, model=info.model, num_blocks=info.num_blocks,
                block_size=info.block_size, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                eos_token_ids=tuple(info.eos_token_ids))
            self._heartbeat = Heartbeat(self._redis, RedisKeys(s.key_prefix), record, s.heartbeat_ttl_s)
            await self._heartbeat.start()
        log.info("worker %s serving %s on %s (%d KV blocks of %d tokens, max_model_len %d, attention %s)",
                 s.worker_id, info.model, self.address, info.num_blocks, info.block_size, info.max_model_len,
                 getattr(self._runner, "attention_backend", "simulated"))

    async def _wait_idle_then_stop(self) -> None:
        try:
            await self.servicer.wait_idle()
        finally:  # idle, or the grace ran out: the server stops next
            self.servicer.stopping = True

    @property
    def info(self):
        """The runner's WorkerInfo (model, KV blocks, limits)."""
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
        if self._redis is not None:
            await self._redis.aclose()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve worker",
        description="Run one model worker: loads the model, allocates the paged KV cache and serves the "
                    "internal Worker gRPC API (Describe, Step stream, Reset) plus grpc.health.v1 and "
                    "reflection. A scheduler drives it; with --redis-url it registers itself so schedulers "
                    "and gateways find it. SIGTERM: leave the registry, report NOT_SERVING, finish held "
                    "requests within --drain-grace-s, exit.")
    add_flag(parser, env, "model", default="smollm2-135m",
             help="short name (smollm2-135m), Hugging Face folder, or .gguf file")
    add_flag(parser, env, "host", default="127.0.0.1", help="interface to listen on (0.0.0.0 in containers)")
    add_flag(parser, env, "port", type=int, default=DEFAULT_PORT, help="port to listen on (0 = any free port)")
    add_flag(parser, env, "advertise-address", default="",
             help="host:port schedulers should dial (default: derived from --host/--port)")
    add_flag(parser, env, "worker-id", default="", help="registry id (default: random)")
    add_flag(parser, env, "heartbeat-ttl-s", type=float, default=10.0,
             help="registry entry lifetime in seconds; refreshed every third of it")
    add_common_flags(parser, env, redis_required=False)
    add_flag(parser, env, "dtype", default="auto", choices=list(DTYPES),
             help=f"weights, activations and KV-cache dtype; {describe_auto_dtype()}")
    add_flag(parser, env, "device", default="", help="torch device (default: cuda if available, else cpu)")
    add_flag(parser, env, "block-size", type=int, default=16, help="tokens per KV-cache block")
    add_flag(parser, env, "max-num-seqs", type=int, default=128, help="rows of the persistent batch")
    add_flag(parser, env, "max-num-batched-tokens", type=int, default=2048, help="tokens per step at most")
    add_flag(parser, env, "max-model-len", type=int, default=0,
             help="prompt + output tokens at most (0: the model's max_position_embeddings)")
    add_flag(parser, env, "kv-cache-memory", default="",
             help="KV-cache budget such as 2GiB (default: a fraction of free GPU memory, 1GiB on CPU)")
    add_flag(parser, env, "num-blocks", type=int, default=0, help="exact KV blocks incl. the null block (0: from memory)")
    add_flag(parser, env, "gpu-memory-fraction", type=float, default=0.9,
             help="share of free GPU memory the KV cache may take")
    add_flag(parser, env, "attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
             help="paged-attention implementation: " + "; ".join(f"{k} = {v}" for k, v in ATTENTION_BACKENDS.items()))
    add_flag(parser, env, "step-delay-s", type=float, default=0.0,
             help="testing only: sleep this long after every step (throttles generation so chaos tests can kill "
                  "processes mid-generation)")
    add_flag(parser, env, "simulate-step-latency", default="",
             help="SIMULATION for control-plane benchmarks only: 'a,b' runs no model; each step sleeps "
                  "a + b x scheduled tokens seconds and returns made-up deterministic tokens (empty: off)")
    return parser


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    runner = ModelRunnerConfig(
        model=args.model, dtype=args.dtype, device=args.device or None, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or None, kv_cache_memory=args.kv_cache_memory or None,
        num_blocks=args.num_blocks or None, gpu_memory_fraction=args.gpu_memory_fraction,
        attention_backend=args.attention_backend)
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    simulate = None
    if args.simulate_step_latency:
        from worker_service.simulated_runner import parse_step_latency

        simulate = parse_step_latency(args.simulate_step_latency)
        if not args.worker_id:
            extra["worker_id"] = "sim-" + uuid.uuid4().hex[:8]
    return WorkerSettings(
        runner=runner, host=args.host, port=args.port, advertise_address=args.advertise_address,
        redis_url=args.redis_url, key_prefix=args.key_prefix, heartbeat_ttl_s=args.heartbeat_ttl_s,
        drain_grace_s=args.drain_grace_s, step_delay_s=args.step_delay_s, simulate_step_latency=simulate, **extra)


def make_app(settings: WorkerSettings) -> WorkerApp:
    return WorkerApp(settings)

def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("worker", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
