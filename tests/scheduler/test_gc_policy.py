"""The scheduler process's collector settings (scheduler_service/gc_policy.py). They change the
whole process, so each check runs in a child interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from scheduler_service import gc_policy


def _in_child(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def test_tune_raises_only_the_young_threshold_and_freezes_what_exists():
    out = _in_child(
        "import gc, json; from scheduler_service import gc_policy; before = gc.get_threshold(); gc_policy.tune(); "
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()]))")
    before, after, frozen, enabled = json.loads(out)
    assert after == [gc_policy.GEN0_THRESHOLD, *before[1:]]
    assert frozen > 0 and enabled


def test_a_cycle_made_after_tuning_is_still_collected():
    out = _in_child(
        "import gc, weakref; from scheduler_service import gc_policy; gc_policy.tune()\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a; probe = weakref.ref(a); del a, b\n"
        "gc.collect(); print(probe() is None)")
    assert out == "True"
