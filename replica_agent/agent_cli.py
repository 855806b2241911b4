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
    p.add_argument("--model", default=None, help="served model name (key root); default: the engine's /v1/models")
    p.add_argument("--block-size", type=int, default=0, help="tokens per block; default: from events / cache_config_info")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (default: all)")
    p.add_argument("--load-interval", type=float, default=1.0, metavar="S", help="engine /metrics scrape period in seconds")
    p.add_argument("--snapshot-interval", type=float, default=5.0, metavar="S", help="feed snapshot period in seconds (when keys changed)")
    p.add_argument("--admin-host", default="127.0.0.1", help="address of the agent's /healthz and /metrics")
    p.add_argument("--admin-port", type=int, default=None, help="port of the agent's /healthz and /metrics (default: none)")

