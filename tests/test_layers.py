"""The floors of docs/architecture.md ("Packages") hold: import-linter's contracts (pyproject
``[tool.importlinter]``), and a client that imports only the SDK and runs the client commands pulls
in no server dependency."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_ONLY = ("torch", "transformers", "triton", "redis", "numpy", "scheduler_service", "worker_service",
               "gateway_service", "paged_kernels")


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


CLIENT_SCRIPT = """
import socket, sys
with socket.socket() as s:  # a port nobody listens on: every command fails fast, after its imports
    s.bind(("127.0.0.1", 0)); closed = f"127.0.0.1:{s.getsockname()[1]}"
import pagedserve
from pagedserve import AsyncClient, Client, SamplingParams
import pagedserve.errors, pagedserve.admin
from pagedserve.cli import main
for argv in (["health", closed, "--timeout", "0.2"], ["stats", closed, "--timeout", "0.2"],
             ["generate", "hi", "--address", closed, "--timeout", "0.3"],
             ["chat", "hi", "--address", closed, "--timeout", "0.3"]):
    try:
        main(argv)
    except BaseException as exc:  # the commands fail: nothing listens
        pass
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] in SERVER_ONLY)))
"""


def test_client_sdk_and_client_commands_import_no_server_dependency():
    script = f"SERVER_ONLY = {SERVER_ONLY!r}\n" + CLIENT_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1:] in ([], [""]), f"client imported: {result.stdout}"


def test_each_top_level_package_name_is_ours_alone():
    """A top-level package that shares its import name with another distribution shadows it (from the
    repository root) and fools libraries that probe for it: transformers took a folder once called
    ``kernels`` for Hugging Face's ``kernels`` and imported from it."""
    import importlib.metadata
    import importlib.util
    import tomllib

    roots = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    owners = importlib.metadata.packages_distributions()
    for name in roots:
        assert set(owners.get(name, ["pagedserve"])) == {"pagedserve"}, (name, owners[name])
        assert Path(importlib.util.find_spec(name).origin).is_relative_to(REPO), name
