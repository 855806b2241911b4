"""What `warmroute bench` shows a user: the reason requests failed (with the hint for a missing
key) instead of bare `nan`s, `--api-key` and its environment variable against an authenticated
gateway, progress (a bar on a terminal, plain lines in a pipe), where the JSON and PNG went,
labelled CPU rows, a one-line error when a port it picked is taken, and a plot a reader can use
(checked by introspecting the figure and reading the PNG back)."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from loadtests.bench_plot import build_figure, in_flight_series, png_info, save_plot
from loadtests.harness import EmbeddedSystem, SystemSpec
from loadtests.runner import Sample, error_reason, summarize
from tests.conftest import REPO

EXE = [sys.executable, "-m", "gateway.cli"]
SMALL = ["--param", "doc_tokens=60", "--param", "n_docs=2", "--param", "question_tokens=10"]


# -- reasons --------------------------------------------------------------------------------------

def test_error_reason_reads_openai_errors_and_client_failures():
    body = json.dumps({"error": {"message": "Invalid API key", "type": "invalid_request_error", "code": "invalid_api_key"}})
    assert error_reason(Sample("a", status=401, error=body)) == "HTTP 401 invalid_api_key: Invalid API key"
    assert error_reason(Sample("a", status=502, error="<html>\n bad gateway </html>")) == "HTTP 502: <html> bad gateway </html>"
    assert error_reason(Sample("a", status=0, error="ClientConnectorError: Cannot connect to host x:1")) == \
        "ClientConnectorError: Cannot connect to host x:1"
    assert error_reason(Sample("a", status=200, error=json.dumps({"message": "replica died", "type": "server_error"}))) == \
        "error event in the stream: replica died"
    samples = [Sample("a", status=401, error=body) for _ in range(3)] + [Sample("b", status=0, error="TimeoutError")]
    rep = summarize(samples, 1.0)
    assert rep["errors"] == 4 and rep["error_reasons"] == {"HTTP 401 invalid_api_key: Invalid API key": 3, "TimeoutError": 1}


async def _bench(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(*EXE, *args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 180)
    return p.returncode, out.decode(), err.decode()


async def test_bench_target_against_an_authenticated_gateway(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WARMROUTE_BENCH_API_KEY"}
    async with EmbeddedSystem(SystemSpec(replicas=1, num_blocks=128, tenants=("t0",))) as system:
        key = system.api_keys["t0"]
        args = ["bench", "--target", system.url, "--requests", "4", "--rate", "20", *SMALL]
        rc, out, err = await _bench(*args, env=env)
        assert rc == 1, out + err
        assert "4 of 4 requests failed" in out and "4 x HTTP 401" in out, out
        assert "--api-key" in out and "WARMROUTE_BENCH_API_KEY" in out, out  # the hint
        assert "nan" not in out, out
        assert "without an API key" in err
        rc, out, err = await _bench(*args, "--api-key", key, env=env)
        assert rc == 0, out + err
        assert "| errors | 0 |" in out and "failed" not in out, out
        rc, out, err = await _bench(*args, env={**env, "WARMROUTE_BENCH_API_KEY": key})
        assert rc == 0 and "| errors | 0 |" in out, out + err
        assert "CPU, load generator (cores)" in out and "CPU, whole machine (share)" in out


# -- progress, outputs, labels: a terminal and a pipe ---------------------------------------------

def _bench_cmd(tmp_path: Path, tag: str) -> list[str]:
    return EXE + ["bench", "--policy", "cache_aware", "--replicas", "1", "--requests", "10", "--rate", "10", *SMALL,
                  "--json", str(tmp_path / f"{tag}.json"), "--plot", str(tmp_path / f"{tag}.png")]


def _run_in_pty(cmd: list[str], timeout_s: float = 180) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # 120 columns, as a terminal has
    p = subprocess.Popen(cmd, cwd=REPO, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif p.poll() is not None:
            break
    os.close(master)
    try:
        rc = p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    return rc, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_progress_on_a_terminal_and_in_a_pipe(tmp_path):
    rc, tty_out = _run_in_pty(_bench_cmd(tmp_path, "tty"))
    assert rc == 0, tty_out[-3000:]
    assert "\r" in tty_out.replace("\r\n", "\n"), "no progress bar redraws on a terminal"
    assert "10/10" in tty_out and "req/s" in tty_out, tty_out[-3000:]  # tqdm's bar: count and rate
    assert "requests done" not in tty_out  # plain lines are for pipes

    r = subprocess.run(_bench_cmd(tmp_path, "pipe"), cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "\r" not in r.stderr and "\r" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "requests done" in ln]
    assert 2 <= len(lines) <= 12 and "10/10 requests done, 0 failed" in lines[-1], r.stderr
    assert "starting 1 simulated replicas" in r.stderr
    for out, tag in ((tty_out, "tty"), (r.stderr, "pipe")):
        assert f"JSON report written to {tmp_path / (tag + '.json')}" in out
        assert f"plot written to {tmp_path / (tag + '.png')}" in out
        assert json.loads((tmp_path / f"{tag}.json").read_text())["cache_aware"]["requests"] == 10
        assert png_info(tmp_path / f"{tag}.png")["text"]["Title"].startswith("warmroute bench: workload shared_docs, 1 replicas")
    # the table goes to stdout, labelled; progress stays on stderr
    assert "CPU, this process (cores)" in r.stdout and "CPU, whole machine (share)" in r.stdout
    assert "requests done" not in r.stdout


# -- a taken port: one line ------------------------------------------------------------------------

def test_a_taken_port_is_one_line_not_a_traceback(monkeypatch, capsys):
    import uvloop

    import loadtests.harness as harness
    from gateway.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(harness, "free_port", lambda: taken.getsockname()[1])
    monkeypatch.setattr(uvloop, "install", lambda: None)  # keep this test process's loop policy
    try:
        rc = main(["bench", "--policy", "round_robin", "--replicas", "1", "--requests", "2", *SMALL])
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("warmroute bench: a port")]
    assert len(lines) == 1 and "run it again" in lines[0] and "Traceback" not in err, err


# -- the plot --------------------------------------------------------------------------------------

def _samples(n: int, ttft_s: float, replicas: list[str], fail: int = 0) -> list[Sample]:
    out = []
    for i in range(n):
        ok = i >= fail
        out.append(Sample(f"q{i}", ok=ok, status=200 if ok else 503, error="" if ok else "HTTP 503",
                          start_s=i * 0.25, ttft_s=ttft_s * (1 + i % 5) if ok else float("nan"),
                          e2e_s=ttft_s * (1 + i % 5) + 0.3 if ok else float("nan"), prompt_tokens=600,
                          cached_tokens=500 if ttft_s < 0.5 else 100, replica=replicas[i % len(replicas)] if ok else ""))
    return out


def test_plot_shows_the_run_distributions_hit_ratio_and_load(tmp_path):
    reps = ["r0", "r1", "r2"]
    runs = {"cache_aware": _samples(40, 0.08, reps), "round_robin": _samples(40, 0.9, reps, fail=2)}
    report = {n: summarize(s, 10.0) for n, s in runs.items()}
    context = dict(workload="shared_docs", requests=40, rate="4/s", replicas=3, seed=7)
    bf = build_figure(report, runs, context)
    assert bf.title.startswith("warmroute bench: workload shared_docs, 3 replicas, 40 requests at 4/s, seed 7")
    assert "lowest TTFT p50: cache_aware" in bf.title and "round_robin" in bf.title
    assert bf.fig.get_suptitle() == bf.title
    # TTFT distributions: one ECDF per policy, log x, labelled, legend naming each policy
    ax = bf.ax_ttft
    assert ax.get_xscale() == "log" and "ECDF" in ax.get_title()
    assert "time to first token" in ax.get_xlabel() and "share of requests" in ax.get_ylabel()
    lines = ax.get_lines()
    assert len(lines) == 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0].startswith("cache_aware (p50") and legend[1].startswith("round_robin (p50") and "2 failed" in legend[1]
    y_ca = lines[0].get_ydata()
    assert y_ca[-1] == pytest.approx(1.0) and lines[1].get_ydata()[-1] == pytest.approx(38 / 40)  # failures never arrive
    assert max(lines[0].get_xdata()) < min(lines[1].get_xdata()) * 10  # ms on the x axis
    # hit ratio: one bar per policy, labelled with its value
    bars = bf.ax_hit.patches
    assert len(bars) == 2 and bars[0].get_height() == pytest.approx(report["cache_aware"]["hit_ratio"])
    assert [t.get_text() for t in bf.ax_hit.get_xticklabels()] == ["cache_aware", "round_robin"]
    assert "hit ratio" in bf.ax_hit.get_title()
    # load per replica over time: one panel per policy, a line per replica
    assert len(bf.ax_load) == 2
    for a, name in zip(bf.ax_load, runs):
        assert a.get_title().startswith(name) and "in flight" in a.get_title()
        assert [ln.get_label() for ln in a.get_lines()] == reps
        assert a.get_xlabel() == "time since start (s)"
    # read the PNG back: a real PNG of the figure's size, carrying the title and axis labels
    path = tmp_path / "bench.png"
    bf2 = save_plot(report, runs, context, path, dpi=80)
    info = png_info(path)
    w_in, h_in = bf2.fig.get_size_inches()
    assert (info["width"], info["height"]) == (round(w_in * 80), round(h_in * 80))
    assert info["text"]["Title"] == bf.title
    desc = info["text"]["Description"]
    for label in ("TTFT distribution per policy (ECDF)", "time to first token (ms, log scale)", "prompt-token cache hit ratio",
                  "cache_aware: requests in flight per replica", "round_robin: requests in flight per replica"):
        assert label in desc, label
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (info["height"], info["width"]) and pixels.std() > 0.05  # not blank
    with pytest.raises(ValueError):
        png_info(Path(__file__))


def test_in_flight_series_counts_overlapping_requests_per_replica():
    s = [Sample("a", ok=True, start_s=0.0, e2e_s=2.0, replica="r0"), Sample("b", ok=True, start_s=1.0, e2e_s=2.0, replica="r0"),
         Sample("c", ok=True, start_s=0.5, e2e_s=0.1, replica="r1"), Sample("d", ok=False, start_s=0.2, replica="")]
    series = in_flight_series(s)
    assert series["r0"] == ([0.0, 0.0, 1.0, 2.0, 3.0], [0, 1, 2, 1, 0])
    assert series["r1"][1] == [0, 1, 0] and set(series) == {"r0", "r1"}
