"""Time to first token of short requests while one long prompt prefills.

One process loads the model once (the in-process engine: ``pagedserve.LLM``'s scheduler and model
runner, the same pair the scheduler service drives over gRPC) and runs phases, each with a fresh
scheduler over the same runner and prefix caching off (nothing is reused between phases):

- ``alone-old`` / ``alone-new``: the long prompt alone, with the old defaults (no shared-prefill cap,
  no attention cap) and the new ones: its time to finish alone.
- ``shared-old`` / ``shared-new``: the long prompt at t=0 plus a stream of short requests, one every
  ``--short-interval-s`` seconds until the long one finishes: the short ones' TTFT p50/p99/max and
  the long prompt's time to finish, old defaults vs new.

A short request's arrival time is its place in the stream (wall clock); it is added to the
scheduler at the first step boundary after that, so its TTFT includes the step in flight when it
arrived. Steps run back to back (the long prompt is live until it finishes, and the stream ends
then). A phase stops taking new short requests after ``--max-seconds`` and finishes what it has.

    python benchmarks/ttft_fairness.py                         # all phases (several minutes on 2 CPU cores)
    python benchmarks/ttft_fairness.py --phases shared-new     # one phase; merged into the JSON

Results: ``benchmarks/results/ttft_fairness[-<tag>].json`` (phases merged across runs) and a PNG.
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

PHASES = ("alone-old", "shared-old", "alone-new", "shared-new")
RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def parse_phase_args(parser: argparse.ArgumentParser, all_phases: tuple[str, ...]):
    """``parser``'s arguments with ``--phases`` (of ``all_phases``), ``--tag`` and ``--seed`` added:
    (args, the phases chosen, in order)."""
    parser.add_argument("--phases", default=",".join(all_phases), help=f"comma-separated, from {all_phases}")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(all_phases)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}")
    return args, phases


def save_figure(fig, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` and release it (matplotlib)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, json_path: Path, plot=None) -> None:
    """``report`` as JSON at ``json_path`` and, with ``plot(report, png_path)``, its PNG beside it."""
    RESULTS.mkdir(exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    if plot is not None:
        plot(report, json_path.with_suffix(".png"))
        print(f"wrote {json_path} and {json_path.with_suffix('.png')}")


def run_phase(runner, phase: str, args: argparse.Namespace, rng: random.Random) -> dict:
    from scheduler_service.core.request import Request
    from scheduler_service.core.scheduler import Scheduler
    from servicekit.contract.sampling_params import SamplingParams
    from servicekit.contract.scheduling import DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, SchedulingConfig

    new = phase.endswith("-new")
    threshold = (args.shared_threshold if args.shared_threshold is not None
                 else DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD) if new else 0
    attention_limit = (args.attention_limit if args.attention_limit is not None
                       else runner.info.prefill_chunk_attention_limit) if new else 0
    config = SchedulingConfig(enable_prefix_caching=False, shared_prefill_token_threshold=threshold,
                              prefill_chunk_attention_limit=attention_limit)
    scheduler = Scheduler(config, runner.info, seed_rng=random.Random(0))
    vocab = runner.info.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=args.short_max_tokens, temperature=0.0, ignore_eos=True)
    with_shorts = phase.startswith("shared")
    load_before = os.getloadavg()
    start = time.perf_counter()
    scheduler.add_request(Request("long", prompt(args.long_tokens), long_params, arrival_time=0.0))
    arrivals: dict[str, float] = {}  # short id -> arrival (s since start)
    first_token: dict[str, float] = {}
    long_done: float | None = None
    next_arrival, k = 0.0, 0
    step_times: list[float] = []
    while True:
        # Every short whose time has come joins now, if it came while the long prompt ran (a step
        # can be long: shorts that arrived during it join after it, TTFT counted from arrival).
        horizon = min(time.perf_counter() - start, args.max_seconds,
                      long_done if long_done is not None else float("inf"))
        while with_shorts and next_arrival <= horizon:
            rid = f"short-{k}"
            scheduler.add_request(Request(rid, prompt(args.short_tokens), short_params, arrival_time=next_arrival))
            arrivals[rid] = next_arrival
            k += 1
            next_arrival = k * args.short_interval_s
        if not scheduler.has_unfinished_requests():
            break  # the long prompt is done (it is live until then) and so is every short
        plan = scheduler.schedule()
        t0 = time.perf_counter()
        outputs = scheduler.update_from_output(plan, runner.execute_model(plan))
        t1 = time.perf_counter()
        step_times.append(t1 - t0)
        for out in outputs:
            rid = out.request_id
            if rid == "long":
                if out.finished:
                    long_done = t1 - start
            elif out.new_token_ids and rid not in first_token:
                first_token[rid] = t1 - start
    ttfts = [first_token[rid] - arrivals[rid] for rid in arrivals]
    result = {
        "phase": phase,
        "shared_prefill_token_threshold": threshold,
        "prefill_chunk_attention_limit": attention_limit,
        "long_seconds": long_done,
        "num_steps": len(step_times),
        "max_step_seconds": max(step_times),
        "num_short": len(ttfts),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    if ttfts:
        result.update(short_ttft_p50=statistics.median(ttfts), short_ttft_p99=percentile(ttfts, 99),
                      short_ttft_max=max(ttfts), short_ttfts=ttfts, short_arrivals=list(arrivals.values()))
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = report["phases"]
    fig, (ax_ttft, ax_long) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("shared-old", "o"), ("shared-new", "s")):
        p = phases.get(name)
        if p and p.get("short_ttfts"):
            ax_ttft.plot(p["short_arrivals"], p["short_ttfts"], style, label=(
                f"{name} (cap {p['shared_prefill_token_threshold']}, "
                f"attention limit {p.get('prefill_chunk_attention_limit', 0)}): p50 {p['short_ttft_p50']:.2f}s, "
                f"p99 {p['short_ttft_p99']:.2f}s"))
    ax_ttft.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="goal: p99 < 2 s")
    ax_ttft.set_xlabel("short request arrival (s after the long prompt)")
    ax_ttft.set_ylabel("time to first token (s)")
    ax_ttft.set_yscale("log")
    ax_ttft.legend(fontsize=8)
    names = [n for n in PHASES if n in phases and phases[n]["long_seconds"] is not None]
    ax_long.bar(names, [phases[n]["long_seconds"] for n in names], color="tab:blue")
    if "alone-old" in phases and phases["alone-old"]["long_seconds"]:
        ax_long.axhline(1.5 * phases["alone-old"]["long_seconds"], color="grey", linestyle="--", linewidth=1,
                        label="goal: 1.5x alone (old)")
        ax_long.legend(fontsize=8)
    ax_long.set_ylabel(f"long prompt ({report['config']['long_tokens']} tokens) finished after (s)")
    fig.suptitle(f"TTFT fairness, {report['config']['model']} on {report['machine']['device']} "
                 f"({report['machine']['cpus']} CPUs); short every {report['config']['short_interval_s']}s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--short-max-tokens", type=int, default=4)
    parser.add_argument("--short-interval-s", type=float, default=1.0)
    parser.add_argument("--shared-threshold", type=int, default=None,
                        help="the new phases' shared_prefill_token_threshold (default: the scheduler default)")
    parser.add_argument("--attention-limit", type=int, default=None,
                        help="the new phases' prefill_chunk_attention_limit (default: what the model runner states)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="a phase takes no new short request after this many seconds")
    args, phases = parse_phase_args(parser, PHASES)

    from pagedserve import LLM

    print(f"load average {os.getloadavg()}", flush=True)
    t = time.perf_counter()
    llm = LLM(args.model, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=max(args.long_tokens + 64, 256), num_blocks=-(-(args.long_tokens + 64) // 16) + 256)
    print(f"model loaded in {time.perf_counter() - t:.1f}s: {llm.info}", flush=True)

    stem = "ttft_fairness" + (f"-{args.tag}" if args.tag else "")
    json_path = RESULTS / f"{stem}.json"
    report = json.loads(json_path.read_text()) if json_path.exists() else {"phases": {}}
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("phases", "tag")}
    report["machine"] = {"device": str(llm.runner.device), "cpus": os.cpu_count(), "platform": platform.platform(),
                         "attention_backend": llm.runner.attention_backend}
    rng = random.Random(args.seed)
    for phase in phases:
        result = run_phase(llm.runner, phase, args, rng)
        report["phases"][phase] = result
        summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()
                   if k not in ("short_ttfts", "short_arrivals")}
        print(json.dumps(summary), flush=True)
        write_report(report, json_path)  # after each phase: a later one failing keeps the earlier ones
    write_report(report, json_path, plot)


if __name__ == "__main__":
    main()
