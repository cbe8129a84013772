"""A cluster of pagedserve processes on this machine, for chaos tests and benchmarks: any number of
workers, schedulers and gateways (``python -m pagedserve.cli <kind> ...``) on free loopback ports
around one redis-server, each logging to its own file; every process can be waited for (health
SERVING), killed with SIGKILL (no drain, no goodbye) or stopped.

``pagedserve serve`` (``pagedserve.launcher``) is the one-of-each stack for people; this is the
many-of-each one for programs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.launcher import REPO_ROOT, find_redis_server, free_port, redis_pings


@dataclasses.dataclass
class Proc:
    kind: str  # "redis", "worker", "scheduler", "gateway"
    name: str
    port: int
    popen: subprocess.Popen
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting until {what}")
        time.sleep(interval_s)


class LocalCluster:
    """Processes under ``workdir`` (logs, Redis' append-only file), all under one key prefix."""

    def __init__(self, workdir: Path, *, key_prefix: str = "ps:", log_level: str = "INFO",
                 env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.key_prefix = key_prefix
        self.log_level = log_level
        self.procs: list[Proc] = []
        self.redis: Proc | None = None
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH", "")) if p)
        base["PYTHONUNBUFFERED"] = "1"
        base["PAGEDSERVE_HTTP_PORT"] = "0"  # several gateways on one host: each HTTP API on a free port
        base.update(env or {})
        self.env = base

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"

    def _spawn(self, kind: str, name: str, port: int, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT,
                                     start_new_session=True)
        proc = Proc(kind, name, port, popen, log)
        self.procs.append(proc)
        return proc

    def start_redis(self, port: int | None = None, *, appendonly: bool = True) -> Proc:
        """redis-server, with the append-only file fsynced every second when ``appendonly`` (as
        compose runs it). Restarting on the same ``port`` reloads that file."""
        port = port or free_port()
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]
        self.redis = self._spawn("redis", "redis", port, [
            find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
            "--dir", str(self.workdir)])
        wait_for(lambda: redis_pings(port) or self._exited(self.redis), 20, "redis-server answers PING")
        return self.redis

    def start(self, kind: str, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """``pagedserve <kind> --port P --redis-url ... --key-prefix ... <args>`` on a free port."""
        port = free_port()
        argv = [sys.executable, "-m", "pagedserve.cli", kind, "--port", str(port), "--redis-url", self.redis_url,
                "--key-prefix", self.key_prefix, "--log-level", self.log_level, *args]
        if env:
            saved, self.env = self.env, {**self.env, **env}
            try:
                return self._spawn(kind, name, port, argv)
            finally:
                self.env = saved
        return self._spawn(kind, name, port, argv)

    def wait_serving(self, *procs: Proc, timeout_s: float = 300) -> None:
        for proc in procs:
            wait_for(lambda p=proc: self._serving(p), timeout_s, f"{proc.name} reports SERVING", 0.1)

    def _exited(self, proc: Proc) -> bool:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        return False

    def _serving(self, proc: Proc) -> bool:
        self._exited(proc)
        with grpc.insecure_channel(proc.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def kill(self, proc: Proc) -> None:
        """SIGKILL: the process gets no chance to drain, deregister or release anything."""
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def live(self, kind: str) -> list[Proc]:
        return [p for p in self.procs if p.kind == kind and p.alive]

    def logs(self, n: int = 4000) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.tail(n)}" for p in self.procs if p.kind != "redis")

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM the services (they drain), then Redis; SIGKILL what outlives ``grace_s``."""
        services = [p for p in self.procs if p.kind != "redis"]
        for group in (services, [p for p in self.procs if p.kind == "redis"]):
            for proc in group:
                if proc.alive:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                    proc.popen.wait(5)
