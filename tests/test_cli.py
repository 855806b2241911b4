"""The `warmroute` console script as a user runs it: every subcommand's --help, the flag names
that must keep working (the README's commands and outside checks use them), `warmroute sim` as a
process, and `warmroute bench` / `warmroute demo` end to end (small)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from loadtests.processes import stop_processes
from tests.conftest import free_port

EXE = [sys.executable, "-m", "gateway.cli"]

STABLE_FLAGS = {
    "gateway": ["--config", "--host", "--port", "--admin-port", "--replica", "--feed", "--policy", "--tokenizer",
                "--block-size", "--api-keys", "--no-auth", "--salt-secret-file", "--check-config"],
    "agent": ["--replica-id", "--engine-url", "--kv-events-endpoint", "--replay-endpoint", "--bind", "--feed"],
    "sim": ["--host", "--port", "--model", "--tokenizer", "--block-size", "--num-blocks", "--kv-events-endpoint",
            "--replay-endpoint", "--hash-algo", "--max-model-len"],
    "bench": ["--workload", "--policy", "--replicas", "--requests", "--rate", "--concurrency", "--seed", "--json",
              "--plot", "--target"],
    "demo": [],
}


def _run(*args, timeout=60):
    return subprocess.run(EXE + list(args), capture_output=True, text=True, timeout=timeout)


def test_help_of_every_subcommand_lists_the_stable_flags():
    top = _run("--help")
    assert top.returncode == 0
    for name, flags in STABLE_FLAGS.items():
        assert name in top.stdout
        r = _run(name, "--help")
        assert r.returncode == 0, r.stderr
        for flag in flags:
            assert flag in r.stdout, (name, flag)


def test_unknown_subcommand_fails_with_usage():
    r = _run("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_sim_process_serves_and_stops_on_sigterm():
    port = free_port()
    proc = subprocess.Popen(EXE + ["sim", "--port", str(port), "--block-size", "16", "--num-blocks", "64",
                                   "--max-model-len", "1024"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
                assert time.monotonic() < deadline, "sim did not become healthy"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
        assert 'vllm:cache_config_info{' in text and 'num_gpu_blocks="64"' in text
    finally:
        stop_processes([proc], 15)
    assert proc.returncode in (0, -signal.SIGTERM)


@pytest.mark.slow
def test_bench_writes_the_report_contract(tmp_path):
    out = tmp_path / "report.json"
    r = _run("bench", "--workload", "shared_docs", "--policy", "cache_aware", "--policy", "round_robin",
             "--replicas", "2", "--requests", "16", "--rate", "8", "--seed", "3", "--json", str(out),
             "--param", "doc_tokens=120", "--param", "n_docs=2", timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"cache_aware", "round_robin"}
    for figures in report.values():
        for key in ("requests", "errors", "throughput_rps", "prompt_tokens", "cached_tokens", "hit_ratio"):
            assert key in figures
        assert set(figures["ttft_ms"]) >= {"p50", "p90", "p99", "max"}
        assert figures["requests"] == 16 and figures["errors"] == 0
        assert figures["prompt_tokens"] > 0
    # two documents repeated 8 times each: the cache-aware run must reuse the engine's cache
    assert report["cache_aware"]["cached_tokens"] > 0


@pytest.mark.slow
def test_demo_runs_and_exits_zero():
    r = _run("demo", "--requests", "12", timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "cache_aware" in r.stdout and "round_robin" in r.stdout and "TTFT p50" in r.stdout
    # progress in a pipe: plain lines on stderr, each stage announced, no carriage returns
    assert "[1/2] cache_aware: starting" in r.stderr and "[2/2] round_robin: starting" in r.stderr
    assert "round_robin: 12/12 requests done" in r.stderr and "\r" not in r.stderr
    assert "CPU, this process (cores)" in r.stdout and "PyTorch" not in r.stdout + r.stderr
