"""loadtests.processes.stop_processes, on real child processes: SIGTERM first, one bounded wait,
SIGKILL for what ignores it, and with `group=True` the children a process spawned."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from loadtests.processes import stop_processes

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def _ready(p: subprocess.Popen) -> subprocess.Popen:
    assert p.stdout.readline().strip() == b"up"  # its handlers are set before we signal it
    return p


def test_a_term_first_then_a_kill_within_the_one_wait():
    polite = _ready(subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                     stdout=subprocess.PIPE))
    stubborn = _ready(subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE))
    t0 = time.monotonic()
    codes = stop_processes([polite, None, stubborn], timeout_s=1.0)
    assert codes == [-signal.SIGTERM, -signal.SIGKILL]
    assert time.monotonic() - t0 < 5.0
    assert stop_processes([polite]) == [-signal.SIGTERM]  # already stopped: nothing sent, its code kept


def test_a_group_stops_with_its_leader():
    child = f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {IGNORES_TERM!r}]); print(c.pid, flush=True); c.wait()"
    leader = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, start_new_session=True)
    pid = int(leader.stdout.readline())
    assert leader.stdout.readline().strip() == b"up"  # the child (our pipe is its stdout too) ignores SIGTERM now
    stop_processes([leader], timeout_s=1.0, group=True)
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the leader's child survived the group's stop")
