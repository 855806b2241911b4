"""Conformance suite: every registered policy keeps the rules of policies/base.py (hypothesis)."""
from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from policies import Decision, Policy, ReplicaView, RequestView
from policies.registry import POLICY_NAMES, get_policy

replica_st = st.builds(
    ReplicaView,
    replica_id=st.just("x"),
    healthy=st.booleans(),
    matched_blocks_gpu=st.integers(0, 64),
    matched_blocks_cpu=st.integers(0, 64),
    index_live=st.booleans(),
    running_reqs=st.integers(0, 300),
    waiting_reqs=st.integers(0, 300),
    inflight_reqs=st.integers(0, 50),
    inflight_prefill_tokens=st.integers(0, 100_000),
    kv_usage=st.floats(0, 1),
    prefill_s_per_token=st.floats(1e-6, 1e-3),
    decode_step_s=st.floats(1e-3, 0.2),
)


@st.composite
def scenario(draw):
    reps = draw(st.lists(replica_st, min_size=0, max_size=12))
    reps = [ReplicaView(**{**{f: getattr(r, f) for f in r.__slots__}, "replica_id": f"r{i}"}) for i, r in enumerate(reps)]
    n_keys = draw(st.integers(0, 64))
    req = RequestView(prompt_tokens=n_keys * 16 + draw(st.integers(0, 15)), block_size=16, keys=tuple(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n_keys, max_size=n_keys))))
    return req, reps, draw(st.integers(0, 2**32))


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=40, deadline=None)
@given(sc=scenario())
def test_policy_conformance(name, sc):
    req, reps, seed = sc
    pol = get_policy(name)
    assert isinstance(pol, Policy)
    d = pol.rank(req, reps, random.Random(seed))
    assert isinstance(d, Decision) and d.policy == name
    healthy = {r.replica_id for r in reps if r.healthy}
    ids = [c.replica_id for c in d.ranked]
    assert sorted(ids) == sorted(healthy)  # each healthy replica exactly once, never an unhealthy one
    if not healthy:
        assert d.ranked == () and d.winner is None
    for c in d.ranked:
        assert "score" in c.terms and c.terms["score"] == c.score
    assert [c.score for c in d.ranked] == sorted((c.score for c in d.ranked), reverse=True)
    # deterministic for an rng seed (fresh instances: stateful policies start equal)
    again = get_policy(name).rank(req, reps, random.Random(seed))
    assert [c.replica_id for c in again.ranked] == ids


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_rank_leaves_inputs_untouched_and_sequences_repeat(name):
    reps = [ReplicaView(f"r{i}", running_reqs=i, matched_blocks_gpu=i) for i in range(5)]
    req = RequestView(prompt_tokens=200, block_size=16, keys=tuple(range(12)))
    a, b = get_policy(name), get_policy(name)
    ra, rb = random.Random(7), random.Random(7)
    seq_a = [a.rank(req, reps, ra).winner for _ in range(20)]
    seq_b = [b.rank(req, reps, rb).winner for _ in range(20)]
    assert seq_a == seq_b
    assert reps[3].running_reqs == 3


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ranking_again_before_placing_changes_no_decision(name):
    """Flow control ranks a held request again at release and /debug/route ranks without sending:
    a policy's state moves with `placed` only, so each decision is the same whether the request
    was ranked once or three times before it was placed (fresh rng per call: same seed, same draw)."""
    reps = [ReplicaView(f"r{i}", running_reqs=i % 3, matched_blocks_gpu=(5 * i) % 13) for i in range(5)]  # up to 12 of 12: cache_plan plans
    once, thrice = get_policy(name), get_policy(name)
    for i in range(30):
        req = RequestView(prompt_tokens=200, block_size=16, keys=tuple(range(i % 4, i % 4 + 12)))
        a = once.rank(req, reps, random.Random(i))
        for _ in range(2):
            thrice.rank(req, reps, random.Random(i))
        b = thrice.rank(req, reps, random.Random(i))
        assert [c.replica_id for c in a.ranked] == [c.replica_id for c in b.ranked], (name, i)
        once.placed(req, a)
        thrice.placed(req, b)


def test_round_robin_takes_one_turn_per_request_placed():
    pol, reps = get_policy("round_robin"), [ReplicaView(f"r{i}") for i in range(3)]
    req = RequestView(prompt_tokens=32, block_size=16, keys=(1, 2))
    winners = []
    for _ in range(6):
        d = pol.rank(req, reps, random.Random(0))
        winners.append(d.winner)
        pol.placed(req, d)
    assert winners == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_registry_errors_say_what_is_accepted():
    with pytest.raises(ValueError, match="cache_aware"):
        get_policy("nope")
    with pytest.raises(TypeError, match="cache_aware"):
        get_policy("cache_aware", w_bogus=1)
    with pytest.raises(ValueError):
        get_policy("cache_aware", cpu_weight=2.0)


def test_prefix_hash_is_sticky_and_falls_to_next_on_the_ring():
    reps = [ReplicaView(f"r{i}") for i in range(8)]
    pol = get_policy("prefix_hash", prefix_blocks=4)
    req = RequestView(prompt_tokens=160, block_size=16, keys=tuple(range(100, 110)))
    order = [c.replica_id for c in pol.rank(req, reps, random.Random(0)).ranked]
    assert all(pol.rank(req, reps, random.Random(s)).winner == order[0] for s in range(5))
    sick = [ReplicaView(r.replica_id, healthy=r.replica_id != order[0]) for r in reps]
    assert pol.rank(req, sick, random.Random(0)).winner == order[1]
    # only the first prefix_blocks keys matter
    req2 = RequestView(prompt_tokens=160, block_size=16, keys=tuple(range(100, 104)) + (1, 2, 3))
    assert pol.rank(req2, reps, random.Random(0)).winner == order[0]


def test_policies_import_no_io():
    """policies/ imports no I/O or asyncio module (pure cores, I/O at the edges)."""
    import policies.registry
    import ast
    from pathlib import Path

    for path in Path(policies.registry.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"aiohttp", "asyncio", "zmq", "redis", "socket", "httpx"}, path
