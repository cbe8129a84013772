"""benchmarks/serve.py: the stack / in-process summary over paired rounds."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve import ratio_summary  # noqa: E402


def _round(tokens: int, seconds: float) -> dict:  # the fields of serve.summarize's dict it reads
    return {"total_output_tokens": tokens, "duration_s": seconds, "output_token_throughput": tokens / seconds}


def test_rounds_give_their_ratios_median_mean_error_and_pooled_ratio():
    rounds = [(_round(900, 10.0), _round(1000, 10.0)),   # 0.9
              (_round(1000, 10.0), _round(1000, 10.0)),  # 1.0
              (_round(1000, 20.0), _round(1000, 19.0))]  # 0.95
    over = ratio_summary(rounds)
    assert over["rounds"] == pytest.approx([0.9, 1.0, 0.95])
    assert over["median"] == pytest.approx(0.95)
    assert over["mean"] == pytest.approx(0.95)
    assert over["stderr"] == pytest.approx(0.05 / math.sqrt(3))  # stdev 0.05 over 3 rounds
    # all stack tokens over all stack time (2,900 / 40 s) against the in-process engine's (3,000 / 39 s)
    assert over["pooled"] == pytest.approx((2900 / 40) / (3000 / 39))


def test_a_failed_request_counts_against_the_stack():
    """The ratio is of tokens delivered per second, not of durations: a round whose stack lost a
    request's tokens is worse though it took the same time."""
    (ratio,) = ratio_summary([(_round(800, 10.0), _round(1000, 10.0))])["rounds"]
    assert ratio == pytest.approx(0.8)


def test_one_round_has_no_error_and_none_is_refused():
    assert ratio_summary([(_round(10, 1.0), _round(10, 1.0))])["stderr"] is None
    with pytest.raises(ValueError, match="no rounds"):
        ratio_summary([])
