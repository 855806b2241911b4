"""loadtests/vtime_keepalive.py: the keep-alive probe keeps the plan's long roots on the replicas
they went to, refreshes one when it has been idle, within a KV budget, and so stops the engines'
LRU from evicting cold documents between their requests on the busy regime."""
from __future__ import annotations

import pytest

from loadtests.vtime import simulate
from loadtests.vtime_keepalive import KEEPALIVE, KeepAlive, Retainer

BS = 16


def _doc(n, blocks=100, tail=6):
    """A request's keys: a document's `blocks` then its own question's `tail`."""
    return list(range(n * 10_000, n * 10_000 + blocks)) + list(range(n * 10_000 + 5_000, n * 10_000 + 5_000 + tail))


def test_an_idle_root_is_refreshed_with_one_token_past_its_blocks():
    ret = Retainer(KeepAlive(idle_s=2.0, min_blocks=64), 2, num_blocks=1000, block_size=BS)
    keys = _doc(1)
    ret.used(1, keys, 100, t=0.0)
    held = lambda ri, prefix: len(prefix)  # noqa: E731 - the index shows every block there
    assert ret.due(1.5, held) == []  # used 1.5 s ago: not idle yet
    out = ret.due(2.5, held)
    assert len(out) == 1
    r = out[0]
    assert r.rep == 1 and r.keys == keys[:100] and r.prompt == 100 * BS + 1 and r.max_out == 1 and r.pace is KEEPALIVE
    assert ret.due(3.0, held) == []  # the refresh counts as a use
    ret.used(1, keys, 100, t=4.0)
    assert ret.due(5.9, held) == [] and len(ret.due(6.1, held)) == 1


def test_short_roots_and_unplanned_requests_are_not_kept():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64), 1, num_blocks=1000, block_size=BS)
    ret.used(0, _doc(1, blocks=43), 43, t=0.0)  # a 700-token system prompt
    ret.used(0, _doc(2), 0, t=0.0)  # unplanned (no root)
    assert ret.due(5.0, lambda ri, p: len(p)) == []


def test_a_refresh_is_cut_to_what_the_index_still_holds_and_a_lost_root_is_dropped():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64), 1, num_blocks=1000, block_size=BS)
    keys = _doc(1)
    ret.used(0, keys, 100, t=0.0)
    (r,) = ret.due(2.0, lambda ri, p: 80)  # the LRU took its last 20 blocks (a request's tail goes first)
    assert r.keys == keys[:80]
    assert ret.due(4.0, lambda ri, p: 10) == []  # under min_blocks: nothing worth keeping is left
    assert ret.kept[0] == {}


def test_the_budget_keeps_the_busiest_roots_and_forgets_unused_ones():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64, forget_s=30.0, kv_frac=0.5), 1, num_blocks=400, block_size=BS)
    hot, cold = _doc(1), _doc(2)
    for t in (0.0, 0.5, 1.0):
        ret.used(0, hot, 100, t)
    ret.used(0, cold, 100, 1.0)
    ret.used(0, _doc(3), 100, 1.0)
    out = ret.due(3.0, lambda ri, p: len(p))  # room for two of the three (200 of 400 blocks)
    assert [r.keys[0] for r in out] == [hot[0], cold[0]]  # the busiest, then the first of two equals
    assert len(ret.due(40.0, lambda ri, p: len(p))) == 0 and ret.kept[0] == {}  # 30 s unused: forgotten


def test_keep_alive_stops_the_busy_regime_evicting_cold_documents():
    """busy's Zipf case, seed 0: without refreshes the engines' LRU evicts cold documents between
    their requests (long misses no replica could serve warm); with them nearly none is."""
    from loadtests.vtime_regimes import REGIMES, _policy, build_case

    reg = REGIMES["busy"]
    c = build_case("busy", "shared_docs_zipf", 0)

    def run(ka):
        return simulate(c.workload, _policy("cache_plan", c.workload, c.keys, reg.replicas), reg.replicas, reg.params,
                        seed=0, keys=c.keys, warmup=c.warmup, keep_alive=ka)

    plain, kept = run(None), run(KeepAlive(idle_s=2.0))
    assert plain.refreshes == 0 and kept.refreshes > 0
    assert plain.misses_evicted >= 5
    assert kept.misses_evicted <= plain.misses_evicted // 3
    assert kept.completed == plain.completed and kept.unfinished == 0
    assert kept.summary()["hit_ratio"] > plain.summary()["hit_ratio"]


def test_keep_alive_rejects_bad_parameters():
    for kw in ({"idle_s": 0}, {"min_blocks": 0}, {"forget_s": 0}, {"kv_frac": 0}, {"kv_frac": 1.5}):
        with pytest.raises(ValueError):
            KeepAlive(**kw)


def test_report_takes_keep_alive_only_with_a_regime(capsys):
    from loadtests.vtime_report import main

    for argv in (["--keep-alive", "2"], ["--regime", "busy", "--keep-alive", "-1"],
                 ["--regime", "busy", "--keep-alive", "2", "--keep-alive-kv-frac", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "--keep-alive" in capsys.readouterr().err
