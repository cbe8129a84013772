"""The wheels carried to the GPU machine, whose image lacks them (or has other versions).

``benchmarks/gpu_wheels.txt`` lists them, one ``name==version`` a line; ``make gpu-wheels``
downloads them (for the machine's CPython 3.12 on x86-64) into ``.gpu-wheels/``, which the device
tool's ``carry`` takes along. Where the installed versions differ, the check installs the carried
wheels into a folder of its own and puts it first on the path of every section it runs.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from gpucheck.common import REPO

LIST = REPO / "benchmarks" / "gpu_wheels.txt"
FOLDER = REPO / ".gpu-wheels"


def wanted(path: Path = LIST) -> dict[str, str]:
    """``{distribution: version}`` from the list (``#`` comments and blank lines ignored)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins[name.strip()] = version.strip()
    return pins


def mismatched(pins: dict[str, str]) -> dict[str, str | None]:
    """The listed distributions not installed at the listed version: ``{name: installed or None}``."""
    found = {}
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            found[name] = installed
    return found


def install(pins: dict[str, str], target: Path, folder: Path = FOLDER) -> list[str]:
    """Install the carried wheels of ``pins`` into ``target`` (no index, no dependencies): returns
    the wheel files used; raises ``FileNotFoundError`` naming those not carried."""
    import subprocess
    import sys

    files, missing = [], []
    for name, version in pins.items():
        stem = f"{name.replace('-', '_')}-{version}-"
        match = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower()))
        (files.append(str(match[0])) if match else missing.append(f"{name}=={version}"))
    if missing:
        raise FileNotFoundError(f"not in {folder}: {', '.join(missing)} (run `make gpu-wheels` and carry the folder)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(target), *files], check=True)
    return files
