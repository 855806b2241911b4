"""`warmroute epp` flags (gateway/epp_cli.py) and a picker process (gateway/epp/serve.py) that serves until
SIGTERM and stops promptly (readiness first, then a drain)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.serve import server_options
from gateway.epp_cli import add_arguments
from gateway.epp.extproc import BUFFERED, FULL_DUPLEX_STREAMED
from tests.conftest import REPO, free_port


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="warmroute epp")
    add_arguments(p)
    return p


def test_flags_are_the_gateways_plus_the_pickers():
    p = parser()
    help_text = p.format_help()
    for flag in ("--replica", "--feed", "--policy", "--tokenizer", "--block-size", "--api-keys", "--admin-port",
                 "--grpc-port", "--grpc-health-port", "--dns-service"):
        assert flag in help_text
    assert "--workers" not in help_text and "OpenAI API port" not in help_text
    a = p.parse_args(["--replica", "r1=http://10.0.0.1:8000", "--no-auth"])
    opts = server_options(a, max_body_bytes=1 << 20)
    assert opts == {"host": "0.0.0.0", "port": 9002, "health_port": 9003, "max_body_bytes": 1 << 20,
                    "default_request_body_mode": FULL_DUPLEX_STREAMED, "transport": "h2"}
    a = p.parse_args(["--grpc-port", "7000", "--grpc-health-port", "-1", "--request-body-mode", "buffered", "--host", "127.0.0.1",
                      "--transport", "grpcio"])
    opts = server_options(a, max_body_bytes=10)
    assert (opts["port"], opts["health_port"], opts["default_request_body_mode"], opts["host"], opts["transport"]) == (
        7000, None, BUFFERED, "127.0.0.1", "grpcio")


def _status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
def test_picker_process_is_ready_then_stops_promptly_on_sigterm(transport):
    grpc_port, health_port = free_port(), free_port()
    script = textwrap.dedent(f"""
        import argparse, asyncio
        from gateway.epp.serve import serve
        from gateway.epp_cli import add_arguments
        from tests.epp_double import StaticPickerDouble
        p = argparse.ArgumentParser(); add_arguments(p)
        args = p.parse_args(["--host", "127.0.0.1", "--grpc-port", "{grpc_port}", "--grpc-health-port", "{health_port}",
                             "--shutdown-grace-s", "20", "--transport", "{transport}"])
        async def until_ready():
            await asyncio.sleep(0.5)
        raise SystemExit(serve(StaticPickerDouble(["a:1"]), args, until_ready=until_ready))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert "serving ext_proc" in proc.stdout.readline()
        assert _status(health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        assert _status(grpc_port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING  # until_ready runs
        deadline = time.monotonic() + 5
        while _status(health_port, "readiness") != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.stderr.read()
        assert time.monotonic() - t0 < 3  # nothing open: no wait for the 20 s grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
