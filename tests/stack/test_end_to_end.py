"""`pagedserve serve` as real processes (Redis, worker, scheduler, gateway), driven by the blocking
SDK; Ctrl-C / SIGTERM stops every process cleanly."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.client import Client
from servicekit.contract.sampling_params import SamplingParams
from servicekit import serving
from servicekit.serving import PARENT_PID_ENV

from helpers.stack import DTYPE, REPO, free_port

pytestmark = [pytest.mark.service, pytest.mark.slow]


def _serve(model_dir: str, log: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    """`pagedserve serve` on free ports, once it says it is serving."""
    ports = {name: free_port() for name in ("port", "http-port", "scheduler-port", "worker-port", "redis-port")}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model_dir,
             *(f"--{k}={v}" for k, v in ports.items()), "--worker-arg=--num-blocks=512", f"--worker-arg=--dtype={DTYPE}",
             "--worker-arg=--max-num-seqs=32", "--drain-grace-s=3"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 180
    while "is serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pagedserve serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, ports


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, ports = _serve(tiny_model_dir, log)
    yield f"127.0.0.1:{ports['port']}", proc, log
    if proc.poll() is None:
        proc.kill()


def test_stack_of_processes_streams_what_llm_generates(served, llm):
    address, _proc, _log = served
    prompt = "In a hole in the ground there lived"
    expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    with Client(address, timeout=60) as client:
        info = client.model_info()
        with client.stream(prompt, max_tokens=24, temperature=0, ignore_eos=True) as stream:
            chunks = list(stream)
        whole = client.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
    assert info.max_model_len == 512 and info.num_workers == 1
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert list(whole.token_ids) == expected.token_ids and whole.finish_reason == "length"


def test_sigint_stops_every_process_cleanly(served):
    _address, proc, log = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    for service in ("gateway", "scheduler", "worker"):
        assert f"{service} stopped" in text
    assert "pagedserve serve: stopped" in text
    assert re.search(r"is serving \S+ at \S+ \(started in \d+\.\d s", text)  # how long the start took


def _started_by(launcher_pid: int, redis_port: int) -> list[int]:
    """The live processes a launcher started: the services carry its pid in PAGEDSERVE_PARENT_PID;
    Redis writes its title over its environment, so it is known by its port."""
    mark, redis = f"{PARENT_PID_ENV}={launcher_pid}".encode(), f"127.0.0.1:{redis_port}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ours = (mark in (entry / "environ").read_bytes().split(b"\0")
                    or (b"redis-server" in (cmdline := (entry / "cmdline").read_bytes()) and redis in cmdline))
        except OSError:  # gone meanwhile, or not ours
            continue
        if ours and not _exited(int(entry.name)):
            found.append(int(entry.name))
    return found


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped (an orphan's new parent in a container may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_a_killed_launcher_leaves_no_process_behind(tiny_model_dir, tmp_path):
    """`pagedserve serve` killed with SIGKILL cannot stop its children: each service notices its
    launcher is gone and drains and exits; Redis gets SIGTERM from the kernel (setpriv --pdeathsig)."""
    log = tmp_path / "serve.log"
    proc, ports = _serve(tiny_model_dir, log)
    children = _started_by(proc.pid, ports["redis-port"])
    try:
        assert len(children) == 4, children  # Redis, worker, scheduler, gateway

        proc.kill()
        proc.wait(10)

        deadline = time.monotonic() + 30
        while [pid for pid in children if not _exited(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in children if not _exited(pid)]
        assert not left, log.read_text()[-3000:]
    finally:  # nothing outlives the test, whatever failed
        proc.kill()
        for pid in children:
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert text.count(f"the launcher (pid {proc.pid}) is gone: draining") == 3, text[-3000:]
    for service in ("gateway", "scheduler", "worker"):
        assert f"{service} stopped" in text


def test_the_parent_pid_is_watched_only_when_it_is_the_parent(caplog):
    parent = os.getppid()
    assert serving._parent_pid({PARENT_PID_ENV: str(parent)}, "worker") == parent
    assert serving._parent_pid({}, "worker") is None
    assert serving._parent_pid({PARENT_PID_ENV: "launcher"}, "worker") is None
    assert serving._parent_pid({PARENT_PID_ENV: str(parent + 1)}, "worker") is None  # leaked into another process
    assert "ignoring PAGEDSERVE_PARENT_PID" in caplog.text


async def test_waiting_for_the_parent_ends_when_the_process_is_reparented(monkeypatch):
    parents = iter([41, 41, 41, 1])
    monkeypatch.setattr(os, "getppid", lambda: next(parents))

    await asyncio.wait_for(serving.wait_for_parent_exit(41, poll_s=0.01), 5)


def test_the_launcher_stops_the_gateway_first_and_redis_last_whatever_the_start_order():
    """The gateway starts beside the worker, the scheduler after it; stopping still goes gateway
    (its streams drain while the rest serves), scheduler, worker, Redis."""
    from pagedserve.launcher import Child, Stack, StackConfig

    stopped: list[str] = []

    class FakeProcess:
        def __init__(self, name: str) -> None:
            self.name, self.returncode = name, None

        def poll(self):
            return self.returncode

        def send_signal(self, signum):
            stopped.append(self.name)
            self.returncode = -signum

        def wait(self, timeout=None):
            return self.returncode

    stack = Stack(StackConfig(drain_grace_s=0.1))
    stack.children = [Child(name, FakeProcess(name)) for name in ("redis", "worker", "gateway", "scheduler")]
    assert stack.stop() == 0
    assert stopped == ["gateway", "scheduler", "worker", "redis"]


def test_the_launcher_hands_the_output_ttl_to_the_gateway_and_the_scheduler(monkeypatch):
    """`pagedserve serve --output-ttl-s N`: both sides of the output streams (the gateway sets the
    TTL at admission, the scheduler keeps it on every write) get N; the worker has no such flag."""
    from pagedserve.launcher import Child, Stack, StackConfig

    argv: dict[str, list[str]] = {}
    stack = Stack(StackConfig(output_ttl_s=45, redis_url="redis://127.0.0.1:1/0"))
    monkeypatch.setattr(stack, "_service", lambda name, args, port: argv.setdefault(name, args) and Child(name, None))
    for wait in ("_wait_serving", "_wait_answering"):
        monkeypatch.setattr(stack, wait, lambda *a: None)
    stack.start()
    for name in ("gateway", "scheduler"):
        assert argv[name][argv[name].index("--output-ttl-s") + 1] == "45", argv[name]
    assert "--output-ttl-s" not in argv["worker"]


def test_free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice():
    # A port from bind(0) is ephemeral: an outgoing connection may take it as its source port
    # before the child process binds it.
    from pagedserve import launcher

    low = launcher._ephemeral_low()
    ports = [launcher.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 12000:
        assert all(10000 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free: nothing holds it
