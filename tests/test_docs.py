"""The documents stay what their readers need: a short README for a user's first
ten minutes, docs/ for the rest, measured history only under benchmarks/results/, and no link or
path that points at nothing.

Pure reading of the checkout: no services, no network. Paths come from ``git ls-files`` so that
what is checked is what the repository holds, not stray files of a working tree.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

README_MAX_LINES = 250
REQUIRED_DOCS = ("docs/architecture.md", "docs/api.md", "docs/configuration.md", "docs/operations.md",
                 "benchmarks/README.md")
# Documents whose relative links must all land on something in the repository.
LINKED_DOCS = ("README.md", "docs/*.md", "benchmarks/README.md", "benchmarks/results/README.md")
# Words of a lab notebook: numbered work periods and tracker numbers. History belongs in
# benchmarks/results/ and in commit bodies; the same pattern as
# grep -rnIiE 'session [0-9]|\bsitting\b|\bissue [0-9]+([^0-9a-z-]|$)'.
NOTEBOOK_WORDS = re.compile(r"session [0-9]|\bsitting\b|\bissue [0-9]+([^0-9a-z-]|$)", re.IGNORECASE)
NOTEBOOK_SUFFIXES = (".md", ".py", ".yaml")
NOTEBOOK_EXEMPT = ("benchmarks/results/", ".venv/")

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCED_BLOCK = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository path as architecture.md writes one: `servicekit/contract/`, `paged_kernels/reference.py`.
SLASH_PATH = re.compile(r"[A-Za-z_][\w.-]*(/[\w.-]+)*/?")
# A dotted module path: `servicekit.contract.errors`, `pagedserve.LLM`.
DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def tracked_files() -> list[str]:
    """The repository's files (git ls-files) that are present in the working tree: a file another
    change is moving away is no longer the repository's."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def doc_paths(patterns: tuple[str, ...]) -> list[Path]:
    found: list[Path] = []
    for pattern in patterns:
        found.extend(sorted(ROOT.glob(pattern)))
    return found


def relative_links(markdown: str) -> list[str]:
    """Link targets of ``markdown`` outside code blocks that are neither URLs nor in-page anchors,
    without their ``#fragment``."""
    prose = FENCED_BLOCK.sub("", markdown)
    targets = []
    for target in MARKDOWN_LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # https:, mailto:, ... or an anchor in the same page
        targets.append(target.split("#", 1)[0])
    return targets


def top_level_names() -> set[str]:
    return {p.split("/", 1)[0] for p in tracked_files()}


def repo_paths_in_code_spans(markdown: str, top_level: set[str]) -> tuple[list[str], list[str]]:
    """(slash paths, dotted module paths) written in backticks whose first part is a top-level entry of
    the repository: the spans that claim to name a place in the tree."""
    prose = FENCED_BLOCK.sub("", markdown)
    slash, dotted = [], []
    for span in CODE_SPAN.findall(prose):
        span = span.strip()
        if SLASH_PATH.fullmatch(span) and ("/" in span or span.endswith(".py")):
            if span.split("/", 1)[0] in top_level:
                slash.append(span)
        elif DOTTED_PATH.fullmatch(span) and span.split(".", 1)[0] in top_level:
            dotted.append(span)
    return slash, dotted


def dotted_path_exists(name: str) -> bool:
    """``a.b.c`` names a module or package, or a name defined in one: every part but the last is a
    package or module of the tree, and the last is a module, a package, or a word of its parent
    module's source (a class, function or constant there)."""
    parts = name.split(".")
    location = ROOT
    for i, part in enumerate(parts):
        package, module = location / part, location / f"{part}.py"
        if package.is_dir():
            location = package
        elif module.is_file():
            if i == len(parts) - 1:
                return True
            source = module.read_text(encoding="utf-8")
            return i == len(parts) - 2 and re.search(rf"\b{re.escape(parts[-1])}\b", source) is not None
        elif i == len(parts) - 1 and i > 0:
            init = location / "__init__.py"
            return init.is_file() and re.search(rf"\b{re.escape(part)}\b", init.read_text(encoding="utf-8")) is not None
        else:
            return False
    return True


def test_the_readme_fits_a_first_ten_minutes():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


@pytest.mark.parametrize("path", REQUIRED_DOCS)
def test_each_document_the_readme_promises_exists(path):
    assert (ROOT / path).is_file(), f"{path} is missing"


def test_no_lab_notebook_words_outside_the_results():
    offenders = []
    for path in tracked_files():
        if not path.endswith(NOTEBOOK_SUFFIXES) or path.startswith(NOTEBOOK_EXEMPT):
            continue
        data = (ROOT / path).read_bytes()
        if b"\0" in data:
            continue  # binary, as grep -I skips it
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if NOTEBOOK_WORDS.search(line):
                offenders.append(f"{path}:{number}: {line.strip()[:120]}")
    assert not offenders, "history words outside benchmarks/results/:\n" + "\n".join(offenders)


def test_every_relative_link_lands_inside_the_repository():
    broken = []
    for doc in doc_paths(LINKED_DOCS):
        for target in relative_links(doc.read_text(encoding="utf-8")):
            if not target:
                continue
            resolved = (doc.parent / target).resolve()
            where = f"{doc.relative_to(ROOT)} -> {target}"
            if not resolved.is_relative_to(ROOT):
                broken.append(f"{where} (leaves the repository)")
            elif not resolved.exists():
                broken.append(f"{where} (no such file)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_architecture_names_only_paths_that_exist():
    architecture = ROOT / "docs" / "architecture.md"
    if not architecture.is_file():
        pytest.fail("docs/architecture.md is missing")
    slash, dotted = repo_paths_in_code_spans(architecture.read_text(encoding="utf-8"), top_level_names())
    assert slash, "docs/architecture.md names no package path: the check would prove nothing"
    missing = [p for p in slash if not (ROOT / p.rstrip("/")).exists()]
    missing += [p for p in dotted if not dotted_path_exists(p)]
    assert not missing, "docs/architecture.md names paths the tree does not have:\n" + "\n".join(missing)


def test_the_path_check_itself_tells_real_paths_from_stale_ones():
    top_level = {"servicekit", "scheduler_service", "pagedserve"}
    text = ("`servicekit/contract/` and `scheduler_service/core/no_such_module.py`, `pagedserve.LLM`, "
            "`servicekit.no_such_module.thing`, not `ps:requests` nor `{prefix}out:{id}`\n"
            "```\nservicekit/not_a_span_in_a_block/\n```\n")
    slash, dotted = repo_paths_in_code_spans(text, top_level)
    assert slash == ["servicekit/contract/", "scheduler_service/core/no_such_module.py"]
    assert dotted == ["pagedserve.LLM", "servicekit.no_such_module.thing"]
    assert [(ROOT / p.rstrip("/")).exists() for p in slash] == [True, False]
    assert [dotted_path_exists(p) for p in dotted] == [True, False]
