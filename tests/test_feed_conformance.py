"""One conformance suite for every feed transport (memory://, and redis:// on a real redis-server)."""
from __future__ import annotations

import asyncio
import uuid
import time

import pytest

from gateway.index import KVIndex, Match
from gateway.index_sync import IndexSync
from replica_agent.feed import FeedEvent, FeedUnavailable, LoadReport, Snapshot, open_feed


@pytest.fixture(params=["memory", "redis"])
def make_feed(request):
    """A factory of feed instances that share one backend (like several processes would)."""
    if request.param == "memory":
        url = f"memory://conf-{uuid.uuid4().hex[:8]}"
        server = None
    else:
        request.applymarker(pytest.mark.redis)
        server = request.getfixturevalue("redis_server")
        url = server.url

    def make(**opts):
        return open_feed(url, **opts)

    make.server = server
    make.kind = request.param
    return make


def drafts(*specs):
    return [FeedEvent("", 0, kind, tuple(keys)) for kind, keys in specs]


LOAD = LoadReport(2, 1, 0.5, 100.0, 40.0, 48, 16, 1.0)


async def test_offsets_are_dense_and_reads_ordered(make_feed):
    feed = make_feed()
    out = await feed.publish("r1", drafts(("stored", [1, 2]), ("removed", [2]), ("cleared", [])))
    b = out[0].offset - 1  # an empty stream starts at a time-derived base (never reused after a wipe)
    assert b > 10**15 and [e.offset for e in out] == [b + 1, b + 2, b + 3]
    assert all(e.replica_id == "r1" and e.ts > 0 for e in out)
    (r2,) = await feed.publish("r2", drafts(("stored", [9])))
    got = await feed.read({"r1": 0, "r2": 0}, block_s=0.1)
    assert [(e.replica_id, e.offset, e.kind, e.keys) for e in got if e.replica_id == "r1"] == [
        ("r1", b + 1, "stored", (1, 2)), ("r1", b + 2, "removed", (2,)), ("r1", b + 3, "cleared", ())]
    assert [e.keys for e in got if e.replica_id == "r2"] == [(9,)]
    assert await feed.read({"r1": b + 3, "r2": r2.offset}, block_s=0.05) == []
    assert [e.offset for e in await feed.read({"r1": b + 1}, block_s=0)] == [b + 2, b + 3]
    assert await feed.last_offset("r1") == b + 3 and await feed.last_offset("nobody") == 0
    assert {"r1", "r2"} <= set(await feed.replicas())
    await feed.close()


async def test_load_and_hello_roundtrip(make_feed):
    from replica_agent.feed import Hello

    feed = make_feed()
    await feed.publish("r", [FeedEvent("", 0, "load", load=LOAD), FeedEvent("", 0, "hello", hello=Hello(16, "m", "ep"))])
    a, b = await feed.read({"r": 0}, block_s=0.1)
    assert a.load == LOAD and b.hello == Hello(16, "m", "ep")
    await feed.close()


async def test_lora_slots_roundtrip_and_an_older_reader_ignores_them(make_feed):
    """An engine serving LoRA reports its slots with each load record; the record form of a load
    without them is unchanged, and a gateway that predates them (its decoder knows six fields)
    reads the rest of a record that has them."""
    import msgspec

    from replica_agent.feed.records import decode_event, encode_event

    feed = make_feed()
    with_lora = LoadReport(2, 1, 0.5, 100.0, 40.0, 48, 16, 1.0, 2, ("sql-lora", "chat-lora"), ("dyn-lora",))
    await feed.publish("r", [FeedEvent("", 0, "load", load=with_lora), FeedEvent("", 0, "load", load=LOAD)])
    a, b = await feed.read({"r": 0}, block_s=0.1)
    assert a.load == with_lora and b.load == LOAD and b.load.max_lora == 0 and b.load.lora_running == ()
    await feed.close()

    class OldWire(msgspec.Struct, array_like=True):  # the record form before LoRA slots
        kind: str
        keys: tuple[int, ...]
        medium: str
        load: tuple[int, int, float, float, float, int, int, float] | None
        hello: tuple[int, str, str] | None
        ts: float

    old = msgspec.msgpack.decode(encode_event(FeedEvent("r", 1, "load", load=with_lora)), type=OldWire)
    assert old.load == (2, 1, 0.5, 100.0, 40.0, 48, 16, 1.0)
    assert encode_event(FeedEvent("r", 1, "load", load=LOAD)) == msgspec.msgpack.encode(
        OldWire("load", (), "GPU", (2, 1, 0.5, 100.0, 40.0, 48, 16, 1.0), None, 0.0))
    assert decode_event("r", 1, msgspec.msgpack.encode(OldWire("load", (), "GPU", (2, 1, 0.5, 100.0, 40.0, 48, 16, 1.0), None, 0.0))).load == LOAD


async def test_blocking_read_wakes_on_publish(make_feed):
    reader, writer = make_feed(), make_feed()
    task = asyncio.create_task(reader.read({"r": 0}, block_s=5.0))
    await asyncio.sleep(0.1)
    await writer.publish("r", drafts(("stored", [7])))
    got = await asyncio.wait_for(task, 3.0)
    assert [e.keys for e in got] == [(7,)]
    await reader.close()
    await writer.close()


async def test_a_new_publisher_continues_the_sequence(make_feed):
    a = make_feed()
    first = await a.publish("r", drafts(("stored", [1]), ("stored", [2])))
    await a.close()
    b = make_feed()
    out = await b.publish("r", drafts(("stored", [3])))
    assert out[0].offset == first[-1].offset + 1
    await b.close()


async def test_snapshot_roundtrip(make_feed):
    feed = make_feed()
    assert await feed.read_snapshot("r") is None
    snap = Snapshot("r", 12, {"GPU": (1, 2, 2**64 - 1), "CPU": (5,)}, 3.0)
    await feed.write_snapshot(snap)
    assert await make_feed().read_snapshot("r") == snap
    assert "r" in await feed.replicas()
    await feed.close()


async def test_bounded_stream_skips_offsets_for_a_slow_reader(make_feed):
    feed = make_feed(maxlen=5)
    for i in range(60):
        await feed.publish("r", drafts(*[("stored", [i * 10 + j]) for j in range(10)]))
    got = await feed.read({"r": 0}, block_s=0.1, count=10_000)
    last = await feed.last_offset("r")
    offs = [e.offset for e in got]
    assert offs[-1] == last and len(offs) < 600  # the oldest records are gone
    assert offs == list(range(offs[0], last + 1))
    await feed.close()


async def test_liveness_expires(make_feed):
    feed = make_feed()
    await feed.set_live("r", LOAD, ttl_s=0.3)
    await feed.set_live("s", None, ttl_s=5)
    live = await feed.live()
    assert live["r"] == LOAD and "s" in live and live["s"] is None
    await asyncio.sleep(0.5)
    assert "r" not in await feed.live()
    await feed.close()


async def test_inflight_counters_are_shared(make_feed):
    g1, g2 = make_feed(), make_feed()
    await g1.incr_inflight("r", 2, 1000)
    await g2.incr_inflight("r", 1, 500)
    await g2.incr_inflight("q", 1, 10)
    seen = await g1.inflight()
    assert (seen["r"].reqs, seen["r"].prefill_tokens) == (3, 1500) and seen["q"].reqs == 1
    await g1.incr_inflight("r", -2, -1000)
    assert (await g2.inflight())["r"].reqs == 1
    # the exchange a gateway makes every poll: its changes in, everyone's counts out, in one call
    seen = await g1.exchange_inflight({"r": (4, 40), "q": (0, 0)})
    assert (seen["r"].reqs, seen["r"].prefill_tokens) == (5, 540) and seen["q"].reqs == 1
    assert (await g2.exchange_inflight({}))["r"].reqs == 5
    # the open counter (sent, not finished: slots held), beside the other two
    await g2.incr_inflight("r", 0, 0, 3)
    seen = await g1.exchange_inflight({"r": (-1, -10, 2)})
    assert (seen["r"].reqs, seen["r"].prefill_tokens, seen["r"].open_reqs) == (4, 530, 5)
    assert seen["q"].open_reqs == 0
    await g1.close()
    await g2.close()


async def test_dispatch_gauges_replace_and_sum(make_feed):
    """Each process's gauges (routed rate, size weight, weight x mean) replace its previous ones;
    the read sums every process's; a replica it no longer publishes drops out of its share."""
    g1, g2 = make_feed(), make_feed()
    await g1.exchange_inflight({}, {"r": (1.5, 2.0, 200.0), "q": (0.5, 1.0, 30.0)})
    seen = await g2.exchange_inflight({"r": (1, 10)}, {"r": (0.25, 1.0, 3000.0)})
    assert (seen["r"].routed_rps, seen["r"].size_weight, seen["r"].size_tokens) == (1.75, 3.0, 3200.0)
    assert seen["r"].reqs == 1 and seen["q"].routed_rps == 0.5
    seen = await g1.exchange_inflight({}, {"r": (1.0, 2.0, 100.0)})  # replaced, not added; q dropped
    assert (seen["r"].routed_rps, seen["r"].size_tokens) == (1.25, 3100.0)
    assert "q" not in seen or seen["q"].routed_rps == 0.0
    seen = await g1.exchange_inflight({})  # an exchange without gauges leaves ours as they were
    assert seen["r"].routed_rps == 1.25
    await g1.close()
    await g2.close()


async def test_lora_adapters_replace_and_reach_the_other_processes(make_feed):
    """Each process's adapters per replica (generating, no first token yet) replace its previous
    ones; a read merges the other processes' (an adapter generating anywhere is running, not
    wanting), never the reader's own; an exchange without them leaves ours; an empty map clears."""
    g1, g2, g3 = make_feed(), make_feed(), make_feed()
    await g1.exchange_inflight({}, None, {"r": (["x"], ["y"]), "q": ([], ["x"])})
    await g2.exchange_inflight({}, None, {"r": ([], ["x", "z"])})
    seen = await g3.exchange_inflight({"r": (1, 10)}, None, {})
    assert (seen["r"].lora_running, seen["r"].lora_wanting) == (("x",), ("y", "z"))
    assert (seen["q"].lora_running, seen["q"].lora_wanting) == ((), ("x",))
    assert seen["r"].reqs == 1
    seen = await g1.inflight()  # g2's only
    assert (seen["r"].lora_running, seen["r"].lora_wanting) == ((), ("x", "z"))
    assert "q" not in seen or seen["q"].lora_wanting == ()
    await g2.exchange_inflight({})  # no adapters given: g2's stay
    assert (await g3.inflight())["r"].lora_wanting == ("y", "z")
    await g2.exchange_inflight({}, None, {})  # none any more
    await g1.exchange_inflight({}, None, {"r": (["y"], [])})  # replaced: q and x dropped
    seen = await g3.inflight()
    assert (seen["r"].lora_running, seen["r"].lora_wanting) == (("y",), ())
    assert "q" not in seen or seen["q"].lora_wanting == ()
    for g in (g1, g2, g3):
        await g.close()


async def test_copies_in_progress_reach_every_other_process_once(make_feed):
    g1, g2, g3 = make_feed(), make_feed(), make_feed()
    big = (2**64 - 1, 0, 12345678901234567890)  # block keys are unsigned 64-bit
    assert await g1.exchange_copies([("r", big, 5.0), ("s", (1, 2), 0.05)]) == []  # none of its own
    await asyncio.sleep(0.1)
    got = await g2.exchange_copies([("q", (7,), 5.0)])
    assert [(rid, keys) for rid, keys, _ in got] == [("r", big)]  # s's expired on the way
    assert 4.5 < got[0][2] < 5.0  # the TTL left
    assert await g2.exchange_copies([]) == []  # each entry once
    got = await g3.exchange_copies([])
    assert sorted(rid for rid, _, _ in got) == ["q", "r"]
    assert [rid for rid, _, _ in await g1.exchange_copies([])] == ["q"]
    for g in (g1, g2, g3):
        await g.close()


async def test_placements_reach_every_other_process_once(make_feed):
    """A process's batch of placement records (JSON-able lists, 64-bit keys intact) reaches every
    other process once, in order, never its own; an empty batch publishes nothing."""
    g1, g2, g3 = make_feed(), make_feed(), make_feed()
    a = [2**64 - 1, 188, "r0", 412.5, True, ["r0", "r2"]]
    b = [7, 3, "r1", 0.0, False, []]
    assert await g1.exchange_placements([a, b]) == []  # none of its own
    assert await g2.exchange_placements([]) == [a, b]
    assert await g2.exchange_placements([]) == []  # each once
    assert await g2.exchange_placements([b]) == []
    assert await g3.exchange_placements([]) == [a, b, b]
    assert await g1.exchange_placements([]) == [b]
    for g in (g1, g2, g3):
        await g.close()


async def _until(pred, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_late_consumer_rebuilds_from_snapshot(make_feed):
    pub = make_feed(maxlen=5)
    await pub.publish("r", drafts(("stored", range(1, 101))))
    for i in range(30):  # lots of history that a late consumer must not need
        await pub.publish("r", drafts(("stored", [1000 + i]), ("removed", [1000 + i])))
    last = await pub.last_offset("r")
    await pub.write_snapshot(Snapshot("r", last, {"GPU": tuple(range(1, 101))}))
    await pub.publish("r", drafts(("stored", [101, 102])))
    index = KVIndex()
    sync = IndexSync(make_feed(), index, block_s=0.05, discover_every_s=0.1)
    task = asyncio.create_task(sync.run())
    try:
        await _until(lambda: index.match(list(range(1, 103))).get("r") == Match(102, 102))
        assert sync.stats["rebuilds"] >= 1 and sync.position("r") == last + 1
        assert 0.0 <= sync.lag_s("r") < 5.0 and index.stats().feed_lag_s_by_replica["r"] == sync.lag_s("r")
        # falling behind: a gap in offsets makes it rebuild from the (newer) snapshot
        await pub.publish("r", drafts(("removed", [1])))
        await _until(lambda: index.match([1, 2]) == {})
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_consumer_rebuilds_when_it_missed_trimmed_records(make_feed):
    pub = make_feed(maxlen=5)
    await pub.publish("r", drafts(("stored", [1, 2, 3])))
    index = KVIndex()
    sync = IndexSync(make_feed(), index, block_s=0.05, discover_every_s=0.1)
    await sync.step()
    await sync.step()
    assert index.match([1, 2, 3])["r"] == Match(3, 3)
    # the consumer sleeps while 500 records pass: most are trimmed away
    for i in range(500):
        await pub.publish("r", drafts(("stored", [100 + i])))
    await pub.publish("r", drafts(("removed", [3])))
    last = await pub.last_offset("r")
    await pub.write_snapshot(Snapshot("r", last, {"GPU": (1, 2, *range(100, 600))}))
    for _ in range(5):
        await sync.step()
    assert sync.stats["gaps"] >= 1 and sync.stats["rebuilds"] >= 2
    assert index.match([1, 2, 3])["r"] == Match(2, 2)
    assert index.match(list(range(100, 600)))["r"] == Match(500, 500)


async def test_wiped_feed_detected_and_consumer_survives(make_feed):
    pub = make_feed()
    await pub.publish("r", drafts(("stored", [1, 2])))
    index = KVIndex()
    sync = IndexSync(make_feed(), index, block_s=0.05, discover_every_s=0.1, check_every_s=0.1)
    task = asyncio.create_task(sync.run())
    try:
        await _until(lambda: "r" in index.match([1, 2]))
        if make_feed.kind == "redis":
            make_feed.server.stop()
            with pytest.raises(FeedUnavailable):
                await pub.publish("r", drafts(("stored", [3])))
            await asyncio.sleep(0.3)
            make_feed.server.start()
        else:
            pub.clear()
        # a new publisher (the agent restarted too) starts over at offset 1 with a full state
        fresh = make_feed()
        out = await fresh.publish("r", drafts(("cleared", []), ("stored", [5, 6])))
        await fresh.write_snapshot(Snapshot("r", out[-1].offset, {"GPU": (5, 6)}))
        await _until(lambda: index.match([5, 6]).get("r") == Match(2, 2) and index.match([1]) == {}, 10)
        assert sync.stats["wiped"] + sync.stats["rebuilds"] >= 2
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_consumer_survives_bad_records(make_feed):
    pub = make_feed()
    await pub.publish("r", drafts(("stored", [1])))
    await pub.publish("r", [FeedEvent("", 0, "bogus-kind", (9,))])  # a newer writer's kind, or corruption
    if make_feed.kind == "redis":
        import redis.asyncio as aioredis

        raw = aioredis.from_url(make_feed.server.url)
        last = await pub.last_offset("r")
        await raw.xadd("wr:r:events", {"d": b"\xc1 not msgpack"}, id=f"{last + 1}-0")
        await raw.aclose()
    await pub.publish("r", drafts(("stored", [2])))  # the publisher steps over the foreign entry
    index = KVIndex()
    sync = IndexSync(make_feed(), index, block_s=0.05)
    for _ in range(4):
        await sync.step()
    assert index.match([1, 2])["r"] == Match(2, 2)
    assert sync.stats["bad_records"] == (2 if make_feed.kind == "redis" else 1)


async def test_a_request_about_to_be_routed_ends_the_coalescing_wait(make_feed):
    """Reads are coalesced (at most one per `min_read_interval_s` while caught up); `wake()` (called
    by the pipeline before it tokenizes) ends the wait, so a removal published since the last read
    is in the index before the request's match. No sooner than `wake_floor_s` after the last read."""
    pub = make_feed()
    await pub.publish("r", drafts(("stored", [1, 2, 3])))
    index = KVIndex()
    sync = IndexSync(make_feed(), index, block_s=0.05, min_read_interval_s=5.0, wake_floor_s=0.3)
    task = asyncio.create_task(sync.run())
    try:
        await _until(lambda: index.match([1, 2, 3]).get("r") == Match(3, 3))
        await pub.publish("r", drafts(("removed", [3])))
        await asyncio.sleep(0.5)
        assert index.match([1, 2, 3])["r"] == Match(3, 3), "coalescing: the removal waits for the next read"
        t0 = time.monotonic()
        sync.wake()
        await _until(lambda: index.match([1, 2, 3])["r"] == Match(2, 2), 2.0)
        assert time.monotonic() - t0 < 1.0  # not the 5 s interval
        # a wake right after a read waits out the floor, then reads
        await pub.publish("r", drafts(("removed", [2])))
        sync.wake()
        await asyncio.sleep(0.1)
        assert index.match([1, 2])["r"] == Match(2, 2), "within the floor"
        await _until(lambda: index.match([1, 2])["r"] == Match(1, 1), 2.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
