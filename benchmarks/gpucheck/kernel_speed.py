"""Section 3: kernel speed, through ``benchmarks/gpu_kernels.py`` (``--quick``): its own correctness
checks on Llama-3-8B-like shapes, the device-to-device copy bandwidth, then decode attention over
batch x context as a fraction of that bandwidth, beside SDPA on contiguous K/V. Dry, the same
stages at its dry-run sizes with a wall clock."""

from __future__ import annotations

import argparse
import json
import shutil

from gpucheck.common import Context, log

PLOT = "gpu_kernels.png"


def run(ctx: Context) -> dict:
    import gpu_kernels

    if ctx.dry:
        gpu_kernels.use_dry_run_sizes()
    args = argparse.Namespace(out=ctx.work, quick=True, sweep=False, split_sweep=False)
    status = gpu_kernels.run(args, device=ctx.device)
    report = json.loads((ctx.work / "gpu_kernels.json").read_text())
    if (ctx.work / PLOT).exists():
        shutil.copy(ctx.work / PLOT, ctx.out / PLOT)
    copy_gbps = report.get("copy", {}).get("gbps_read_plus_write")
    decode = [
        dict(batch=r["batch"], context=r["context"], triton_gbps=r["triton_gbps"],
             fraction_of_copy=r["triton_gbps"] / copy_gbps if copy_gbps else None,
             sdpa_gbps=r.get("sdpa_gbps"), num_splits=r["num_splits"])
        for r in report.get("decode", []) if "triton_gbps" in r
    ]
    log(f"kernel speed: copy {copy_gbps} GB/s, {len(decode)} decode points, goal {report.get('goal')}")
    return dict(
        passed=status == 0,
        device=report.get("device"),
        correctness_passed=all(c["passed"] for c in report.get("correctness", [])),
        copy_gbps=copy_gbps,
        launcher_overhead_us=report.get("launcher_overhead_us"),
        goal=report.get("goal"),
        decode=decode,
        errors=report.get("errors", []),
    )
