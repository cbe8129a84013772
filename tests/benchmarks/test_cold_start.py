"""benchmarks/cold_start.py: requests wait for a worker, one is launched, and the script reports
how long the answers took after the launch and where that time went."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.stack import redis_server_binary

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cold_start  # noqa: E402

pytestmark = pytest.mark.service


def test_waiting_requests_are_answered_after_the_launch_and_the_time_is_broken_down(tiny_model_dir, tmp_path):
    redis_server_binary()  # skips when there is none
    assert cold_start.main(["--model", tiny_model_dir, "--requests", "2", "--max-tokens", "3",
                            "--worker-after-s", "0.5", "--torch-threads", "1", "--out", str(tmp_path),
                            "--worker-arg=--dtype=float32", "--worker-arg=--num-blocks=64", "--no-plot"]) == 0
    report = json.loads((tmp_path / "cold_start.json").read_text())
    (round_,) = report["rounds"]
    assert round_["waited_before_launch_s"] >= 0.5
    # "weights" is marked by the packing of bf16 weights only: a float32 worker has none
    assert {"imports", "kv_cache", "serving", "driven", "answered"} <= set(round_["parts_s"])
    assert all(s >= 0 for s in round_["parts_s"].values())
    assert round_["launch_to_answers_s"] == pytest.approx(sum(round_["parts_s"].values()), abs=0.01)
    assert round_["first_answer_after_launch_s"] <= round_["launch_to_answers_s"]
