"""`pagedserve serve` as real processes (Redis, worker, scheduler, gateway), driven by the blocking
SDK; Ctrl-C / SIGTERM stops every process cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve.client import Client
from servicekit.contract.sampling_params import SamplingParams

from .conftest import DTYPE, REPO, free_port

pytestmark = [pytest.mark.service, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    ports = {name: free_port() for name in ("port", "http-port", "scheduler-port", "worker-port", "redis-port")}
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", tiny_model_dir,
             *(f"--{k}={v}" for k, v in ports.items()), "--worker-arg=--num-blocks=512", f"--worker-arg=--dtype={DTYPE}",
             "--worker-arg=--max-num-seqs=32", "--drain-grace-s=3"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 180
    while "is serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pagedserve serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
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
