"""Build and load the C kernels of ``paged_kernels/csrc/`` for the CPU, through ``ctypes``.

The CPU attention backend (``paged_kernels.cpu``) runs its decode rows in C: plain C99 + OpenMP, no torch
headers, compiled once per machine with the system's C compiler (``$CC``, else ``cc``) in about a
second and cached under ``$PAGEDSERVE_KERNEL_CACHE`` (default ``~/.cache/pagedserve/kernels``). The
cache key covers the source, the flags, the compiler's version and the CPU's feature flags, because
``-march=native`` code must never run on a different CPU. Without a compiler (or with
``PAGEDSERVE_NATIVE_KERNELS=0``) :func:`load` returns ``None`` and callers fall back to the torch
reference, with one warning in the log.

``make install`` builds the library ahead of time (``python -m paged_kernels.native``), so the first
request does not pay for it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -ffast-math's parts, not the flag itself: with it, GCC 12 links crtfastmath.o into the shared
# object, whose constructor turns on flush-to-zero for the whole process that loads the kernel
# (torch's numerics and hypothesis' subnormal floats included).
FAST_MATH = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
             "-freciprocal-math", "-ffinite-math-only")
FLAGS = ("-O3", "-march=native", *FAST_MATH, "-fopenmp", "-fPIC", "-shared")
LIBS = ("-lm",)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
# A worker's settings (--native-kernels, --kernel-cache), when it gave them: they win over the
# environment, which is what `python -m paged_kernels.native` (make native) and in-process users read.
_configured: dict[str, object] = {}


def configure(*, enabled: bool | None = None, cache_dir: str | None = None) -> None:
    """Take a worker's settings (``None`` leaves the environment's say)."""
    for key, value in (("enabled", enabled), ("cache_dir", cache_dir)):
        if value is None:
            _configured.pop(key, None)
        else:
            _configured[key] = value


class NativeBuildError(RuntimeError):
    """The C compiler is missing or rejected a kernel source."""


def cache_dir() -> Path:
    configured = _configured.get("cache_dir") or os.environ.get("PAGEDSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve" / "kernels"


def enabled() -> bool:
    if "enabled" in _configured:
        return bool(_configured["enabled"])
    return os.environ.get("PAGEDSERVE_NATIVE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    return path


@functools.cache  # read once: the per-layer path asks for the flags on every call
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The feature flags of this machine's CPU (``/proc/cpuinfo``; empty where there is none)."""
    return _parse_flags(_cpu_flags())


@functools.lru_cache(maxsize=4)
def _parse_flags(line: str) -> frozenset[str]:
    _, _, flags = line.partition(":")
    return frozenset(flags.split())


def library_path(name: str) -> Path:
    """Where the library built from ``csrc/<name>.c`` (and the headers beside it) for this machine and
    compiler lives."""
    source = b"\0".join([(CSRC / f"{name}.c").read_bytes(), *(h.read_bytes() for h in sorted(CSRC.glob("*.h")))])
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS + LIBS).encode(), version.encode(),
                                     _cpu_flags().encode(), sys.platform.encode()])).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


def build(name: str) -> Path:
    """Compile ``csrc/<name>.c`` unless this machine's build is cached; return the library's path."""
    target = library_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [_compiler(), *FLAGS, "-o", tmp, str(CSRC / f"{name}.c"), *LIBS]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.strip()}")
    os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    log.info("built %s in %.1f s: %s", name, time.perf_counter() - started, target)
    return target


def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.c`` (built on first use), or ``None`` if it can't be."""
    try:  # the per-layer path: no lock once loaded (a dict read is atomic)
        return _loaded[name]
    except KeyError:
        pass
    with _lock:
        if name not in _loaded:
            library = None
            if enabled():
                try:
                    library = ctypes.CDLL(str(build(name)))
                except (NativeBuildError, OSError) as exc:
                    log.warning("native kernel %s unavailable, using the torch reference instead: %s", name, exc)
            _loaded[name] = library
        return _loaded[name]


# ctypes argument types of the kernels' entry points (pointers, int64 strides and sizes, int, float)
PTR, I64, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def function(name: str, symbol: str, argtypes: list, restype: type | None = None) -> ctypes._CFuncPtr | None:
    """Entry point ``symbol`` of the library built from ``csrc/<name>.c``, its argument and result
    types set (ctypes checks and converts each call's arguments by them), or ``None`` if the library
    can't be had (see :func:`load`)."""
    library = load(name)
    if library is None:
        return None
    fn = getattr(library, symbol)  # ctypes keeps one object per symbol: the types are set once
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def main(argv: list[str] | None = None) -> int:
    """``python -m paged_kernels.native``: build every kernel in csrc/ for this machine (used by make)."""
    import argparse

    parser = argparse.ArgumentParser(description="Build the CPU kernels of paged_kernels/csrc/ for this machine.")
    parser.parse_args(argv)
    for source in sorted(CSRC.glob("*.c")):
        try:
            print(f"{source.stem}: {build(source.stem)}")
        except NativeBuildError as exc:  # not an install failure: the reference path still works
            print(f"{source.stem}: not built ({exc}); the CPU path will use the torch reference", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
