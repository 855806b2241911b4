"""The agent's logs: a failure that repeats every second is logged once, then at most once a
minute, and once when it recovers; the start line says where the admin port is (or that there is
none), never `None`; a feed URL's password never reaches a log line."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

from loadtests.processes import stop_processes
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.feed.redis_feed import redact_url
from replica_agent.feed import FailureLog
from tests.conftest import REPO, free_port


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_failure_log_rate_limits_repeats_and_says_when_it_recovers(caplog):
    clock = Clock()
    log = logging.getLogger("test.failurelog")
    fl = FailureLog(log, "load scrape of http://e/metrics", every_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.failurelog"):
        for _ in range(59):  # one a second for a minute, same error
            fl.failed("ConnectionRefusedError")
            clock.t += 1.0
        assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
        assert "failed: ConnectionRefusedError" in caplog.records[0].getMessage()
        fl.failed("ConnectionRefusedError")  # 59 s later: still not a minute
        clock.t += 1.0
        fl.failed("ConnectionRefusedError")  # a minute after the first line: one reminder
        assert len(caplog.records) == 2
        assert "still failing for 60 s (61 failures, 59 not logged)" in caplog.records[1].getMessage()
        fl.failed("HTTP 500")  # a different error is news
        assert len(caplog.records) == 3 and "HTTP 500" in caplog.records[2].getMessage()
        clock.t += 4.5
        fl.ok()
        assert len(caplog.records) == 4 and caplog.records[3].levelno == logging.INFO
        assert "recovered after 64.5 s (62 failures)" in caplog.records[3].getMessage()
        fl.ok()  # healthy again: nothing more to say
        fl.failed("again")  # a new spell starts with a full line
        assert len(caplog.records) == 5 and "failed: again" in caplog.records[4].getMessage()


def test_redact_url_hides_the_password_only():
    assert redact_url("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redact_url("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_agent_process_logs_a_dead_engine_once_and_its_recovery():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r-log", "--engine-url", f"http://127.0.0.1:{port}",
         "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--feed", "redis://:hunter2@127.0.0.1:1/0",
         "--model", "warmroute-sim", "--load-interval", "0.1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    async def read_until(text: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not any(text in ln for ln in lines):
            assert loop.time() < deadline, f"no {text!r} in:\n" + "".join(lines)
            line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline), deadline - loop.time())
            assert line, "agent exited:\n" + "".join(lines)
            lines.append(line)

    sim = None
    try:
        await read_until(" up; ", 30)
        t_up = time.monotonic()
        await asyncio.sleep(3.0)  # ~30 failed scrapes at 0.1 s
        sim = await start_sim_server(SimConfig(block_size=16, num_blocks=64), "127.0.0.1", port)
        await read_until("recovered after", 30)
        scrape_lines = [ln for ln in lines if "load scrape" in ln]
        assert time.monotonic() - t_up > 2.5
        assert len(scrape_lines) == 2, "".join(scrape_lines)  # the first failure, the recovery
        assert "failed" in scrape_lines[0] and "recovered after" in scrape_lines[1]
        up = next(ln for ln in lines if " up; " in ln)
        assert "None" not in up and "no admin port" in up, up
        text = "".join(lines)
        assert "hunter2" not in text and ":***@" in text  # the feed failure is logged, its password not
    finally:
        stop_processes([proc])
        if sim is not None:
            await sim.close()
    assert proc.returncode == 0
