"""Compile the scheduler core with mypyc: ``python -m scheduler_service.compile_core`` (``make install``).

mypyc (part of mypy) turns type-annotated Python modules into C extension modules: attribute access
on the core's classes becomes a struct read, calls between its modules direct C calls. Chosen over
Cython or a hand-written extension because the source stays the one plain-Python core, read, tested
and run as it is where no C compiler is (``scheduler_service.core.compiled`` picks the form at
import). It needs mypy and a C compiler at build time only; the build folder holds the extension
modules and mypyc's shared library for them, nothing else is needed to load them.

The build is written to a temporary folder and renamed into place, so a concurrent import never sees
half of it; the folder's name is the digest of the sources compiled, checked again after the build (a
source edited meanwhile leaves nothing behind). Without mypy or a compiler it says so and exits 0:
the source runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scheduler_service.core import compiled

REPO = compiled.SOURCE_DIR.parents[1]  # the folder that holds the scheduler_service package

# run in a child interpreter: setuptools and mypyc stay out of the caller's process
_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
out, temp, group, *paths = sys.argv[1:]
setup(name=group, ext_modules=mypycify(["--follow-imports=silent", *paths], group_name=group, target_dir=temp),
      script_args=["build_ext", "--build-lib", out, "--build-temp", temp, "-q"])
"""


class CompileError(RuntimeError):
    """mypy, mypyc or the C compiler is missing, or refused the sources."""


def build(force: bool = False) -> Path:
    """Compile the core unless the build of its sources on disk exists; return the build folder."""
    target = compiled.build_dir()
    if compiled.library(target) is not None and not force:
        return target
    try:
        import mypyc  # noqa: F401  (present: the build can run)
    except ImportError:
        raise CompileError("mypy is not installed (pip install mypy): the core runs as Python") from None
    key = target.name  # the digest of the sources compiled: checked again after the build
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out, temp = Path(tmp) / "out", Path(tmp) / "temp"
        paths = [str(Path(*compiled.PACKAGE.split("."), f"{name}.py")) for name in compiled.MODULES]
        done = subprocess.run([sys.executable, "-c", _SETUP, str(out), str(temp), compiled.GROUP, *paths],
                              cwd=REPO, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CompileError(f"mypyc failed ({done.returncode}):\n{(done.stdout + done.stderr).strip()[-4000:]}")
        if compiled.digest() != key:
            raise CompileError("the core's sources changed during the build: run it again")
        missing = [name for name in compiled.MODULES if not any(compiled.module_dir(out).glob(f"{name}.*"))]
        if missing:
            raise CompileError(f"mypyc built no extension for {missing}")
        if target.is_dir():  # --force, or a folder without its library (half of a build)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(out, target)  # atomic: an import sees the whole build or none
        except OSError:
            if not target.is_dir():  # else another builder won the race with the same sources
                raise
    print(f"compiled the scheduler core in {time.perf_counter() - started:.1f} s: {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Compile the scheduler core (scheduler_service/core) with mypyc into "
                    f"${compiled.ENV_CACHE} (default ~/.cache/pagedserve/core). Without mypy or a C "
                    "compiler it says so and the core runs as Python.")
    parser.add_argument("--force", action="store_true", help="build again even if this build exists")
    args = parser.parse_args(argv)
    try:
        print(f"scheduler core: {build(force=args.force)}")
    except CompileError as exc:  # not an install failure: the source is the same core
        print(f"scheduler core: not compiled ({exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
