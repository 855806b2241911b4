"""Redis feed (`redis://HOST:PORT/DB`): real deployments and every multi-process test.

Keys (prefix "wr:" by default):
  {p}replicas                 SET of replica ids that ever published
  {p}{rid}:events             STREAM, entry id "<offset>-0", field d = records.encode_event bytes,
                              trimmed to ~maxlen entries (MAXLEN ~)
  {p}{rid}:snapshot           STRING, records.encode_snapshot bytes
  {p}{rid}:live               HASH (load report fields), EXPIRE ttl_s: liveness + last load
  {p}inflight:{owner}         HASH "<rid>\\x00reqs" / "<rid>\\x00tokens" -> int, one per feed instance
                              (each gateway), EXPIRE inflight_ttl_s refreshed on every change, so a
                              gateway that dies stops counting instead of leaking in-flight work
Rule: offsets are assigned here, per replica: the next after the stream's last id (read once, then
kept in memory; re-read if Redis refuses an id; an empty stream starts at records.fresh_stream_base()). After a Redis restart without persistence the
publisher's counter keeps going, so consumers never see offsets go backwards; they see a wiped
snapshot and the publisher's resync ("cleared" + full key set + snapshot). Every Redis error
surfaces as FeedUnavailable; the client reconnects on the next call.
"""
from __future__ import annotations

import time
import uuid
from urllib.parse import urlsplit, urlunsplit
from typing import Mapping, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from .base import FeedUnavailable
from .records import INVALID_KIND, FeedDecodeError, FeedEvent, Inflight, LoadReport, Snapshot, fresh_stream_base, decode_event, decode_snapshot, encode_event, encode_snapshot

__all__ = ["RedisFeed"]

_LOAD_FIELDS = ("running_reqs", "waiting_reqs", "kv_usage", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "num_gpu_blocks", "block_size", "ts")


class RedisFeed:
    def __init__(self, url: str, *, maxlen: int = 100_000, prefix: str = "wr:", inflight_ttl_s: float = 60.0,
                 owner: str | None = None, **_ignored) -> None:
        self.url = url
        self._shown_url = _without_password(url)  # for messages: they end up in logs
        self.maxlen = maxlen
        self.prefix = prefix
        self.inflight_ttl_s = inflight_ttl_s
        self.owner = owner or uuid.uuid4().hex[:12]
        self._r: aioredis.Redis | None = None
        self._next: dict[str, int] = {}  # replica -> last offset assigned

    def _redis(self) -> aioredis.Redis:
        if self._r is None:
            self._r = aioredis.from_url(self.url, socket_connect_timeout=2, socket_timeout=None,
                                        health_check_interval=10)
        return self._r

    def _k(self, rid: str, what: str) -> str:
        return f"{self.prefix}{rid}:{what}"

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError) as exc:
            if isinstance(exc, ResponseError):
                raise
            raise FeedUnavailable(f"redis feed {self._shown_url} unavailable: {exc}") from exc

    # ---------------------------------------------------------------- publisher side
    async def last_offset(self, replica_id: str) -> int:
        r = self._redis()
        last = await self._call(r.xrevrange(self._k(replica_id, "events"), count=1))
        off = int(last[0][0].split(b"-")[0]) if last else 0
        return off

    async def publish(self, replica_id: str, drafts: Sequence[FeedEvent]) -> list[FeedEvent]:
        if not drafts:
            return []
        r = self._redis()
        if replica_id not in self._next:
            self._next[replica_id] = await self.last_offset(replica_id) or fresh_stream_base()
        for attempt in (0, 1):
            off = self._next[replica_id]
            now = time.time()
            out: list[FeedEvent] = []
            pipe = r.pipeline(transaction=False)
            key = self._k(replica_id, "events")
            pipe.sadd(self.prefix + "replicas", replica_id)
            for d in drafts:
                off += 1
                ev = FeedEvent(replica_id, off, d.kind, d.keys, d.medium, d.load, d.hello, d.ts or now)
                pipe.xadd(key, {"d": encode_event(ev)}, id=f"{off}-0", maxlen=self.maxlen, approximate=True)
                out.append(ev)
            try:
                await self._call(pipe.execute())
            except ResponseError as exc:  # our counter is behind the stream (another publisher)
                if attempt == 0 and "ID" in str(exc):
                    self._next[replica_id] = await self.last_offset(replica_id) or fresh_stream_base()
                    continue
                raise FeedUnavailable(f"redis feed refused records for {replica_id}: {exc}") from exc
            self._next[replica_id] = off
            return out
        raise AssertionError("unreachable")

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        r = self._redis()
        pipe = r.pipeline(transaction=False)
        pipe.sadd(self.prefix + "replicas", snapshot.replica_id)
        pipe.set(self._k(snapshot.replica_id, "snapshot"), encode_snapshot(snapshot))
        await self._call(pipe.execute())

    async def set_live(self, replica_id: str, load: LoadReport | None, ttl_s: float) -> None:
        r = self._redis()
        key = self._k(replica_id, "live")
        mapping: dict[str, str] = {"seen": repr(time.time())}
        if load is not None:
            mapping.update({f: repr(getattr(load, f)) for f in _LOAD_FIELDS})
        pipe = r.pipeline(transaction=False)
        pipe.sadd(self.prefix + "replicas", replica_id)
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        await self._call(pipe.execute())

    # ---------------------------------------------------------------- consumer side
    async def read_snapshot(self, replica_id: str) -> Snapshot | None:
        raw = await self._call(self._redis().get(self._k(replica_id, "snapshot")))
        return decode_snapshot(raw) if raw else None

    async def replicas(self) -> list[str]:
        members = await self._call(self._redis().smembers(self.prefix + "replicas"))
        return sorted(m.decode() for m in members)

    async def read(self, positions: Mapping[str, int], *, block_s: float = 1.0, count: int = 1000) -> list[FeedEvent]:
        if not positions:
            return []
        streams = {self._k(rid, "events"): f"{pos}-0" for rid, pos in positions.items()}
        rid_of = {self._k(rid, "events").encode(): rid for rid in positions}
        block_ms = int(block_s * 1000) if block_s > 0 else None
        res = await self._call(self._redis().xread(streams, count=count, block=block_ms))
        out: list[FeedEvent] = []
        for key, entries in res or ():
            rid = rid_of[key if isinstance(key, bytes) else key.encode()]
            for entry_id, fields in entries:
                off = int(entry_id.split(b"-")[0])
                try:
                    out.append(decode_event(rid, off, fields[b"d"]))
                except (FeedDecodeError, KeyError):
                    out.append(FeedEvent(rid, off, INVALID_KIND))  # consumers skip and count it
        return out

    async def live(self) -> dict[str, LoadReport | None]:
        r = self._redis()
        rids = await self.replicas()
        if not rids:
            return {}
        pipe = r.pipeline(transaction=False)
        for rid in rids:
            pipe.hgetall(self._k(rid, "live"))
        res = await self._call(pipe.execute())
        out: dict[str, LoadReport | None] = {}
        for rid, h in zip(rids, res):
            if not h:
                continue
            if b"ts" in h:
                v = {k.decode(): float(x) for k, x in h.items()}
                out[rid] = LoadReport(int(v["running_reqs"]), int(v["waiting_reqs"]), v["kv_usage"],
                                      v["prefix_cache_queries_total"], v["prefix_cache_hits_total"],
                                      int(v["num_gpu_blocks"]), int(v["block_size"]), v["ts"])
            else:
                out[rid] = None
        return out

    async def incr_inflight(self, replica_id: str, reqs: int, tokens: int) -> None:
        key = f"{self.prefix}inflight:{self.owner}"
        pipe = self._redis().pipeline(transaction=False)
        if reqs:
            pipe.hincrby(key, f"{replica_id}\x00reqs", reqs)
        if tokens:
            pipe.hincrby(key, f"{replica_id}\x00tokens", tokens)
        pipe.pexpire(key, int(self.inflight_ttl_s * 1000))
        await self._call(pipe.execute())

    async def inflight(self) -> dict[str, Inflight]:
        r = self._redis()

        async def scan() -> list[bytes]:
            return [k async for k in r.scan_iter(match=f"{self.prefix}inflight:*", count=100)]

        keys = await self._call(scan())
        if not keys:
            return {}
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        res = await self._call(pipe.execute())
        acc: dict[str, list[int]] = {}
        for h in res:
            for f, v in h.items():
                rid, _, what = f.decode().rpartition("\x00")
                c = acc.setdefault(rid, [0, 0])
                c[0 if what == "reqs" else 1] += int(v)
        return {rid: Inflight(max(0, c[0]), max(0, c[1])) for rid, c in acc.items()}

    async def close(self) -> None:
        if self._r is not None:
            r, self._r = self._r, None
            try:
                await r.aclose()
            except (RedisError, OSError):
                pass


def _without_password(url: str) -> str:
    """`url` with its password (if any) replaced by ***: a feed URL may carry Redis's password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
