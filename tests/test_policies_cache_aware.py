"""cache_aware's properties (hypothesis): longest match wins at equal load; a queue costing more
than the prefill it saves loses to an idle cold replica; load never raises a score."""
from __future__ import annotations

import dataclasses
import random

import hypothesis.strategies as st
from hypothesis import assume, given, settings

from policies import ReplicaView, RequestView
from policies.cache_aware import MEAN_UNCACHED_EXTRA, CacheAwarePolicy

load_st = st.fixed_dictionaries(
    {
        "running_reqs": st.integers(0, 200),
        "waiting_reqs": st.integers(0, 100),
        "inflight_reqs": st.integers(0, 50),
        "inflight_prefill_tokens": st.integers(0, 50_000),
        "kv_usage": st.floats(0, 1),
    }
)


@settings(max_examples=150, deadline=None)
@given(load=load_st, matches=st.lists(st.integers(0, 100), min_size=2, max_size=8, unique=True), seed=st.integers(0, 2**32))
def test_equal_loads_longest_match_wins(load, matches, seed):
    req = RequestView(prompt_tokens=101 * 16, block_size=16)
    reps = [ReplicaView(f"r{i}", matched_blocks_gpu=m, matched_blocks_cpu=m, **load) for i, m in enumerate(matches)]
    d = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    assert d.winner == f"r{matches.index(max(matches))}"
    assert d.ranked[0].terms["matched_blocks"] == max(matches)


@settings(max_examples=150, deadline=None)
@given(matched=st.integers(1, 200), extra_tokens=st.integers(1, 100_000), seed=st.integers(0, 2**32))
def test_warm_replica_with_costly_queue_loses_to_idle_cold(matched, extra_tokens, seed):
    pol = CacheAwarePolicy()
    req = RequestView(prompt_tokens=matched * 16 + 1, block_size=16)
    p = 5e-5
    saved_s = matched * 16 * p * pol.w_cache / pol.w_queue
    backlog_tokens = int(saved_s / p) + extra_tokens  # its queue costs more than the prefill it saves
    warm = ReplicaView("warm", matched_blocks_gpu=matched, matched_blocks_cpu=matched, inflight_reqs=3, inflight_prefill_tokens=backlog_tokens)
    cold = ReplicaView("cold")
    assert pol.rank(req, [warm, cold], random.Random(seed)).winner == "cold"
    assert pol.rank(req, [cold, warm], random.Random(seed)).winner == "cold"


@settings(max_examples=300, deadline=None)
@given(
    base=load_st,
    add=load_st,
    matched=st.integers(0, 100),
    mean_tokens=st.one_of(st.none(), st.floats(0, 5000)),
    w=st.tuples(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5)),
)
def test_adding_load_never_raises_the_score(base, add, matched, mean_tokens, w):
    pol = CacheAwarePolicy(w_cache=w[0], w_queue=w[1], w_kv=w[2])
    req = RequestView(prompt_tokens=2000, block_size=16)
    extra = {MEAN_UNCACHED_EXTRA: mean_tokens} if mean_tokens is not None else {}
    v = ReplicaView("r", matched_blocks_gpu=matched, matched_blocks_cpu=matched, extra=extra, **base)
    more = {k: (min(1.0, base[k] + add[k]) if k == "kv_usage" else base[k] + add[k]) for k in base}
    v2 = dataclasses.replace(v, **more)
    assert pol.terms(req, v2)["score"] <= pol.terms(req, v)["score"] + 1e-12


def test_terms_cap_cpu_weight_and_dead_index():
    pol = CacheAwarePolicy(cpu_weight=0.5)
    req = RequestView(prompt_tokens=160, block_size=16)  # 10 blocks; at most 9 usable
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=10, matched_blocks_cpu=10))
    assert t["matched_blocks"] == 9 and t["matched_tokens"] == 144 and t["uncached_tokens"] == 16
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=2, matched_blocks_cpu=6))
    assert t["matched_tokens"] == (2 + 0.5 * 4) * 16
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=8, matched_blocks_cpu=8, index_live=False))
    assert t["matched_tokens"] == 0 and t["cache_benefit_s"] == 0
    for key in ("matched_blocks", "matched_tokens", "cache_benefit_s", "queue_penalty_s", "kv_pressure", "score"):
        assert key in t


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 10))
def test_ties_go_to_less_load_then_rng_deterministically(seed, n):
    req = RequestView(prompt_tokens=100, block_size=16)
    reps = [ReplicaView(f"r{i}") for i in range(n)]
    a = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    b = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    assert [c.replica_id for c in a.ranked] == [c.replica_id for c in b.ranked]
    assume(n > 1)
    busy = reps[:-1] + [ReplicaView(f"r{n - 1}", running_reqs=0, waiting_reqs=0)]
    assert CacheAwarePolicy().rank(req, busy, random.Random(seed)).winner in {r.replica_id for r in busy}
