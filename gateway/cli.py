"""The `warmroute` console script: one entry point, one subcommand per component.

Each subcommand's flags live with the component that owns them, in a light module
(`add_arguments(parser)`, a user-facing `DESCRIPTION`); its work is a `main_from_args(args) -> int`
named here by module path and imported only when that subcommand runs, so `warmroute --help`
stays fast. Every flag's help states its default (`HelpFormatter` appends it unless the text
already says); tests/test_cli_help.py checks.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# transformers warns "PyTorch was not found" on import: warmroute only uses its tokenizers, so the
# advice is noise on every command. Set before anything imports transformers (also inherited by
# the gateway's worker processes); a user's own setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# name -> (module with add_arguments, module whose main_from_args runs it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "gateway": ("gateway.gateway_cli", "gateway.serve", "serve the OpenAI API and route each request to the best replica"),
    "epp": ("gateway.epp_cli", "gateway.epp.serve", "Endpoint Picker for Envoy (Gateway API Inference Extension): the gateway's routing, Envoy proxies"),
    "agent": ("replica_agent.agent_cli", "replica_agent.agent", "sidecar for one vLLM replica: KV events -> feed, load scraping"),
    "sim": ("loadtests.sim_cli", "loadtests.sim.server", "one simulated vLLM replica (HTTP, prefix cache, scheduler, KV events)"),
    "bench": ("loadtests.bench_cli", "loadtests.bench", "run a workload against policies (or a --target) and write a report"),
    "demo": ("loadtests.demo_cli", "loadtests.demo", "embedded self-contained run: cache-aware vs round-robin side by side"),
    "check": ("gateway.check_cli", "gateway.check", "is a deployed gateway ready and answering? (what `helm test` runs)"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the text already names its default or there
    is nothing to say (a switch that is off, a required flag, no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or "%(default)" in text or action.required:
            return text
        d = action.default
        if d is None or d is False or d == [] or d is argparse.SUPPRESS or d == "":
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("warmroute")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmroute", description="Cache-aware router for vLLM replicas.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"warmroute {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, runner, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                           formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_runner=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runner = importlib.import_module(args._runner)
    try:
        return int(runner.main_from_args(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
