"""Flags of `warmroute epp` (the gateway's flags plus the picker's gRPC ports), and the process
loop that serves a `Picker` until SIGTERM/SIGINT.

`add_arguments(p)` takes every flag of `warmroute gateway` (replicas or a headless Service,
feed, policy, tokenizer, block size, auth, salt, admin port, ...) and adds the EPP's own;
the API port and worker count do not apply (Envoy is the HTTP front; one picker process).
`serve(picker, args)` runs the gRPC server: ready only when the owner says so, NOT_SERVING and a
drain of open streams (`--shutdown-grace-s`) on SIGTERM, exit code 0.

Defaults follow the reference Endpoint Picker: ext_proc on 9002, gRPC health also on 9003.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Awaitable, Callable

__all__ = ["add_arguments", "server_options", "serve", "serve_async"]

log = logging.getLogger("warmroute.epp")

_NOT_FOR_EPP = ("port", "workers")  # gateway flags with no meaning here (hidden, still parsed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gateway import gateway_cli

    gateway_cli.add_arguments(p)
    for action in p._actions:  # argparse has no public way to hide an inherited flag
        if action.dest in _NOT_FOR_EPP:
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("endpoint picker (Envoy ext_proc)")
    g.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    g.add_argument("--grpc-health-port", type=int, default=9003,
                   help="gRPC health port (liveness, readiness, the ext_proc service; also served on --grpc-port; "
                        "default 9003, -1: none)")
    g.add_argument("--request-body-mode", choices=["full-duplex", "buffered"], default="full-duplex",
                   help="body mode assumed when Envoy does not say (Envoy 1.36+ always says; default full-duplex)")
    g.add_argument("--shutdown-grace-s", type=float, default=None,
                   help="SIGTERM: readiness off, then open streams get this long (default: server.shutdown_grace_s, 30)")


def server_options(args: argparse.Namespace, *, max_body_bytes: int) -> dict:
    """EppServer keyword arguments from the parsed flags (`max_body_bytes` from the config)."""
    from gateway.epp.extproc import BUFFERED, FULL_DUPLEX_STREAMED

    health = args.grpc_health_port
    return {
        "host": args.host or "0.0.0.0",
        "port": args.grpc_port,
        "health_port": None if health is None or health < 0 else health,
        "max_body_bytes": max_body_bytes,
        "default_request_body_mode": BUFFERED if args.request_body_mode == "buffered" else FULL_DUPLEX_STREAMED,
    }


async def serve_async(picker, options: dict, *, grace_s: float = 30.0,
                      until_ready: Callable[[], Awaitable[None]] | None = None,
                      stop: asyncio.Event | None = None) -> int:
    """Serve `picker` until SIGTERM/SIGINT (or `stop` is set). `until_ready`: awaited after the
    server is up (e.g. first feed sync, replicas known); readiness turns SERVING after it."""
    from gateway.epp.server import EppServer

    server = EppServer(picker, **options)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    port = await server.start()
    print(f"warmroute epp serving ext_proc on {options.get('host')}:{port}", flush=True)
    try:
        if until_ready is not None:
            waiting = asyncio.ensure_future(until_ready())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not waiting.done():
                waiting.cancel()
            elif waiting.exception() is not None:
                raise waiting.exception()
        if not stop.is_set():
            await server.set_ready(True)
            log.info("endpoint picker ready")
        await stop.wait()
        log.info("stopping: readiness off, draining open streams for up to %.0fs", grace_s)
    finally:
        await server.stop(grace_s)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):  # pragma: no cover
                pass
    return 0


def serve(picker, args: argparse.Namespace, *, max_body_bytes: int = 8 * 1024 * 1024, grace_s: float = 30.0,
          until_ready: Callable[[], Awaitable[None]] | None = None) -> int:
    """`serve_async` on uvloop (asyncio when uvloop is missing), for a CLI `run(args)`."""
    if args.shutdown_grace_s is not None:
        grace_s = args.shutdown_grace_s
    coro = serve_async(picker, server_options(args, max_body_bytes=max_body_bytes), grace_s=grace_s,
                       until_ready=until_ready)
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
