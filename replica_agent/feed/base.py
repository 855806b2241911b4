"""The feed interface (records: replica_agent/feed/records.py): one Protocol, one `open_feed(url)`, two transports.

Rules every transport keeps (tests/test_feed_conformance.py checks them on each):
  - `publish(replica_id, drafts)` assigns each record the next offset of that replica's stream
    (dense: last + 1, starting after whatever the feed already holds) and returns the stored records;
    it raises `FeedUnavailable` if the records may not have been stored (the publisher must then
    resynchronise: publish "cleared" plus its full key set and a snapshot; see replica_agent.agent).
  - `read(positions)` returns records with offset > positions[replica] for the replicas named,
    in offset order per replica, waiting up to `block_s` when there are none. Streams are bounded:
    when a consumer falls behind, the oldest records are gone and the first record returned skips
    offsets; the consumer then rebuilds from `read_snapshot`.
  - `write_snapshot` replaces the replica's snapshot; `read_snapshot` returns it or None.
  - `last_offset(replica)` is the newest offset stored (0 when none), so a restarted publisher
    continues the sequence and a consumer can see that a feed was wiped (last_offset < its position).
  - liveness/load (`set_live`, `live`) expire after their TTL; in-flight counters
    (`incr_inflight`, `inflight`) are shared by every process using the same feed.
Constructors do no I/O; connections open on first use, in the caller's event loop.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

from .records import FeedEvent, Inflight, LoadReport, Snapshot

__all__ = ["Feed", "FeedUnavailable", "open_feed"]


class FeedUnavailable(ConnectionError):
    """The feed's backend cannot be reached right now; retry later (with backoff)."""


@runtime_checkable
class Feed(Protocol):
    url: str

    async def publish(self, replica_id: str, drafts: Sequence[FeedEvent]) -> list[FeedEvent]: ...

    async def write_snapshot(self, snapshot: Snapshot) -> None: ...

    async def read_snapshot(self, replica_id: str) -> Snapshot | None: ...

    async def last_offset(self, replica_id: str) -> int: ...

    async def replicas(self) -> list[str]: ...

    async def read(self, positions: Mapping[str, int], *, block_s: float = 1.0, count: int = 1000) -> list[FeedEvent]: ...

    async def set_live(self, replica_id: str, load: LoadReport | None, ttl_s: float) -> None: ...

    async def live(self) -> dict[str, LoadReport | None]: ...

    async def incr_inflight(self, replica_id: str, reqs: int, tokens: int) -> None: ...

    async def inflight(self) -> dict[str, Inflight]: ...

    async def close(self) -> None: ...


def open_feed(url: str, **options) -> Feed:
    """`memory://[name]` (in-process, shared by name within the process) or `redis://HOST:PORT/DB`.

    Options: `maxlen` (records kept per replica stream, default 100_000), and for Redis
    `prefix` (key prefix, default "wr:") and `inflight_ttl_s` (default 60).
    """
    if url.startswith("memory:"):
        from .memory import MemoryFeed

        return MemoryFeed(url, **options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis_feed import RedisFeed

        return RedisFeed(url, **options)
    raise ValueError(f"unsupported feed URL {url!r}: use memory://[name] or redis://HOST:PORT/DB")
