"""What every section of the GPU check shares: its run context and a timestamped log line."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def use_repo_imports() -> None:
    """Make the project, the other benchmark scripts and the test factories importable (the GPU
    machine runs from a copy of the working tree, with nothing installed)."""
    for path in (REPO, BENCHMARKS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if str(REPO / "tests") not in sys.path:  # last: its folders (e.g. tests/kernels) must not shadow packages
        sys.path.append(str(REPO / "tests"))


@dataclass(frozen=True)
class Context:
    """One section's run: ``dry`` = tiny shapes (the CPU, Triton's interpreter); ``work`` is a
    scratch folder of its own; ``deadline`` a ``time.monotonic()`` value it should finish by."""

    dry: bool
    device: str  # "cuda" or "cpu"
    out: Path  # the check's output folder (at most a few files: the device tool brings back 8)
    work: Path
    deadline: float
    result_path: Path | None = None  # where the section's result goes

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def save_partial(self, result: dict) -> None:
        """Leave what is measured so far where the driver finds it should the section be stopped."""
        if self.result_path is not None:
            self.result_path.write_text(json.dumps(result, indent=2, default=str))


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def rel_l2(out, expected) -> float:
    """``|out - expected| / |expected|`` over all elements, in fp32."""
    diff = out.float() - expected.float()
    return float(diff.norm() / expected.float().norm().clamp_min(1e-12))
