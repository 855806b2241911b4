"""`warmroute gateway` as a process: config from file, environment and flags; one worker or a
supervisor of N; SIGTERM/SIGINT drain and exit; `--check-config` runs start-up's checks only.

Exit codes: 0 clean exit; 1 a worker failed; 2 invalid configuration, or a port that cannot be
bound (one line on stderr naming the field or the address, never a traceback).
With `--workers N` the supervisor runs N worker processes sharing the ports (SO_REUSEPORT),
forwards SIGTERM/SIGINT to them, and aggregates metrics through prometheus-client's
multiprocess directory.
"""
from __future__ import annotations

import asyncio
import errno
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile

from gateway.assemble import check_startup
from gateway.config import ConfigError, GatewayConfig, apply_args, config_from_dict, load_config
from gateway.server import Gateway
from gateway.telemetry import build_tracer_provider, setup_logging

__all__ = ["main_from_args"]

log = logging.getLogger("warmroute.gateway")


def main_from_args(args) -> int:
    """`warmroute gateway`: see the module header for exit codes."""
    check_path = getattr(args, "check_config", None)
    try:
        # --check-config FILE is the config file (a --config beside it is ignored); flags and
        # environment apply on top exactly as they do at start.
        cfg = apply_args(load_config(check_path or getattr(args, "config", None)), args)
        check_startup(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        what = f"invalid config {check_path}" if check_path else "invalid configuration"
        print(f"{what}: {exc}", file=sys.stderr)
        return 2
    if check_path:
        print(f"config {check_path} is valid")
        return 0
    setup_logging(cfg.telemetry.log_level)
    if cfg.server.workers > 1:
        return _supervise(cfg)
    return _run_worker(cfg, reuse_port=False)


def _run_worker(cfg: GatewayConfig, *, reuse_port: bool) -> int:
    try:
        return run_loop(_serve(cfg, reuse_port))
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            print(f"cannot listen on {cfg.server.host} (API port {cfg.server.port}, admin port "
                  f"{cfg.server.admin_port}): {exc.strerror or exc}", file=sys.stderr)
            return 2
        raise


async def _serve(cfg: GatewayConfig, reuse_port: bool) -> int:
    tp = build_tracer_provider(cfg.telemetry.service_name)
    gw = Gateway(cfg, tracer_provider=tp, reuse_port=reuse_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        start = asyncio.ensure_future(gw.start())
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # told to stop while starting (a slow tokenizer load, a DNS wait)
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return 0
        start.result()
        # Everything loaded so far (tokenizer, templates, modules) lives as long as the process:
        # move it out of the collector's reach, or each full collection walks it all (65 ms
        # measured with the default tokenizer) and stalls every stream in flight.
        gc.freeze()
        log.info("gateway serving", extra={"fields": {"url": gw.url, "admin_url": gw.admin_url, "pid": os.getpid()}})
        await waiter
        log.info("draining", extra={"fields": {"grace_s": cfg.server.shutdown_grace_s}})
    finally:
        await gw.close()
        if tp is not None:
            tp.shutdown()
    return 0


def run_loop(coro) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.run(coro)
    return uvloop.run(coro)


def _worker_main(cfg_dict: dict, index: int) -> None:
    cfg = config_from_dict(cfg_dict, env={})
    setup_logging(cfg.telemetry.log_level)
    sys.exit(_run_worker(cfg, reuse_port=True))


def _supervise(cfg: GatewayConfig) -> int:
    mdir = tempfile.mkdtemp(prefix="warmroute-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mdir
    ctx = mp.get_context("spawn")
    cfg_dict = cfg.to_dict()
    procs = [ctx.Process(target=_worker_main, args=(cfg_dict, i), name=f"warmroute-gw-{i}") for i in range(cfg.server.workers)]
    for p in procs:
        p.start()
    stopping = False

    def _forward(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    rc = 0
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(0.5)
                if not p.is_alive() and not stopping and p.exitcode not in (0, None):
                    log.error("worker exited", extra={"fields": {"worker": p.name, "exitcode": p.exitcode}})
                    rc = p.exitcode if p.exitcode == 2 else 1
                    _forward(signal.SIGTERM, None)
        return rc
    finally:
        shutil.rmtree(mdir, ignore_errors=True)
