"""The `warmroute` console script: one entry point, one subcommand per component.

Each subcommand's flags live with the component that owns them, in a light module that imports
only argparse (`add_arguments(parser)`); its work is a `main_from_args(args) -> int` named here
by module path and imported only when that subcommand runs, so `warmroute --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments, module whose main_from_args runs it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "gateway": ("gateway.gateway_cli", "gateway.serve", "serve the OpenAI API and route each request to the best replica"),
    "epp": ("gateway.epp_cli", "gateway.epp.serve", "Endpoint Picker for Envoy (Gateway API Inference Extension): the gateway's routing, Envoy proxies"),
    "agent": ("replica_agent.agent_cli", "replica_agent.agent", "sidecar for one vLLM replica: KV events -> feed, load scraping"),
    "sim": ("loadtests.sim_cli", "loadtests.sim.server", "one simulated vLLM replica (HTTP, prefix cache, scheduler, KV events)"),
    "bench": ("loadtests.bench_cli", "loadtests.bench", "run a workload against policies (or a --target) and write a report"),
    "demo": ("loadtests.demo_cli", "loadtests.demo", "embedded self-contained run: cache-aware vs round-robin side by side"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmroute", description="Cache-aware router for vLLM replicas.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, runner, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0])
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
