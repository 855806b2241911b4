"""`warmroute --help` and every subcommand's help explain themselves: each flag has a description
and says its default (unless it is required or a switch), workload and policy names are listed,
`--version` works, no help text names an internal module; a wrong name is a one-line usage error
that names the flag and the valid choices; no command prints transformers' PyTorch advice."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from gateway.cli import SUBCOMMANDS, build_parser
from loadtests.workloads import WORKLOADS
from policies.registry import POLICY_NAMES
from tests.conftest import REPO, free_port

EXE = [sys.executable, "-m", "gateway.cli"]
# a Python module path of this project (gateway.server, loadtests/bench.py, replica_agent.agent ...)
INTERNAL = re.compile(r"\b(?:gateway|replica_agent|loadtests|hashing|policies)(?:\.(?!yaml\b)[a-z_]+|/[a-z_/]+\.py)\b")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _run(*args, env=None, timeout=60):
    return subprocess.run(EXE + list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_flag_has_a_description_and_its_default(name):
    sub = _subparsers()[name]
    fmt = sub._get_formatter()
    problems = []
    for act in sub._actions:
        if isinstance(act, argparse._HelpAction) or act.help == argparse.SUPPRESS:  # hidden: not shown
            continue
        flag = act.option_strings[0]
        if not (act.help or "").strip():
            problems.append(f"{flag}: no description")
            continue
        shown = fmt._expand_help(act) if hasattr(fmt, "_expand_help") else act.help
        switch = isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not (act.required or switch or "default" in shown):
            problems.append(f"{flag}: default not stated ({shown!r})")
    assert not problems, f"warmroute {name}:\n" + "\n".join(problems)


def test_help_names_workloads_and_policies_and_no_internal_module():
    outs = {"": _run("--help").stdout}
    for name in SUBCOMMANDS:
        r = _run(name, "--help")
        assert r.returncode == 0, r.stderr
        outs[name] = r.stdout
    for workload in WORKLOADS:
        assert workload in outs["bench"], workload
    for policy in POLICY_NAMES:
        assert policy in outs["bench"] and policy in outs["gateway"], policy
    assert "WARMROUTE_BENCH_API_KEY" in outs["bench"] and "--api-key" in outs["bench"]
    for name, text in outs.items():
        found = INTERNAL.findall(" ".join(text.split()))  # joined: argparse wraps lines anywhere
        assert not found, f"warmroute {name} --help names internal modules: {found}"
    for name, text in outs.items():
        if name:  # each subcommand has a description paragraph of its own, not its one-line summary only
            assert len(text.split("options:")[0].splitlines()) > 3, name


def test_internal_pattern_catches_module_names():
    assert INTERNAL.search("the runner lives in loadtests.bench")
    assert INTERNAL.search("see gateway/config.py")
    assert INTERNAL.search("the sidecar lives in replica_agent.agent")
    assert not INTERNAL.search("gateway/gateway.yaml is an example")  # a config file, not a module
    assert not INTERNAL.search("the gateway. It")


def test_version():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"warmroute {version('warmroute')}", r.stdout + r.stderr


@pytest.mark.parametrize("args, flag, valid", [
    (["bench", "--policy", "nonsense"], "--policy", POLICY_NAMES),
    (["bench", "--policy", "cache_aware", "--policy", "round_robbin"], "--policy", POLICY_NAMES),
    (["bench", "--workload", "shared_doc"], "--workload", tuple(WORKLOADS)),
])
def test_a_wrong_name_is_a_one_line_error_naming_the_flag_and_the_choices(args, flag, valid):
    r = _run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(err) == 1 and flag in err[0], r.stderr
    assert all(v in err[0] for v in valid), err[0]
    assert "policy.params" not in r.stderr


def test_no_pytorch_advice_from_transformers():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    port = free_port()
    p = subprocess.Popen(EXE + ["sim", "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        for line in p.stdout:  # the sim loads its tokenizer (transformers) before it listens
            out.append(line)
            if "listening on" in line:
                break
    finally:
        p.terminate()
        rest = p.communicate(timeout=20)[0]
    text = "".join(out) + rest
    assert "listening on" in text, text
    assert "PyTorch" not in text, text
