"""A cluster of pagedserve processes on this machine, for chaos tests and benchmarks: any number of
workers, schedulers and gateways (``python -m pagedserve.cli <kind> ...``) on free loopback ports
around one redis-server — or a Redis primary with replicas watched by Sentinels
(:meth:`LocalCluster.start_redis_ha`), which the services then reach through the Sentinels — each
logging to its own file; every process can be waited for (health SERVING), killed with SIGKILL
(no drain, no goodbye) or stopped. With ``tls`` (one certificate and key for every process, and the
CA that signed it) the links are TLS: workers and schedulers require a client certificate of that
CA (mutual TLS, as the scheduler's Step streams and admin calls run in production), gateways speak
TLS to clients that verify them against the CA.

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
from servicekit.redis_layout import DEFAULT_PREFIX
from servicekit.tls import TlsFiles, sync_channel


@dataclasses.dataclass
class Proc:
    kind: str  # "redis" (a primary or replica), "sentinel", "worker", "scheduler", "gateway"
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

    def __init__(self, workdir: Path, *, key_prefix: str = DEFAULT_PREFIX, log_level: str = "INFO",
                 env: dict[str, str] | None = None, tls: TlsFiles | None = None) -> None:
        self.workdir = Path(workdir)
        self.tls = tls if tls is not None and tls.enabled else None
        self.key_prefix = key_prefix
        self.log_level = log_level
        self.procs: list[Proc] = []
        self.redis: Proc | None = None  # the primary this cluster started (with Sentinels, maybe no longer primary)
        self.sentinels: list[Proc] = []
        self.master_name = ""
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
        self.redis = self._start_redis_node("redis", port, appendonly=appendonly, workdir=self.workdir)
        return self.redis

    def _start_redis_node(self, name: str, port: int | None, *, appendonly: bool = True, workdir: Path,
                          args: tuple[str, ...] = ()) -> Proc:
        port = port or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]
        proc = self._spawn("redis", name, port, [
            find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
            "--dir", str(workdir), *args])
        wait_for(lambda: redis_pings(port) or self._exited(proc), 20, f"{name} answers PING")
        return proc

    def start_redis_ha(self, *, num_replicas: int = 1, num_sentinels: int = 3, master_name: str = "pagedserve",
                       down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> None:
        """A primary (``self.redis``, AOF on) + ``num_replicas`` replicas + ``num_sentinels``
        Sentinels (quorum: a majority) watching it under ``master_name``, all in sync and aware of
        each other before this returns. Services started afterwards reach Redis through the
        Sentinels. A primary silent for ``down_after_ms`` is failed over to a replica."""
        primary = self.start_redis()
        replicas = [self._start_redis_node(f"redis-replica-{i}", None, workdir=self.workdir / f"redis-replica-{i}",
                                           args=("--replicaof", "127.0.0.1", str(primary.port)))
                    for i in range(num_replicas)]
        for replica in replicas:
            wait_for(lambda r=replica: self._replication(r.port).get("master_link_status") == "up"
                     or self._exited(r), 30, f"{replica.name} is in sync with the primary", 0.1)
        self.master_name = master_name
        quorum = num_sentinels // 2 + 1
        for i in range(num_sentinels):
            port = free_port()
            config = self.workdir / f"sentinel-{i}.conf"  # Sentinel rewrites it: its own file, writable
            config.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.workdir}",
                f"sentinel monitor {master_name} 127.0.0.1 {primary.port} {quorum}",
                f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
                f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
                f"sentinel parallel-syncs {master_name} 1", ""]))
            sentinel = self._spawn("sentinel", f"sentinel-{i}", port, [find_redis_server(), str(config), "--sentinel"])
            wait_for(lambda s=sentinel: redis_pings(s.port) or self._exited(s), 20, f"{sentinel.name} answers PING")
            self.sentinels.append(sentinel)

        def all_aware() -> bool:
            for s in self.sentinels:
                state = self._sentinel_view(s.port)
                if (int(state.get("num-slaves", 0)) < num_replicas
                        or int(state.get("num-other-sentinels", 0)) < num_sentinels - 1):
                    return False
            return True

        wait_for(all_aware, 60, "every Sentinel sees the replicas and the other Sentinels", 0.2)

    @staticmethod
    def _replication(port: int) -> dict:
        import redis

        with redis.Redis(port=port, socket_timeout=1) as client:
            return client.info("replication")

    def _sentinel_view(self, port: int) -> dict:
        import redis

        with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
            return client.sentinel_master(self.master_name)

    @property
    def sentinel_addresses(self) -> str:
        return ",".join(s.address for s in self.sentinels)

    def primary_port(self) -> int:
        """The port of the primary a live Sentinel names now."""
        import redis

        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            with redis.Redis(port=sentinel.port, socket_timeout=1, decode_responses=True) as client:
                _, port = client.sentinel_get_master_addr_by_name(self.master_name)
                return int(port)
        raise RuntimeError("no live Sentinel")

    def start(self, kind: str, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """``pagedserve <kind> --port P --redis-url ... --key-prefix ... <args>`` on a free port
        (with ``--redis-sentinels ... --redis-master-name ...`` after :meth:`start_redis_ha`)."""
        port = free_port()
        redis_args = ["--redis-url", self.redis_url]
        if self.sentinels:  # the URL's host and port are then ignored: the Sentinels name the primary
            redis_args += ["--redis-sentinels", self.sentinel_addresses, "--redis-master-name", self.master_name]
        argv = [sys.executable, "-m", "pagedserve.cli", kind, "--port", str(port), *redis_args,
                "--key-prefix", self.key_prefix, "--log-level", self.log_level, *self._tls_args(kind), *args]
        if env:
            saved, self.env = self.env, {**self.env, **env}
            try:
                return self._spawn(kind, name, port, argv)
            finally:
                self.env = saved
        return self._spawn(kind, name, port, argv)

    def _tls_args(self, kind: str) -> list[str]:
        if self.tls is None:
            return []
        pair = ["--tls-cert-file", self.tls.cert_file, "--tls-key-file", self.tls.key_file]
        # a gateway's clients carry no certificate: its CA option would require one of them
        return pair if kind == "gateway" else [*pair, "--tls-ca-file", self.tls.ca_file]

    def wait_serving(self, *procs: Proc, timeout_s: float = 300) -> None:
        for proc in procs:
            wait_for(lambda p=proc: self._serving(p), timeout_s, f"{proc.name} reports SERVING", 0.1)

    def _exited(self, proc: Proc) -> bool:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        return False

    def _serving(self, proc: Proc) -> bool:
        self._exited(proc)
        with sync_channel(proc.address, self.tls) as channel:
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
        services = [p for p in self.procs if p.kind not in ("redis", "sentinel")]
        for group in (services, [p for p in self.procs if p.kind == "sentinel"],
                      [p for p in self.procs if p.kind == "redis"]):
            for proc in group:
                if proc.alive:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                    proc.popen.wait(5)
