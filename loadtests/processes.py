"""Stopping the processes a test or benchmark started: SIGTERM to each, one bounded wait for all,
then SIGKILL for any still running (every process we start stops by its PID, never by name).

`group=True` signals each one's process group (started with `start_new_session=True`), so the
children it spawned (a gateway's workers, an engine's helpers) stop with it: what is left of a
group once its leader has exited gets the rest of the wait, then SIGKILL.
`private_redis()`: a benchmark's own redis-server, stopped that way and its directory removed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Iterable, Iterator

from loadtests.ports import free_port

__all__ = ["stop_processes", "private_redis"]


@contextlib.contextmanager
def private_redis(prefix: str = "wr-bench-redis-") -> Iterator[str]:
    """A redis-server on a free loopback port, no persistence, for the `with` block; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    port, tmp = free_port(), tempfile.mkdtemp(prefix=prefix)
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_processes([proc])
        shutil.rmtree(tmp, ignore_errors=True)


def _signal(p: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except ProcessLookupError:
        pass  # already gone


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 10.0, *, group: bool = False) -> list[int]:
    """SIGTERM each running process (in the order given), wait up to `timeout_s` in all for them
    (and with `group`, their groups) to exit, SIGKILL those that did not and reap them; their exit
    codes, in the same order."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL, group)
            p.wait(10)
    if group:
        for p in procs:
            while _group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal(p, signal.SIGKILL, True)  # what is left of the group, if anything
    return [p.returncode for p in procs]
