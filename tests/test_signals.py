"""Every warmroute process stops promptly on SIGTERM and SIGINT, in each state where it waits:
the agent waiting for its engine's /v1/models, running with the engine unreachable, with the feed
unreachable or not answering; the sim serving a long stream; bench waiting on a target that never
answers; demo in the middle of its run. Each is a real process, signalled, and must exit within a
few seconds with its clean-stop code."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

EXE = [sys.executable, "-m", "gateway.cli"]
STOP_WITHIN_S = 5.0
SIGNALS = [pytest.param(signal.SIGTERM, id="TERM"), pytest.param(signal.SIGINT, id="INT")]


class Proc:
    """A warmroute subcommand with its output in a file (a pipe nobody reads could fill)."""

    def __init__(self, *args: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix="wr-signals-", suffix=".log")[1])
        self._fh = self.log.open("wb")
        self.p = subprocess.Popen(EXE + list(args), cwd=REPO, stdout=self._fh, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.p.poll() is None, f"exited ({self.p.returncode}) before {text!r}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def stop(self, sig: int) -> tuple[int, float]:
        """Send `sig`; (exit code, seconds it took). Fails (after a kill) if it does not exit."""
        t0 = time.monotonic()
        self.p.send_signal(sig)
        try:
            rc = self.p.wait(STOP_WITHIN_S + 10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"still running {STOP_WITHIN_S + 10} s after {signal.Signals(sig).name}:\n{self.output()[-3000:]}")
        return rc, time.monotonic() - t0

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self._fh.close()
        self.log.unlink(missing_ok=True)


@contextmanager
def proc(*args: str):
    p = Proc(*args)
    try:
        yield p
    finally:
        p.close()


@contextmanager
def silent_server():
    """A TCP server that accepts connections and never answers (a hung engine, feed or target)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    held, done = [], threading.Event()

    def loop():
        while not done.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()


def _agent_args(engine_port: int, feed: str, *extra: str) -> list[str]:
    return ["agent", "--replica-id", "r-sig", "--engine-url", f"http://127.0.0.1:{engine_port}",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--feed", feed, "--load-interval", "0.2", *extra]


def _assert_clean_stop(rc: int, took_s: float, out: str, codes=(0,)) -> None:
    assert took_s < STOP_WITHIN_S, f"took {took_s:.1f} s to stop:\n{out[-2000:]}"
    assert rc in codes, f"exit code {rc}:\n{out[-2000:]}"
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("sig", SIGNALS)
def test_agent_stops_while_waiting_for_the_engines_models(sig):
    # no --model: the agent must ask the engine, which is not there (yet)
    with proc(*_agent_args(free_port(), "memory://")) as a:
        a.wait_for("waiting for the engine")
        time.sleep(0.5)  # inside the back-off sleep
        _assert_clean_stop(*a.stop(sig), a.output())


@pytest.mark.parametrize("sig", SIGNALS)
def test_agent_stops_while_the_engine_hangs(sig):
    # the engine accepts connections and never answers: /v1/models hangs until its timeout
    with silent_server() as port, proc(*_agent_args(port, "memory://")) as a:
        time.sleep(2.0)
        assert a.p.poll() is None, a.output()
        _assert_clean_stop(*a.stop(sig), a.output())


@pytest.mark.parametrize("sig", SIGNALS)
def test_agent_stops_when_running_with_the_engine_unreachable(sig):
    with proc(*_agent_args(free_port(), "memory://", "--model", "m")) as a:
        a.wait_for(" up; ")
        a.wait_for("load scrape")
        _assert_clean_stop(*a.stop(sig), a.output())


@pytest.mark.parametrize("sig", SIGNALS)
def test_agent_stops_with_the_feed_unreachable(sig):
    with proc(*_agent_args(free_port(), f"redis://127.0.0.1:{free_port()}/0", "--model", "m")) as a:
        a.wait_for("feed publish failed")
        _assert_clean_stop(*a.stop(sig), a.output())


@pytest.mark.parametrize("sig", SIGNALS)
def test_agent_stops_with_a_feed_that_never_answers(sig):
    # a Redis address that accepts and never replies: the first publish waits without a bound
    with silent_server() as port, proc(*_agent_args(free_port(), f"redis://127.0.0.1:{port}/0", "--model", "m")) as a:
        a.wait_for("load scrape")  # start-up reached the feed
        time.sleep(0.5)
        assert " up; " not in a.output()  # still stuck on the feed
        _assert_clean_stop(*a.stop(sig), a.output())


@pytest.mark.parametrize("sig", SIGNALS)
def test_sim_stops_while_serving_a_long_stream(sig):
    port = free_port()
    with proc("sim", "--port", str(port), "--block-size", "16", "--num-blocks", "256", "--max-model-len", "4096",
              "--time-profile", "wallclock") as s:
        s.wait_for("listening on")
        body = json.dumps({"model": "warmroute-sim", "prompt": "hello " * 50, "max_tokens": 2000, "stream": True,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=10)
        assert resp.status == 200 and resp.readline()  # the stream is running (2000 tokens take ~30 s)
        try:
            _assert_clean_stop(*s.stop(sig), s.output())
        finally:
            resp.close()


@pytest.mark.parametrize("sig", SIGNALS)
def test_bench_stops_while_waiting_on_a_target_that_never_answers(sig):
    with silent_server() as port, proc("bench", "--target", f"http://127.0.0.1:{port}", "--requests", "4", "--rate", "10") as b:
        b.wait_for("sending 4 requests")
        time.sleep(0.5)
        rc, took = b.stop(sig)
        _assert_clean_stop(rc, took, b.output(), codes=(128 + sig,))
        assert f"stopped by {signal.Signals(sig).name}" in b.output()


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_demo_stops_in_the_middle_of_its_run(sig):
    with proc("demo", "--requests", "60") as d:
        d.wait_for("requests done", timeout_s=120)  # embedded system up, load running
        rc, took = d.stop(sig)
        _assert_clean_stop(rc, took, d.output(), codes=(128 + sig,))
        assert f"stopped by {signal.Signals(sig).name}" in d.output()
