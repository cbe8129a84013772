"""Fault tolerance under load with a real model: kill -9 workers at a random point of a run.

A local cluster (``pagedserve.local_cluster``): Redis with its append-only file, the workers and
schedulers of ``--topology`` (workers run ``--model`` on the CPU, torch threads 1 each; schedulers
find them in the registry, a fair share each, with the default fault-detection times), 1 gateway.
The same ``--num-streams`` greedy, seeded streams run twice: once without faults (the reference),
once while the topology's victims are killed with SIGKILL when a random share of the run's tokens
has been delivered. Their requests resume elsewhere from prompt + delivered tokens.

Topologies (workers w, schedulers s; docs/operations.md, "Faults"):
  2w1s          one scheduler drives both; a random worker dies (its requests move to the other)
  2w2s          one worker each; the busiest worker dies (its scheduler has none left: it hands
                its requests back to the group, the other scheduler claims them)
  1w1s-rejoin   the only worker dies; a new one joins --rejoin-after-s later (requests wait for it)
  3w2s          the lone worker of the scheduler driving one dies (hand-back; then the fair share
                gives that scheduler one of the other's two)
  2w-one-sched  3 workers: both workers of the scheduler driving two die; the third serves all
  2w1s-redis-primary  Redis is a primary + a replica + three Sentinels (failing over after 1 s of
                silence), the services reach it through the Sentinels; the primary dies, the
                Sentinels promote the replica (docs/operations.md, "Redis high availability")

Reported (goals in brackets): requests lost [0], duplicated indices [0], missing indices [0],
outputs that differ from the reference [0], the longest stall a client saw (largest gap between
two chunks of one stream, time to first token excluded), and the recovery time: from the kill
until the last stream that was waiting got its next token (for 1w1s-rejoin, also from the
newcomer's SERVING).

    .venv/bin/python benchmarks/chaos.py [--topology 2w1s] [--model smollm2-135m] [--num-streams 64]
        [--output-len 32]

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


@dataclass(frozen=True)
class Topology:
    num_workers: int
    num_schedulers: int
    victims: str  # what dies, in words
    rejoin: bool = False  # a new worker joins --rejoin-after-s after the kill
    redis_primary: bool = False  # Redis runs with Sentinels and its primary is the victim


TOPOLOGIES = {
    "2w1s": Topology(2, 1, "a random worker"),
    "2w2s": Topology(2, 2, "the busiest worker (its scheduler has no other)"),
    "1w1s-rejoin": Topology(1, 1, "the only worker; a new one joins later", rejoin=True),
    "3w2s": Topology(3, 2, "the lone worker of the scheduler that drives one"),
    "2w-one-sched": Topology(3, 2, "both workers of the scheduler that drives two"),
    "2w1s-redis-primary": Topology(2, 1, "the Redis primary (the Sentinels promote its replica)", redis_primary=True),
}


def fair_shares(num_workers: int, num_schedulers: int) -> list[int]:
    """Workers per scheduler once settled, sorted: as even as the fair share makes it."""
    base, extra = divmod(num_workers, num_schedulers)
    return sorted([base + 1] * extra + [base] * (num_schedulers - extra))


def choose_victims(topology: str, workers, driven: dict[str, list[str]], held: dict[str, int],
                   rng: random.Random) -> list:
    """The worker processes to kill, from who drives what (scheduler -> worker addresses) and the
    requests each worker holds."""
    by_address = {w.address: w for w in workers}
    if topology == "2w1s":
        return [rng.choice(workers)]
    if topology in ("2w2s", "1w1s-rejoin"):
        return [max(workers, key=lambda w: held.get(w.address, 0))]
    size = 1 if topology == "3w2s" else 2
    group = next(addresses for addresses in driven.values() if len(addresses) == size)
    return [by_address[a] for a in group]


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

    def first_after(self, t: float) -> float | None:
        return next((a for a in self.arrivals if a > t), None)

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


async def cluster_view(cluster) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Scheduler name -> workers it drives (connected, not being handed over); worker address ->
    requests its scheduler holds on it."""
    from pagedserve.admin import async_scheduler_stats

    driven, held = {}, {}
    for scheduler in cluster.live("scheduler"):
        stats = await async_scheduler_stats(scheduler.address)
        driven[scheduler.name] = sorted(w.address for w in stats.workers if w.connected and not w.releasing)
        for w in stats.workers:
            held[w.address] = w.num_running + w.num_waiting
    return driven, held


async def faulty_run(cluster, gateway: str, prompts, args, rng: random.Random) -> dict:
    total = len(prompts) * args.output_len
    kill_at_tokens = int(total * rng.uniform(args.kill_after_min, args.kill_after_max))
    delivered = {"n": 0}
    killed = asyncio.Event()
    info: dict = {"kill_at_tokens": kill_at_tokens, "total_tokens": total}

    def on_tokens(n: int) -> None:
        delivered["n"] += n
        if delivered["n"] >= kill_at_tokens and not killed.is_set():
            killed.set()

    async def killer() -> None:
        await killed.wait()
        driven, held = await cluster_view(cluster)
        if TOPOLOGIES[args.topology].redis_primary:
            victims = [cluster.redis]
        else:
            victims = choose_victims(args.topology, cluster.live("worker"), driven, held, rng)
        info["driven_at_kill"] = driven
        info["victims"] = [v.name for v in victims]
        on_victims = [held.get(v.address, 0) for v in victims]
        info["victim_held_requests"] = sum(held.values()) if victims == [cluster.redis] else sum(on_victims)
        info["delivered_at_kill"] = delivered["n"]
        info["kill_time"] = time.monotonic()
        for victim in victims:
            cluster.kill(victim)
        if TOPOLOGIES[args.topology].rejoin:
            await asyncio.sleep(args.rejoin_after_s)
            newcomer = start_worker(cluster, args, "worker-rejoined")
            await asyncio.to_thread(cluster.wait_serving, newcomer, timeout_s=900)
            info["rejoin_time"] = time.monotonic()

    kill_task = asyncio.create_task(killer())
    records, start = await run_streams(gateway, prompts, args, on_tokens)
    await asyncio.wait_for(kill_task, 60)
    if TOPOLOGIES[args.topology].redis_primary:
        info["primary_port_before_after"] = [cluster.redis.port, cluster.primary_port()]
    info["records"], info["start"] = records, start
    return info


def start_worker(cluster, args, name: str):
    return cluster.start("worker", name, ["--model", args.model, "--worker-id", name, "--heartbeat-ttl-s", "3"])


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
    ax.axvline(kill - start, color="black", linestyle="--", label=f"kill -9 {', '.join(info['victims'])}")
    if "rejoin_time" in info:
        ax.axvline(info["rejoin_time"] - start, color="tab:green", linestyle=":", label="new worker SERVING")
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
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="2w1s")
    parser.add_argument("--rejoin-after-s", type=float, default=5.0, help="1w1s-rejoin: the new worker starts then")
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
            topology = TOPOLOGIES[args.topology]
            if topology.redis_primary:
                cluster.start_redis_ha(num_replicas=1, num_sentinels=3, down_after_ms=1000, failover_timeout_ms=3000)
            else:
                cluster.start_redis()
            workers = [start_worker(cluster, args, f"worker-{i}") for i in range(topology.num_workers)]
            schedulers = [cluster.start("scheduler", f"scheduler-{i}", ["--consumer", f"scheduler-{i}"])
                          for i in range(topology.num_schedulers)]
            gateway = cluster.start("gateway", "gateway", ["--model", args.model])
            cluster.wait_serving(*workers, *schedulers, gateway, timeout_s=900)
            from pagedserve.local_cluster import wait_for

            shares = fair_shares(topology.num_workers, topology.num_schedulers)
            wait_for(lambda: sorted(map(len, asyncio.run(cluster_view(cluster))[0].values())) == shares, 120,
                     f"the schedulers drive {shares} workers", 0.5)
            print(f"{args.topology}: {topology.num_workers} workers, {topology.num_schedulers} schedulers; "
                  f"loadavg {os.getloadavg()}", flush=True)
            print(f"reference run: {args.num_streams} streams x {args.output_len} tokens, no faults", flush=True)
            t0 = time.monotonic()
            reference, ref_start = asyncio.run(run_streams(gateway.address, prompts, args))
            ref_duration = time.monotonic() - t0
            print(f"  {ref_duration:.1f}s; run killing {topology.victims} at a random point", flush=True)
            t0 = time.monotonic()
            info = asyncio.run(faulty_run(cluster, gateway.address, prompts, args, rng))
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
    resumed = [t for t in (rec.first_after(kill) for rec in records if rec.gap_spanning(kill) is not None)
               if t is not None]
    longest = max(rec.longest_gap() for rec in records)
    ref_longest = max(rec.longest_gap() for rec in reference)
    ref_ttft = statistics.median(rec.ttft(ref_start) for rec in reference)
    recovery = max(resumed, default=kill) - kill
    summary = {
        "topology": args.topology,
        **counts,
        "longest_stall_s": longest,
        "longest_stall_without_faults_s": ref_longest,
        "ttft_without_faults_median_s": ref_ttft,
        "recovery_s": recovery,
        "recovery_after_rejoin_s": (max(resumed) - info["rejoin_time"]) if "rejoin_time" in info and resumed else None,
        "stall_spanning_kill_s": {"max": max(spans, default=0.0), "median": statistics.median(spans) if spans else 0.0,
                                  "streams": len(spans)},
        "victims": info["victims"], "victim_held_requests": info.get("victim_held_requests"),
        "driven_at_kill": info.get("driven_at_kill"),
        "redis_primary_port_before_after": info.get("primary_port_before_after"),
        "killed_after_tokens": info.get("delivered_at_kill"), "total_tokens": info["total_tokens"],
        "reference_duration_s": ref_duration, "faulty_duration_s": faulty_duration,
        "loadavg_at_end": os.getloadavg(),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    print(f"\n== {args.topology}: kill -9 {TOPOLOGIES[args.topology].victims} mid-run ==")
    print(f"killed {', '.join(summary['victims'])} holding {summary['victim_held_requests']} requests after "
          f"{summary['killed_after_tokens']}/{summary['total_tokens']} tokens")
    for key, goal in (("requests_lost", "0"), ("duplicated_indices", "0"), ("missing_indices", "0"),
                      ("mismatched_outputs", "0")):
        print(f"{key:<22} {summary[key]:>8}   (goal {goal})")
    print(f"{'longest_stall_s':<22} {longest:8.2f}   ({ref_longest:.2f} s without faults; first prefill step "
          f"{ref_ttft:.2f} s)")
    print(f"{'recovery_s':<22} {recovery:8.2f}   (kill -> the last waiting stream's next token)")
    if summary["recovery_after_rejoin_s"] is not None:
        print(f"{'recovery_after_rejoin_s':<22} {summary['recovery_after_rejoin_s']:8.2f}   "
              f"(new worker SERVING -> the last waiting stream's next token)")
    print(f"stall across the kill: max {summary['stall_spanning_kill_s']['max']:.2f} s, median "
          f"{summary['stall_spanning_kill_s']['median']:.2f} s over {len(spans)} streams")
    print(f"durations: {ref_duration:.1f} s without faults, {faulty_duration:.1f} s with the kill; "
          f"loadavg {os.getloadavg()}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    topo = "" if args.topology == "2w1s" else f"-{args.topology}"  # 2w1s: the names of earlier runs
    stem = (f"chaos-{Path(args.model).name}{topo}-n{args.num_streams}-o{args.output_len}"
            f"{'-' + args.tag if args.tag else ''}")
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "config": vars(args),
               "summary": summary}
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    plot(reference, ref_start, info, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / (stem + '.json')} and .png")
    ok = not any(counts.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
