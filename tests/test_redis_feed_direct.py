"""RedisFeed's dedicated connections (XREAD, the in-flight board) against a real redis-server:
a cancelled blocking read leaves no reply behind for the next command, an outage surfaces as
FeedUnavailable and the next call reconnects, entries without the record field count as invalid,
and the one-script board read sees every gateway's counters however many keys the SCAN walks."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from replica_agent.feed import INVALID_KIND, FeedEvent, FeedUnavailable, open_feed
from replica_agent.feed.records import encode_event

pytestmark = pytest.mark.redis


def _drafts(*keys_lists):
    return [FeedEvent("", 0, "stored", tuple(k)) for k in keys_lists]


async def test_cancelled_blocking_read_does_not_leak_its_reply(redis_server):
    pub, sub = open_feed(redis_server.url), open_feed(redis_server.url)
    try:
        first = await pub.publish("r", _drafts([1]))
        pos = first[0].offset
        blocked = asyncio.create_task(sub.read({"r": pos}, block_s=5.0))
        await asyncio.sleep(0.2)  # XREAD BLOCK is on the server now
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await pub.publish("r", _drafts([2, 3]))
        # the cancelled XREAD's late reply must not be read as this call's (nor as the board's)
        got = await sub.read({"r": pos}, block_s=0)
        assert [(e.offset, e.keys) for e in got] == [(pos + 1, (2, 3))]
        await sub.incr_inflight("r", 1, 7)
        assert (await sub.inflight())["r"].prefill_tokens == 7
    finally:
        await pub.close()
        await sub.close()


async def test_outage_is_feed_unavailable_then_reconnects(redis_server):
    pub, sub = open_feed(redis_server.url), open_feed(redis_server.url)
    try:
        out = await pub.publish("r", _drafts([1]))
        assert [e.keys for e in await sub.read({"r": out[0].offset - 1}, block_s=0)] == [(1,)]
        await sub.incr_inflight("r", 1, 1)
        redis_server.stop()
        with pytest.raises(FeedUnavailable):
            await sub.read({"r": 0}, block_s=0)
        with pytest.raises(FeedUnavailable):
            await sub.inflight()
        with pytest.raises(FeedUnavailable):
            await sub.incr_inflight("r", 1, 1)
        redis_server.start()  # empty: no persistence
        try:  # the publisher's pooled connection may still be the dead one: its first call fails
            out = await pub.publish("r", _drafts([4]))
        except FeedUnavailable:
            out = await pub.publish("r", _drafts([4]))
        got = await sub.read({"r": out[0].offset - 1}, block_s=0)
        assert [e.keys for e in got] == [(4,)]
        await sub.incr_inflight("q", 2, 3)
        assert {k: (v.reqs, v.prefill_tokens) for k, v in (await sub.inflight()).items()} == {"q": (2, 3)}
    finally:
        await pub.close()
        await sub.close()


async def test_entry_without_record_field_is_invalid_and_dense(redis_server):
    pub, sub = open_feed(redis_server.url), open_feed(redis_server.url)
    raw = aioredis.from_url(redis_server.url)
    try:
        out = await pub.publish("r", _drafts([1]))
        off = out[0].offset
        await raw.xadd("wr:r:events", {"x": b"1", "y": b"2"}, id=f"{off + 1}-0")
        await raw.xadd("wr:r:events", {"x": b"1", "d": encode_event(FeedEvent("r", 0, "stored", (5,)))}, id=f"{off + 2}-0")
        got = await sub.read({"r": off - 1}, block_s=0)
        assert [(e.offset, e.kind, e.keys) for e in got] == [
            (off, "stored", (1,)), (off + 1, INVALID_KIND, ()), (off + 2, "stored", (5,))]
    finally:
        await raw.aclose()
        await pub.close()
        await sub.close()


async def test_board_read_sees_every_owner_across_scan_pages(redis_server):
    raw = aioredis.from_url(redis_server.url)
    feeds = [open_feed(redis_server.url, owner=f"g{i}") for i in range(5)]
    try:
        await raw.mset({f"filler:{i}": b"x" for i in range(3000)})  # SCAN needs many pages to find them
        for i, f in enumerate(feeds):
            await f.incr_inflight("r", 1, 10 * (i + 1))
        await feeds[0].incr_inflight("s", 2, 0)
        seen = await feeds[3].inflight()
        assert (seen["r"].reqs, seen["r"].prefill_tokens) == (5, 150)
        assert (seen["s"].reqs, seen["s"].prefill_tokens) == (2, 0)
        await feeds[1].incr_inflight("r", -1, -20)
        assert (await feeds[0].inflight())["r"].prefill_tokens == 130
    finally:
        await raw.aclose()
        for f in feeds:
            await f.close()


async def test_bad_gauges_copies_and_placements_from_another_gateway_are_skipped_not_fatal(redis_server):
    """A gauge that is not a number, a copies entry without its fields or a placements entry that
    is not a JSON list (another version, or a bad writer), loses that value only: the exchange goes
    on with everything else."""
    g1 = open_feed(redis_server.url, owner="g1")
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.hset("wr:inflight:bad", mapping={"r\x00rps": "fast", "r\x00szw": "inf", "r\x00reqs": 2})
        await raw.xadd("wr:copies", {"o": "bad", "r": "r"})  # no keys, no TTL
        await raw.xadd("wr:copies", {"o": "g2", "r": "r", "t": "5.0", "w": "1e12", "k": b"\x01" + b"\x00" * 7})
        seen = await g1.exchange_inflight({"r": (1, 10)}, {"r": (0.5, 1.0, 100.0)})
        assert (seen["r"].reqs, seen["r"].routed_rps, seen["r"].size_weight) == (3, 0.5, 1.0)
        got = await g1.exchange_copies([])
        assert [(rid, keys) for rid, keys, _ in got] == [("r", (1,))]
        assert got[0][2] <= 5.0  # a publish time ahead of ours adds nothing to the TTL
        await raw.xadd("wr:placements", {"o": "bad", "p": b"\xff not json"})
        await raw.xadd("wr:placements", {"o": "bad2"})  # no batch
        await raw.xadd("wr:placements", {"o": "bad3", "p": '{"a": 1}'})  # not a list
        await raw.xadd("wr:placements", {"o": "g2", "p": '[[7, 3, "r", 1.5, false, ["r"]]]'})
        assert await g1.exchange_placements([]) == [[7, 3, "r", 1.5, False, ["r"]]]
    finally:
        await raw.aclose()
        await g1.close()


async def test_adapters_of_a_stopped_or_bad_gateway_are_left_out(redis_server):
    """Another gateway's LoRA adapters count while it exchanges: a field published more than
    ADAPTERS_STALE_S ago (that gateway stopped; its hash lives on until its TTL) is left out, and so
    is one that is not what this version writes (another version, or a bad writer), without losing
    the exchange or the other gateways' adapters."""
    import json
    import time

    from replica_agent.feed.base import ADAPTERS_STALE_S

    g1 = open_feed(redis_server.url, owner="g1")
    raw = aioredis.from_url(redis_server.url)
    fresh, stale = time.time(), time.time() - ADAPTERS_STALE_S - 1
    try:
        await raw.hset("wr:inflight:live", "\x00lora", json.dumps({"o": "live", "t": fresh, "a": {"r": [["x"], []]}}))
        await raw.hset("wr:inflight:gone", "\x00lora", json.dumps({"o": "gone", "t": stale, "a": {"r": [["y"], []]}}))
        await raw.hset("wr:inflight:bad1", "\x00lora", b"\xff not json")
        await raw.hset("wr:inflight:bad2", "\x00lora", json.dumps({"o": "bad2", "t": fresh, "a": {"r": ["x"]}}))
        await raw.hset("wr:inflight:bad3", "\x00lora", json.dumps({"o": "bad3", "t": fresh, "a": {"r": [[7, "w"], "z"]}}))
        await raw.hset("wr:inflight:bad4", mapping={"\x00lora": json.dumps([1, 2]), "r\x00reqs": 2})
        seen = await g1.exchange_inflight({"r": (1, 10)}, None, {"r": (["mine"], [])})
        assert (seen["r"].reqs, seen["r"].lora_running, seen["r"].lora_wanting) == (3, ("x",), ())
        assert json.loads(await raw.hget("wr:inflight:g1", "\x00lora"))["a"] == {"r": [["mine"], []]}
        await g1.exchange_inflight({}, None, {})
        assert await raw.hget("wr:inflight:g1", "\x00lora") is None  # cleared once it has none
    finally:
        await raw.aclose()
        await g1.close()


async def test_exchange_inflight_is_increments_then_read(redis_server):
    g1, g2 = open_feed(redis_server.url, owner="g1"), open_feed(redis_server.url, owner="g2")
    raw = aioredis.from_url(redis_server.url)
    try:
        await g2.incr_inflight("r", 3, 30)
        seen = await g1.exchange_inflight({"r": (1, 10), "s": (2, 0)})
        assert {k: (v.reqs, v.prefill_tokens) for k, v in seen.items()} == {"r": (4, 40), "s": (2, 0)}
        assert 0 < await raw.pttl("wr:inflight:g1") <= 60_000  # our counters' TTL is set
        seen = await g1.exchange_inflight({})  # nothing pending: a plain read (and the TTL refreshed)
        assert {k: (v.reqs, v.prefill_tokens) for k, v in seen.items()} == {"r": (4, 40), "s": (2, 0)}
        assert await g2.inflight() == seen
        await g1.exchange_inflight({"r": (-1, -10), "s": (-2, 0)})
        assert {k: (v.reqs, v.prefill_tokens) for k, v in (await g2.inflight()).items()} == {"r": (3, 30), "s": (0, 0)}
    finally:
        await raw.aclose()
        await g1.close()
        await g2.close()
