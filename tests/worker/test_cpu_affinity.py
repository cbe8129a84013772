"""worker_service.cpu_affinity: when a CPU worker pins its threads, and the layout it makes.

The pinning itself runs in a child process: pinned threads keep their mask, and the test process
(with everything it starts later) must not be confined to one CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker_service import cpu_affinity
from worker_service.cpu_affinity import plan

ROOT = Path(__file__).resolve().parents[2]


def test_plan_pins_only_one_thread_per_allowed_cpu():
    assert plan(2, {3, 1}) == [1, 3]  # thread 0 (the runner) on the lowest CPU
    assert plan(4, {0, 1, 2, 3}) == [0, 1, 2, 3]
    assert plan(1, {0}) is None  # nothing to keep apart
    assert plan(2, {0, 1, 2, 3}) is None  # fewer threads than CPUs: may share the machine with another worker
    assert plan(4, {0, 1}) is None  # more threads than CPUs: pinning would stack them


def test_off_linux_nothing_is_pinned(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert cpu_affinity.bind_worker_threads().startswith("CPU threads not pinned (thread placement is only set on Linux")


CHILD = textwrap.dedent("""
    import json, os, threading
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:2]))
    import torch
    torch.set_num_threads(2)
    from concurrent.futures import ThreadPoolExecutor
    from worker_service import cpu_affinity
    service = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)  # a gRPC-like thread
    service.start()
    runner = ThreadPoolExecutor(max_workers=1)
    runner.submit(lambda: torch.ones(256, 256) @ torch.ones(256, 256)).result()  # the team exists, as after loading
    message = runner.submit(cpu_affinity.bind_worker_threads).result()
    masks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    runner_tid = runner.submit(threading.get_native_id).result()
    later = threading.Thread(target=lambda: masks.setdefault("later", sorted(os.sched_getaffinity(0))))
    later.start(); later.join()
    out = runner.submit(lambda: (torch.ones(512, 512) @ torch.ones(512, 512)).sum().item()).result()
    print(json.dumps({"message": message, "masks": {str(k): v for k, v in masks.items()},
                      "runner": runner_tid, "main": threading.get_native_id(), "service": service.native_id,
                      "matmul": out}))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin two threads apart")
def test_worker_threads_pinned_team_apart_service_threads_with_a_helper():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["message"].startswith("CPU threads pinned"), result["message"]
    masks = {k: v for k, v in result["masks"].items() if k != "later"}
    first, second = sorted(os.sched_getaffinity(0))[:2]
    runner, main, service = str(result["runner"]), str(result["main"]), str(result["service"])
    assert masks[runner] == [first]  # team thread 0: the runner thread, alone on its CPU
    assert [tid for tid, m in masks.items() if m == [first]] == [runner]
    assert masks[main] == [second] and masks[service] == [second]  # service threads share the helper's CPU
    assert all(len(m) == 1 for m in masks.values())  # no thread left floating
    assert result["masks"]["later"] == [second]  # threads started later inherit the service CPU
    assert result["matmul"] == 512.0 ** 3  # torch still computes on the pinned team
