"""`warmroute epp` as a process: the gateway's request pipeline (gateway.server.Gateway without
its HTTP port) behind Envoy, answering ext_proc streams (gateway.epp.server) through
`gateway.epp.picker.PipelinePicker`, until SIGTERM/SIGINT.

Readiness (the gRPC `readiness` service) follows the gateway's own (`/readyz`): SERVING once the
tokenizer, model, replicas and feed are usable, re-checked every second. SIGTERM: readiness
off, then open streams get `--shutdown-grace-s` (default: server.shutdown_grace_s) to finish,
exit 0. Exit 2: invalid configuration (one line naming the field) or a port in use.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import sys
from typing import Awaitable, Callable

from gateway.assemble import check_startup
from gateway.config import ConfigError, GatewayConfig, apply_args, load_config
from gateway.epp.extproc import BUFFERED, FULL_DUPLEX_STREAMED
from gateway.epp.picker import PipelinePicker
from gateway.epp.server import EppServer
from gateway.serve import run_loop
from gateway.server import Gateway
from gateway.telemetry import build_tracer_provider, setup_logging

__all__ = ["main_from_args", "server_options", "serve", "serve_async"]

log = logging.getLogger("warmroute.epp")


def main_from_args(args: argparse.Namespace) -> int:
    try:
        cfg = apply_args(load_config(getattr(args, "config", None)), args)
        check_startup(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.telemetry.log_level)
    try:
        return run_loop(_serve_pipeline(cfg, args))
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            print(f"cannot listen: {exc.strerror or exc}", file=sys.stderr)
            return 2
        raise


async def _serve_pipeline(cfg: GatewayConfig, args: argparse.Namespace) -> int:
    tp = build_tracer_provider(cfg.telemetry.service_name)
    gw = Gateway(cfg, tracer_provider=tp, api_port=False)
    picker = PipelinePicker(gw, trusted_tenant_header=args.trusted_tenant_header)
    grace_s = args.shutdown_grace_s if args.shutdown_grace_s is not None else cfg.server.shutdown_grace_s

    async def until_ready() -> None:
        await gw.start()
        while not gw.readiness()[0]:
            await asyncio.sleep(0.25)

    try:
        return await serve_async(picker, server_options(args, max_body_bytes=cfg.server.max_body_bytes),
                                 grace_s=grace_s, until_ready=until_ready, readiness=lambda: gw.readiness()[0])
    finally:
        await gw.close()
        if tp is not None:
            tp.shutdown()


def server_options(args: argparse.Namespace, *, max_body_bytes: int) -> dict:
    """EppServer keyword arguments from the parsed flags (`max_body_bytes` from the config)."""
    health = args.grpc_health_port
    return {
        "host": args.host or "0.0.0.0",
        "port": args.grpc_port,
        "health_port": None if health is None or health < 0 else health,
        "max_body_bytes": max_body_bytes,
        "default_request_body_mode": BUFFERED if args.request_body_mode == "buffered" else FULL_DUPLEX_STREAMED,
        "transport": getattr(args, "transport", "h2"),
    }


async def serve_async(picker, options: dict, *, grace_s: float = 30.0,
                      until_ready: Callable[[], Awaitable[None]] | None = None,
                      stop: asyncio.Event | None = None, readiness: Callable[[], bool] | None = None) -> int:
    """Serve `picker` until SIGTERM/SIGINT (or `stop` is set). `until_ready`: awaited after the
    server is up (e.g. first feed sync, replicas known); readiness turns SERVING after it, and
    then follows `readiness()` (checked every second) when given."""
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
        await _follow_readiness(server, stop, readiness)
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
    return run_loop(serve_async(picker, server_options(args, max_body_bytes=max_body_bytes), grace_s=grace_s,
                                until_ready=until_ready))


async def _follow_readiness(server: EppServer, stop: asyncio.Event, readiness: Callable[[], bool] | None) -> None:
    """Until `stop`: keep the gRPC readiness equal to `readiness()` (checked every second)."""
    ready = True
    while not stop.is_set():
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
            async with asyncio.timeout(1.0):
                await stop.wait()
        except TimeoutError:
            pass
        if readiness is not None and not stop.is_set() and readiness() != ready:
            ready = not ready
            await server.set_ready(ready)
            log.info("endpoint picker %s", "ready" if ready else "not ready")
