"""Log lines for an operation that keeps failing (pure but for the logger it writes to): both
ends of the feed report a failing dependency through it (the agent its engine and Redis, the
gateway its feed and shared counters).

Rule: the first failure is logged at WARNING; while it keeps failing, a repeat is logged only when
the error text changes or `every_s` has passed (saying how many were suppressed), so a dead engine
or feed polled every second costs one line a minute, not sixty; the first success after a failure
logs one INFO line saying it recovered and after how long.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

__all__ = ["FailureLog"]


class FailureLog:
    def __init__(self, log: logging.Logger, what: str, *, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.what = what  # e.g. "load scrape of http://.../metrics"
        self.every_s = every_s
        self.clock = clock
        self.failures = 0  # in the current failing spell
        self._since: float | None = None  # start of the current failing spell
        self._last_logged_at = 0.0
        self._last_error = ""
        self._suppressed = 0

    @property
    def failing(self) -> bool:
        return self._since is not None

    def failed(self, error: object) -> None:
        now = self.clock()
        text = str(error) or type(error).__name__
        self.failures += 1
        if self._since is None:
            self._since = now
            self.log.warning("%s failed: %s (repeats logged at most every %.0f s)", self.what, text, self.every_s)
        elif text != self._last_error or now - self._last_logged_at >= self.every_s:
            self.log.warning("%s still failing for %.0f s (%d failures, %d not logged): %s",
                             self.what, now - self._since, self.failures, self._suppressed, text)
        else:
            self._suppressed += 1
            return
        self._last_logged_at = now
        self._last_error = text
        self._suppressed = 0

    def ok(self) -> None:
        if self._since is None:
            return
        self.log.info("%s recovered after %.1f s (%d failures)", self.what, self.clock() - self._since, self.failures)
        self._since = None
        self.failures = 0
        self._suppressed = 0
        self._last_error = ""
