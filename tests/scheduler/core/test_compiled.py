"""The core's mypyc build (``scheduler_service/core/compiled.py``): after ``make install`` it is what
runs, it plans and delivers exactly what the source does, and without a build of these very sources
the source runs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import scheduler_service.core.scheduler as scheduler_module
from scheduler_service.core import compiled

REPO = Path(__file__).resolve().parents[3]
CORE_TESTS = Path(__file__).resolve().parent

FORM = ("import scheduler_service.core.compiled as c, scheduler_service.core.scheduler as m\n"
        "print(c.active is not None, m.__file__.endswith('.py'), c.describe())\n")

# Every policy, with and without planning ahead, drafts, tenants, aborts, a short pool (preemptions)
# and shared prefixes: what each request received, how it finished, how many steps it took and the
# counters at the end.
TRACE = """
import hashlib, json
from tests.scheduler.core.test_async_scheduling import simulate
runs = []
for policy in ("fcfs", "priority", "fair", "lpm", "spf"):
    for pipelined, drafts, tenants, abort, blocks in ((False, 0, 0, 0.0, 65), (True, 3, 3, 0.05, 65),
                                                      (True, 0, 2, 0.1, 40), (False, 4, 0, 0.0, 30)):
        delivered, finish, steps, ahead, s = simulate(40, 7, pipelined=pipelined, abort_rate=abort,
                                                      num_drafts=drafts, tenants=tenants, policy=policy,
                                                      num_blocks=blocks)
        stats = s.stats()
        runs.append([policy, pipelined, drafts, sorted(delivered.items()),
                     sorted((k, str(v)) for k, v in finish.items()), steps, ahead,
                     stats.num_preemptions, stats.prefix_cache_hits, stats.prefix_cache_queries])
print(sum(r[7] for r in runs), sum(r[8] for r in runs), hashlib.sha256(json.dumps(runs).encode()).hexdigest())
"""


def _run(code: str, timeout: float = 120, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _can_build() -> bool:
    return importlib.util.find_spec("mypyc") is not None and shutil.which(os.environ.get("CC") or "cc") is not None


def _require_build() -> None:
    if not compiled.build_dir().is_dir():
        if _can_build():
            pytest.fail("mypy and a C compiler are here but the core has no build of its sources: "
                        "`make native` (python -m scheduler_service.compile_core) failed, or was not run")
        pytest.skip("no mypy or no C compiler here: the core runs as Python")


def test_the_build_of_these_sources_is_what_runs():
    _require_build()
    assert os.environ.get(compiled.ENV_ENABLED, "1") != "0", "the suite runs the form the services run"
    assert compiled.active == compiled.build_dir()
    assert Path(scheduler_module.__file__).parent == compiled.module_dir(compiled.active)
    assert _run(FORM).split()[:2] == ["True", "False"]


def test_the_compiled_core_plans_and_delivers_what_the_source_does():
    _require_build()
    source, built = _run(TRACE, PAGEDSERVE_COMPILED_CORE="0"), _run(TRACE, PAGEDSERVE_COMPILED_CORE="1")
    preemptions, hits, _ = source.split()
    assert int(preemptions) > 0 and int(hits) > 0  # the runs reach those paths
    assert built == source


def test_without_a_build_of_these_sources_the_source_runs(tmp_path):
    absent = _run(FORM, PAGEDSERVE_CORE_CACHE=str(tmp_path))
    assert absent.startswith("False True Python source (no mypyc build")
    # a build of other sources (an older revision) is never loaded
    (tmp_path / "0123456789abcdef" / "scheduler_service" / "core").mkdir(parents=True)
    assert _run(FORM, PAGEDSERVE_CORE_CACHE=str(tmp_path)).startswith("False True")
    assert _run(FORM, PAGEDSERVE_COMPILED_CORE="0").startswith(
        f"False True Python source ({compiled.ENV_ENABLED}=0)")


def test_the_source_passes_the_core_tests_too():
    """The suite runs the build; the source must hold as well (a machine without a C compiler runs it)."""
    _require_build()  # else the whole suite ran the source already
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(CORE_TESTS),
                           f"--ignore={Path(__file__)}"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, compiled.ENV_ENABLED: "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_the_digest_covers_the_contract_the_core_is_compiled_against(tmp_path, monkeypatch):
    """mypyc builds the contract's annotations into the compiled checks: a contract change needs a
    new build, never the old one."""
    before = compiled.digest()
    copy = tmp_path / "contract"
    shutil.copytree(compiled.CONTRACT_DIR, copy)
    monkeypatch.setattr(compiled, "CONTRACT_DIR", copy)
    assert compiled.digest() == before
    step = copy / "step.py"
    step.write_text(step.read_text() + "\n# changed\n")
    assert compiled.digest() != before


def test_a_build_that_does_not_load_leaves_the_source(tmp_path):
    """A build made for another system's libraries, or damaged: the source runs, with a warning."""
    code = ("import os, pathlib, importlib.machinery\n"
            "import scheduler_service.core.compiled as c\n"
            "root = c.build_dir()\n"
            "root.mkdir(parents=True)\n"
            "(root / (c.GROUP + '__mypyc' + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b'not a library')\n")
    # the probe runs with the build disabled so that it only computes where the build goes
    _run(code, PAGEDSERVE_CORE_CACHE=str(tmp_path), PAGEDSERVE_COMPILED_CORE="0")
    done = subprocess.run([sys.executable, "-c", FORM], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PAGEDSERVE_CORE_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False True")
    assert "does not load" in done.stderr
