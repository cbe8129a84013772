"""The protos document every service, rpc, message, enum value and field, and the
generated code is what `python -m servicekit.proto.gen` makes of them."""

from __future__ import annotations

import re

import pytest

from servicekit.proto import gen

from helpers.stack import REPO

PROTOS = sorted((REPO / "protos" / "pagedserve" / "v1").glob("*.proto"))
DECLARATION = re.compile(
    r"^\s*(service|rpc|message|enum|oneof|(optional |repeated )?[\w.]+ \w+ = \d+;|[A-Z_0-9]+ = \d+;)")


def undocumented(path) -> list[str]:
    lines = path.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if not DECLARATION.match(line):
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        prev = lines[j].strip() if j >= 0 else ""
        trailing = "//" in line
        if not (prev.startswith("//") or trailing):
            missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    return missing


@pytest.mark.parametrize("path", PROTOS, ids=[p.name for p in PROTOS])
def test_every_declaration_is_documented(path):
    assert undocumented(path) == []


def test_generated_code_is_current_and_importable():
    assert not gen.is_stale()
    from servicekit.proto import pb

    assert pb.GENERATION_SERVICE == "pagedserve.v1.Generation"
    assert pb.WORKER_SERVICE == "pagedserve.v1.Worker"
    assert pb.SCHEDULER_ADMIN_SERVICE == "pagedserve.v1.SchedulerAdmin"


def test_generated_code_is_git_ignored():
    assert "servicekit/proto/proto_gen/" in (REPO / ".gitignore").read_text()
