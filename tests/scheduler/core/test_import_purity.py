"""The core imports the standard library only (docs/architecture.md, decision 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FORBIDDEN = ("torch", "grpc", "redis", "numpy", "google", "triton", "transformers")


def test_importing_the_core_loads_no_heavy_dependency():
    code = (
        "import json, sys\n"
        "import scheduler_service.core\n"
        "import scheduler_service.core.scheduler, scheduler_service.core.kv_cache_manager\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    proc = subprocess.run([sys.executable, "-E", "-s", "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    loaded = set(json.loads(proc.stdout))
    assert "scheduler_service" in loaded
    assert not loaded & set(FORBIDDEN), f"the core pulled in {sorted(loaded & set(FORBIDDEN))}"
