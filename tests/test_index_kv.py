"""KVIndex: leading runs per medium, liveness, speculation, purge, budget (pure, fake clock)."""
from __future__ import annotations

import random

import pytest

from gateway.index import IndexStats, KVIndex, Match
from replica_agent.feed.records import FeedEvent, Hello, LoadReport, Snapshot


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def ev(rid, kind, keys=(), medium="GPU", off=1, **kw):
    return FeedEvent(rid, off, kind, tuple(keys), medium, **kw)


@pytest.fixture
def clock():
    return Clock()


def test_leading_run_not_count(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2, 3, 5]))  # holds 1,2,3 and 5 but not 4
    ix.apply(ev("b", "stored", [2, 3, 4, 5]))  # no block 0: useless
    m = ix.match([1, 2, 3, 4, 5])
    assert m == {"a": Match(3, 3)}
    assert ix.match([]) == {}


def test_gpu_and_any_medium(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2]))
    ix.apply(ev("a", "stored", [3, 4], medium="CPU"))
    ix.apply(ev("b", "stored", [1, 2, 3, 4], medium="CPU"))
    assert ix.match([1, 2, 3, 4, 9]) == {"a": Match(2, 4), "b": Match(0, 4)}


def test_removed_and_cleared(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2, 3]))
    ix.apply(ev("b", "stored", [1, 2, 3]))
    ix.apply(ev("a", "removed", [2], off=2))
    assert ix.match([1, 2, 3]) == {"a": Match(1, 1), "b": Match(3, 3)}
    ix.apply(ev("b", "cleared", off=2))
    assert ix.match([1, 2, 3]) == {"a": Match(1, 1)}
    assert ix.stats().entries == 2 and ix.stats().entries_by_replica == {"a": 2, "b": 0}


def test_silent_replica_stops_counting_and_returns(clock):
    ix = KVIndex(stale_after_s=15, clock=clock)
    ix.apply(ev("a", "stored", [1, 2]))
    ix.apply(ev("b", "stored", [1]))
    clock.t += 10
    ix.apply(ev("b", "load", off=2, load=LoadReport(1, 0, 0.5, 0, 0, 48, 16, 0.0)))
    clock.t += 6
    assert not ix.is_live("a") and ix.is_live("b")
    assert ix.match([1, 2]) == {"b": Match(1, 1)}
    assert ix.last_load("b").running_reqs == 1 and ix.last_load("a") is None
    assert (ix.waiting_reqs("a"), ix.kv_capacity_blocks("a")) == (0, 0)  # no report yet: unknown
    ix.apply(ev("b", "load", off=3, load=LoadReport(1, 3, 0.5, 0, 0, 48, 16, 0.0)))
    assert (ix.waiting_reqs("b"), ix.kv_capacity_blocks("b")) == (3, 48)
    ix.apply(ev("a", "load", off=2, load=LoadReport(0, 0, 0.1, 0, 0, 48, 16, 0.0)))
    assert ix.match([1, 2])["a"] == Match(2, 2)


def test_speculative_entries_count_until_ttl_or_real_events(clock):
    ix = KVIndex(clock=clock)
    ix.insert_speculative("a", [1, 2, 3], ttl_s=2.0)
    assert ix.match([1, 2, 3]) == {"a": Match(3, 3)}
    clock.t += 2.5
    assert ix.match([1, 2, 3]) == {}
    ix.insert_speculative("a", [1, 2, 3], ttl_s=2.0)
    ix.apply(ev("a", "stored", [1, 2]))  # real events: 1,2 are real now
    ix.apply(ev("a", "removed", [2], off=2))  # and the engine evicted 2: the removal is authoritative
    assert ix.match([1, 2, 3]) == {"a": Match(1, 1)}
    clock.t += 2.5
    assert ix.match([1, 2, 3]) == {"a": Match(1, 1)}
    assert ix.stats().speculative_entries == 0


def test_a_late_removal_of_an_older_copy_leaves_the_speculation(clock):
    """The engine evicted blocks 2-3 (its removal still on the way), then a request for 1-3 was
    routed there: it will compute 2-3 again. The late removal must not end the speculation, or the
    index says 1 block until the new copy's store arrives (a request routed meanwhile was
    predicted short of what the engine held)."""
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2, 3]))
    ix.insert_speculative("a", [1, 2, 3], ttl_s=2.0)
    ix.apply(ev("a", "removed", [2, 3], off=2))  # of the older copy
    assert ix.match([1, 2, 3]) == {"a": Match(3, 3)}
    ix.apply(ev("a", "stored", [2, 3], off=3))  # the new copy
    clock.t += 2.5
    assert ix.match([1, 2, 3]) == {"a": Match(3, 3)}
    ix.apply(ev("a", "removed", [3], off=4))  # after its store: authoritative
    assert ix.match([1, 2, 3]) == {"a": Match(2, 2)}


def test_event_run_counts_the_feeds_entries_alone(clock):
    """event_run: the leading run from stored events only; speculative entries (which gpu_run and
    match count) do not extend it (the real-vLLM churn test tells an over-prediction made on an
    earlier request's speculative entry this way)."""
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2, 3]))
    ix.insert_speculative("a", [1, 2, 3, 4, 5], ttl_s=2.0)
    ix.apply(ev("a", "removed", [3], off=2))
    assert (ix.gpu_run("a", [1, 2, 3, 4, 5]), ix.event_run("a", [1, 2, 3, 4, 5])) == (5, 2)
    assert ix.event_run("b", [1, 2]) == 0  # unknown replica


def test_speculation_refresh_keeps_later_ttl(clock):
    ix = KVIndex(clock=clock)
    ix.insert_speculative("a", [1], ttl_s=1.0)
    clock.t += 0.5
    ix.insert_speculative("a", [1], ttl_s=1.0)
    clock.t += 0.7  # first insert expired, the second not
    assert ix.match([1]) == {"a": Match(1, 1)}


def test_purge_frees_slot_and_state(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2]))
    ix.apply(ev("a", "hello", off=2, hello=Hello(16, "m", "e1")))
    ix.insert_speculative("a", [3])
    ix.purge("a")
    assert ix.match([1, 2]) == {} and ix.match([3]) == {}
    assert ix.stats().entries == 0 and ix.stats().replicas == 0 and ix.last_load("a") is None
    ix.apply(ev("c", "stored", [1]))  # reuses the slot cleanly
    assert ix.match([1, 2]) == {"c": Match(1, 1)}


def test_snapshot_replaces_replica_state(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2, 9]))
    ix.apply(ev("b", "stored", [1]))
    ix.load_snapshot("a", Snapshot("a", 42, {"GPU": (1, 2, 3), "CPU": (4,)}))
    assert ix.match([1, 2, 3, 4]) == {"a": Match(3, 4), "b": Match(1, 1)}
    assert ix.match([9]) == {}
    assert ix.offset("a") == 42 and ix.stats().entries_by_replica["a"] == 4


def test_budget_evicts_least_recently_used_keys_tail_first(clock):
    ix = KVIndex(max_entries=100, clock=clock)
    chain_a = list(range(1, 51))
    ix.apply(ev("a", "stored", chain_a))
    ix.apply(ev("b", "stored", range(1000, 1040)))
    ix.apply(ev("a", "stored", chain_a, off=2))  # re-reported: a's chain is recent now
    ix.apply(ev("c", "stored", range(2000, 2020)))
    st = ix.stats()
    assert st.entries <= 100 and st.evictions >= 10
    # b's keys (least recently used) went first, deepest blocks first, so b keeps a prefix
    assert ix.match(chain_a)["a"] == Match(50, 50)
    mb = ix.match(list(range(1000, 1040)))["b"].gpu_blocks
    assert 0 < mb < 40
    assert ix.match(list(range(2000, 2020)))["c"] == Match(20, 20)


def test_many_replicas_random_against_reference(clock):
    rng = random.Random(7)
    ix = KVIndex(clock=clock)
    ref: dict[str, set] = {}
    keys = list(range(1, 200))
    for step in range(2000):
        rid = f"r{rng.randrange(70)}"
        ks = rng.sample(keys, rng.randrange(1, 8))
        if rng.random() < 0.6:
            ix.apply(ev(rid, "stored", ks))
            ref.setdefault(rid, set()).update(ks)
        else:
            ix.apply(ev(rid, "removed", ks))
            ref.setdefault(rid, set()).difference_update(ks)
    for _ in range(50):
        q = keys[: rng.randrange(1, 30)]
        m = ix.match(q)
        for rid, held in ref.items():
            run = 0
            for k in q:
                if k not in held:
                    break
                run += 1
            assert (m[rid].gpu_blocks if rid in m else 0) == run
    assert ix.stats().entries == sum(len(s) for s in ref.values())


def test_stats_shape(clock):
    ix = KVIndex(clock=clock)
    ix.apply(ev("a", "stored", [1, 2]))
    ix.set_feed_lag("a", 0.25)
    st = ix.stats()
    assert isinstance(st, IndexStats) and st.entries == 2 and st.bytes_estimate > 0
    assert st.feed_lag_s_by_replica == {"a": 0.25} and st.live_replicas == 1


def test_unknown_kind_raises(clock):
    with pytest.raises(ValueError):
        KVIndex(clock=clock).apply(ev("a", "bogus"))


def test_clear_is_immediate_and_sweep_is_incremental(clock):
    ix = KVIndex(clock=clock)
    ix.sweep_keys_per_call = 10  # tiny budget: the sweep spans many calls
    ix.apply(ev("a", "stored", range(1, 1001)))
    ix.apply(ev("b", "stored", range(1, 501)))
    ix.apply(ev("a", "cleared", off=2))
    assert ix.match(list(range(1, 11))) == {"b": Match(10, 10)}  # a's entries stopped counting at once
    assert ix.stats().entries_by_replica["a"] == 0
    ix.apply(ev("a", "stored", [1, 2], off=3))  # a relearns on its fresh slot
    assert ix.match([1, 2, 3]) == {"a": Match(2, 2), "b": Match(3, 3)}
    while ix.maintain(100):
        pass
    assert ix.stats().entries == 502 and not ix._zombies and ix._sweep is None
    assert ix._free_slots == [0] or 0 in ix._free_slots  # the retired slot is reusable


def test_random_ops_with_clears_snapshots_and_purges_against_reference(clock):
    rng = random.Random(11)
    ix = KVIndex(clock=clock)
    ix.sweep_keys_per_call = 7
    ref: dict[str, set] = {}
    keys = list(range(1, 300))
    for step in range(3000):
        rid = f"r{rng.randrange(12)}"
        x = rng.random()
        if x < 0.5:
            ks = rng.sample(keys, rng.randrange(1, 10))
            ix.apply(ev(rid, "stored", ks))
            ref.setdefault(rid, set()).update(ks)
        elif x < 0.85:
            ks = rng.sample(keys, rng.randrange(1, 10))
            ix.apply(ev(rid, "removed", ks))
            ref.setdefault(rid, set()).difference_update(ks)
        elif x < 0.93:
            ix.apply(ev(rid, "cleared"))
            ref[rid] = set()
        elif x < 0.97:
            snap = set(rng.sample(keys, rng.randrange(0, 50)))
            ix.load_snapshot(rid, Snapshot(rid, step, {"GPU": tuple(snap)}))
            ref[rid] = snap
        else:
            ix.purge(rid)
            ref.pop(rid, None)
        if step % 50 == 0:
            q = keys[: rng.randrange(1, 40)]
            m = ix.match(q)
            for r, held in ref.items():
                run = next((i for i, k in enumerate(q) if k not in held), len(q))
                assert (m[r].gpu_blocks if r in m else 0) == run, (step, r)
            assert set(m) <= set(ref)
            assert {r: n for r, n in ix.stats().entries_by_replica.items()} == {r: len(h) for r, h in ref.items()}
    while ix.maintain(1000):
        pass
    assert ix.stats().entries == sum(len(h) for h in ref.values())
    assert max(ix._slot_of.values()) < 24  # slots are recycled, masks stay small
