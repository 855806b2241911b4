"""The feed between replica agents and gateways: three small interfaces, one `open_feed(url)`, two
transports (in-process memory, and Redis Streams).

What it carries (the contract): per replica, an ordered stream of records with dense, increasing
offsets (`stored(keys, medium)`, `removed(keys, medium)`, `cleared`, `load(...)`, `hello(block
size, model, agent epoch)`) and a snapshot (the replica's whole key set with the offset it is
valid at), so a gateway that starts late or falls behind rebuilds without replaying history; and
in-flight counters shared by every gateway. Roles: an agent is a `FeedWriter`, a gateway's index
consumer a `FeedReader`, the gateways share an `InflightBoard`; a transport (`Feed`) is all three.

Rules every transport keeps (tests/test_feed_conformance.py checks them on each, per role):
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
  - in-flight counters (`incr_inflight`, `inflight`, both at once: `exchange_inflight`) are shared
    by every process using the same feed, and a process's own counts expire when it stops
    exchanging them (Redis: a TTL refreshed by every exchange). `exchange_inflight` may also carry
    the process's dispatch gauges (per replica: routed rate, size weight, weight x mean), which
    replace its previous ones; `inflight()` returns every process's gauges summed. It may also
    carry the process's LoRA adapters per replica (those its requests there run, generating or not
    yet), which replace its previous ones; the reads return the other processes' (not the
    reader's own, nor those of a process silent for ADAPTERS_STALE_S), merged per replica.
  - copies in progress (`exchange_copies`): each process's entries (replica, block keys, TTL) reach
    every other process using the feed once, with the TTL left (none of its own, none expired);
    the feed keeps only the latest ~COPIES_KEPT of them.
  - placements (`exchange_placements`): each process's batch of its policy's placement records
    (JSON-able lists) reaches every other process once; the feed keeps the latest
    ~PLACEMENT_BATCHES_KEPT batches, and a reader's first call gets those (a new gateway's plan
    starts from the recent stream).
Constructors do no I/O; connections open on first use, in the caller's event loop.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

from .records import FeedEvent, Inflight, Snapshot

COPIES_KEPT = 1000  # copies in progress a feed keeps for late readers (older ones are dropped)
PLACEMENT_BATCHES_KEPT = 300  # placement batches (one per gateway exchange that had any) a feed keeps
# A process's published LoRA adapters count this long after its last exchange (a live gateway
# exchanges at least once a second; one that stopped must not hold LoRA slots for the hash's TTL).
ADAPTERS_STALE_S = 5.0

__all__ = ["Feed", "FeedReader", "FeedWriter", "InflightBoard", "FeedUnavailable", "open_feed"]


class FeedUnavailable(ConnectionError):
    """The feed's backend cannot be reached right now; retry later (with backoff)."""


@runtime_checkable
class FeedWriter(Protocol):
    """What a replica's agent needs: publish its records and snapshots, continue its sequence."""

    url: str

    async def publish(self, replica_id: str, drafts: Sequence[FeedEvent]) -> list[FeedEvent]: ...

    async def write_snapshot(self, snapshot: Snapshot) -> None: ...

    async def last_offset(self, replica_id: str) -> int: ...

    async def close(self) -> None: ...


@runtime_checkable
class FeedReader(Protocol):
    """What a gateway's index consumer needs: every replica's stream, in order, and snapshots."""

    url: str

    async def read(self, positions: Mapping[str, int], *, block_s: float = 1.0, count: int = 1000) -> list[FeedEvent]: ...

    async def read_snapshot(self, replica_id: str) -> Snapshot | None: ...

    async def last_offset(self, replica_id: str) -> int: ...

    async def replicas(self) -> list[str]: ...

    async def close(self) -> None: ...


@runtime_checkable
class InflightBoard(Protocol):
    """Counters of requests sent to each replica and not yet started, shared by every gateway."""

    async def incr_inflight(self, replica_id: str, reqs: int, tokens: int, open_reqs: int = 0) -> None: ...

    async def inflight(self) -> dict[str, Inflight]: ...

    async def exchange_inflight(self, changes: Mapping[str, tuple[int, ...]],
                                gauges: Mapping[str, tuple[float, float, float]] | None = None,
                                adapters: Mapping[str, tuple[Sequence[str], Sequence[str]]] | None = None,
                                ) -> dict[str, Inflight]:
        """`incr_inflight` for every replica -> (reqs, tokens[, open_reqs]) change, this process's
        dispatch gauges (replica -> (routed_rps, size_weight, size_tokens)) and LoRA adapters
        (replica -> (adapters generating, adapters without a first token)) each set in place of its
        previous ones when given, its counters kept alive, then `inflight()`: what a gateway does
        every poll, in one round trip. The adapters read back are the other processes' (a process's
        that has not published for ADAPTERS_STALE_S left out: it stopped)."""
        ...

    async def exchange_copies(self, entries: Sequence[tuple[str, Sequence[int], float]]) -> list[tuple[str, tuple[int, ...], float]]:
        """Publish this process's copies in progress (replica, block keys, ttl_s) and return the
        other processes' published since the last call, with their TTL left (expired ones dropped)."""
        ...

    async def exchange_placements(self, records: Sequence[list]) -> list[list]:
        """Publish this process's placement records (one batch; none published when empty) and
        return the other processes' published since the last call, in order."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Feed(FeedWriter, FeedReader, InflightBoard, Protocol):
    """A transport: all three roles on one backend (memory or Redis)."""


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
