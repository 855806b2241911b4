"""gateway.background_holds: a background response's holds are released exactly once, when its
engine says it ended, when it is gone, after `max_s`, or at close; a poll without an answer is
tried again."""
from __future__ import annotations

import asyncio

import pytest

from gateway.background_holds import BackgroundHolds
from gateway.errors import ApiError
from tests.flow_helpers import until

pytestmark = pytest.mark.asyncio


class Engine:
    """A replica's answers to `GET /v1/responses/{id}`, in turn (a response, None or an ApiError)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.asked = 0

    async def fetch(self, replica_id: str, response_id: str):
        assert (replica_id, response_id) == ("r0", "resp_1")
        self.asked += 1
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, Exception):
            raise a
        return a


def _holds(engine: Engine, max_s: float = 60.0):
    answered, events, released = [], [], []
    holds = BackgroundHolds(engine.fetch, poll_s=0.01, max_s=max_s, answered=lambda rid, r: answered.append((rid, r["status"])),
                            count=events.append)
    return holds, answered, events, released


@pytest.mark.parametrize("last, recorded", [({"status": "completed", "output": []}, True),
                                            ({"status": "cancelled", "output": []}, True), (None, False)])
async def test_released_once_when_the_engine_says_it_ended_or_it_is_gone(last, recorded) -> None:
    unavailable = ApiError(502, "no answer", code="upstream_unavailable")
    engine = Engine({"status": "queued", "output": []}, unavailable, {"status": "in_progress", "output": []}, last)
    holds, answered, events, released = _holds(engine)
    holds.watch("r0", "resp_1", lambda: released.append(1))
    assert len(holds) == 1 and events == ["background_held"]
    await until(lambda: released, what="the release")
    await asyncio.sleep(0.05)
    assert released == [1] and engine.asked == 4 and len(holds) == 0
    assert answered == ([("resp_1", last["status"])] if recorded else [])


async def test_given_up_after_max_s_and_released_at_close() -> None:
    engine = Engine({"status": "in_progress", "output": []})
    holds, _, events, released = _holds(engine, max_s=0.1)
    holds.watch("r0", "resp_1", lambda: released.append("expired"))
    await until(lambda: released, what="the release")
    assert events == ["background_held", "background_gave_up"] and engine.asked >= 3
    holds, _, events, released = _holds(engine)
    holds.watch("r0", "resp_1", lambda: released.append("closed"))
    await asyncio.sleep(0.03)
    await holds.close()
    assert released == ["closed"] and len(holds) == 0
