"""Background responses keep what a running request holds until their engine says they ended.

A background response (`background: true`, served when the engines store responses:
gateway.stored_responses) is answered at once, `queued`, and runs on in its engine whoever
listens; the client of a streamed one may also leave before its end. Were its holds (the tenant's
limiter slot, flow control's grant, the replica's in-flight count) to end with the client's
answer, a tenant could start any number of them past its `max_concurrent_reqs` and its fair
share, unseen by the gateway's load signal. Rules:
- When the client has its answer and the response is not final, the pipeline hands its holds to
  a watch here (its own end then releases nothing), which asks the holder for the response
  (`GET /v1/responses/{id}`) every `responses.background_poll_s` and releases them once it is
  final (completed, incomplete, failed, cancelled: its answer is then recorded as a relayed one
  is), not found (its replica lost it, or left the pool), or after `responses.background_max_s`
  (counted `background_gave_up`, and a warning).
- A poll that gets no answer is tried again at the next interval. Closing releases every hold.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from gateway.errors import ApiError
from gateway.stored_responses import Fetch, final_output

__all__ = ["BackgroundHolds"]

log = logging.getLogger("warmroute.gateway.background_holds")


class BackgroundHolds:
    """The watches of background responses still running (module rules)."""

    def __init__(self, fetch: Fetch, *, poll_s: float, max_s: float, answered: Callable[[str, object], None],
                 count: Callable[[str], None] = lambda event: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch = fetch  # (replica, response id) -> the stored response, None when not there
        self.poll_s = poll_s
        self.max_s = max_s
        self.answered = answered  # records a final response's answer (StoredResponses.answered)
        self.count = count  # counts an event (the stored responses' counter)
        self.clock = clock
        self._watches: dict[str, asyncio.Task] = {}

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, replica_id: str, response_id: str, release: Callable[[], None]) -> None:
        """Holds until the response ends (module rules); `release()` then, exactly once."""
        self.count("background_held")
        task = asyncio.get_running_loop().create_task(self._watch(replica_id, response_id, release))
        self._watches[response_id] = task
        task.add_done_callback(lambda _: self._watches.pop(response_id, None))

    async def _watch(self, replica_id: str, response_id: str, release: Callable[[], None]) -> None:
        deadline = self.clock() + self.max_s
        try:
            while True:
                await asyncio.sleep(min(self.poll_s, max(0.0, deadline - self.clock())))
                if self.clock() >= deadline:
                    self.count("background_gave_up")
                    log.warning("a background response still running after responses.background_max_s: its tenant's "
                                "slot and its replica's in-flight count are released", extra={"fields": {
                                    "replica": replica_id, "held_s": self.max_s}})
                    return
                try:
                    response = await self.fetch(replica_id, response_id)
                except ApiError:  # no answer this time: the next interval asks again
                    continue
                if response is None:
                    return
                if final_output(response) is not None:
                    self.answered(response_id, response)
                    return
        finally:
            release()

    async def close(self) -> None:
        """Ends every watch, releasing its holds."""
        tasks = list(self._watches.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
