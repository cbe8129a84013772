"""GPU benchmark of the paged KV-cache kernels: correctness on realistic shapes, then speed.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels [--quick] [--sweep]

What it does, on a CUDA machine (Llama-3-8B-like attention: bf16, head_dim 128, 32 query / 8 KV
heads, block size 16, shuffled block tables):

1. checks each Triton kernel against its torch reference: ``reshape_and_cache`` (bit-exact), decode
   attention with contexts up to 32k (heuristic, single pass, forced split-K) and a mixed batch of
   decodes and prefill chunks with earlier context in the cache;
2. measures the device-to-device copy bandwidth of a large tensor (read + write bytes / time: what
   the memory system can deliver);
3. times decode attention for batch 1..256 x context 1k..32k (combinations that do not fit in free
   memory are skipped) and reports the effective bandwidth, bytes of K/V read / time, next to
   ``scaled_dot_product_attention`` on the same amount of K/V stored contiguously;
4. with ``--sweep``, times other launch configurations (tile size, warps, stages, splits) at a few
   points, to tune the launcher's heuristics.

It writes ``gpu_kernels.json`` and ``gpu_kernels.png`` to ``--out`` (also after a failure part way,
with what it has). The goal it reports: decode reaches >= 75 % of the copy bandwidth for batch >= 32
at context >= 4k. Exit status 1 if a correctness check failed, else 0 — also on a machine without
CUDA, where it only says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
GOAL_FRACTION, GOAL_MIN_BATCH, GOAL_MIN_CONTEXT = 0.75, 32, 4096
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_BATCHES, QUICK_CONTEXTS = [1, 8, 32, 128, 256], [1024, 4096, 32768]
COPY_BYTES = 4 << 30
OVERHEAD_CALLS = 200
SWEEP_POINTS = [(32, 4096), (256, 8192), (4, 32768)]  # (batch, context) for --sweep
# Correctness: decodes up to 32k (one at position 0), then 20 decodes + 4 prefill chunks (one a
# first chunk, the others with earlier chunks cached).
CHECK_DECODE_LENS = [32768, 1, 17, 4096, 31000, 777, 16384, 12345, 2048, 100, 32767, 9999]
CHECK_MIXED_Q_LENS = [1] * 20 + [512, 1000, 37, 2048]
CHECK_MIXED_SEQ_LENS = [(n * 2654435761) % 8191 + 1 for n in range(20)] + [4608, 1000, 20037, 6144]
CHECK_CACHE_TOKENS, CHECK_CACHE_BLOCKS = 4096, 2048
# Every size above shrunk, for a dry run on the CPU under Triton's interpreter (the tests, and
# benchmarks/gpu_check.py --dry): same stages, seconds instead of minutes.
DRY_RUN_SIZES = dict(
    NUM_HEADS=4,
    NUM_KV_HEADS=2,
    HEAD_DIM=16,
    BLOCK_SIZE=4,
    BATCHES=[1, 2],
    CONTEXTS=[16, 40],
    QUICK_BATCHES=[1, 2],
    QUICK_CONTEXTS=[16, 40],
    GOAL_MIN_BATCH=2,
    GOAL_MIN_CONTEXT=40,
    CHECK_DECODE_LENS=[40, 1, 17],
    CHECK_MIXED_Q_LENS=[1, 1, 5, 9],
    CHECK_MIXED_SEQ_LENS=[30, 3, 5, 33],
    CHECK_CACHE_TOKENS=20,
    CHECK_CACHE_BLOCKS=16,
    COPY_BYTES=1 << 20,
    OVERHEAD_CALLS=2,
    SWEEP_POINTS=[(2, 40)],
)


def use_dry_run_sizes() -> None:
    """Switch this module to :data:`DRY_RUN_SIZES` (for a whole process: a dry run)."""
    globals().update(DRY_RUN_SIZES)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn()`` (Triton's do_bench: warm-up, L2 flushed between runs); one
    wall-clock call without CUDA (a dry run: the figure only proves the stage runs)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except TypeError:  # an older do_bench without return_mode
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))


# ----------------------------------------------------------------------------- batches


def make_cache(num_blocks: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    value_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    return key_cache, value_cache


def make_batch(q_lens: list[int], seq_lens: list[int], device: str, query_scale: float = 1.0):
    """A paged batch: shuffled distinct blocks per sequence over a cache sized for it (+ spare)."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 64
    key_cache, value_cache = make_cache(num_blocks, device)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = order[start : start + n]
        start += n
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device=device) * query_scale
    return dict(
        query=query.to(DTYPE),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=HEAD_DIM**-0.5,
    )


# ----------------------------------------------------------------------------- correctness


def compare(name: str, out: torch.Tensor, expected: torch.Tensor, rel_tol: float) -> dict:
    diff = (out.float() - expected.float()).flatten()
    rel_l2 = float(diff.norm() / expected.float().norm().clamp_min(1e-12))
    result = dict(
        name=name,
        max_abs_err=float(diff.abs().max()),
        rel_l2_err=rel_l2,
        ref_abs_mean=float(expected.float().abs().mean()),
        passed=bool(torch.isfinite(out.float()).all()) and rel_l2 <= rel_tol,
    )
    log(f"check {name}: {'ok' if result['passed'] else 'FAILED'} rel_l2={rel_l2:.2e}")
    return result


def check_correctness(device: str) -> list[dict]:
    from paged_kernels.cache import reshape_and_cache
    from paged_kernels.paged_attention import paged_attention
    from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache

    results = []
    torch.manual_seed(0)

    # reshape_and_cache: a 4096-token step into a 2048-block cache, every 7th token padding.
    key_cache, value_cache = make_cache(CHECK_CACHE_BLOCKS, device)
    slots = torch.randperm(CHECK_CACHE_BLOCKS * BLOCK_SIZE, device=device)[:CHECK_CACHE_TOKENS]
    slots[::7] = -1
    key = torch.randn(CHECK_CACHE_TOKENS, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    value = torch.randn_like(key)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ref_reshape_and_cache(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    exact = torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    results.append(dict(name=f"reshape_and_cache {CHECK_CACHE_TOKENS} tokens", passed=exact))
    log(f"check reshape_and_cache: {'ok' if exact else 'FAILED'}")
    del key_cache, value_cache, expected_k, expected_v

    # Decode, contexts up to 32k. A larger query scale makes softmax peaky, so outputs are O(1)
    # and errors are not hidden by averaging over long contexts.
    batch = make_batch([1] * len(CHECK_DECODE_LENS), CHECK_DECODE_LENS, device, query_scale=4.0)
    expected = ref_paged_attention(**batch)
    for label, kwargs in [
        ("heuristic", {}),
        ("single pass", dict(num_splits=1)),
        ("split-K 8", dict(num_splits=8)),
        ("split-K 3, max_query_len=1", dict(num_splits=3, max_query_len=1)),
    ]:
        out = paged_attention(**batch, **kwargs)
        name = f"decode to context {max(CHECK_DECODE_LENS)}, {label}"
        results.append(compare(name, out, expected, 2e-2))
    del batch, expected

    # Mixed: decodes plus prefill chunks, one a first chunk, others with earlier chunks cached.
    q_lens, seq_lens = CHECK_MIXED_Q_LENS, CHECK_MIXED_SEQ_LENS
    batch = make_batch(q_lens, seq_lens, device, query_scale=4.0)
    expected = ref_paged_attention(**batch)
    for label, kwargs in [
        ("max_query_len unknown", {}),
        ("max_query_len=2048", dict(max_query_len=2048)),
        ("split-K 4", dict(num_splits=4)),
    ]:
        out = paged_attention(**batch, **kwargs)
        results.append(compare(f"mixed decodes + prefill chunks, {label}", out, expected, 2e-2))
    return results


# ----------------------------------------------------------------------------- speed


def copy_bandwidth(device: str) -> dict:
    """Read + write bytes per second of a large device-to-device copy."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / (ms * 1e-3) / 1e9
    log(f"copy bandwidth: {gbps:.0f} GB/s ({COPY_BYTES >> 20} MiB in {ms:.3f} ms, read + write)")
    return dict(bytes_copied=src.numel(), ms=ms, gbps_read_plus_write=gbps)


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fits(batch: int, context: int) -> bool:
    if not torch.cuda.is_available():
        return True  # a dry run's tiny shapes
    free, _ = torch.cuda.mem_get_info()
    return 1.15 * kv_bytes(batch, context) + (1 << 30) < free


def heuristic_splits(batch: int, device: str) -> int:
    """The split count the launcher picks for a decode batch of this size."""
    from paged_kernels.paged_attention import _choose_config

    config = _choose_config(
        num_tokens=batch,
        num_seqs=batch,
        num_kv_heads=NUM_KV_HEADS,
        queries_per_kv=NUM_HEADS // NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_query_len=1,
        num_splits=None,
        device=torch.device(device),
    )
    return config.num_splits


def launcher_overhead_us(device: str) -> float:
    """Host time of one ``paged_attention`` call (checks, config, launch) on a tiny batch, where
    the GPU work is negligible: what a step pays per layer without CUDA graphs."""
    from paged_kernels.paged_attention import paged_attention

    data = make_batch([1] * 4, [16] * 4, device)
    out = torch.empty_like(data["query"])
    for _ in range(10):
        paged_attention(**data, out=out)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(OVERHEAD_CALLS):
        paged_attention(**data, out=out)
    per_call_us = (time.perf_counter() - start) / OVERHEAD_CALLS * 1e6
    synchronize(device)
    log(f"paged_attention host overhead: {per_call_us:.1f} us per call")
    return per_call_us


def time_decode(batch: int, context: int, device: str, split_sweep: bool) -> dict:
    """Triton decode, then SDPA on contiguous K/V (the paged cache is freed in between)."""
    row = time_paged_decode(batch, context, device, split_sweep)
    torch.cuda.empty_cache()
    row.update(time_sdpa(batch, context, device))
    torch.cuda.empty_cache()
    return row


def time_paged_decode(batch: int, context: int, device: str, split_sweep: bool) -> dict:
    from paged_kernels.paged_attention import paged_attention

    data = make_batch([1] * batch, [context] * batch, device)
    out = torch.empty_like(data["query"])

    def decode(**kwargs) -> torch.Tensor:
        return paged_attention(**data, out=out, max_query_len=1, **kwargs)

    nbytes = kv_bytes(batch, context)
    ms = bench_ms(decode)
    row = dict(
        batch=batch,
        context=context,
        kv_bytes=nbytes,
        num_splits=heuristic_splits(batch, device),
        triton_ms=ms,
        triton_gbps=nbytes / (ms * 1e-3) / 1e9,
    )
    if split_sweep:
        splits = (1, 2, 4, 8, 16)
        row["ms_by_num_splits"] = {n: bench_ms(lambda n=n: decode(num_splits=n)) for n in splits}
    return row


def time_sdpa(batch: int, context: int, device: str) -> dict:
    """SDPA over the same amount of K/V stored contiguously, ``[batch, kv_heads, context, dim]``.

    The query heads of a KV group are folded into SDPA's query-length axis (a decode row's mask is
    the same for all of them), which is exact and lets the flash backend run without GQA support.
    """
    import torch.nn.functional as F

    try:
        shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
        k = torch.empty(shape, dtype=DTYPE, device=device).normal_()
        v = torch.empty_like(k).normal_()
        q = torch.randn(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, device=device)
        q = q.to(DTYPE)
    except torch.OutOfMemoryError:
        return dict(sdpa_ms=None, sdpa_gbps=None, sdpa_error="out of memory")
    ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5))
    return dict(sdpa_ms=ms, sdpa_gbps=kv_bytes(batch, context) / (ms * 1e-3) / 1e9)


def config_sweep_space() -> list[tuple[int, int, int]]:
    """(tile_size, num_warps, num_stages) combinations the sweep times."""
    return list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))


def config_sweep(device: str, points: list[tuple[int, int]]) -> list[dict]:
    """Decode time of other launch configurations, for tuning ``_choose_config``."""
    rows = []
    for batch, context in points:
        if fits(batch, context):
            rows += sweep_point(batch, context, device)
            torch.cuda.empty_cache()
    return rows


def sweep_point(batch: int, context: int, device: str) -> list[dict]:
    from paged_kernels.paged_attention import _launch, _LaunchConfig

    data = make_batch([1] * batch, [context] * batch, device)
    args = [data[k] for k in ("query", "key_cache", "value_cache", "block_tables")]
    args += [data["query_start_loc"], data["seq_lens"], data["scale"]]
    out = torch.empty_like(data["query"])
    splits = heuristic_splits(batch, device)
    rows = []
    for tile, warps, stages in config_sweep_space():
        config = _LaunchConfig(
            block_m=16,
            block_q=1,
            tile_size=tile,
            num_splits=splits,
            one_token_per_seq=True,
            num_warps=warps,
            num_stages=stages,
        )
        row = dict(batch=batch, context=context, tile_size=tile, num_warps=warps)
        row.update(num_stages=stages, num_splits=splits)
        try:
            row["ms"] = bench_ms(lambda c=config: _launch(*args, out, c))
            row["gbps"] = kv_bytes(batch, context) / (row["ms"] * 1e-3) / 1e9
        except Exception as error:  # e.g. out of shared memory
            row["error"] = repr(error)[:200]
        rows.append(row)
    timed = [r for r in rows if "gbps" in r]
    if timed:
        log(f"sweep batch {batch} context {context}: best {max(timed, key=lambda r: r['gbps'])}")
    return rows


# ----------------------------------------------------------------------------- report


def goal_summary(decode: list[dict], copy_gbps: float) -> dict:
    covered = [
        r
        for r in decode
        if r["batch"] >= GOAL_MIN_BATCH and r["context"] >= GOAL_MIN_CONTEXT and "triton_gbps" in r
    ]
    fractions = [r["triton_gbps"] / copy_gbps for r in covered]
    return dict(
        description=f"decode >= {GOAL_FRACTION:.0%} of copy bandwidth for batch >= "
        f"{GOAL_MIN_BATCH} at context >= {GOAL_MIN_CONTEXT}",
        points=len(covered),
        min_fraction=min(fractions) if fractions else None,
        mean_fraction=sum(fractions) / len(fractions) if fractions else None,
        met=bool(fractions) and min(fractions) >= GOAL_FRACTION,
    )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in report.get("decode", []) if "triton_gbps" in r]
    if not decode:
        return
    copy_gbps = report.get("copy", {}).get("gbps_read_plus_write")
    fig, (ax_bw, ax_sdpa) = plt.subplots(1, 2, figsize=(14, 5.5))
    for context in sorted({r["context"] for r in decode}):
        rows = sorted((r for r in decode if r["context"] == context), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        label = f"{context // 1024}k" if context >= 1024 else str(context)
        ax_bw.plot(batches, [r["triton_gbps"] for r in rows], marker="o", label=label)
        ratio = [r["sdpa_ms"] / r["triton_ms"] if r.get("sdpa_ms") else math.nan for r in rows]
        ax_sdpa.plot(batches, ratio, marker="o", label=label)
    if copy_gbps:
        ax_bw.axhline(copy_gbps, color="black", linestyle="--", label="copy (read+write)")
        ax_bw.axhline(GOAL_FRACTION * copy_gbps, color="gray", linestyle=":", label="75 % of copy")
    ax_bw.set(
        xscale="log",
        xlabel="batch (decode sequences)",
        ylabel="K/V bytes read / time (GB/s)",
        title="Triton paged decode: effective bandwidth",
    )
    ax_sdpa.axhline(1.0, color="black", linestyle="--")
    ax_sdpa.set(
        xscale="log",
        xlabel="batch (decode sequences)",
        ylabel="SDPA time / Triton time (>1: Triton faster)",
        title="vs SDPA on contiguous K/V",
    )
    for ax in (ax_bw, ax_sdpa):
        ax.set_xticks(sorted({r["batch"] for r in decode}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(title="context", fontsize=8)
    fig.suptitle(f"{report['device']}: bf16, {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="fewer batch x context points")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    parser.add_argument(
        "--split-sweep", action="store_true", help="time every num_splits at each point"
    )
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "gpu_kernels: no CUDA device here, nothing to benchmark (the kernel tests run under "
            "the Triton interpreter instead)."
        )
        return 0
    return run(args, device="cuda")


def run(args: argparse.Namespace, device: str) -> int:
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else device,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        started=time.strftime("%Y-%m-%dT%H:%M:%S"),
        shapes=dict(
            dtype=str(DTYPE),
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
        ),
        errors=[],
    )
    failed = False
    try:
        log(f"device {report['device']}, torch {torch.__version__}, triton {triton.__version__}")
        report["correctness"] = check_correctness(device)
        failed = not all(r["passed"] for r in report["correctness"])
        torch.cuda.empty_cache()

        report["copy"] = copy_bandwidth(device)
        torch.cuda.empty_cache()
        report["launcher_overhead_us"] = launcher_overhead_us(device)

        batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
        report["decode"] = []
        for context in contexts:
            for batch in batches:
                if not fits(batch, context):
                    log(f"skip batch {batch} context {context}: does not fit in free memory")
                    report["decode"].append(dict(batch=batch, context=context, skipped="memory"))
                    continue
                try:
                    row = time_decode(batch, context, device, args.split_sweep)
                except Exception as error:  # keep going: one bad point must not lose the rest
                    torch.cuda.empty_cache()
                    row = dict(batch=batch, context=context, error=repr(error)[:300])
                    report["errors"].append(row)
                    log(f"batch {batch} context {context}: {row['error']}")
                else:
                    fraction = row["triton_gbps"] / report["copy"]["gbps_read_plus_write"]
                    log(
                        f"batch {batch:4d} context {context:6d}: {row['triton_ms']:.4f} ms "
                        f"{row['triton_gbps']:.0f} GB/s ({fraction:.0%} of copy), "
                        f"splits {row['num_splits']}, sdpa {row.get('sdpa_ms')} ms"
                    )
                report["decode"].append(row)
        report["goal"] = goal_summary(report["decode"], report["copy"]["gbps_read_plus_write"])
        log(f"goal: {report['goal']}")

        if args.sweep:
            report["config_sweep"] = config_sweep(device, SWEEP_POINTS)
    except Exception:
        failed = True
        report["errors"].append(dict(fatal=traceback.format_exc()))
        traceback.print_exc()
    finally:
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        json_path = args.out / "gpu_kernels.json"
        json_path.write_text(json.dumps(report, indent=2, default=str))
        log(f"wrote {json_path}")
        try:
            plot(report, args.out / "gpu_kernels.png")
            log(f"wrote {args.out / 'gpu_kernels.png'}")
        except Exception:
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
