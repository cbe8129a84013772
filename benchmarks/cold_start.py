"""Scale from zero: how long requests that wait for a worker take once one is launched.

A local cluster of processes (``pagedserve.local_cluster``): Redis, a gateway with
``--worker-wait-s`` (it admits while no worker is registered) and a scheduler, but no worker.
``--requests`` generations are sent over gRPC; ``--worker-after-s`` later a worker is launched.
Reported: seconds from the worker's launch to every answer, and where they went, read from the
services' logs — the worker's imports (until its first log line), loading and packing the weights,
faulting in the KV cache, until it serves, until the scheduler drives it, and the rest (the first
steps and the answers).

    python benchmarks/cold_start.py                      # SmolLM2-135M, 4 requests, worker after 5 s
    python benchmarks/cold_start.py --rounds 3 --tag x   # three clusters in a row

Results: ``benchmarks/results/cold_start[-<tag>].json`` and a PNG of the breakdown per round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.aio_client import AsyncClient  # noqa: E402
from pagedserve.local_cluster import LocalCluster  # noqa: E402
from tenant_fairness import cpu_flags  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (milestone, the log line that marks it): the worker's own, then the scheduler's
WORKER_MARKS = (("imports", re.compile(r"worker_service\.loader: model dtype")),
                ("weights", re.compile(r"GEMM weights laid out")),  # bf16 on the CPU only: else within kv_cache
                ("kv_cache", re.compile(r"KV cache: \d+ blocks")),
                ("serving", re.compile(r"pagedserve\.worker: worker \S+ serving")))
SCHEDULER_MARK = re.compile(r"driving worker")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamp_of(line: str) -> float | None:
    """The wall-clock time of a service's log line (its logging format), or None."""
    match = STAMP.match(line)
    if match is None:
        return None
    return datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_stamp(log: Path, pattern: re.Pattern, after: float) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if pattern.search(line):
            t = stamp_of(line)
            if t is not None and t >= after - 0.01:
                return t
    return None


async def one_round(args: argparse.Namespace, workdir: Path) -> dict:
    cluster = LocalCluster(workdir, key_prefix="coldstart:", env={"OMP_NUM_THREADS": str(args.torch_threads)})
    try:
        cluster.start_redis(appendonly=False)
        gateway = cluster.start("gateway", "gateway", ["--model", args.model, "--worker-wait-s", str(args.worker_wait_s)])
        scheduler = cluster.start("scheduler", "scheduler", [])
        cluster.wait_serving(gateway, scheduler)
        async with AsyncClient(gateway.address, timeout=args.worker_wait_s + 60) as client:
            sent = time.time()
            calls = [asyncio.create_task(client.generate(f"Request {i}: count to ten.", max_tokens=args.max_tokens,
                                                         ignore_eos=True, temperature=0))
                     for i in range(args.requests)]
            await asyncio.sleep(args.worker_after_s)
            launched = time.time()
            worker = cluster.start("worker", "worker", ["--model", args.model, *args.worker_arg])
            answered = []
            for call in asyncio.as_completed(calls):
                completion = await call
                answered.append(time.time())
                assert len(completion.token_ids) == args.max_tokens, completion
        marks = {name: first_stamp(worker.log, pattern, launched) for name, pattern in WORKER_MARKS}
        marks["driven"] = first_stamp(scheduler.log, SCHEDULER_MARK, launched)
        marks["answered"] = max(answered)
        parts, before = {}, launched
        for name in ("imports", "weights", "kv_cache", "serving", "driven", "answered"):
            if marks[name] is not None:
                parts[name] = round(marks[name] - before, 3)
                before = marks[name]
        return {"launch_to_answers_s": round(max(answered) - launched, 3),
                "first_answer_after_launch_s": round(min(answered) - launched, 3),
                "waited_before_launch_s": round(launched - sent, 3), "parts_s": parts}
    finally:
        cluster.stop()


def plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("imports", "weights", "kv_cache", "serving", "driven", "answered")
    labels = {"imports": "imports", "weights": "weights (load, pack)", "kv_cache": "KV cache",
              "serving": "until serving", "driven": "until the scheduler drives it", "answered": "first steps, answers"}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(rounds)))
    for i, r in enumerate(rounds):
        left = 0.0
        for name in names:
            width = r["parts_s"].get(name, 0.0)
            ax.barh(i, width, left=left, label=labels[name] if i == 0 else None)
            left += width
    ax.set_yticks(range(len(rounds)), [f"round {i + 1}" for i in range(len(rounds))])
    ax.set_xlabel("seconds after the worker's launch")
    ax.set_title("scale from zero: requests waiting, then a worker")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=4, help="generations waiting for the worker")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--worker-after-s", type=float, default=5.0, help="seconds between the requests and the worker")
    parser.add_argument("--worker-wait-s", type=float, default=120.0, help="the gateway's --worker-wait-s")
    parser.add_argument("--worker-arg", action="append", default=[], help="an extra argument for the worker")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)

    rounds = []
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="pagedserve-cold-") as tmp:
            result = asyncio.run(one_round(args, Path(tmp)))
        rounds.append(result)
        parts = ", ".join(f"{name} {s:.2f}" for name, s in result["parts_s"].items())
        print(f"round {k + 1}: all {args.requests} answered {result['launch_to_answers_s']:.2f} s after the "
              f"worker's launch ({parts})", flush=True)
    totals = [r["launch_to_answers_s"] for r in rounds]
    report = {
        "benchmark": "cold_start",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "cpu_flags": cpu_flags(), "platform": platform.platform(),
                    "load_average": os.getloadavg()},
        "rounds": rounds,
        "launch_to_answers_s": {"median": statistics.median(totals), "min": min(totals), "max": max(totals)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "cold_start" + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        plot(rounds, args.out / f"{stem}.png")
    print(f"median {statistics.median(totals):.2f} s over {len(totals)} round(s); wrote {args.out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
