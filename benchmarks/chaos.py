"""Fault tolerance under load with a real model: kill -9 a worker at a random point of a run.

A local cluster (``pagedserve.local_cluster``): Redis with its append-only file, 2 workers running
``--model`` on the CPU (torch threads 1 each), 1 scheduler, 1 gateway. The same ``--num-streams``
greedy, seeded streams run twice: once without faults (the reference), once while a randomly
chosen worker is killed with SIGKILL when a random share of the run's tokens has been delivered.
Its requests resume on the surviving worker from prompt + delivered tokens.

Reported (goals in brackets): requests lost [0], duplicated indices [0], missing indices [0],
outputs that differ from the reference [0], the longest stall a client saw (largest gap between
two chunks of one stream, time to first token excluded) [< 2 s + the recompute time], how long
the scheduler took to resume the dead worker's requests on the other one (detection + placement),
and the recompute estimate (the longest stall across the kill minus that).

    .venv/bin/python benchmarks/chaos.py [--model smollm2-135m] [--num-streams 64] [--output-len 32]

Prints a summary and writes JSON + PNG to benchmarks/results/chaos-*.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"


@dataclass
class StreamRecord:
    indices: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each chunk with tokens
    finish_reason: str | None = None
    error: str = ""

    def longest_gap(self) -> float:
        """The longest wait between two chunks once tokens flow (time to first token excluded)."""
        times = self.arrivals
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def ttft(self, start: float) -> float:
        return self.arrivals[0] - start if self.arrivals else 0.0

    def gap_spanning(self, t: float) -> float | None:
        """The gap between the last chunk before ``t`` and the first after it (None: none after)."""
        before = [a for a in self.arrivals if a <= t]
        after = [a for a in self.arrivals if a > t]
        if not before or not after:
            return None
        return after[0] - before[-1]


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1000, 40000) for _ in range(length)] for _ in range(n)]


async def run_streams(gateway: str, prompts: list[list[int]], args, on_tokens=None) -> tuple[list[StreamRecord], float]:
    from pagedserve.aio_client import AsyncClient

    records = [StreamRecord() for _ in prompts]
    start = time.monotonic()
    async with AsyncClient(gateway, timeout=900) as client:
        async def one(i: int) -> None:
            rec = records[i]
            try:
                async with client.stream(prompts[i], max_tokens=args.output_len, temperature=0, seed=i,
                                         ignore_eos=True) as stream:
                    async for chunk in stream:
                        if chunk.token_ids:
                            rec.arrivals.append(time.monotonic())
                            rec.indices.extend(range(chunk.first_index, chunk.first_index + len(chunk.token_ids)))
                            rec.tokens.extend(chunk.token_ids)
                            if on_tokens is not None:
                                on_tokens(len(chunk.token_ids))
                        rec.finish_reason = chunk.finish_reason or rec.finish_reason
            except Exception as exc:  # a lost request is a result, not a crash
                rec.error = f"{type(exc).__name__}: {exc}"[:300]

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records, start


async def faulty_run(cluster, gateway: str, scheduler, prompts, args, rng: random.Random) -> dict:
    from pagedserve.admin import async_scheduler_stats

    total = len(prompts) * args.output_len
    kill_at_tokens = int(total * rng.uniform(args.kill_after_min, args.kill_after_max))
    victim = rng.choice(cluster.live("worker"))
    delivered = {"n": 0}
    killed = asyncio.Event()
    info: dict = {"victim": victim.name, "kill_at_tokens": kill_at_tokens, "total_tokens": total}

    def on_tokens(n: int) -> None:
        delivered["n"] += n
        if delivered["n"] >= kill_at_tokens and not killed.is_set():
            killed.set()

    async def killer() -> None:
        await killed.wait()
        before = await async_scheduler_stats(scheduler.address)
        held = {w.address: w.num_running + w.num_waiting for w in before.workers}
        info["victim_held_requests"] = held.get(victim.address, 0)
        info["delivered_at_kill"] = delivered["n"]
        info["kill_time"] = time.monotonic()
        cluster.kill(victim)
        while True:  # how long until the scheduler resumed the dead worker's requests elsewhere
            stats = await async_scheduler_stats(scheduler.address)
            if stats.num_resumed > before.num_resumed or info["victim_held_requests"] == 0:
                info["resume_latency_s"] = time.monotonic() - info["kill_time"]
                info["num_resumed"] = stats.num_resumed - before.num_resumed
                return
            await asyncio.sleep(0.02)

    kill_task = asyncio.create_task(killer())
    records, start = await run_streams(gateway, prompts, args, on_tokens)
    await asyncio.wait_for(kill_task, 60)
    info["records"], info["start"] = records, start
    return info


def compare(reference: list[StreamRecord], faulty: list[StreamRecord], args) -> dict:
    lost = duplicated = missing = mismatched = 0
    for ref, got in zip(reference, faulty):
        if got.error or got.finish_reason is None:
            lost += 1
            continue
        seen = set()
        for i in got.indices:
            duplicated += i in seen
            seen.add(i)
        missing += len(set(range(args.output_len)) - seen)
        mismatched += got.tokens != ref.tokens
    return {"requests_lost": lost, "duplicated_indices": duplicated, "missing_indices": missing,
            "mismatched_outputs": mismatched}


def plot(reference, ref_start, info, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    start, kill = info["start"], info["kill_time"]
    for i, rec in enumerate(info["records"]):
        ax.plot([a - start for a in rec.arrivals], [i] * len(rec.arrivals), ".", markersize=2,
                color="tab:red" if (rec.gap_spanning(kill) or 0) > 1.0 else "tab:blue")
    ax.axvline(kill - start, color="black", linestyle="--", label=f"kill -9 {info['victim']}")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("stream")
    ax.set_title("token arrivals per stream (red: stalled > 1 s across the kill)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1]
    spans = [g for g in (rec.gap_spanning(kill) for rec in info["records"]) if g is not None]
    ref_gaps = [b - a for rec in reference for a, b in zip(rec.arrivals, rec.arrivals[1:])]
    ax.hist(ref_gaps, bins=40, alpha=0.6, label="gaps between chunks, run without faults", density=True)
    ax.hist(spans, bins=20, alpha=0.6, label="gap spanning the kill, run with the kill", density=True)
    ax.set_xlabel("seconds")
    ax.set_title("client-side stalls", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-streams", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of each worker")
    parser.add_argument("--kill-after-min", type=float, default=0.2, help="kill once this share of tokens arrived...")
    parser.add_argument("--kill-after-max", type=float, default=0.7, help="...or up to this share (uniform)")
    parser.add_argument("--seed", type=int, default=0, help="picks the victim and the kill point")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    from pagedserve.local_cluster import LocalCluster

    rng = random.Random(args.seed)
    prompts = make_prompts(args.num_streams, args.input_len, args.seed)
    with tempfile.TemporaryDirectory(prefix="pagedserve-chaos-") as tmp:
        cluster = LocalCluster(Path(tmp), key_prefix="chaosbench:", env={"OMP_NUM_THREADS": str(args.torch_threads)})
        try:
            cluster.start_redis()
            workers = [cluster.start("worker", f"worker-{i}", ["--model", args.model, "--worker-id", f"worker-{i}",
                                                                "--heartbeat-ttl-s", "3"]) for i in range(2)]
            scheduler = cluster.start("scheduler", "scheduler", ["--consumer", "scheduler"])
            gateway = cluster.start("gateway", "gateway", ["--model", args.model])
            cluster.wait_serving(*workers, scheduler, gateway, timeout_s=900)
            from pagedserve.admin import scheduler_stats
            from pagedserve.local_cluster import wait_for

            wait_for(lambda: sum(w.connected for w in scheduler_stats(scheduler.address).workers) == 2, 60,
                     "the scheduler drives both workers", 0.2)
            print(f"reference run: {args.num_streams} streams x {args.output_len} tokens, no faults", flush=True)
            t0 = time.monotonic()
            reference, ref_start = asyncio.run(run_streams(gateway.address, prompts, args))
            ref_duration = time.monotonic() - t0
            print(f"  {ref_duration:.1f}s; run with a worker killed at a random point", flush=True)
            t0 = time.monotonic()
            info = asyncio.run(faulty_run(cluster, gateway.address, scheduler, prompts, args, rng))
            faulty_duration = time.monotonic() - t0
        except BaseException:
            print(cluster.logs(2000))
            raise
        finally:
            cluster.stop()

    records = info["records"]
    counts = compare(reference, records, args)
    kill = info["kill_time"]
    spans = [g for g in (rec.gap_spanning(kill) for rec in records) if g is not None]
    longest = max(rec.longest_gap() for rec in records)
    ref_longest = max(rec.longest_gap() for rec in reference)
    ref_ttft = statistics.median(rec.ttft(ref_start) for rec in reference)
    resume = info.get("resume_latency_s") or 0.0
    summary = {
        **counts,
        "longest_stall_s": longest,
        "longest_stall_without_faults_s": ref_longest,
        "ttft_without_faults_median_s": ref_ttft,
        "resume_latency_s": info.get("resume_latency_s"),
        "recompute_estimate_s": max(spans, default=0.0) - resume,
        "num_resumed": info.get("num_resumed"),
        "stall_spanning_kill_s": {"max": max(spans, default=0.0), "median": statistics.median(spans) if spans else 0.0,
                                  "streams": len(spans)},
        "victim": info["victim"], "victim_held_requests": info.get("victim_held_requests"),
        "killed_after_tokens": info.get("delivered_at_kill"), "total_tokens": info["total_tokens"],
        "reference_duration_s": ref_duration, "faulty_duration_s": faulty_duration,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    print("\n== kill -9 a worker mid-run ==")
    print(f"killed {summary['victim']} holding {summary['victim_held_requests']} requests after "
          f"{summary['killed_after_tokens']}/{summary['total_tokens']} tokens")
    for key, goal in (("requests_lost", "0"), ("duplicated_indices", "0"), ("missing_indices", "0"),
                      ("mismatched_outputs", "0")):
        print(f"{key:<22} {summary[key]:>8}   (goal {goal})")
    print(f"{'longest_stall_s':<22} {longest:8.2f}   (goal < 2 s + recompute; "
          f"{ref_longest:.2f} s without faults)")
    print(f"{'resume_latency_s':<22} {resume:8.3f}   (kill -> requests placed on the survivor)")
    print(f"{'recompute_estimate_s':<22} {summary['recompute_estimate_s']:8.2f}   (longest stall across the kill "
          f"minus resume latency: the survivor's prefill of prompt + delivered tokens of the resumed requests; "
          f"for scale, the first prefill step of the run without faults took {ref_ttft:.2f} s)")
    print(f"stall across the kill: max {summary['stall_spanning_kill_s']['max']:.2f} s, median "
          f"{summary['stall_spanning_kill_s']['median']:.2f} s over {len(spans)} streams")
    print(f"durations: {ref_duration:.1f} s without faults, {faulty_duration:.1f} s with the kill")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"chaos-{Path(args.model).name}-n{args.num_streams}-o{args.output_len}{'-' + args.tag if args.tag else ''}"
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "config": vars(args),
               "summary": summary}
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    plot(reference, ref_start, info, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / (stem + '.json')} and .png")
    ok = not any(counts.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
