"""Why the worker runs every torch call on one thread: two OpenMP teams on the same cores.

Each thread that enters an OpenMP parallel region gets a thread team of its own. The worker used to
load its model on one thread (``asyncio.to_thread``) and run its steps on another; this script
times the same small bf16 GEMM loop (a decode step's shape for SmolLM2-135M: 64 rows x 576 -> 1536)

- ``one team``: in a fresh process, on one thread only (what the worker does now), and
- ``two teams``: in a fresh process, once on the main thread and then on a second thread,

printing wall time and how many cores were busy (process CPU seconds / wall seconds).

    python benchmarks/omp_teams.py                # 2 threads (torch.set_num_threads), 2000 GEMMs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _child(mode: str, threads: int, iterations: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import psutil
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(64, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)

    def loop() -> dict:
        proc = psutil.Process()
        before, start = proc.cpu_times(), time.perf_counter()
        for _ in range(iterations):
            torch.nn.functional.linear(a, w)
        wall, after = time.perf_counter() - start, proc.cpu_times()
        cpu = after.user + after.system - before.user - before.system
        return {"wall_s": round(wall, 3), "cores_busy": round(cpu / wall, 2)}

    other = ThreadPoolExecutor(max_workers=1)
    if mode == "two-teams":
        loop()  # the main thread's team exists now
    other.submit(loop).result()  # warm-up on the runner thread
    print(json.dumps(other.submit(loop).result()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--child", choices=["one-team", "two-teams"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.threads, args.iterations)
        return
    print(f"load average {os.getloadavg()}; {args.threads} torch threads, {args.iterations} GEMMs 64x576x1536 bf16")
    for mode in ("one-team", "two-teams"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--threads", str(args.threads),
                              "--iterations", str(args.iterations)], check=True, capture_output=True, text=True)
        print(f"{mode:<9}: {out.stdout.strip()}")


if __name__ == "__main__":
    main()
