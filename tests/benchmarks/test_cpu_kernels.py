"""benchmarks/cpu_kernels.py runs (tiny sizes): it cannot rot between the runs benchmarks/README.md quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paged_kernels import cpu, cpu_fused, small_gemm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (cpu.available() and cpu_fused.available()), reason="no C compiler on this machine")
def test_the_cpu_kernel_benchmark_runs_and_reports_every_part():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_kernels.py"), "--layers", "2",
                           "--blocks", "1400", "--rounds", "1"], capture_output=True, text=True, timeout=240,
                          check=False)

    assert done.returncode == 0, done.stderr[-2000:]
    assert "ms a layer" in done.stdout and "C read" in done.stdout and "plain read" in done.stdout
    assert "float32  2048 tokens: gather + SDPA" in done.stdout and "C kernel" in done.stdout
    assert "2048 tokens: add + RMSNorm, torch" in done.stdout and "rotary, fused" in done.stdout
    if cpu.amx_prefill_available():  # tiles: AMX, or emulated with AVX512-BF16
        assert "prefill chunk of 512 tokens after    0 cached: rows" in done.stdout
        assert "decode rows over 4 shared prefix(es) of 1024" in done.stdout
    else:
        assert "tiles: no tile kernel" in done.stdout
    if small_gemm.available():  # the tile GEMM runs only where AMX does
        assert "1024 rows: oneDNN" in done.stdout and "AMX small GEMM" in done.stdout
