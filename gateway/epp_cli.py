"""Flags of `warmroute epp`: every flag of `warmroute gateway` (replicas or a headless Service,
feed, policy, tokenizer, block size, auth, salt, admin port, ...) plus the picker's own; the API
port and worker count do not apply (Envoy is the HTTP front; one picker process). The process
is gateway.epp.serve. Defaults follow the reference Endpoint Picker: ext_proc on 9002, gRPC
health also on 9003.
"""
from __future__ import annotations

import argparse

from gateway import gateway_cli

__all__ = ["add_arguments", "DESCRIPTION"]

DESCRIPTION = """\
Serve the Gateway API Inference Extension's Endpoint Picker protocol (Envoy ext_proc over gRPC):
for each request Envoy forwards, authenticate, tokenize, key and decide exactly as `warmroute
gateway` does, rewrite the body (the derived cache_salt), and name the replica (and fallbacks)
Envoy sends it to; learn from the response Envoy streams back. Takes every flag of `warmroute
gateway` except the API port and workers (Envoy is the HTTP front)."""

_NOT_FOR_EPP = ("port", "workers")  # gateway flags with no meaning here (hidden, still parsed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    gateway_cli.add_arguments(p)
    for action in p._actions:  # argparse has no public way to hide an inherited flag
        if action.dest in _NOT_FOR_EPP:
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("endpoint picker (Envoy ext_proc)")
    g.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    g.add_argument("--grpc-health-port", type=int, default=9003,
                   help="gRPC health port (liveness, readiness, the ext_proc service; also served on --grpc-port; "
                        "default 9003, -1: none)")
    g.add_argument("--transport", choices=["h2", "grpcio"], default="h2",
                   help="the gRPC server: h2 (an asyncio protocol over the h2 library; default) or grpcio (grpc.aio; "
                        "about 1.4x the picker's CPU per request)")
    g.add_argument("--request-body-mode", choices=["full-duplex", "buffered"], default="full-duplex",
                   help="body mode assumed when Envoy does not say (Envoy 1.36+ always says; default full-duplex)")
    g.add_argument("--shutdown-grace-s", type=float, default=None,
                   help="SIGTERM: readiness off, then open streams get this long (default: server.shutdown_grace_s, 30)")
    g.add_argument("--trusted-tenant-header", default=None, metavar="NAME",
                   help="take the tenant from this request header, set by an authenticating gateway in front "
                        "(instead of checking API keys/JWTs here); only for a picker no client can reach directly (default: none, authenticate here)")
