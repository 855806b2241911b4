"""A task cancelled in the same loop turn as the wake it waits for ends cancelled.

Python 3.11's `asyncio.wait_for` returns the inner result when the outer task is cancelled just as
the awaited event is set, and the cancel is lost: a background loop (the index sync reading the
in-process feed, flow control's timer) then runs on after `cancel()`, and the gateway's close, which
gathers its tasks, never returns (seen as a 300 s hang of the embedded-agents end-to-end test under
load). These waits use `asyncio.timeout` instead; each case here sets the wake and cancels in one
turn, which lost the cancel before.
"""
from __future__ import annotations

import asyncio

import pytest

from replica_agent.feed import open_feed
from tests.test_flow_admission import _flow_control

pytestmark = pytest.mark.asyncio


async def _cancel_at_wake(task: asyncio.Task, wake) -> None:
    for _ in range(5):  # let the task reach its wait
        await asyncio.sleep(0)
    assert not task.done()
    wake()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert task in done, "the task went on after cancel()"
    assert task.cancelled()


async def test_a_memory_feed_read_cancelled_as_a_record_arrives_is_cancelled():
    feed = open_feed("memory://cancel-at-wake")
    task = asyncio.create_task(feed.read({"r0": 0}, block_s=30.0))

    def wake():
        for _, ev in list(feed._hub.waiters):
            ev.set()

    await _cancel_at_wake(task, wake)


async def test_flow_controls_timer_cancelled_as_it_is_woken_stops():
    fc = _flow_control(1)
    task = asyncio.create_task(fc.run())
    await _cancel_at_wake(task, lambda: fc._wake.set())
