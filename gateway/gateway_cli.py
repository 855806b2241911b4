"""Flags of `warmroute gateway`; the process is gateway.serve, the service gateway.server.

Flags override the YAML config (--config) and its WARMROUTE_<SECTION>__<FIELD> environment
overrides; gateway/config.py has every field, gateway/gateway.yaml is a commented example."""
from __future__ import annotations

import argparse

from policies.registry import POLICY_NAMES

DESCRIPTION = """\
Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models) and vLLM's
/tokenize and /detokenize in front of several vLLM replicas, and an admin port (/metrics /healthz
/readyz /debug/route /debug/index). Settings come from a YAML config (--config), then
WARMROUTE_<SECTION>__<FIELD> environment variables, then these flags; the repository's
gateway/gateway.yaml is a commented example of every section."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file; environment variables and flags override it (default: built-in defaults)")
    p.add_argument("--check-config", metavar="FILE", help="validate FILE and exit: 0 valid, 2 invalid (default: serve)")
    p.add_argument("--host", default=None, help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=None, help="OpenAI API port (default 8080)")
    p.add_argument("--admin-port", type=int, default=None, help="admin port: /metrics /healthz /readyz /debug (default 8081)")
    p.add_argument("--replica", action="append", default=[], metavar="ID=URL", help="a replica, repeatable (default: none; the config's list or --dns-service)")
    p.add_argument("--feed", default=None, metavar="URL", help="where the agents publish: memory:// or redis://HOST:PORT/DB (default memory://)")
    p.add_argument("--policy", default=None, help=f"routing policy, one of: {', '.join(POLICY_NAMES)} (default cache_aware)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer directory (default: built-in Qwen/ChatML)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default 16)")
    p.add_argument("--api-keys", default=None, metavar="FILE", help="YAML: tenant id -> list of keys, plain or sha256:HEX (default: none)")
    p.add_argument("--no-auth", action="store_true", help="single-tenant mode: no authentication")
    p.add_argument("--salt-secret-file", default=None, metavar="FILE", help="file holding the cache-salt HMAC secret (default: the WARMROUTE_SALT_SECRET environment variable)")
    p.add_argument("--workers", type=int, default=None, help="worker processes sharing the ports (SO_REUSEPORT; default 1)")
    p.add_argument("--model", default=None, help="served model name (default: discovered from the replicas' /v1/models)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: from the replicas)")
    p.add_argument("--dns-service", default=None, metavar="NAME",
                   help="Kubernetes headless Service to resolve for replicas, instead of --replica (default: none)")
    p.add_argument("--dns-port", type=int, default=None, help="engine port behind --dns-service (default 8000)")
    p.add_argument("--load-only", action="store_true", help="no feed: route by load only (explicit mode)")
    p.add_argument("--access-log", action="store_true", help="one JSON log line per request (costs CPU)")

