"""Flow control's shared board: what each gateway holds and has released per tenant, so fair
shares and per-tenant limits hold across gateway workers and gateway replicas.

Each gateway (an owner) writes its whole row on every exchange and reads every other owner's:
per tenant hash, the cost it has released from its queue so far (a counter that only grows while
the owner lives), the requests it holds queued now, the requests it has active (the tenant
limiter's count), the requests it was asked for (the limiter's arrivals, a growing counter) and
the requests its flow control granted (sent on, not finished: what the tenant occupies of the
pool's slots through that owner).
A row expires `ttl_s` after its owner's last write, so a gateway that dies stops counting. Tenant
ids never reach the board, only their hashes.

Transports, like the rest of the feed: in-process (`memory://`, shared by name within the
process) and Redis (`{prefix}flow:{owner}`, a HASH of tenant hash -> msgpack [released, queued,
active, arrivals, granted, asked], written with DEL + HSET + PEXPIRE and the others' read by SCAN +
HGETALL in one script, one round trip on a connection of its own: while gateways hold requests
they exchange every 25 ms, gateway.flow). Every Redis error surfaces as FeedUnavailable.
"""
from __future__ import annotations

import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import msgspec

__all__ = ["TenantShare", "FairShareBoard", "fair_share_board"]


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One owner's figures for one tenant."""

    released: float = 0.0  # cost released from its queue so far (grows)
    queued: int = 0  # requests held now
    active: int = 0  # requests admitted and not finished (tenant limiter)
    arrivals: int = 0  # requests asked for so far (tenant limiter; grows)
    granted: int = 0  # requests flow control sent on and not finished (0 from an owner that predates it)
    asked: int = 0  # requests flow control was asked to admit so far (grows; 0 from an owner that predates it)


@runtime_checkable
class FairShareBoard(Protocol):
    owner: str

    async def exchange_shares(self, mine: Mapping[str, TenantShare]) -> dict[str, dict[str, TenantShare]]:
        """Write this owner's row; every other live owner's rows (owner -> tenant -> share)."""
        ...


def fair_share_board(feed, *, ttl_s: float = 10.0, owner: str | None = None) -> FairShareBoard:
    """The board on the same backend as `feed` (a MemoryFeed or RedisFeed)."""
    from .memory import MemoryFeed
    from .redis_feed import RedisFeed

    if isinstance(feed, RedisFeed):
        return _RedisBoard(feed, ttl_s, owner or feed.owner)
    if isinstance(feed, MemoryFeed):
        return _MemoryBoard(feed, ttl_s, owner or uuid.uuid4().hex[:12])
    raise TypeError(f"no fair-share board for {type(feed).__name__}")


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def _encode(s: TenantShare) -> bytes:
    return _enc.encode([s.released, s.queued, s.active, s.arrivals, s.granted, s.asked])


def _decode(raw: bytes) -> TenantShare | None:
    try:
        r, q, a, n, *later = _dec.decode(raw)[:6]  # four or five fields from a gateway of an earlier release
        g, asked = (list(later) + [0, 0])[:2]
        return TenantShare(float(r), int(q), int(a), int(n), int(g), int(asked))
    except Exception:  # noqa: BLE001 - a malformed row is skipped, not fatal
        return None


# KEYS[1] our row; ARGV: the rows' MATCH pattern, the TTL in ms, then field, value pairs (at least
# "_", ""). Rewrites our row whole (DEL + HSET, atomic: nobody reads it half-written), then returns
# every other row as a flat list: key, its HGETALL reply, key, ...
_EXCHANGE_LUA = """
redis.call("DEL", KEYS[1])
for i = 3, #ARGV, 200 do
  redis.call("HSET", KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
end
redis.call("PEXPIRE", KEYS[1], ARGV[2])
local out, cursor = {}, "0"
repeat
  local r = redis.call("SCAN", cursor, "MATCH", ARGV[1], "COUNT", 100)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    if k ~= KEYS[1] then
      out[#out + 1] = k
      out[#out + 1] = redis.call("HGETALL", k)
    end
  end
until cursor == "0"
return out
"""


class _RedisBoard:
    def __init__(self, feed, ttl_s: float, owner: str) -> None:
        self.feed = feed  # shares the feed's client and error mapping
        self.ttl_s = ttl_s
        self.owner = owner

    async def exchange_shares(self, mine: Mapping[str, TenantShare]) -> dict[str, dict[str, TenantShare]]:
        f = self.feed
        prefix = f"{f.prefix}flow:"
        key = prefix + self.owner
        args: list = [prefix + "*", max(1, int(self.ttl_s * 1000)), "_", b""]
        for t, s in mine.items():
            args += (t, _encode(s))
        (flat,) = await f._call(f._direct("_shares").run(("EVAL", _EXCHANGE_LUA, 1, key, *args)))  # noqa: SLF001
        out: dict[str, dict[str, TenantShare]] = {}
        for i in range(0, len(flat) - 1, 2):
            k, row = flat[i], flat[i + 1]
            if not row:
                continue
            shares = {}
            for j in range(0, len(row) - 1, 2):
                t, raw = row[j], row[j + 1]
                if t == b"_":
                    continue
                s = _decode(raw)
                if s is not None:
                    shares[t.decode()] = s
            out[k.decode()[len(prefix):]] = shares
        return out


# memory: hub name -> owner -> (expires monotonic, row)
_ROWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _MemoryBoard:
    def __init__(self, feed, ttl_s: float, owner: str) -> None:
        self._hub = feed._hub  # noqa: SLF001 - the feed's in-process hub (one per name)
        self.ttl_s = ttl_s
        self.owner = owner

    async def exchange_shares(self, mine: Mapping[str, TenantShare]) -> dict[str, dict[str, TenantShare]]:
        now = time.monotonic()
        with _LOCK:
            rows = _ROWS.setdefault(self._hub, {})
            rows[self.owner] = (now + self.ttl_s, dict(mine))
            for o in [o for o, (until, _) in rows.items() if until <= now]:
                del rows[o]
            return {o: dict(row) for o, (_, row) in rows.items() if o != self.owner}
