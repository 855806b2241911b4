"""Stopping the processes a test or benchmark started: SIGTERM to each, one bounded wait for all,
then SIGKILL for any still running (every process we start stops by its PID, never by name).

`group=True` signals each one's process group (started with `start_new_session=True`), so the
children it spawned (a gateway's workers, an engine's helpers) stop with it: what is left of a
group once its leader has exited gets the rest of the wait, then SIGKILL.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterable

__all__ = ["stop_processes"]


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
