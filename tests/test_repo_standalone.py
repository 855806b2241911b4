"""The repository stands alone: a user's clone has nothing beside it, so no file in it may refer to
a document or path outside it (design notes kept elsewhere, a sibling `shared/` directory), and
the data the tests need lives under tests/fixtures."""
from __future__ import annotations

import re
import subprocess

from tests.conftest import FIXTURE_EVENTS, REPO

# Names of documents that live outside the repository, and paths that lead out of it.
OUTSIDE = re.compile(
    r"\b(?:DESIGN|ENGINE_FACTS|EPP_FACTS|PEERS|STYLE)\.md\b"
    r"|\bENGINE_FACTS\b|\bEPP_FACTS\b|\bthe DESIGN\b|DESIGN contract"
    r"|shared/fixtures|\.\./shared|parent\s*/\s*[\"']shared[\"']"
)
THIS_FILE = "tests/test_repo_standalone.py"
# Files another change is rewriting right now (the gateway's pipeline split); each must still
# hold a reference, so this list cannot go stale: once one is fixed, this test says to drop it.
PENDING: dict[str, str] = {}


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [f for f in out if f and (REPO / f).is_file()]


def _offenders() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for rel in _tracked_files():
        if rel == THIS_FILE:
            continue
        try:
            text = (REPO / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for no, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.setdefault(rel, []).append(f"{no}: {line.strip()[:120]}")
    return found


def test_no_file_refers_to_anything_outside_the_repository():
    found = _offenders()
    unexpected = {f: lines for f, lines in found.items() if f not in PENDING}
    assert not unexpected, "references to files outside the repository:\n" + "\n".join(
        f"{f}:{line}" for f, lines in unexpected.items() for line in lines)
    fixed = [f for f in PENDING if f not in found]
    assert not fixed, f"{fixed} no longer refer outside the repository: remove them from PENDING"


def test_the_pattern_catches_what_it_must():
    for bad in ('see DESIGN.md "Salt"', "(ENGINE_FACTS.md)", "REPO.parent / 'shared'", "../shared/fixtures/x.json",
                "as in PEERS.md", "STYLE.md habit 1", "the DESIGN contract"):
        assert OUTSIDE.search(bad), bad
    for fine in ("shared documents", "WARMROUTE_PEERS_VENV", "tests/fixtures/README.md", "design"):
        assert not OUTSIDE.search(fine), fine


def test_captured_fixture_is_inside_the_repository():
    assert FIXTURE_EVENTS.is_file() and FIXTURE_EVENTS.resolve().is_relative_to(REPO)
    assert FIXTURE_EVENTS.stat().st_size > 100_000
    assert (REPO / "tests" / "fixtures" / "README.md").is_file()
    # and git tracks it (a fresh clone has it)
    r = subprocess.run(["git", "ls-files", "--error-unmatch", str(FIXTURE_EVENTS.relative_to(REPO))], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
