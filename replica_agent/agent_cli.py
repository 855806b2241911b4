"""Flags of `warmroute agent` (DESIGN.md "Operating it"); the sidecar lives in replica_agent.agent."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica-id", required=True, help="this replica's id (as the gateway names it)")
    p.add_argument("--engine-url", required=True, help="the engine's HTTP base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--kv-events-endpoint", required=True, metavar="EP", help="engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default=None, metavar="EP", help="engine's ZMQ ROUTER replay endpoint")
    p.add_argument("--bind", action="store_true", help="bind the SUB socket (engine connects) instead of connecting")
    p.add_argument("--feed", required=True, metavar="URL", help="memory:// or redis://HOST:PORT/DB")


def run(args: argparse.Namespace) -> int:
    from replica_agent.agent import main_from_args

    return main_from_args(args)
