"""Fair shares between tenants: one tenant floods, another sends one short request a second.

One process loads the model once (the in-process engine: ``pagedserve.LLM``'s model runner under a
fresh scheduler core per phase, the pair the scheduler service drives over gRPC) and runs phases of
``--seconds`` of wall-clock arrivals each:

- tenant A floods: ``--flood`` requests at once, then ``--a-rate`` a second (prompts of
  ``--a-prompt`` tokens, ``--a-max-tokens`` outputs);
- tenant B sends one request a second (``--b-prompt`` / ``--b-max-tokens``), the first at 0.5 s.

Phases: ``b-alone`` and ``a-alone`` (each tenant without the other), ``both-fcfs`` (arrival
order) and ``both-fair`` (policy ``fair``, the virtual token counter). Reported per phase: B's
TTFT p50 / p99 (a request still without its first token when the phase ends counts with the time
it waited so far: a lower bound), A's output tokens per second over the phase, the step count and
the load average. Greedy, ``ignore_eos``; prefix caching off (random prompts share nothing); the
phase ends at ``--seconds`` with whatever is still queued dropped (no drain: the flood never ends).

    python benchmarks/tenant_fairness.py                  # all phases (about 2.5 minutes on 2 CPU cores)

Results: ``benchmarks/results/tenant_fairness[-<tag>].json`` and a PNG of B's TTFTs over time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from ttft_fairness import parse_phase_args, percentile, save_figure, write_report

PHASES = ("b-alone", "a-alone", "both-fcfs", "both-fair")
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return ",".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in text) or "none"


def arrivals(phase: str, args: argparse.Namespace) -> list[tuple[float, str]]:
    """(time, tenant) of every request the phase sends, in time order."""
    out: list[tuple[float, str]] = []
    if phase != "b-alone":
        out += [(0.0, "A")] * args.flood
        out += [(k / args.a_rate, "A") for k in range(1, int(args.seconds * args.a_rate))]
    if phase != "a-alone":
        out += [(0.5 + k, "B") for k in range(int(args.seconds - 0.5))]
    return sorted(out, key=lambda a: a[0])


def run_phase(runner, phase: str, args: argparse.Namespace, rng: random.Random) -> dict:
    from scheduler_service.core.request import Request
    from scheduler_service.core.scheduler import Scheduler
    from servicekit.contract.sampling_params import SamplingParams
    from servicekit.contract.scheduling import SchedulingConfig

    policy = "fair" if phase == "both-fair" else "fcfs"
    config = SchedulingConfig(enable_prefix_caching=False, policy=policy, max_num_seqs=args.max_num_seqs)
    scheduler = Scheduler(config, runner.info, seed_rng=random.Random(0))
    vocab = runner.info.vocab_size
    shape = {"A": (args.a_prompt, SamplingParams(max_tokens=args.a_max_tokens, temperature=0.0, ignore_eos=True)),
             "B": (args.b_prompt, SamplingParams(max_tokens=args.b_max_tokens, temperature=0.0, ignore_eos=True))}
    pending = arrivals(phase, args)
    arrived: dict[str, tuple[str, float]] = {}  # request id -> (tenant, arrival s)
    first_token: dict[str, float] = {}
    tokens = {"A": 0, "B": 0}
    load_before = os.getloadavg()
    start = time.perf_counter()
    num_steps, k = 0, 0
    while True:
        now = time.perf_counter() - start
        if now >= args.seconds:
            break
        while k < len(pending) and pending[k][0] <= now:
            at, tenant = pending[k]
            n, params = shape[tenant]
            rid = f"{tenant}-{k}"
            request = Request(rid, [rng.randrange(100, vocab) for _ in range(n)], params, arrival_time=at,
                              tenant=tenant)
            scheduler.add_request(request)
            arrived[rid] = (tenant, at)
            k += 1
        if not scheduler.has_unfinished_requests():
            time.sleep(min(0.01, pending[k][0] - now) if k < len(pending) else 0.01)
            continue
        plan = scheduler.schedule()
        outputs = scheduler.update_from_output(plan, runner.execute_model(plan))
        t = time.perf_counter() - start
        num_steps += 1
        for out in outputs:
            if out.new_token_ids:
                tenant = arrived[out.request_id][0]
                tokens[tenant] += len(out.new_token_ids)
                first_token.setdefault(out.request_id, t)
    end = min(time.perf_counter() - start, args.seconds)
    scheduler.abort(list(scheduler.requests))  # what is left is dropped; one empty step tells the runner
    runner.execute_model(scheduler.schedule())
    b_ttfts = [(first_token.get(rid, end) - at, rid in first_token) for rid, (tenant, at) in arrived.items()
               if tenant == "B"]
    result = {"phase": phase, "policy": policy, "num_steps": num_steps, "seconds": end,
              "num_preemptions": scheduler.num_preemptions,
              "a_tokens_per_s": tokens["A"] / end, "b_tokens_per_s": tokens["B"] / end,
              "num_a": sum(1 for t, _ in arrived.values() if t == "A"), "num_b": len(b_ttfts),
              "load_before": load_before, "load_after": os.getloadavg()}
    if b_ttfts:
        values = [v for v, _ in b_ttfts]
        result.update(b_ttft_p50=statistics.median(values), b_ttft_p99=percentile(values, 99),
                      b_without_first_token=sum(1 for _, got in b_ttfts if not got), b_ttfts=values,
                      b_arrivals=[at for rid, (tenant, at) in arrived.items() if tenant == "B"])
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for phase, result in report["phases"].items():
        if result.get("b_ttfts"):
            ax.plot(result["b_arrivals"], result["b_ttfts"], marker="o", ms=3,
                    label=f"{phase} (A {result['a_tokens_per_s']:.0f} tok/s)" if result["num_a"] else phase)
    ax.set_yscale("log")
    ax.set_xlabel("B's request arrival (s)")
    ax.set_ylabel("B's time to first token (s)")
    ax.set_title("tenant B's TTFT while tenant A floods")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals (and the phase) last this long")
    parser.add_argument("--flood", type=int, default=64, help="tenant A's requests at t=0")
    parser.add_argument("--a-rate", type=float, default=8.0, help="tenant A's requests a second after the flood")
    parser.add_argument("--a-prompt", type=int, default=128)
    parser.add_argument("--a-max-tokens", type=int, default=64)
    parser.add_argument("--b-prompt", type=int, default=64)
    parser.add_argument("--b-max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--warmup-seconds", type=float, default=10.0, help="an untimed phase of both tenants first")
    args, phases = parse_phase_args(parser, PHASES)

    from pagedserve import LLM

    print(f"load average {os.getloadavg()}, CPU flags {cpu_flags()}", flush=True)
    t = time.perf_counter()
    llm = LLM(args.model, skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=1024)
    print(f"model loaded in {time.perf_counter() - t:.1f}s (not in any figure): {llm.info}", flush=True)

    # Warm-up (not in any figure): a phase of both tenants, so every batch shape the phases meet
    # has been run once (the first steps of a shape allocate what later ones reuse).
    t = time.perf_counter()
    run_phase(llm.runner, "both-fcfs", argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds}),
              random.Random(-1))
    print(f"warmed up in {time.perf_counter() - t:.1f}s", flush=True)

    stem = "tenant_fairness" + (f"-{args.tag}" if args.tag else "")
    json_path = RESULTS / f"{stem}.json"
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("phases", "tag")},
              "machine": {"device": str(llm.runner.device), "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
                          "platform": platform.platform()},
              "phases": {}}
    rng = random.Random(args.seed)
    for phase in phases:
        result = run_phase(llm.runner, phase, args, rng)
        report["phases"][phase] = result
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()
                          if k not in ("b_ttfts", "b_arrivals")}), flush=True)
    phases_done = report["phases"]
    if {"a-alone", "b-alone", "both-fair"} <= set(phases_done):
        alone, fair = phases_done["b-alone"], phases_done["both-fair"]
        report["goal"] = {
            "b_ttft_p50_vs_alone": fair["b_ttft_p50"] / alone["b_ttft_p50"],
            "b_ttft_p99_vs_alone": fair["b_ttft_p99"] / alone["b_ttft_p99"],
            "a_throughput_vs_alone": fair["a_tokens_per_s"] / phases_done["a-alone"]["a_tokens_per_s"],
        }
        report["goal"]["met"] = (report["goal"]["b_ttft_p50_vs_alone"] <= 1.5
                                 and report["goal"]["b_ttft_p99_vs_alone"] <= 1.5
                                 and report["goal"]["a_throughput_vs_alone"] >= 0.9)
        print("goal (B's TTFT p50 / p99 <= 1.5x alone, A's throughput >= 0.9x alone):", report["goal"], flush=True)
    write_report(report, json_path, plot)


if __name__ == "__main__":
    main()
