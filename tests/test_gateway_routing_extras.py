"""The gateway hands cache_aware the signals its balance guard and eviction term need:
routed requests per second per replica (EWMA) and the share of each replica's KV that is indexed."""
from __future__ import annotations

import math
import random

from gateway.load import ROUTED_TAU_S, LoadTracker
from gateway.routing import build_views
from policies.base import RequestView
from policies.registry import get_policy


def test_routed_rate_is_an_ewma_that_decays():
    lt = LoadTracker()
    for i in range(10):
        lt.dispatch("a", 100, now=float(i) * 0.1)
    r_now = lt.routed_rps("a", 0.9)
    assert r_now > 0.9  # ten requests within a second: close to 1/s once scaled by tau
    later = lt.routed_rps("a", 0.9 + ROUTED_TAU_S)
    assert math.isclose(later, r_now * math.exp(-1.0), rel_tol=1e-9)
    assert lt.routed_rps("b", 5.0) == 0.0


def _views(routed, fill=None):
    ids = ["hot", "cold1", "cold2"]
    lt = LoadTracker()
    # the hot replica holds the prefix and is much busier than the others
    return build_views(
        ids,
        matches={"hot": type("M", (), {"gpu_blocks": 30, "any_blocks": 30})()},
        available={i: True for i in ids},
        live={i: True for i in ids},
        reports={i: None for i in ids},
        loads={"hot": lt.get("hot")},
        rates={i: (1e-3, 0.015) for i in ids},
        cached_frac=fill,
        routed_rps=routed,
    )


def test_views_carry_the_routed_rate_and_cache_fill():
    views = _views({"hot": 3.0}, {"hot": 0.5})
    assert views[0].routed_rps == 3.0 and views[0].kv_cached_frac == 0.5
    assert views[1].routed_rps == 0.0 and views[1].kv_cached_frac is None


def test_routed_rate_changes_the_guard_decision():
    """Same loads; the replica that receives far more than its share of the traffic loses its
    cache credit only when the routed rates say so (the guard's rate condition)."""
    pol = get_policy("cache_aware")
    req = RequestView(prompt_tokens=500, block_size=16, keys=tuple(range(31)))
    base = _views(None)
    loaded = [v.__class__(**{**{f: getattr(v, f) for f in v.__slots__}, "running_reqs": 12 if v.replica_id == "hot" else 1})
              for v in base]
    even = [v.__class__(**{**{f: getattr(v, f) for f in v.__slots__}, "routed_rps": 1.0}) for v in loaded]
    skew = [v.__class__(**{**{f: getattr(v, f) for f in v.__slots__},
                           "routed_rps": 6.0 if v.replica_id == "hot" else 0.5}) for v in loaded]
    d_even = pol.rank(req, even, random.Random(0))
    d_skew = pol.rank(req, skew, random.Random(0))
    assert d_even.winner == "hot"
    assert d_skew.winner != "hot"
