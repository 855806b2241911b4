"""In-process feed (`memory://[name]`): the embedded default, no Redis.

Rule: one hub per name per process (`memory://` is the name ""), shared by every `MemoryFeed` opened
with that URL, so agents and the gateway in one process see the same streams. Streams are bounded
deques (`maxlen` records per replica); readers in any event loop of the process are woken on
publish. Records are stored as the immutable FeedEvents themselves (no copies, no encoding).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Mapping, Sequence

from .base import ADAPTERS_STALE_S, COPIES_KEPT, PLACEMENT_BATCHES_KEPT
from .records import FeedEvent, Inflight, LoadReport, Snapshot, fresh_stream_base, merge_adapters

__all__ = ["MemoryFeed", "reset_memory_feeds"]


class _Hub:
    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.lock = threading.Lock()
        self.streams: dict[str, deque[FeedEvent]] = {}
        self.last: dict[str, int] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.live: dict[str, tuple[float, LoadReport | None]] = {}  # replica -> (expires monotonic, load)
        self.inflight: dict[str, list[int]] = {}
        self.gauges: dict[str, dict[str, tuple[float, float, float]]] = {}  # owner -> its dispatch gauges
        self.adapters: dict[str, tuple[float, dict]] = {}  # owner -> (published monotonic, replica -> (running, wanting))
        self.copies: deque = deque(maxlen=COPIES_KEPT)  # (seq, owner, replica, keys, expires monotonic)
        self.copies_seq = 0
        self.placements: deque = deque(maxlen=PLACEMENT_BATCHES_KEPT)  # (seq, owner, records)
        self.placements_seq = 0
        self.waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def wake(self) -> None:
        for loop, ev in list(self.waiters):
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed
                self.waiters.discard((loop, ev))


_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub(name: str, maxlen: int) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.get(name)
        if hub is None:
            hub = _HUBS[name] = _Hub(maxlen)
        return hub


def reset_memory_feeds() -> None:
    """Drop every in-process hub (tests)."""
    with _HUBS_LOCK:
        _HUBS.clear()


class MemoryFeed:
    def __init__(self, url: str = "memory://", *, maxlen: int = 100_000, **_ignored) -> None:
        self.url = url
        self.name = url.split("://", 1)[1] if "://" in url else ""
        self._hub = _hub(self.name, maxlen)
        self.owner = uuid.uuid4().hex[:12]  # whose dispatch gauges and copies (exchange_inflight, exchange_copies)
        self._copies_seen = 0  # the hub's copies_seq at our last exchange_copies
        self._placements_seen = 0  # the hub's placements_seq at our last exchange_placements

    async def publish(self, replica_id: str, drafts: Sequence[FeedEvent]) -> list[FeedEvent]:
        hub = self._hub
        out: list[FeedEvent] = []
        now = time.time()
        with hub.lock:
            stream = hub.streams.get(replica_id)
            if stream is None:
                stream = hub.streams[replica_id] = deque(maxlen=hub.maxlen)
            off = hub.last.get(replica_id) or fresh_stream_base()
            for d in drafts:
                off += 1
                ev = replace(d, replica_id=replica_id, offset=off, ts=d.ts or now)
                stream.append(ev)
                out.append(ev)
            hub.last[replica_id] = off
        if out:
            hub.wake()
        return out

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        with self._hub.lock:
            self._hub.snapshots[snapshot.replica_id] = snapshot

    async def read_snapshot(self, replica_id: str) -> Snapshot | None:
        return self._hub.snapshots.get(replica_id)

    async def last_offset(self, replica_id: str) -> int:
        return self._hub.last.get(replica_id, 0)

    async def replicas(self) -> list[str]:
        hub = self._hub
        with hub.lock:
            return sorted(set(hub.streams) | set(hub.snapshots) | set(hub.live))

    def _collect(self, positions: Mapping[str, int], count: int) -> list[FeedEvent]:
        hub = self._hub
        out: list[FeedEvent] = []
        with hub.lock:
            for rid, pos in positions.items():
                stream = hub.streams.get(rid)
                if not stream or stream[-1].offset <= pos:
                    continue
                first = stream[0].offset
                start = max(0, pos + 1 - first)  # dense offsets: index arithmetic
                for i in range(start, min(len(stream), start + count)):
                    out.append(stream[i])
        return out

    async def read(self, positions: Mapping[str, int], *, block_s: float = 1.0, count: int = 1000) -> list[FeedEvent]:
        out = self._collect(positions, count)
        if out or block_s <= 0:
            return out
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        key = (loop, ev)
        self._hub.waiters.add(key)
        try:
            out = self._collect(positions, count)  # published between the check and the wait
            if out:
                return out
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
                async with asyncio.timeout(block_s):
                    await ev.wait()
            except TimeoutError:
                return []
            return self._collect(positions, count)
        finally:
            self._hub.waiters.discard(key)

    async def set_live(self, replica_id: str, load: LoadReport | None, ttl_s: float) -> None:
        with self._hub.lock:
            self._hub.live[replica_id] = (time.monotonic() + ttl_s, load)

    async def live(self) -> dict[str, LoadReport | None]:
        now = time.monotonic()
        with self._hub.lock:
            return {r: load for r, (until, load) in self._hub.live.items() if until > now}

    async def incr_inflight(self, replica_id: str, reqs: int, tokens: int, open_reqs: int = 0) -> None:
        with self._hub.lock:
            c = self._hub.inflight.setdefault(replica_id, [0, 0, 0])
            c[0] += reqs
            c[1] += tokens
            c[2] += open_reqs

    async def exchange_inflight(self, changes: Mapping[str, tuple[int, ...]],
                                gauges: Mapping[str, tuple[float, float, float]] | None = None,
                                adapters: Mapping[str, tuple[Sequence[str], Sequence[str]]] | None = None,
                                ) -> dict[str, Inflight]:
        for rid, change in changes.items():
            await self.incr_inflight(rid, *change)
        with self._hub.lock:
            if gauges is not None:
                self._hub.gauges[self.owner] = dict(gauges)
            if adapters is not None:
                self._hub.adapters[self.owner] = (time.monotonic(), {r: (tuple(a), tuple(w)) for r, (a, w) in adapters.items()})
        return await self.inflight()

    async def inflight(self) -> dict[str, Inflight]:
        with self._hub.lock:
            sums: dict[str, list[float]] = {}
            for own in self._hub.gauges.values():
                for rid, g in own.items():
                    acc = sums.setdefault(rid, [0.0, 0.0, 0.0])
                    for i, x in enumerate(g):
                        acc[i] += x
            now = time.monotonic()
            loras = merge_adapters(per for owner, (t, per) in self._hub.adapters.items()
                                   if owner != self.owner and now - t <= ADAPTERS_STALE_S)
            out = {}
            for r in set(self._hub.inflight) | set(sums) | set(loras):
                c = self._hub.inflight.get(r, (0, 0, 0))
                out[r] = Inflight(c[0], c[1], c[2], *sums.get(r, (0.0, 0.0, 0.0)), *loras.get(r, ((), ())))
            return out

    async def exchange_copies(self, entries: Sequence[tuple[str, Sequence[int], float]]) -> list[tuple[str, tuple[int, ...], float]]:
        now = time.monotonic()
        hub = self._hub
        with hub.lock:
            for rid, keys, ttl in entries:
                hub.copies_seq += 1
                hub.copies.append((hub.copies_seq, self.owner, rid, tuple(keys), now + ttl))
            out = [(rid, keys, until - now) for seq, owner, rid, keys, until in hub.copies
                   if seq > self._copies_seen and owner != self.owner and until > now]
            self._copies_seen = hub.copies_seq
        return out

    async def exchange_placements(self, records: Sequence[list]) -> list[list]:
        hub = self._hub
        with hub.lock:
            if records:
                hub.placements_seq += 1
                hub.placements.append((hub.placements_seq, self.owner, json.loads(json.dumps(list(records)))))
            out = [r for seq, owner, batch in hub.placements if seq > self._placements_seen and owner != self.owner
                   for r in batch]
            self._placements_seen = hub.placements_seq
        return out

    async def close(self) -> None:
        return None

    def clear(self) -> None:
        """Wipe this hub (tests: the in-process analogue of a Redis restart without persistence)."""
        hub = self._hub
        with hub.lock:
            hub.streams.clear()
            hub.last.clear()
            hub.snapshots.clear()
            hub.live.clear()
            hub.inflight.clear()
            hub.gauges.clear()
            hub.copies.clear()
            hub.placements.clear()
