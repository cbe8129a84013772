"""``python -m scheduler_service.compile_core``: builds the core once per source digest, and where it
cannot (no mypy, no compiler, mypyc refusing) says why without failing the install."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys

import pytest

from scheduler_service import compile_core
from scheduler_service.core import compiled


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compiled.ENV_CACHE, str(tmp_path))
    return tmp_path


def test_without_mypy_it_says_so_and_the_install_goes_on(empty_cache, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mypyc", None)  # import mypyc raises ImportError
    with pytest.raises(compile_core.CompileError, match="mypy is not installed"):
        compile_core.build()
    assert compile_core.main([]) == 0
    assert "scheduler core: not compiled (mypy is not installed" in capsys.readouterr().err
    assert list(empty_cache.iterdir()) == []


def test_a_failed_build_leaves_nothing_behind(empty_cache, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, stdout="", stderr="scheduler.py:1: error: it does not type-check")

    monkeypatch.setattr(compile_core.subprocess, "run", refuse)
    with pytest.raises(compile_core.CompileError, match="it does not type-check"):
        compile_core.build()
    assert compile_core.main([]) == 0
    assert "mypyc failed (1)" in capsys.readouterr().err
    assert [p for p in empty_cache.iterdir() if not p.name.startswith(".")] == []
    assert not compiled.build_dir().exists()


def test_an_existing_build_of_these_sources_is_kept_half_of_one_is_not(empty_cache, monkeypatch):
    root = compiled.build_dir()
    root.mkdir(parents=True)
    calls = []
    monkeypatch.setattr(compile_core.subprocess, "run",
                        lambda *a, **k: calls.append(a) or subprocess.CompletedProcess(a, 1, "", "refused"))
    with pytest.raises(compile_core.CompileError):  # a folder without mypyc's library: built again
        compile_core.build()
    assert len(calls) == 1
    (root / f"{compiled.GROUP}__mypyc{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    assert compile_core.build() == root and len(calls) == 1  # kept
