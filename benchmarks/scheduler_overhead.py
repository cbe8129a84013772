"""Scheduler-core overhead per engine step: schedule() + update_from_output(), no model.

Scenarios:
- ``decode_256`` / ``decode_1024``: that many requests all decoding (prefix caching on, a shared
  system prompt), one token each per step; blocks fill and get hashed as they would in serving.
- ``mixed``: a seeded arrival trace (random prompt and output lengths, some shared prefixes) under
  a 2,048-token budget and a pool that runs full, so steps mix prefill chunks, decodes, admissions,
  finishes and preemptions.

The fake model's work (building ``ModelRunnerOutput``) is not timed. The core runs in the form the
services run it: its mypyc build where ``make install`` made one (``scheduler_service/core/compiled.py``),
else the Python source; ``PAGEDSERVE_COMPILED_CORE=0`` times the source (files get a ``_core-python``
suffix). Writes JSON and a PNG plot to
``benchmarks/results/`` (or ``--out``). Goal: under 1 ms per step at 256 running requests.
The collector runs as the scheduler service sets it (``--gc service``, the default:
``scheduler_service/gc_policy.py``); ``--gc default`` keeps CPython's thresholds and ``--gc off``
disables it (files get a ``_gc-default`` / ``_gc-off`` suffix): the differences are what
collections cost a process holding that many requests.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 400] [--gc service|default|off] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service import gc_policy  # noqa: E402
from scheduler_service.core import compiled  # noqa: E402
from scheduler_service.core import (  # noqa: E402
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulingConfig,
    WorkerDescription,
)

BLOCK_SIZE = 16
VOCAB = 32_000


def fake_model(scheduler: Scheduler, out, rng: random.Random) -> ModelRunnerOutput:
    """One token for each request whose step reaches the end of its known tokens."""
    sampled = {}
    requests = scheduler.requests
    for rid, n in out.num_scheduled_tokens.items():
        req = requests[rid]
        if req.num_computed_tokens + n >= req.num_tokens:
            sampled[rid] = [rng.randrange(10, VOCAB)]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def timed_steps(scheduler: Scheduler, steps: int, rng: random.Random, arrivals=None) -> dict:
    """Run ``steps`` steps; time schedule() and update_from_output() per step, as wall time and as
    this thread's CPU time (the latter is not inflated when other processes share the cores)."""
    sched_ns, update_ns, cpu_ns, batch, tokens = [], [], [], [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for k in range(steps):
        if arrivals is not None:
            for request in arrivals.get(k, ()):
                scheduler.add_request(request)
        c0 = cpu_clock()
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        c1 = cpu_clock()
        mro = fake_model(scheduler, out, rng)
        c2 = cpu_clock()
        t2 = clock()
        scheduler.update_from_output(out, mro)
        t3 = clock()
        c3 = cpu_clock()
        sched_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        cpu_ns.append(c1 - c0 + c3 - c2)
        batch.append(len(out.num_scheduled_tokens))
        tokens.append(out.total_num_scheduled_tokens)
    total = [a + b for a, b in zip(sched_ns, update_ns)]
    us = sorted(t / 1000 for t in total)
    cpu_us = sorted(t / 1000 for t in cpu_ns)

    def pct(values, p):
        return values[min(len(values) - 1, int(p / 100 * len(values)))]

    return {
        "steps": steps,
        "mean_us": statistics.fmean(us),
        "p50_us": pct(us, 50),
        "p90_us": pct(us, 90),
        "p99_us": pct(us, 99),
        "cpu_mean_us": statistics.fmean(cpu_us),
        "cpu_p50_us": pct(cpu_us, 50),
        "schedule_mean_us": statistics.fmean(sched_ns) / 1000,
        "update_mean_us": statistics.fmean(update_ns) / 1000,
        "mean_batch_size": statistics.fmean(batch),
        "mean_tokens_per_step": statistics.fmean(tokens),
        "per_step_us": [t / 1000 for t in total],
    }


def decode_scenario(num_requests: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt_len, system_len = 128, 64
    max_len = prompt_len + steps + 64
    num_blocks = num_requests * (-(-max_len // BLOCK_SIZE)) + 1
    worker = WorkerDescription("fake", num_blocks, BLOCK_SIZE, max_len + 64, VOCAB, (2,))
    config = SchedulingConfig(max_num_batched_tokens=8192, max_num_seqs=num_requests, enable_prefix_caching=True)
    scheduler = Scheduler(config, worker, seed_rng=random.Random(seed))
    system = [rng.randrange(10, VOCAB) for _ in range(system_len)]
    for k in range(num_requests):
        # Lengths vary by up to a block so that requests do not all fill a block in the same step.
        own = prompt_len - system_len - rng.randrange(BLOCK_SIZE)
        prompt = system + [rng.randrange(10, VOCAB) for _ in range(own)]
        scheduler.add_request(Request(f"d{k}", prompt, SamplingParams(max_tokens=max_len - prompt_len, ignore_eos=True),
                                      arrival_time=float(k)))
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):  # prefill everyone first
        scheduler.update_from_output(out := scheduler.schedule(), fake_model(scheduler, out, rng))
    assert scheduler.num_running == num_requests
    result = timed_steps(scheduler, steps, rng)
    result.update(running_requests=num_requests, block_size=BLOCK_SIZE,
                  prefix_cache_hit_rate=scheduler.stats().prefix_cache_hit_rate)
    return result


def mixed_scenario(steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    worker = WorkerDescription("fake", 4097, BLOCK_SIZE, 4096, VOCAB, (2,))  # 65,536 tokens of KV
    config = SchedulingConfig(max_num_batched_tokens=2048, max_num_seqs=256, long_prefill_token_threshold=512)
    scheduler = Scheduler(config, worker, seed_rng=random.Random(seed))
    systems = [[rng.randrange(10, VOCAB) for _ in range(n)] for n in (0, 256, 512, 1024)]
    arrivals: dict[int, list[Request]] = {}
    k = 0
    for step in range(steps):
        for _ in range(rng.choice((0, 0, 0, 0, 1, 1, 1))):  # ~0.43 arrivals per step: near capacity
            prompt = rng.choice(systems) + [rng.randrange(10, VOCAB) for _ in range(rng.randint(16, 1024))]
            params = SamplingParams(max_tokens=rng.randint(16, 512), ignore_eos=True)
            arrivals.setdefault(step, []).append(Request(f"m{k}", prompt, params, arrival_time=float(step)))
            k += 1
    result = timed_steps(scheduler, steps, rng, arrivals)
    stats = scheduler.stats()
    result.update(requests_arrived=k, num_preemptions=stats.num_preemptions,
                  prefix_cache_hit_rate=stats.prefix_cache_hit_rate, final_running=stats.num_running,
                  final_waiting=stats.num_waiting)
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bar, ax_series) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results)
    x = range(len(names))
    for offset, key in ((-0.27, "p50_us"), (0.0, "mean_us"), (0.27, "p99_us")):
        ax_bar.bar([i + offset for i in x], [results[n][key] for n in names], width=0.27, label=key[:-3])
    ax_bar.axhline(250, color="orange", linestyle="--", linewidth=1, label="0.25 ms goal (256 running)")
    ax_bar.axhline(1000, color="red", linestyle="--", linewidth=1, label="1 ms goal (1,024 running)")
    ax_bar.set_xticks(list(x), names)
    ax_bar.set_yscale("log")
    ax_bar.set_ylabel("µs per step (schedule + update)")
    ax_bar.set_title("scheduler-core overhead per step")
    ax_bar.legend()
    for n in names:
        ax_series.plot(results[n]["per_step_us"], linewidth=0.7, label=n)
    ax_series.set_xlabel("step")
    ax_series.set_ylabel("µs")
    ax_series.set_yscale("log")
    ax_series.set_title("per-step time")
    ax_series.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--gc", choices=("service", "default", "off"), default="service",
                        help="cyclic GC during the run: as the scheduler service sets it, CPython's default, or off")
    args = parser.parse_args(argv)
    if args.gc == "off":
        gc.disable()
    elif args.gc == "service":
        gc_policy.tune()
    suffix = "" if args.gc == "service" else f"_gc-{args.gc}"
    core = compiled.describe()
    if compiled.active is None:
        suffix += "_core-python"
    print(f"scheduler core: {core}")

    results = {
        "decode_256": decode_scenario(256, args.steps, args.seed),
        "decode_1024": decode_scenario(1024, args.steps, args.seed),
        "mixed": mixed_scenario(args.steps * 3, args.seed),
    }
    for name, r in results.items():
        print(f"{name:12s} mean {r['mean_us']:7.1f} µs  p50 {r['p50_us']:7.1f}  p99 {r['p99_us']:8.1f}  "
              f"cpu mean {r['cpu_mean_us']:7.1f} p50 {r['cpu_p50_us']:7.1f}  "
              f"(schedule {r['schedule_mean_us']:.1f} + update {r['update_mean_us']:.1f})  "
              f"batch {r['mean_batch_size']:.0f} reqs / {r['mean_tokens_per_step']:.0f} tokens")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "scheduler_overhead",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "steps": args.steps,
        "seed": args.seed,
        "gc": args.gc,
        "core": core,
        "goal": "mean per step < 250 us at 256 decoding requests and < 1000 us at 1,024",
        "goal_met": results["decode_256"]["mean_us"] < 250 and results["decode_1024"]["mean_us"] < 1000,
        "results": results,
    }
    json_path = args.out / f"scheduler_overhead{suffix}.json"
    json_path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {json_path}")
    if not args.no_plot:
        png_path = args.out / f"scheduler_overhead{suffix}.png"
        plot(results, png_path)
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
