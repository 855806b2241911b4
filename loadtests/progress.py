"""What a long bench or demo run shows while it runs (stderr, so stdout keeps only the report).

Rule: on a terminal, a tqdm progress bar per policy (requests done, errors so far, rate); anywhere
else (a pipe, a file, CI logs) plain lines, one when a stage starts and one per ~10% of requests or
every 10 s, never carriage returns. `Progress.stage()` announces a step in both modes.
"""
from __future__ import annotations

import os
import sys
import time
from typing import IO

__all__ = ["Progress"]


class Progress:
    def __init__(self, stream: IO[str] | None = None, *, tty: bool | None = None, prefix: str = "warmroute") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.prefix = prefix

    def stage(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    def requests(self, label: str, total: int) -> "_Requests":
        return _Requests(self, label, total)


class _Requests:
    """Counts finished requests of one run; `update(sample)` per request, `close()` at the end."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, progress: Progress, label: str, total: int) -> None:
        self.p = progress
        self.label = label
        self.total = total
        self.done = 0
        self.errors = 0
        self._t0 = time.monotonic()
        self._next_share = 0.1
        self._last_line = self._t0
        self._bar = None
        if progress.tty:
            from tqdm import tqdm

            try:  # a terminal that reports no size (0 columns) would get an empty bar
                sized = os.get_terminal_size(progress.stream.fileno()).columns > 0
            except (OSError, ValueError, AttributeError):
                sized = False
            self._bar = tqdm(total=total, desc=label, unit="req", file=progress.stream, leave=True,
                             dynamic_ncols=sized, ncols=None if sized else 100)

    def update(self, sample) -> None:
        self.done += 1
        if not getattr(sample, "ok", True):
            self.errors += 1
        if self._bar is not None:
            self._bar.update(1)
            if self.errors:
                self._bar.set_postfix(errors=self.errors, refresh=False)
            return
        now = time.monotonic()
        if self.done >= self.total or self.done / self.total >= self._next_share or now - self._last_line >= self.PLAIN_EVERY_S:
            while self._next_share <= self.done / self.total:
                self._next_share += 0.1
            self._last_line = now
            print(f"{self.p.prefix}: {self.label}: {self.done}/{self.total} requests done, {self.errors} failed, "
                  f"{now - self._t0:.0f} s", file=self.p.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "_Requests":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
