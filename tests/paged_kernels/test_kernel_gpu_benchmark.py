"""``benchmarks/gpu_kernels.py`` runs end to end — shrunk, on the CPU under the interpreter.

The benchmark is meant for a GPU machine that may be borrowed for a few minutes, so a typo in it
would waste that time; this runs every stage (checks, copy, decode grid, split and config sweeps,
JSON, plot) with its dry-run sizes (without CUDA it times with a wall clock in place of ``do_bench``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import paged_kernels.paged_attention as paged_attention_module

pytestmark = pytest.mark.kernel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_kernels_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real benchmark runs on the GPU")
def test_gpu_benchmark_runs_end_to_end_on_tiny_shapes(tmp_path, monkeypatch):
    bench = load_benchmark()
    for name, value in bench.DRY_RUN_SIZES.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "config_sweep_space", lambda: [(32, 4, 3), (64, 8, 2)])
    monkeypatch.setattr(paged_attention_module, "_num_sms", lambda device: 4)
    args = argparse.Namespace(out=tmp_path, quick=False, sweep=True, split_sweep=True)

    status = bench.run(args, device="cpu")

    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert status == 0, report["errors"]
    assert report["errors"] == []
    assert all(check["passed"] for check in report["correctness"])
    assert len(report["decode"]) == 4 and all("triton_gbps" in r for r in report["decode"])
    assert all("sdpa_ms" in r and "ms_by_num_splits" in r for r in report["decode"])
    assert {r["num_splits"] for r in report["decode"]} == {8, 4}  # the heuristic at 4 "SMs"
    assert len(report["config_sweep"]) == 2 and "goal" in report
    assert (tmp_path / "gpu_kernels.png").stat().st_size > 0


def test_gpu_benchmark_says_so_and_exits_0_without_cuda(tmp_path, monkeypatch, capsys):
    bench = load_benchmark()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    assert bench.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
