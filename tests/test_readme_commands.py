"""Every `python -m loadtests.X ...` command the README gives parses with the module's own flags
today: a flag renamed or removed breaks the README's command, which nothing else runs (they are
minutes-long benchmarks). Parsed, not run (tests/parse_commands.py); placeholders the README
explains (`$c`, `$s`, `C`, `S`, `DIR`) get a valid value."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

from tests.conftest import REPO

PLACEHOLDERS = {"$c": "shared_docs", "$s": "0", "C": "shared_docs", "S": "0"}


def readme_commands(text: str) -> list[list[str]]:
    """[module, arg...] of each `python -m loadtests.` command, in fenced bash blocks (one per
    line once continuations are joined) and in inline code spans outside them."""
    pieces = []
    fenced = re.compile(r"```bash\n(.*?)```", re.S)
    for block in fenced.findall(text):
        pieces += block.replace("\\\n", " ").split("\n")
    pieces += re.findall(r"`([^`]*python -m loadtests\.[^`]*)`", fenced.sub("", text).replace("\n", " "))
    out = []
    for piece in pieces:
        for part in re.split(r"&&|;|\|", piece):
            if "python -m loadtests." in part:
                argv = shlex.split(part[part.index("python -m") + len("python -m"):])
                out.append([PLACEHOLDERS.get(a, a.replace("${c}", "shared_docs").replace("$s", "0")) for a in argv])
    return out


def test_the_extraction_finds_the_readmes_benchmarks():
    mods = {c[0] for c in readme_commands((REPO / "README.md").read_text())}
    assert {"loadtests.compare_peers", "loadtests.bench_flow", "loadtests.vtime_report", "loadtests.bench_epp"} <= mods


def test_a_removed_flag_is_caught():
    res = _parse([["loadtests.bench_flow", "--gateways", "1", "--no-such-flag"],
                  ["loadtests.bench_flow", "--gateways", "1"]])
    assert res[0][1] and "unrecognized arguments: --no-such-flag" in res[0][1] and res[1][1] is None


def _parse(cmds: list[list[str]]) -> list:
    r = subprocess.run([sys.executable, "-m", "tests.parse_commands"], input=json.dumps(cmds), capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_readme_command_parses():
    cmds = readme_commands((REPO / "README.md").read_text())
    bad = [f"python -m {' '.join(argv)}\n    {err}" for argv, err in _parse(cmds) if err]
    assert not bad, "README commands that no longer parse:\n" + "\n".join(bad)
