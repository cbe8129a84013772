"""Which form of the core runs: its mypyc build, where one of these very sources exists, else the source.

The core's modules are plain Python, standard library only. ``make install`` also compiles them with
mypyc (``python -m scheduler_service.compile_core``) into a folder named by a digest of their
sources, the contract's and this interpreter's extension ABI, under ``$PAGEDSERVE_CORE_CACHE`` (default
``~/.cache/pagedserve/core``). The compiled modules do what the source does, about twice as fast
(``benchmarks/scheduler_overhead.py``: a step of 1,024 decoding requests ~1.1 → ~0.6 ms).

The package's ``__init__`` calls :func:`activate` before it imports any module of the core: when the
build for the digest of the sources on disk (the contract they are compiled against included)
exists, its folder goes first on the package's ``__path__``, so ``import
scheduler_service.core.scheduler`` loads the extension module. A source edited since the build
changes the digest: a stale build is never loaded, the source runs until the next ``make
install``. ``PAGEDSERVE_COMPILED_CORE=0`` keeps the source (a debugger, a profiler
that patches methods, a test of the source itself).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "scheduler_service.core"
SOURCE_DIR = Path(__file__).resolve().parent
# The contract the core is compiled against: mypyc builds its annotations (list[int], a dataclass's
# fields) into the compiled code's type checks, so a change there needs a new build too.
CONTRACT_DIR = SOURCE_DIR.parents[1] / "servicekit" / "contract"
# the modules compiled, in dependency order; the package's __init__ and this module stay Python
MODULES = ("kv_cache_utils", "request", "block_pool", "kv_cache_manager", "waiting_queue", "scheduler")
# mypyc's shared library for the group: a top-level extension module of this name
GROUP = "pagedserve_core"
ENV_ENABLED = "PAGEDSERVE_COMPILED_CORE"
ENV_CACHE = "PAGEDSERVE_CORE_CACHE"

active: Path | None = None  # the build folder in use, None when the source runs


def enabled() -> bool:
    """False when ``PAGEDSERVE_COMPILED_CORE`` says 0 / false / no / off."""
    return os.environ.get(ENV_ENABLED, "1").lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    configured = os.environ.get(ENV_CACHE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve" / "core"


def digest() -> str:
    """Of the compiled modules' sources, the contract's (``CONTRACT_DIR``) and this interpreter's
    extension suffix (its ABI)."""
    h = hashlib.sha256(importlib.machinery.EXTENSION_SUFFIXES[0].encode())
    sources = [SOURCE_DIR / f"{name}.py" for name in MODULES] + sorted(CONTRACT_DIR.glob("*.py"))
    for path in sources:
        h.update(b"\0" + path.name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Where the build of the sources on disk lives (or would)."""
    return cache_root() / digest()


def module_dir(root: Path) -> Path:
    """The package's folder inside a build folder (the modules' extension files)."""
    return root.joinpath(*PACKAGE.split("."))


def library(root: Path) -> Path | None:
    """mypyc's shared library in a build folder, None when there is none (no build, or half of one)."""
    if not root.is_dir():
        return None
    return next(root.glob(f"{GROUP}__mypyc*{importlib.machinery.EXTENSION_SUFFIXES[0]}"), None)


def activate(package_path: list[str]) -> Path | None:
    """Put the build of these sources, if there is one, first on ``package_path`` (the package's
    ``__path__``) and load its shared library; returns its folder, or None (the source runs). A
    build that cannot be loaded (made for another system's libraries, damaged) leaves the source,
    with a warning."""
    global active
    if active is not None or not enabled():
        return active
    try:
        root = build_dir()
        found = library(root)
    except (OSError, RuntimeError):  # a source unreadable (its import says why), no home folder
        return None
    if found is None:
        return None
    # The modules' extension files import the group's library by its top-level name: load it from the
    # build folder under that name (sys.path stays as it is).
    name = found.name.split(".")[0]
    if name not in sys.modules:
        try:
            spec = importlib.util.spec_from_file_location(name, found)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except (ImportError, OSError) as exc:
            sys.modules.pop(name, None)
            log.warning("the scheduler core's build %s does not load (%s): running its source; "
                        "python -m scheduler_service.compile_core --force builds it again", root, exc)
            return None
    package_path.insert(0, str(module_dir(root)))
    active = root
    return root


def describe() -> str:
    """Which form runs, for logs and benchmark results."""
    if active is not None:
        return f"mypyc build {active}"
    if not enabled():
        return f"Python source ({ENV_ENABLED}=0)"
    return "Python source (no mypyc build of these sources: python -m scheduler_service.compile_core)"
