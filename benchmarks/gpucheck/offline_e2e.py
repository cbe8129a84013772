"""Section 4: offline throughput of random-weight models of real shapes, bf16, on one device.

For each of ``real_models.SHAPES``: a few hundred requests (prompt lengths uniform in [128, 1024],
outputs in [64, 512], ``ignore_eos``, greedy) through ``pagedserve.LLM`` — after a warm-up that
compiles its kernels — then through transformers' ``generate`` in static batches (left-padded; a
batch runs until its longest request ends; only requested tokens count), for as many batches as
its share of the budget allows (each batch measured whole; how many ran is reported).

Beside them, the memory-bandwidth ceiling: every engine step must read the weights once and the
K/V of every scheduled sequence's context, so ``(weight bytes + KV bytes) / copy bandwidth`` is the
fastest that step could be. Summed over the steps the engine actually ran, that is the ceiling
of the workload; the figure reported is ceiling time / measured time, for all steps and for the
decode-only steps (prefill-heavy steps are compute-bound, so the ceiling flatters them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpucheck.common import Context, log
from gpucheck.real_models import SHAPES, build_model, kv_bytes_per_token, weight_bytes_per_step

REAL = dict(num_requests=256, prompt_len=(128, 1024), output_len=(64, 512), max_num_seqs=256,
            max_num_batched_tokens=8192, max_model_len=2048, hf_batch_size=64)
DRY = dict(num_requests=6, prompt_len=(8, 40), output_len=(4, 12), max_num_seqs=4,
           max_num_batched_tokens=32, max_model_len=128, hf_batch_size=4)
WARMUP_PROMPT_LENS = (20, 300, 1000)  # decode, short and long prefill chunks: each kernel shape compiles


@dataclass
class StepLog:
    """Per engine step: tokens, sequences, context positions read, wall time (the step ends with
    the sampled tokens copied to the host, so it is synchronous whenever any row samples)."""

    steps: list[tuple[int, int, int, float]] = field(default_factory=list)

    def wrap(self, runner) -> None:
        execute = runner.execute_model

        def timed(scheduler_output):
            so = scheduler_output
            context = so.total_num_scheduled_tokens + sum(r.num_computed_tokens for r in so.scheduled_new_reqs) \
                + sum(so.scheduled_cached_reqs.num_computed_tokens)
            start = time.perf_counter()
            out = execute(so)
            self.steps.append((so.total_num_scheduled_tokens, len(so.num_scheduled_tokens), context,
                               time.perf_counter() - start))
            return out

        runner.execute_model = timed


def ceiling(steps: StepLog, weight_bytes: int, kv_per_token: int, copy_gbps: float) -> dict:
    bandwidth = copy_gbps * 1e9
    all_ceiling = sum((weight_bytes + kv_per_token * ctx) / bandwidth for _, _, ctx, _ in steps.steps)
    decode = [(ctx, dt) for tokens, seqs, ctx, dt in steps.steps if tokens == seqs and tokens > 0]
    decode_ceiling = sum((weight_bytes + kv_per_token * ctx) / bandwidth for ctx, _ in decode)
    decode_time = sum(dt for _, dt in decode)
    measured = sum(dt for *_, dt in steps.steps)
    return dict(
        steps=len(steps.steps), decode_only_steps=len(decode), step_time_s=measured,
        ceiling_s=all_ceiling, fraction_of_ceiling=all_ceiling / measured if measured else None,
        decode_ceiling_s=decode_ceiling, decode_time_s=decode_time,
        decode_fraction_of_ceiling=decode_ceiling / decode_time if decode_time else None,
        mean_decode_batch=sum(s for t, s, _, _ in steps.steps if t == s) / len(decode) if decode else None,
    )


def _share(fraction: float | None) -> str:
    """A fraction as a percentage; "n/a" where there was nothing to measure (no decode-only step)."""
    return "n/a" if fraction is None else f"{fraction:.1%}"


def run_model(name: str, ctx: Context, sizes: dict, copy_gbps: float, hf_seconds: float) -> dict:
    import torch
    from offline_throughput import make_requests, run_hf_static

    from pagedserve import LLM, SamplingParams

    hf = build_model(name, ctx.dry, ctx.device, torch.bfloat16)
    requests = make_requests(sizes["num_requests"], 0, hf.config.vocab_size, sizes["prompt_len"], sizes["output_len"])
    row: dict = dict(num_requests=len(requests), prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                     output_tokens=sum(r.output_len for r in requests))
    t0 = time.perf_counter()
    llm = LLM(name, hf_model=hf, dtype="bfloat16", device=ctx.device, skip_tokenizer_init=True,
              max_num_seqs=sizes["max_num_seqs"], max_num_batched_tokens=sizes["max_num_batched_tokens"],
              max_model_len=sizes["max_model_len"])
    row["engine_init_s"] = time.perf_counter() - t0
    warmup = [[7] * min(n, sizes["max_model_len"] - 8) for n in WARMUP_PROMPT_LENS]
    t0 = time.perf_counter()
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    row["warmup_s"] = time.perf_counter() - t0
    steps = StepLog()
    steps.wrap(llm.runner)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outputs)
    row["pagedserve"] = dict(
        generate_s=elapsed, output_tokens=produced, output_tokens_per_s=produced / elapsed,
        num_blocks=llm.info.num_blocks, num_preemptions=llm.scheduler.stats().num_preemptions,
        attention_backend=llm.runner.attention_backend,
        **ceiling(steps, weight_bytes_per_step(llm.runner.model), kv_bytes_per_token(hf.config, torch.bfloat16),
                  copy_gbps),
    )
    row["weight_bytes_per_step"] = weight_bytes_per_step(llm.runner.model)
    log(f"{name}: pagedserve {produced / elapsed:.0f} output tok/s ({elapsed:.1f} s), "
        f"{_share(row['pagedserve']['fraction_of_ceiling'])} of the bandwidth ceiling, decode-only steps "
        f"{_share(row['pagedserve']['decode_fraction_of_ceiling'])}")
    del llm, outputs
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    row["transformers_static"] = run_hf_static(hf, requests, sizes["hf_batch_size"], hf.config.pad_token_id,
                                               max_seconds=hf_seconds)
    hf_rate = row["transformers_static"]["output_tokens_per_s"]
    row["speedup_vs_transformers"] = row["pagedserve"]["output_tokens_per_s"] / hf_rate
    log(f"{name}: transformers static batches of {sizes['hf_batch_size']}: {hf_rate:.0f} output tok/s "
        f"({row['transformers_static']['batches_run']}/{row['transformers_static']['batches']} batches); "
        f"pagedserve {row['speedup_vs_transformers']:.2f}x")
    row["passed"] = produced == row["output_tokens"]
    return row


def run(ctx: Context) -> dict:
    import gpu_kernels
    import torch

    if ctx.dry:
        gpu_kernels.use_dry_run_sizes()
    sizes = DRY if ctx.dry else REAL
    copy_gbps = gpu_kernels.copy_bandwidth(ctx.device)["gbps_read_plus_write"]
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    result: dict = dict(copy_gbps=copy_gbps, sizes=sizes, models={}, passed=True)
    names = list(SHAPES)
    for i, name in enumerate(names):
        # transformers gets a third of what is left per model, so the next model still has its share
        hf_seconds = max(5.0, ctx.seconds_left() / (len(names) - i) / 3)
        row = run_model(name, ctx, sizes, copy_gbps, hf_seconds)
        result["models"][name] = row
        result["passed"] &= row["passed"]
        ctx.save_partial(result)
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    return result
