"""Flags of `warmroute agent`; the sidecar itself lives in replica_agent.agent."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
The sidecar for one vLLM replica: subscribes to the engine's KV-cache events (ZMQ), turns them into
warmroute block keys and publishes them, with the engine's load from its /metrics, on the feed every
gateway reads. Stops on SIGTERM/SIGINT in every state (also while waiting for the engine)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica-id", required=True, help="this replica's id, as the gateway names it (--replica ID=URL)")
    p.add_argument("--engine-url", required=True, help="the engine's HTTP base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--kv-events-endpoint", required=True, metavar="EP",
                   help="the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default=None, metavar="EP",
                   help="the engine's ZMQ ROUTER replay endpoint (default: none; a gap in the events then resyncs)")
    p.add_argument("--bind", action="store_true", help="bind the SUB socket (the engine connects) instead of connecting")
    p.add_argument("--feed", required=True, metavar="URL", help="where to publish: memory:// or redis://HOST:PORT/DB")
    p.add_argument("--model", default=None, help="served model name (key root) (default: the engine's /v1/models)")
    p.add_argument("--block-size", type=int, default=0,
                   help="tokens per KV block (default: 0, learnt from the engine's events or /metrics)")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (default: every topic)")
    p.add_argument("--load-interval", type=float, default=1.0, metavar="S", help="seconds between scrapes of the engine's /metrics")
    p.add_argument("--snapshot-interval", type=float, default=5.0, metavar="S",
                   help="seconds between feed snapshots (taken only when keys changed)")
    p.add_argument("--admin-host", default="127.0.0.1", help="address of the agent's /healthz and /metrics")
    p.add_argument("--admin-port", type=int, default=None,
                   help="port of the agent's /healthz and /metrics (default: none, no admin server; 0: any free port)")

