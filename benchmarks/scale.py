"""Control-plane scaling: throughput with 1, 2, 4, 8 workers and with 2 schedulers — SIMULATION.

*** The workers run NO model. *** Each is ``pagedserve worker --simulate-step-latency a,b``
(``worker_service/simulated_runner.py``): a step sleeps ``a + b × scheduled tokens`` seconds, a
timed model of a GPU step, and returns made-up deterministic tokens. What is measured is whether
the rest — SDK clients, gateways, Redis, scheduler(s), Step streams — keeps N simulated GPUs busy:
scaling efficiency = throughput(N) / (N × throughput(1)), goal ≥ 0.9 at 8 workers.

One cluster for the whole run (``pagedserve.local_cluster``): Redis, 8 simulated workers, the
gateways; each configuration starts its own scheduler(s) with explicit ``--workers`` lists (so
N workers means exactly those N), runs a closed loop of ``--streams-per-worker`` × N concurrent
streams (each stream issues one request after another) for a warm-up and a measured window, lets
the in-flight requests finish, and stops the scheduler(s). CPU seconds used per process kind in
the window are reported too: on a small machine they show which part saturates.

    .venv/bin/python benchmarks/scale.py                      # the default sweep
    .venv/bin/python benchmarks/scale.py --step-latency 0.05,0.00002 --window-s 20

Prints a table and writes JSON + PNG to benchmarks/results/scale-*.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class RunResult:
    name: str
    num_workers: int
    num_schedulers: int
    streams: int
    window_s: float
    output_tokens: int  # delivered to clients inside the measured window
    requests_finished: int
    throughput: float  # output tokens / s
    ideal_per_worker: float  # tokens / s one worker makes if its steps run back to back (model)
    cpu_s: dict  # CPU seconds used in the window, per process kind (+ "client")
    errors: list


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of ``pid`` and its reaped children, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / CLOCK_TICKS  # utime stime cutime cstime


def cpu_by_kind(cluster) -> dict[str, float]:
    totals: dict[str, float] = {}
    for proc in cluster.procs:
        if proc.alive:
            totals[proc.kind] = totals.get(proc.kind, 0.0) + cpu_seconds(proc.popen.pid)
    totals["client"] = cpu_seconds(os.getpid())
    return totals


async def closed_loop(gateways: list[str], streams: int, args, deadline_warm: float, deadline_end: float,
                      counter: dict) -> list[str]:
    """``streams`` concurrent loops of requests until ``deadline_end``; counts tokens that arrive
    between ``deadline_warm`` and ``deadline_end``."""
    from pagedserve.aio_client import AsyncClient

    errors: list[str] = []
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 40000) for _ in range(args.input_len)] for _ in range(streams)]
    async with AsyncClient(gateways, timeout=600) as client:
        async def loop(i: int) -> None:
            n = 0
            while time.monotonic() < deadline_end:
                try:
                    async with client.stream(prompts[i] + [n], max_tokens=args.output_len, ignore_eos=True,
                                             temperature=0) as stream:
                        async for chunk in stream:
                            now = time.monotonic()
                            if deadline_warm <= now < deadline_end:
                                counter["tokens"] += len(chunk.token_ids)
                            if chunk.finish_reason and deadline_warm <= now < deadline_end:
                                counter["finished"] += 1
                except Exception as exc:  # counted, not fatal
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                n += 1

        await asyncio.gather(*(loop(i) for i in range(streams)))
    return errors


def ideal_per_worker(args) -> float:
    """Tokens/s of one worker whose steps run back to back: each request is one prefill step of
    ``input_len`` tokens plus ``output_len - 1`` decode steps, ``streams_per_worker`` at a time."""
    a, b = args.step_latency
    s = args.streams_per_worker
    decode_step = a + b * s
    # Per request cycle (all streams in lockstep): one step carrying the prefills, then decodes.
    cycle = (a + b * s * args.input_len) + (args.output_len - 1) * decode_step
    return s * args.output_len / cycle


def run_config(cluster, workers, gateways, num_workers: int, num_schedulers: int, args) -> RunResult:
    from pagedserve.admin import scheduler_stats
    from pagedserve.local_cluster import wait_for

    chosen = workers[:num_workers]
    groups = [chosen[i::num_schedulers] for i in range(num_schedulers)]
    name = f"{num_workers}w-{num_schedulers}s"
    schedulers = [cluster.start("scheduler", f"scheduler-{name}-{i}", [
        "--workers", ",".join(w.address for w in group), "--consumer", f"{name}-{i}",
        "--max-num-seqs", str(args.streams_per_worker)]) for i, group in enumerate(groups)]
    cluster.wait_serving(*schedulers)
    for scheduler, group in zip(schedulers, groups):
        wait_for(lambda s=scheduler, g=group: sum(w.connected for w in scheduler_stats(s.address).workers) == len(g),
                 60, f"{scheduler.name} drives its {len(group)} workers", 0.2)
    streams = num_workers * args.streams_per_worker
    start = time.monotonic()
    warm, end = start + args.warmup_s, start + args.warmup_s + args.window_s
    counter = {"tokens": 0, "finished": 0}

    async def measure():
        cpu = {}

        async def snapshot_at(t: float, key: str) -> None:
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            cpu[key] = cpu_by_kind(cluster)

        errors, *_ = await asyncio.gather(
            closed_loop([g.address for g in gateways], streams, args, warm, end, counter),
            snapshot_at(warm, "start"), snapshot_at(end, "end"))
        return errors, cpu

    errors, cpu = asyncio.run(measure())
    used = {k: round(cpu["end"].get(k, 0.0) - cpu["start"].get(k, 0.0), 2) for k in cpu["end"]}
    for scheduler in schedulers:
        scheduler.popen.terminate()
    for scheduler in schedulers:
        scheduler.popen.wait(60)
    result = RunResult(name, num_workers, num_schedulers, streams, args.window_s, counter["tokens"],
                       counter["finished"], counter["tokens"] / args.window_s, ideal_per_worker(args), used,
                       sorted(set(errors))[:5])
    print(f"  {name:>7}: {result.throughput:9.1f} tok/s  ({counter['finished']} requests finished in the window; "
          f"CPU s {used})", flush=True)
    return result


def plot(results: list[RunResult], path: Path, subtitle: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    single = [r for r in results if r.num_schedulers == 1]
    base = single[0].throughput / single[0].num_workers
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r.num_workers for r in single]
    ax.plot(xs, [r.throughput for r in single], "o-", label="1 scheduler (measured)")
    ax.plot(xs, [base * x for x in xs], "--", color="gray", label="linear from 1 worker")
    ax.plot(xs, [single[0].ideal_per_worker * x for x in xs], ":", color="green", label="simulated GPU bound")
    for r in results:
        if r.num_schedulers > 1:
            ax.plot([r.num_workers], [r.throughput], "s", markersize=9, label=f"{r.num_schedulers} schedulers")
    for r in single:
        ax.annotate(f"{r.throughput / (base * r.num_workers):.0%}", (r.num_workers, r.throughput),
                    textcoords="offset points", xytext=(-10, 8))
    ax.set_xlabel("workers (SIMULATED: sleep a + b x tokens per step)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"pagedserve control-plane scaling — SIMULATION\n{subtitle}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="name, vocabulary and tokenizer only (no weights)")
    parser.add_argument("--step-latency", default="0.04,0.00002",
                        help="SIMULATED step time 'a,b': a + b x scheduled tokens seconds")
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts with one scheduler")
    parser.add_argument("--two-schedulers-at", type=int, default=8, help="also run this many workers on 2 schedulers")
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--streams-per-worker", type=int, default=16, help="concurrent streams per worker (= its batch)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    from pagedserve.local_cluster import LocalCluster
    from worker_service.simulated_runner import parse_step_latency

    args.step_latency = parse_step_latency(args.step_latency)
    counts = [int(x) for x in args.workers.split(",")]
    max_workers = max(counts + [args.two_schedulers_at])
    a, b = args.step_latency
    print(f"SIMULATION: {max_workers} workers whose steps sleep {a * 1e3:.1f} ms + {b * 1e6:.1f} us x tokens; "
          f"{args.streams_per_worker} streams per worker, {args.input_len} prompt / {args.output_len} output tokens",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-scale-") as tmp:
        cluster = LocalCluster(Path(tmp), key_prefix="scale:", log_level="WARNING", env={"OMP_NUM_THREADS": "1"})
        results: list[RunResult] = []
        try:
            cluster.start_redis(appendonly=False)
            workers = [cluster.start("worker", f"sim-worker-{i}", [
                "--model", args.model, "--simulate-step-latency", f"{a},{b}", "--worker-id", f"sim-{i}",
                "--max-num-seqs", str(args.streams_per_worker), "--num-blocks", "4096"]) for i in range(max_workers)]
            gateways = [cluster.start("gateway", f"gateway-{i}", ["--model", args.model, "--max-queued-requests", "0"])
                        for i in range(args.gateways)]
            cluster.wait_serving(*workers, *gateways, timeout_s=600)
            for n in counts:
                results.append(run_config(cluster, workers, gateways, n, 1, args))
            if args.two_schedulers_at:
                results.append(run_config(cluster, workers, gateways, args.two_schedulers_at, 2, args))
        except BaseException:
            print(cluster.logs(2000))
            raise
        finally:
            cluster.stop()

    base = results[0].throughput / results[0].num_workers
    print("\nSIMULATION — workers sleep instead of computing; this measures the control plane only")
    print(f"{'config':>8} {'tok/s':>10} {'efficiency':>11} {'vs sim. GPU bound':>18}")
    for r in results:
        eff = r.throughput / (base * r.num_workers)
        bound = r.throughput / (r.ideal_per_worker * r.num_workers)
        print(f"{r.name:>8} {r.throughput:10.1f} {eff:11.1%} {bound:18.1%}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"scale-sim-a{a * 1e3:g}ms-b{b * 1e6:g}us{'-' + args.tag if args.tag else ''}"
    payload = {
        "SIMULATION": "workers run no model: each step sleeps a + b x scheduled tokens (worker_service/simulated_runner.py)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "config": {**vars(args), "step_latency": list(args.step_latency)},
        "results": [{**asdict(r), "efficiency_vs_1_worker": r.throughput / (base * r.num_workers)} for r in results],
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    plot(results, RESULTS / f"{stem}.png",
         f"a={a * 1e3:g} ms, b={b * 1e6:g} us/token, {args.streams_per_worker} streams/worker, "
         f"{os.cpu_count()} CPUs")
    print(f"wrote {RESULTS / (stem + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
