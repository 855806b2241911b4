"""The gateway's side of the Redis feed, old way and new way side by side (a benchmark, not a test).

    python -m loadtests.bench_feed [--records 4000] [--keys 32] [--repeat 5]

Against a private redis-server, in one process, CPU time (time.process_time) per record or call:
  decode        one record's bytes -> FeedEvent: a generic msgpack decode plus per-field
                conversion (the previous records.decode_event) vs the typed decoder of today;
  xread         XREAD + decode of `--records` records in reads of `count` records: through the
                redis-py client (its reply parser: pure Python, and hiredis when installed)
                with the generic decode, vs RedisFeed.read (a dedicated connection, typed decode);
  board         reading every gateway's in-flight counters: SCAN + a pipeline of HGETALL
                through the client vs RedisFeed.inflight (one server-side script, one round trip);
  incr          one in-flight increment: a client pipeline vs RedisFeed.incr_inflight;
  shares        one fair-share exchange (flow control's row out, the other gateways' in, four
                gateways of two tenants): DEL + HSET + PEXPIRE in a MULTI, SCAN, a pipeline of
                HGETALL (three round trips through the client) vs the board's one script.
Each line gives both figures and their ratio (old / new). The machine may be shared: the
ratios are measured back to back in one run, the absolute figures move with the load.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import msgspec
import redis.asyncio as aioredis
from redis._parsers import _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from replica_agent.feed import FeedEvent, TenantShare, fair_share_board, open_feed
from replica_agent.feed.fair_share import _decode, _encode
from replica_agent.feed.records import KINDS, Hello, LoadReport, decode_event, encode_event
from loadtests.processes import private_redis

_generic = msgspec.msgpack.Decoder()


def legacy_decode(replica_id: str, offset: int, data: bytes) -> FeedEvent:
    """The previous decoder: generic msgpack, then each field converted in Python."""
    kind, keys, medium, load, hello, ts = _generic.decode(data)[:6]
    if kind not in KINDS:
        raise ValueError(kind)
    return FeedEvent(replica_id=replica_id, offset=int(offset), kind=kind, keys=tuple(keys), medium=str(medium),
                     load=None if load is None else LoadReport(int(load[0]), int(load[1]), float(load[2]), float(load[3]),
                                                               float(load[4]), int(load[5]), int(load[6]), float(load[7])),
                     hello=None if hello is None else Hello(int(hello[0]), str(hello[1]), str(hello[2])), ts=float(ts))


def _cpu_us(fn, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return 1e6 * (time.process_time() - t) / n


async def _acpu_us(fn, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        await fn()
    return 1e6 * (time.process_time() - t) / n


async def _client_xread(client, key: str, base: int, total: int, count: int) -> int:
    pos, n = base, 0
    while n < total:
        res = await client.xread({key: f"{pos}-0"}, count=count)
        for _, entries in res:
            for eid, fields in entries:
                off = int(eid.split(b"-")[0])
                legacy_decode("r", off, fields[b"d"])
                pos, n = off, n + 1
    return n


async def _feed_xread(feed, base: int, total: int, count: int) -> int:
    pos, n = base, 0
    while n < total:
        evs = await feed.read({"r": pos}, block_s=0, count=count)
        pos, n = evs[-1].offset, n + len(evs)
    return n


async def _xread_rows(url: str, feed, base: int, args) -> list[tuple[str, float, float]]:
    rows = []
    parsers = [("client (pure-Python parser)", {"parser_class": _AsyncRESP2Parser})]
    if HIREDIS_AVAILABLE:
        parsers.append(("client (hiredis)", {}))
    for count in (5, 50, 1000):
        for label, kw in parsers:
            client = aioredis.from_url(url, **kw)
            t = time.process_time()
            for _ in range(args.repeat):
                await _client_xread(client, "wr:r:events", base, args.records, count)
            old = 1e6 * (time.process_time() - t) / (args.repeat * args.records)
            await client.aclose()
            t = time.process_time()
            for _ in range(args.repeat):
                await _feed_xread(feed, base, args.records, count)
            new = 1e6 * (time.process_time() - t) / (args.repeat * args.records)
            rows.append((f"xread count={count}: {label} vs RedisFeed.read, per record", old, new))
    return rows


async def _board_rows(url: str, args) -> list[tuple[str, float, float]]:
    feeds = [open_feed(url, owner=f"g{i}") for i in range(3)]
    for i, f in enumerate(feeds):
        for rid in ("r0", "r1", "r2", "r3"):
            await f.incr_inflight(rid, 1, 100 * (i + 1))
    client = aioredis.from_url(url)

    async def old_board():
        keys = [k async for k in client.scan_iter(match="wr:inflight:*", count=100)]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        await pipe.execute()

    async def old_incr():
        pipe = client.pipeline(transaction=False)
        pipe.hincrby("wr:inflight:g0", "r0\x00reqs", 1)
        pipe.hincrby("wr:inflight:g0", "r0\x00tokens", 5)
        pipe.pexpire("wr:inflight:g0", 60_000)
        await pipe.execute()

    n = 50 * args.repeat
    rows = [("board read: SCAN + HGETALL pipeline vs one script, per call",
             await _acpu_us(old_board, n), await _acpu_us(feeds[0].inflight, n)),
            ("in-flight increment: client pipeline vs dedicated connection, per call",
             await _acpu_us(old_incr, n), await _acpu_us(lambda: feeds[0].incr_inflight("r0", 1, 5), n))]
    await client.aclose()
    for f in feeds:
        await f.close()
    return rows


async def _shares_rows(url: str, args) -> list[tuple[str, float, float]]:
    feeds = [open_feed(url, owner=f"g{i}") for i in range(4)]
    row = {"ta": TenantShare(12.5, 3, 2, 40, 5, 41), "tb": TenantShare(3.0, 0, 1, 9, 1, 9)}
    boards = [fair_share_board(f) for f in feeds]
    for b in boards:
        await b.exchange_shares(row)
    client = aioredis.from_url(url)

    async def old_exchange():  # the board's exchange before it was one script
        key = "wr:flow:g0"
        pipe = client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={"_": b"", **{t: _encode(s) for t, s in row.items()}})
        pipe.pexpire(key, 10_000)
        await pipe.execute()
        keys = [k async for k in client.scan_iter(match="wr:flow:*", count=100) if k.decode() != key]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        for r in await pipe.execute():
            {t.decode(): _decode(raw) for t, raw in r.items() if t != b"_"}

    n = 50 * args.repeat
    rows = [("fair-share exchange: MULTI + SCAN + HGETALL pipeline vs one script, per call",
             await _acpu_us(old_exchange, n), await _acpu_us(lambda: boards[0].exchange_shares(row), n))]
    await client.aclose()
    for f in feeds:
        await f.close()
    return rows


async def _run(url: str, args) -> list[tuple[str, float, float]]:
    rng = random.Random(0)
    drafts = [FeedEvent("", 0, "stored", tuple(rng.getrandbits(64) for _ in range(args.keys))) for _ in range(args.records)]
    feed = open_feed(url)
    try:
        published = await feed.publish("r", drafts)
        data = encode_event(published[0])
        rows = [("decode one record: generic vs typed", _cpu_us(lambda: legacy_decode("r", 1, data), 20000),
                 _cpu_us(lambda: decode_event("r", 1, data), 20000))]
        rows += await _xread_rows(url, feed, published[0].offset - 1, args)
        rows += await _board_rows(url, args)
        rows += await _shares_rows(url, args)
    finally:
        await feed.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_feed", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=4000, help="records in the stream read back")
    p.add_argument("--keys", type=int, default=32, help="keys per stored record")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    with private_redis("wr-bench-feed-") as url:
        rows = asyncio.run(_run(url, args))
    print("| measurement | old CPU-us | new CPU-us | old / new |\n|---|---|---|---|")
    for label, old, new in rows:
        print(f"| {label} | {old:.1f} | {new:.1f} | {old / new:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
