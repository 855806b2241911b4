"""The stored Responses' shared records: for each response an engine stored (the Responses API with
`store`), which replica holds it and what the next turn's history needs of it, so a follow-up
(`previous_response_id`) reaching any gateway is routed and rendered as the engine renders it.

The gateway (gateway.stored_responses) owns what a record says; this board only keeps its bytes:
`put(id, previous, record)` and `chain(id)`, the records from `id` back along each one's previous
id (at most `max_depth`), newest first, each with its previous id, in one round trip. A record
expires `ttl_s` after its last write, or after the last write of a record that follows it (a
write gives the chain behind it, up to MAX_REFRESH records, `ttl_s` again): a conversation lasts
as long as it goes on.

Transports, like the rest of the feed: in-process (`memory://`, shared by name within the
process) and Redis (`{prefix}resp:{id}`, a STRING `<previous id>\\x00<record>`; a write, and a
read of the chain, each one script that follows the previous ids). Every Redis error surfaces as
FeedUnavailable.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol, runtime_checkable

__all__ = ["StoredTurnBoard", "stored_turn_board", "MAX_REFRESH"]

MAX_REFRESH = 10_000  # records behind a new one given their ttl again, at most


@runtime_checkable
class StoredTurnBoard(Protocol):
    async def put(self, response_id: str, previous: str | None, record: bytes, *, refresh: bool = True) -> None:
        """Write (or overwrite) one response's record; it expires ttl_s later, and so, with
        `refresh`, does the chain behind it."""
        ...

    async def chain(self, response_id: str, max_depth: int) -> list[tuple[str, str | None, bytes]]:
        """(id, previous id, record) from `response_id` back through the previous ids, newest first;
        it stops at a turn without a previous one, a record not found (empty: `response_id`
        unknown) or `max_depth` records."""
        ...


def stored_turn_board(feed, *, ttl_s: float) -> StoredTurnBoard:
    """The board on the same backend as `feed` (a MemoryFeed or RedisFeed)."""
    from .memory import MemoryFeed
    from .redis_feed import RedisFeed

    if isinstance(feed, RedisFeed):
        return _RedisBoard(feed, ttl_s)
    if isinstance(feed, MemoryFeed):
        return _MemoryBoard(feed, ttl_s)
    raise TypeError(f"no stored-turn board for {type(feed).__name__}")


_PUT_LUA = """
redis.call('SET', KEYS[1] .. ARGV[1], ARGV[2], 'PX', ARGV[3])
local v = ARGV[2]
for i = 1, tonumber(ARGV[4]) do
  local cut = string.find(v, '\\0', 1, true)
  if cut == nil or cut == 1 then break end
  local id = string.sub(v, 1, cut - 1)
  v = redis.call('GET', KEYS[1] .. id)
  if not v then break end
  redis.call('PEXPIRE', KEYS[1] .. id, ARGV[3])
end
"""

_CHAIN_LUA = """
local out = {}
local id = ARGV[1]
for i = 1, tonumber(ARGV[2]) do
  local v = redis.call('GET', KEYS[1] .. id)
  if not v then break end
  out[#out + 1] = id
  out[#out + 1] = v
  local cut = string.find(v, '\\0', 1, true)
  if cut == nil or cut == 1 then break end
  id = string.sub(v, 1, cut - 1)
end
return out
"""


def _pack(previous: str | None, record: bytes) -> bytes:
    return (previous or "").encode() + b"\x00" + record


def _unpack(value: bytes) -> tuple[str | None, bytes]:
    cut = value.index(b"\x00")
    return value[:cut].decode() or None, value[cut + 1:]


class _RedisBoard:
    def __init__(self, feed, ttl_s: float) -> None:
        self.feed = feed  # shares the feed's client and error mapping
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = f"{feed.prefix}resp:"

    async def put(self, response_id: str, previous: str | None, record: bytes, *, refresh: bool = True) -> None:
        f = self.feed
        await f._call(f._redis().eval(_PUT_LUA, 1, self.prefix, response_id, _pack(previous, record),  # noqa: SLF001
                                      self.ttl_ms, MAX_REFRESH if refresh else 0))

    async def chain(self, response_id: str, max_depth: int) -> list[tuple[str, str | None, bytes]]:
        f = self.feed
        flat = await f._call(f._redis().eval(_CHAIN_LUA, 1, self.prefix, response_id, max_depth))  # noqa: SLF001
        return [(flat[i].decode(), *_unpack(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]


# memory: hub -> response id -> (expires monotonic, previous, record)
_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _MemoryBoard:
    def __init__(self, feed, ttl_s: float) -> None:
        self._hub = feed._hub  # noqa: SLF001 - the feed's in-process hub (one per name)
        self.ttl_s = ttl_s

    async def put(self, response_id: str, previous: str | None, record: bytes, *, refresh: bool = True) -> None:
        now = time.monotonic()
        until = now + self.ttl_s
        with _LOCK:
            records = _RECORDS.setdefault(self._hub, {})
            records[response_id] = (until, previous, record)
            for _ in range(MAX_REFRESH if refresh else 0):  # the chain behind it lives on
                hit = records.get(previous) if previous else None
                if hit is None or hit[0] <= now:
                    break
                records[previous] = (until, hit[1], hit[2])
                previous = hit[1]
            if len(records) % 1024 == 0:  # now and then, not per write: drop the expired
                for rid in [r for r, (t, _, _) in records.items() if t <= now]:
                    del records[rid]

    async def chain(self, response_id: str, max_depth: int) -> list[tuple[str, str | None, bytes]]:
        now, out, rid = time.monotonic(), [], response_id
        with _LOCK:
            records = _RECORDS.get(self._hub, {})
            while rid and len(out) < max_depth:
                hit = records.get(rid)
                if hit is None or hit[0] <= now:
                    break
                out.append((rid, hit[1], hit[2]))
                rid = hit[1]
        return out
