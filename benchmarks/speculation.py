"""What n-gram speculation pays, and on what text: the same requests with and without draft tokens.

Two workloads through ``pagedserve.LLM`` (bf16 where the CPU has native bf16), each run with
``num_speculative_tokens`` 0 and the default, in alternating rounds so that host drift hits both:

- ``chat``: 64 chat requests (16 topics x 4 asks: explain, essay, facts, pros and cons), greedy,
  up to 256 tokens, stopping at EOS: natural text, where a small model repeats itself now and then;
- ``random``: ``offline_throughput.py``'s 64 random token-id prompts (U[32, 512]) with outputs of
  U[16, 256] (``ignore_eos``): SmolLM2 falls into loops on them, so most drafts are right.

Per run: output tokens per second, the steps taken, the draft tokens the steps carried and how many
of them the worker kept. Model load is excluded. Writes JSON and a PNG.

    python benchmarks/speculation.py                  # results/speculation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOPICS = ["the French Revolution", "photosynthesis", "black holes", "the stock market", "machine learning",
          "the Roman Empire", "climate change", "the human heart", "quantum computing", "jazz music",
          "the water cycle", "volcanoes", "the printing press", "vaccines", "the Internet", "honeybees"]
ASKS = ["Explain {} to a ten-year-old.", "Write a short essay about {}.", "List five facts about {}.",
        "What are the pros and cons of {}?"]


def run(llm, workload: dict) -> dict:
    """One pass of ``workload`` through ``llm``; its rate and what the steps carried."""
    steps = []
    execute = llm.runner.execute_model

    def counting(plan):
        result = execute(plan)
        drafts = plan.scheduled_spec_decode_tokens
        kept = sum(len(result.sampled_token_ids.get(rid, ())) - 1 for rid in drafts if rid in result.sampled_token_ids)
        steps.append((sum(map(len, drafts.values())), kept))
        return result

    llm.runner.execute_model = counting
    try:
        started = time.perf_counter()
        if workload["kind"] == "chat":
            outputs = llm.chat(workload["prompts"], workload["params"], use_tqdm=False)
        else:
            outputs = llm.generate(workload["prompts"], workload["params"], use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        llm.runner.execute_model = execute
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3), "output_tokens_per_s": round(tokens / elapsed, 1),
            "steps": len(steps), "draft_tokens": sum(n for n, _ in steps), "drafts_kept": sum(k for _, k in steps)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for j, k in enumerate(result["num_speculative_tokens"]):
        values = [max(r["output_tokens_per_s"] for r in result["workloads"][w][str(k)]) for w in names]
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(names))], values, width,
                      label=f"num_speculative_tokens {k}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tokens / s (best round)")
    ax.set_title(f"{result['model']}: n-gram speculation on and off")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--drafts", type=int, default=None,
                        help="num_speculative_tokens of the run with drafts (default: the engine's default)")
    parser.add_argument("--output", default="benchmarks/results/speculation.json")
    args = parser.parse_args(argv)

    from offline_throughput import make_requests

    from pagedserve import LLM, SamplingParams

    load = os.getloadavg()
    on = {} if args.drafts is None else {"num_speculative_tokens": args.drafts}
    llms = {0: LLM(args.model, num_speculative_tokens=0), None: LLM(args.model, **on)}
    k_on = llms[None].runner.config.num_speculative_tokens
    llms = {0: llms[0], k_on: llms[None]}
    randoms = make_requests(64, 0, llms[0].info.vocab_size, (32, 512), (16, 256))
    workloads = {
        "chat": {"kind": "chat", "prompts": [[{"role": "user", "content": a.format(t)}] for t in TOPICS for a in ASKS],
                 "params": SamplingParams(max_tokens=256, temperature=0.0)},
        "random": {"kind": "generate", "prompts": [r.prompt_token_ids for r in randoms],
                   "params": [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                              for r in randoms]},
    }
    result = {"model": args.model, "dtype": str(llms[0].runner.loaded.dtype).removeprefix("torch."),
              "num_speculative_tokens": list(llms), "machine": platform.machine(), "cpu_count": os.cpu_count(),
              "load_average_at_start": list(load), "load_time_excluded": True, "rounds": args.rounds,
              "workloads": {name: {str(k): [] for k in llms} for name in workloads}}
    for rnd in range(args.rounds):
        for name, workload in workloads.items():
            for k, llm in llms.items():
                llm.scheduler.reset_prefix_cache()  # each pass computes its prompts
                row = run(llm, workload)
                result["workloads"][name][str(k)].append(row)
                print(f"round {rnd + 1} {name:6s} num_speculative_tokens {k}: {row['output_tokens_per_s']:7.1f} "
                      f"output tok/s ({row['output_tokens']} tokens, {row['seconds']} s, {row['steps']} steps, "
                      f"{row['drafts_kept']} of {row['draft_tokens']} draft tokens kept)")
    for name in workloads:
        best = {k: max(r["output_tokens_per_s"] for r in result["workloads"][name][str(k)]) for k in llms}
        result["workloads"][name]["ratio_best"] = round(best[k_on] / best[0], 3)
        print(f"{name}: with drafts / without, best rounds: {result['workloads'][name]['ratio_best']}x")
    result["load_average_at_end"] = list(os.getloadavg())
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
