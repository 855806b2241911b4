"""Redis feed (`redis://HOST:PORT/DB`): real deployments and every multi-process test.

Keys (prefix "wr:" by default):
  {p}replicas                 SET of replica ids that ever published
  {p}{rid}:events             STREAM, entry id "<offset>-0", field d = records.encode_event bytes,
                              trimmed to ~maxlen entries (MAXLEN ~)
  {p}{rid}:snapshot           STRING, records.encode_snapshot bytes
  {p}{rid}:live               HASH (load report fields), EXPIRE ttl_s: liveness + last load
  {p}inflight:{owner}         HASH "<rid>\\x00reqs" / "<rid>\\x00tokens" / "<rid>\\x00open" -> int, one per feed instance
                              (each gateway), EXPIRE inflight_ttl_s refreshed on every change, so a
                              gateway that dies stops counting instead of leaking in-flight work;
                              and its dispatch gauges "<rid>\\x00rps" / "szw" / "szt" -> float (HSET),
                              and its LoRA adapters "\\x00lora" -> JSON {"o": owner, "t": wall time,
                              "a": {rid: [running, wanting]}} (HSET while it has any, then HDEL)
  {p}copies                   STREAM of copies in progress, fields o (owner), r (replica), t (ttl_s),
                              w (wall-clock publish time), k (keys, uint64 little-endian), trimmed
                              to ~COPIES_KEPT entries
  {p}placements               STREAM of placement batches, fields o (owner), p (JSON list of the
                              policy's records), trimmed to ~PLACEMENT_BATCHES_KEPT entries
Rule: offsets are assigned here, per replica: the next after the stream's last id (read once, then
kept in memory; re-read if Redis refuses an id; an empty stream starts at records.fresh_stream_base()). After a Redis restart without persistence the
publisher's counter keeps going, so consumers never see offsets go backwards; they see a wiped
snapshot and the publisher's resync ("cleared" + full key set + snapshot). Every Redis error
surfaces as FeedUnavailable; the client reconnects on the next call.

The gateway's periodic calls (the index consumer's XREAD, the in-flight board's increments and
reads, several times a second each) go over dedicated connections (`_Direct`), skipping the
client's per-command machinery, and the board is read by one server-side script (one round trip
instead of SCAN plus a pipeline); a gateway is otherwise woken and charged for each of them.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from array import array
from urllib.parse import urlsplit, urlunsplit
from typing import Mapping, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from .base import ADAPTERS_STALE_S, COPIES_KEPT, PLACEMENT_BATCHES_KEPT, FeedUnavailable
from .records import (INVALID_KIND, FeedDecodeError, FeedEvent, Inflight, LoadReport, Snapshot, fresh_stream_base,
                      decode_event, decode_snapshot, encode_event, encode_snapshot, merge_adapters)

__all__ = ["RedisFeed", "redact_url"]


def redact_url(url: str) -> str:
    """The URL without its password (redis://user:secret@host -> redis://user:***@host): error
    messages and logs never carry secrets."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))

# Every gateway's in-flight hashes, in one round trip: SCAN the owners' keys, HGETALL each.
_READ_INFLIGHT_LUA = """
local out, cursor = {}, "0"
repeat
  local r = redis.call("SCAN", cursor, "MATCH", ARGV[1], "COUNT", 100)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    out[#out + 1] = redis.call("HGETALL", k)
  end
until cursor == "0"
return out
"""

# The live hash's load fields: numbers only, each read back as a float by every gateway version, so
# the LoRA slots (names) are not among them; the load records carry those (records.py).
_LOAD_FIELDS = ("running_reqs", "waiting_reqs", "kv_usage", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "num_gpu_blocks", "block_size", "ts")


class _Direct:
    """One dedicated connection for a hot, periodic command path: commands go straight to redis-py's
    `Connection` (pack, send, read replies), without the client's pool checkout, retry wrapper,
    observability hooks and response callbacks (about half the CPU per call: loadtests/bench_feed.py).
    One exchange at a time; a failure or cancellation mid-exchange drops the connection (the next
    call reconnects), so a reply is never read by the wrong command."""

    def __init__(self, client: aioredis.Redis) -> None:
        pool = client.connection_pool
        self._make = lambda: pool.connection_class(**pool.connection_kwargs)
        self._conn = None
        self._lock = asyncio.Lock()

    async def run(self, *commands: tuple) -> list:
        """The raw replies of `commands`, sent in one write (a server error raises ResponseError)."""
        async with self._lock:
            conn = self._conn
            if conn is None:
                conn = self._conn = self._make()
            try:
                await conn.send_packed_command(conn.pack_commands(commands))
                return [await conn.read_response() for _ in commands]
            except BaseException:
                self._conn = None
                await _drop(conn)
                raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await _drop(conn)


async def _drop(conn) -> None:
    try:
        await asyncio.shield(conn.disconnect(nowait=True))
    except (RedisError, OSError, asyncio.CancelledError):
        pass


def _field(fields, name: bytes):
    """A stream entry's field value from its flat [name, value, ...] list (None if absent)."""
    if not fields:
        return None
    if fields[0] == name:
        return fields[1]
    for i in range(2, len(fields) - 1, 2):
        if fields[i] == name:
            return fields[i + 1]
    return None


_INFLIGHT_FIELDS = {"reqs": 0, "tokens": 1, "open": 2}  # hash field suffix -> Inflight position
_GAUGE_FIELDS = {"rps": 0, "szw": 1, "szt": 2}  # dispatch gauges (HSET, not HINCRBY): suffix -> position
_ADAPTERS_FIELD = "\x00lora"  # one field per gateway: no replica before the NUL, so older gateways skip it
_BIG_ENDIAN = sys.byteorder == "big"  # copies' keys travel little-endian


def _incr_cmds(key: str, rid: str, reqs: int, tokens: int, open_reqs: int = 0) -> list[tuple]:
    return [("HINCRBY", key, f"{rid}\x00{what}", n) for what, n in (("reqs", reqs), ("tokens", tokens), ("open", open_reqs)) if n]


def _gauge_cmds(key: str, gauges: Mapping[str, tuple[float, float, float]], gone: set[str]) -> list[tuple]:
    """Set this gateway's dispatch gauges in its hash; drop those of replicas it no longer has."""
    cmds: list[tuple] = []
    fields: list = []
    for rid, g in gauges.items():
        for what, i in _GAUGE_FIELDS.items():
            fields += [f"{rid}\x00{what}", repr(float(g[i]))]
    if fields:
        cmds.append(("HSET", key, *fields))
    if gone:
        cmds.append(("HDEL", key, *(f"{rid}\x00{what}" for rid in sorted(gone) for what in _GAUGE_FIELDS)))
    return cmds


def _adapters_value(owner: str, adapters: Mapping[str, tuple[Sequence[str], Sequence[str]]]) -> str:
    return json.dumps({"o": owner, "t": time.time(), "a": {r: [list(a), list(w)] for r, (a, w) in adapters.items()}},
                      separators=(",", ":"))


def _published_adapters(value: bytes, owner: str, now: float) -> dict | None:
    """Another gateway's adapters field, or None: ours, published over ADAPTERS_STALE_S ago (that
    gateway stopped; gateways' clocks agree to well under that), or not what this version writes."""
    try:
        got = json.loads(value)
        if got["o"] == owner or now - float(got["t"]) > ADAPTERS_STALE_S:
            return None
        return {r: (a, w) for r, (a, w) in got["a"].items() if isinstance(a, list) and isinstance(w, list)}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _sum_inflight(hashes, owner: str = "") -> dict[str, Inflight]:
    """Every gateway's in-flight hashes (flat [field, value, ...] lists) summed per replica; the
    other gateways' (not `owner`'s) LoRA adapters merged."""
    acc: dict[str, list[int]] = {}
    gauges: dict[str, list[float]] = {}
    published = []
    now = time.time()
    for flat in hashes or ():
        for f, v in zip(flat[::2], flat[1::2]):
            rid, _, what = f.decode().rpartition("\x00")
            if what == "lora" and not rid:
                if (got := _published_adapters(v, owner, now)) is not None:
                    published.append(got)
                continue
            i = _INFLIGHT_FIELDS.get(what)
            if i is not None:
                acc.setdefault(rid, [0, 0, 0])[i] += int(v)
                continue
            i = _GAUGE_FIELDS.get(what)
            if i is not None:  # else a field of a later version: not ours to sum
                try:
                    x = float(v)
                except ValueError:
                    continue  # not a number: that gateway's gauge is skipped, never the exchange
                if x > 0.0 and x != float("inf"):
                    gauges.setdefault(rid, [0.0, 0.0, 0.0])[i] += x
    loras = merge_adapters(published)
    out = {}
    for rid in set(acc) | set(gauges) | set(loras):
        c = acc.get(rid, (0, 0, 0))
        out[rid] = Inflight(max(0, c[0]), max(0, c[1]), max(0, c[2]), *gauges.get(rid, (0.0, 0.0, 0.0)),
                            *loras.get(rid, ((), ())))
    return out


class RedisFeed:
    def __init__(self, url: str, *, maxlen: int = 100_000, prefix: str = "wr:", inflight_ttl_s: float = 60.0,
                 owner: str | None = None, **_ignored) -> None:
        self.url = url
        self.maxlen = maxlen
        self.prefix = prefix
        self.inflight_ttl_s = inflight_ttl_s
        self.owner = owner or uuid.uuid4().hex[:12]
        self._r: aioredis.Redis | None = None
        self._reader: _Direct | None = None  # XREAD (may block: its own connection)
        self._board: _Direct | None = None  # in-flight increments and reads
        self._shares: _Direct | None = None  # flow control's fair-share board (replica_agent.feed.fair_share)
        self._gauge_rids: set[str] = set()  # replicas whose dispatch gauges our hash holds
        self._adapters_held = False  # our hash holds an adapters field
        self._last_read: dict[str, bytes] = {}  # stream (copies, placements) -> id of the last entry read
        self._next: dict[str, int] = {}  # replica -> last offset assigned

    def _redis(self) -> aioredis.Redis:
        if self._r is None:
            self._r = aioredis.from_url(self.url, socket_connect_timeout=2, socket_timeout=None,
                                        health_check_interval=10)
        return self._r

    def _direct(self, which: str) -> _Direct:
        d = getattr(self, which)
        if d is None:
            d = _Direct(self._redis())
            setattr(self, which, d)
        return d

    def _k(self, rid: str, what: str) -> str:
        return f"{self.prefix}{rid}:{what}"

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError) as exc:
            if isinstance(exc, ResponseError):
                raise
            raise FeedUnavailable(f"redis feed {redact_url(self.url)} unavailable: {exc}") from exc

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
        rids = list(positions)
        cmd = ["XREAD", "COUNT", count]
        if block_s > 0:
            cmd += ["BLOCK", max(1, int(block_s * 1000))]
        cmd += ["STREAMS", *(self._k(rid, "events") for rid in rids), *(f"{positions[rid]}-0" for rid in rids)]
        (res,) = await self._call(self._direct("_reader").run(tuple(cmd)))
        if not res:
            return []
        rid_of = {self._k(rid, "events").encode(): rid for rid in rids}
        out: list[FeedEvent] = []
        for key, entries in (res.items() if isinstance(res, dict) else res):  # RESP3 map or RESP2 pairs
            rid = rid_of[key if isinstance(key, bytes) else key.encode()]
            for entry_id, fields in entries:
                off = int(entry_id.split(b"-")[0])
                data = _field(fields, b"d")
                try:
                    if data is None:
                        raise FeedDecodeError("no d field")
                    out.append(decode_event(rid, off, data))
                except FeedDecodeError:
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

    async def incr_inflight(self, replica_id: str, reqs: int, tokens: int, open_reqs: int = 0) -> None:
        key = f"{self.prefix}inflight:{self.owner}"
        cmds = _incr_cmds(key, replica_id, reqs, tokens, open_reqs)
        cmds.append(("PEXPIRE", key, int(self.inflight_ttl_s * 1000)))
        await self._call(self._direct("_board").run(*cmds))

    async def inflight(self) -> dict[str, Inflight]:
        (hashes,) = await self._call(self._direct("_board").run(("EVAL", _READ_INFLIGHT_LUA, 0, f"{self.prefix}inflight:*")))
        return _sum_inflight(hashes, self.owner)

    async def exchange_inflight(self, changes: Mapping[str, tuple[int, ...]],
                                gauges: Mapping[str, tuple[float, float, float]] | None = None,
                                adapters: Mapping[str, tuple[Sequence[str], Sequence[str]]] | None = None,
                                ) -> dict[str, Inflight]:
        """`incr_inflight` for every (replica -> (reqs, tokens[, open_reqs])) change, our dispatch
        gauges and adapters set when given, our counters' TTL refreshed, and then `inflight()`, in
        one round trip."""
        key = f"{self.prefix}inflight:{self.owner}"
        cmds: list[tuple] = []
        for rid, change in changes.items():
            cmds += _incr_cmds(key, rid, *change)
        if gauges is not None:
            cmds += _gauge_cmds(key, gauges, self._gauge_rids - set(gauges))
            self._gauge_rids = set(gauges)
        if adapters:
            cmds.append(("HSET", key, _ADAPTERS_FIELD, _adapters_value(self.owner, adapters)))
        elif adapters is not None and self._adapters_held:
            cmds.append(("HDEL", key, _ADAPTERS_FIELD))
        cmds.append(("PEXPIRE", key, int(self.inflight_ttl_s * 1000)))
        cmds.append(("EVAL", _READ_INFLIGHT_LUA, 0, f"{self.prefix}inflight:*"))
        replies = await self._call(self._direct("_board").run(*cmds))
        if adapters is not None:
            self._adapters_held = bool(adapters)
        return _sum_inflight(replies[-1], self.owner)

    async def exchange_copies(self, entries: Sequence[tuple[str, Sequence[int], float]]) -> list[tuple[str, tuple[int, ...], float]]:
        """XADD ours, then XRANGE everything after the last entry read, in one round trip. The TTL
        left is counted by wall clock from the publisher's time (gateways' clocks agree to well under
        a TTL); the first call reads the whole kept stream, of which only unexpired entries count."""
        key = f"{self.prefix}copies"
        now = time.time()
        cmds: list[tuple] = []
        for rid, keys, ttl in entries:
            try:
                arr = array("Q", keys)
            except (OverflowError, TypeError):
                continue  # not 64-bit block keys: nothing another gateway could match
            if _BIG_ENDIAN:
                arr.byteswap()
            packed = arr.tobytes()
            cmds.append(("XADD", key, "MAXLEN", "~", COPIES_KEPT, "*", "o", self.owner, "r", rid,
                         "t", repr(float(ttl)), "w", repr(now), "k", packed))
        out = []
        for fields in await self._trade(key, cmds, COPIES_KEPT):
            try:
                # never more than it was published with (a clock ahead of ours gives no credit)
                left = float(_field(fields, b"t")) - max(0.0, now - float(_field(fields, b"w")))
                if left > 0:
                    keys = array("Q")
                    keys.frombytes(_field(fields, b"k"))
                    if _BIG_ENDIAN:
                        keys.byteswap()
                    out.append((_field(fields, b"r").decode(), tuple(keys), left))
            except (TypeError, ValueError, AttributeError):
                continue  # a malformed entry (another version's): skip it, never the exchange
        return out

    async def exchange_placements(self, records: Sequence[list]) -> list[list]:
        """XADD our batch (when any), then XRANGE the others' after the last entry read, in one
        round trip; a batch that is not a JSON list is skipped."""
        key = f"{self.prefix}placements"
        cmds = [("XADD", key, "MAXLEN", "~", PLACEMENT_BATCHES_KEPT, "*", "o", self.owner,
                 "p", json.dumps(list(records), separators=(",", ":")))] if records else []
        out: list[list] = []
        for fields in await self._trade(key, cmds, PLACEMENT_BATCHES_KEPT):
            try:
                batch = json.loads(_field(fields, b"p"))
            except (TypeError, ValueError):
                continue  # another version's entry: skip it, never the exchange
            if isinstance(batch, list):
                out.extend(batch)
        return out

    async def _trade(self, key: str, cmds: list[tuple], count: int) -> list:
        """Run `cmds` (our XADDs to stream `key`), then XRANGE it after the last entry read (all
        kept, the first time), in one round trip: the other owners' entries' fields."""
        last = self._last_read.get(key)
        cmds.append(("XRANGE", key, "-" if last is None else b"(" + last, "+", "COUNT", count))
        replies = await self._call(self._direct("_board").run(*cmds))
        owner = self.owner.encode()
        out = []
        for entry_id, fields in replies[-1] or ():
            self._last_read[key] = entry_id
            if _field(fields, b"o") != owner:
                out.append(fields)
        return out

    async def close(self) -> None:
        directs, self._reader, self._board, self._shares = (self._reader, self._board, self._shares), None, None, None
        for d in directs:
            if d is not None:
                await d.close()
        if self._r is not None:
            r, self._r = self._r, None
            try:
                await r.aclose()
            except (RedisError, OSError):
                pass
