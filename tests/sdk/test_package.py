"""The package itself (``pagedserve/__init__.py``): importing it loads no server dependency."""

from __future__ import annotations

import subprocess
import sys


def test_import_pagedserve_stays_light():
    code = ("import sys, pagedserve; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules; from pagedserve import SamplingParams; "
            "assert 'torch' not in sys.modules; print(sorted(pagedserve.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LLM" in out.stdout and "SamplingParams" in out.stdout
