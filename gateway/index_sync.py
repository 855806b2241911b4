"""IndexSync: the consumer task that keeps a KVIndex current from a feed (the I/O edge of the index).

Rule: per replica, start from the feed's snapshot (`load_snapshot`), then apply records with
offset == position + 1, in order. Anything else triggers a rebuild from the snapshot:
  - a skip in offsets (the bounded stream was trimmed: this consumer fell behind);
  - the feed's last offset below our position (the feed was wiped: Redis restarted empty);
  - a replica seen for the first time (started late).
If the snapshot cannot close the gap (it is older than the oldest retained record) the gap is
accepted, counted in `stats["unclosable_gaps"]`, and the next snapshot fixes it. A replica with no
snapshot yet is read from the start of its stream (the agent writes one on its first publish). Records at or below
the position are duplicates and skipped. A record that fails to apply is counted and skipped; a feed
outage is retried with backoff, after which every followed replica is re-checked. `run()` never
returns except by cancellation. Started by the gateway service (or a test), never by a constructor.

Reads are coalesced: after a read that came back with records but less than a full batch (the
consumer is caught up), the next read waits until `min_read_interval_s` after the previous one
started, so records that arrive meanwhile come in one call. Without it every publish of every
agent (one per engine step) woke the gateway for a read of a few records, and the per-call cost of
the Redis client was the largest part of the gateway's CPU on long prompts; the price is at most
`min_read_interval_s` more feed lag (the gateway's own routing is covered by speculative entries).
A full batch from some replica (`batch_records` is per stream: a backlog) is followed by the next
read at once. A request about to be routed calls `wake()`: the wait ends then (no sooner than
`wake_floor_s` after the previous read started), so what the engines published since, above all
the removals of blocks they evicted, is applied before the request's match. Without it a client
sending its next request as the previous one ended was routed on an index up to 100 ms old: the
engines' evictions made during that request were not in it yet (the over-predictions seen on real
vLLM under eviction churn). Reads are then at most one per arrival, and never more than
1 / `wake_floor_s` a second.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from replica_agent.feed import INVALID_KIND, FailureLog, FeedEvent, FeedReader, FeedUnavailable

from .index import KVIndex

__all__ = ["IndexSync"]

log = logging.getLogger("warmroute.index_sync")


class IndexSync:
    def __init__(self, feed: FeedReader, index: KVIndex, *, replicas: Iterable[str] | None = None,
                 discover_every_s: float = 2.0, check_every_s: float = 5.0, block_s: float = 0.5,
                 batch_records: int = 2000, min_read_interval_s: float = 0.1, wake_floor_s: float = 0.01,
                 wall_clock: Callable[[], float] = time.time, health: FailureLog | None = None) -> None:
        self.feed = feed
        # a feed outage is logged when it starts, about once a minute while it lasts, and when it ends
        self.health = health or FailureLog(log, "feed (index sync)")
        self.index = index
        self._only: set[str] | None = set(replicas) if replicas is not None else None
        self.discover_every_s = discover_every_s
        self.check_every_s = check_every_s
        self.block_s = block_s
        self.batch_records = batch_records
        self.min_read_interval_s = min_read_interval_s
        self.wake_floor_s = wake_floor_s
        self._read_at = -1e18  # time.monotonic() when the last read started
        self._wanted_at = -1e18  # time.monotonic() of the last wake(): a request wants a fresh index
        self._woken = asyncio.Event()
        self._coalesce = False  # the last read returned a partial batch: wait before the next
        self._wall = wall_clock
        self._positions: dict[str, int] = {}  # replica -> last applied offset
        self._rebuild: set[str] = set()  # replicas to rebuild from the snapshot before reading on
        self._snapshot_offset: dict[str, int] = {}  # replica -> offset of the last snapshot loaded
        self._lag_s: dict[str, float] = {}
        self._next_discover = 0.0
        self._next_check = 0.0
        self.stats: dict[str, int] = {"records": 0, "bad_records": 0, "gaps": 0, "rebuilds": 0,
                                      "unclosable_gaps": 0, "wiped": 0, "feed_errors": 0, "duplicates": 0}

    # -------------------------------------------------------------- control (gateway side)
    def follow(self, replica_id: str) -> None:
        """Start following a replica (it is rebuilt from its snapshot first)."""
        if self._only is not None:
            self._only.add(replica_id)
        if replica_id not in self._positions:
            self._positions[replica_id] = 0
            self._rebuild.add(replica_id)

    def forget(self, replica_id: str) -> None:
        """Stop following a replica and purge it from the index (removed from the pool)."""
        if self._only is not None:
            self._only.discard(replica_id)
        self._positions.pop(replica_id, None)
        self._rebuild.discard(replica_id)
        self._lag_s.pop(replica_id, None)
        self.index.purge(replica_id)

    def wake(self) -> None:
        """A request is about to be routed: end a coalescing wait (module docstring)."""
        self._wanted_at = time.monotonic()
        self._woken.set()

    def lag_s(self, replica_id: str) -> float:
        """Publish-to-apply delay of the replica's last applied record (s); 0.0 when none yet."""
        return self._lag_s.get(replica_id, 0.0)

    def position(self, replica_id: str) -> int:
        return self._positions.get(replica_id, 0)

    # -------------------------------------------------------------- the task
    async def run(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                await self.step()
                backoff_s = 0.1
                self.health.ok()
            except asyncio.CancelledError:
                raise
            except FeedUnavailable as exc:
                self.stats["feed_errors"] += 1
                self.health.failed(exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                self._next_check = 0.0  # after an outage: re-check every replica for a wiped feed
                self._next_discover = 0.0
            except Exception:  # never die: log, count, go on
                self.stats["feed_errors"] += 1
                log.exception("index sync step failed")
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)

    async def step(self) -> int:
        """One round: discover, check, rebuild what needs it, read and apply one batch."""
        now = time.monotonic()
        if now >= self._next_discover:
            await self._discover()
            self._next_discover = now + self.discover_every_s
        if now >= self._next_check:
            await self._check_wiped()
            self._next_check = now + self.check_every_s
        for rid in list(self._rebuild):
            await self._rebuild_from_snapshot(rid)
        if not self._positions:
            await asyncio.sleep(self.block_s)
            return 0
        if self._coalesce:
            await self._coalescing_wait()
        self._read_at = time.monotonic()
        events = await self.feed.read(dict(self._positions), block_s=self.block_s, count=self.batch_records)
        self._coalesce = bool(events) and not self._backlog(events)
        applied: dict[str, float] = {}  # replica -> publish time of its last record applied in this batch
        for ev in events:
            if self._handle(ev) and ev.ts:
                applied[ev.replica_id] = ev.ts
        if applied:  # one lag per replica and batch: the last record's is the one reported
            now = self._wall()
            for rid, ts in applied.items():
                lag = max(0.0, now - ts)
                self._lag_s[rid] = lag
                self.index.set_feed_lag(rid, lag)
        if not events:
            self.index.maintain(50_000)  # idle: finish sweeping cleared replicas' old entries
        return len(events)

    async def _coalescing_wait(self) -> None:
        """Until `min_read_interval_s` after the last read started, or `wake()` (after the floor)."""
        if self._wanted_at <= self._read_at:  # no request has asked since the last read started
            self._woken.clear()
            wait_s = self._read_at + self.min_read_interval_s - time.monotonic()
            if wait_s > 0:
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
                    async with asyncio.timeout(wait_s):
                        await self._woken.wait()
                except TimeoutError:
                    return
        floor_s = self._read_at + self.wake_floor_s - time.monotonic()
        if floor_s > 0:
            await asyncio.sleep(floor_s)

    def _backlog(self, events: list[FeedEvent]) -> bool:
        """Did some replica's stream fill the batch (`count` is per stream)? Then more is waiting."""
        if len(events) < self.batch_records:
            return False
        per: dict[str, int] = {}
        for ev in events:
            per[ev.replica_id] = per.get(ev.replica_id, 0) + 1
        return max(per.values()) >= self.batch_records

    async def _discover(self) -> None:
        for rid in await self.feed.replicas():
            if self._only is not None and rid not in self._only:
                continue
            if rid not in self._positions:
                self._positions[rid] = 0
                self._rebuild.add(rid)
        if self._only:
            for rid in self._only:
                if rid not in self._positions:
                    self._positions[rid] = 0
                    self._rebuild.add(rid)

    async def _check_wiped(self) -> None:
        for rid, pos in list(self._positions.items()):
            if pos and await self.feed.last_offset(rid) < pos:
                self.stats["wiped"] += 1
                log.warning("feed for %s was wiped (last offset below %d): rebuilding", rid, pos)
                self._positions[rid] = 0
                self._snapshot_offset.pop(rid, None)
                self._rebuild.add(rid)

    async def _rebuild_from_snapshot(self, rid: str) -> None:
        snap = await self.feed.read_snapshot(rid)
        self._rebuild.discard(rid)
        if rid not in self._positions:
            return  # forgotten meanwhile
        self.stats["rebuilds"] += 1
        if snap is None:
            # nothing to rebuild from: read the stream from its start (the publisher writes a
            # snapshot on its first publish and on every resync, so this is a young feed)
            self._positions[rid] = 0
            return
        self.index.load_snapshot(rid, snap)
        self._positions[rid] = snap.offset
        self._snapshot_offset[rid] = snap.offset

    def _handle(self, ev: FeedEvent) -> bool:
        """Apply one record in order (module rule); True if the index applied it."""
        rid = ev.replica_id
        pos = self._positions.get(rid)
        if pos is None or rid in self._rebuild:
            return False  # forgotten, or waiting for a rebuild: the snapshot covers it
        if ev.offset <= pos:
            self.stats["duplicates"] += 1
            return False
        if ev.offset != pos + 1 and pos != 0:
            if self._snapshot_offset.get(rid) == pos:
                # just rebuilt and still a gap: the snapshot is older than the retained stream
                self.stats["unclosable_gaps"] += 1
                log.warning("gap %s: %d -> %d not closable by snapshot; applying on", rid, pos, ev.offset)
            else:
                self.stats["gaps"] += 1
                self._rebuild.add(rid)
                return False
        self._positions[rid] = ev.offset
        self._snapshot_offset.pop(rid, None)
        if ev.kind == INVALID_KIND:
            self.stats["bad_records"] += 1
            log.warning("undecodable feed record %s@%d: skipped", rid, ev.offset)
            return False
        try:
            self.index.apply(ev)
        except Exception:
            self.stats["bad_records"] += 1
            log.exception("bad feed record %s@%d (%s): skipped", rid, ev.offset, ev.kind)
            return False
        self.stats["records"] += 1
        return True
