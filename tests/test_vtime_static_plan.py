"""The virtual-time static plan (loadtests/vtime_peers.py): how documents are packed onto replicas,
and the blind pre-warm (`static_plan_blind`), placed without knowing popularity before the plan
is made from the shares."""
from __future__ import annotations

import random

from loadtests.vtime_peers import StaticPlan, pack_documents
from policies.base import ReplicaView, RequestView

SHARES = {"a": 40, "b": 20, "c": 15, "d": 10, "e": 8, "f": 7}


def _loads(plan: dict, count: dict, n: int) -> list[float]:
    load = [0.0] * n
    for d, hs in plan.items():
        for h in hs:
            load[int(h[1:])] += count[d] / len(hs)
    return load


def test_the_hottest_document_gets_two_holders_and_the_rest_one_each_packed_by_share():
    plan = pack_documents(SHARES, 3)
    assert len(plan["a"]) == 2 and len(set(plan["a"])) == 2
    assert all(len(plan[d]) == 1 for d in SHARES if d != "a")
    load = _loads(plan, SHARES, 3)
    assert max(load) - min(load) <= 10  # greedy by share: within the smallest document's count or so


def test_a_document_stays_where_it_is_while_its_replica_is_within_the_tolerance_and_moves_past_it():
    # everything on r0 now: with no tolerance only what fits under the mean stays there
    stay = {d: ["r0"] for d in SHARES}
    tight = pack_documents(SHARES, 3, stay=stay, stay_tol=0.0)
    loose = pack_documents(SHARES, 3, stay=stay, stay_tol=1.0)
    moved = lambda plan: sum(1 for d in SHARES if plan[d] != ["r0"] and "r0" not in plan[d])  # noqa: E731
    assert moved(loose) < moved(tight)
    mean = sum(SHARES.values()) / 3
    assert max(_loads(loose, SHARES, 3)) <= 2.0 * mean + 1e-9
    assert max(_loads(tight, SHARES, 3)) < max(_loads(loose, SHARES, 3))


def test_no_replica_is_planned_more_blocks_than_its_budget_while_another_has_room():
    sizes = {d: 100 for d in SHARES}
    # 7 copies of 100 blocks (the hottest has two) in 3 x 300: every one fits, so none goes past
    # its budget, the stays on r1 included (without the budget r1 keeps 600)
    plan = pack_documents(SHARES, 3, stay={d: ["r1"] for d in SHARES}, stay_tol=10.0, sizes=sizes, budget=300)
    per = [sum(100 for d in SHARES for h in plan[d] if h == f"r{r}") for r in range(3)]
    assert max(per) <= 300 and per[1] == 300


def _views(n: int, match: dict | None = None) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", matched_blocks_gpu=(match or {}).get(f"r{i}", 0),
                        matched_blocks_cpu=(match or {}).get(f"r{i}", 0), kv_capacity_blocks=1000) for i in range(n)]


def _req(doc: int) -> RequestView:
    keys = tuple(range(doc * 1000, doc * 1000 + 8))  # the document's key at probe block 2 is unique
    return RequestView(prompt_tokens=8 * 16, block_size=16, keys=keys)


def test_the_blind_pre_warm_places_documents_in_turn_and_the_plan_keeps_them_within_the_tolerance():
    docs = [0, 1, 2, 3, 4, 5]
    count = {_req(d).keys[2]: c for d, c in zip(docs, (40, 20, 15, 10, 8, 7))}
    sp = StaticPlan({}, 2, {k: 8 for k in count}, blind_prewarm=(count, 0.25))
    rng = random.Random(0)
    first = [sp.rank(_req(d), _views(3), rng).ranked[0].replica_id for d in docs]
    assert first == ["r0", "r1", "r2", "r0", "r1", "r2"]  # in turn: popularity is not known yet
    assert sp.plan == {}
    # the measured stream starts: its first request makes the plan from the shares
    sp.rank(_req(0), _views(3, {"r0": 8}), rng)
    assert set(sp.plan) == set(count)
    prewarm = dict(zip((_req(d).keys[2] for d in docs), first))
    stayed = [k for k in count if prewarm[k] in sp.plan[k]]
    assert len(stayed) >= 3  # most documents keep the pre-warm's replica
    assert sp.plan == pack_documents(count, 3, stay={k: [prewarm[k]] for k in count}, stay_tol=0.25,
                                     sizes={k: 8 for k in count}, budget=850)
    # a document's requests then go to its planned holders
    k3 = _req(3).keys[2]
    assert sp.rank(_req(3), _views(3), rng).ranked[0].replica_id in sp.plan[k3]


def test_the_report_refuses_a_stay_tolerance_that_is_not_a_share():
    import pytest

    from loadtests.vtime_report import main

    for bad in ("static_plan_blind:x", "static_plan_blind:-1"):
        with pytest.raises(SystemExit) as e:
            main(["--regime", "busy", "--seeds", "0", "--workload", "shared_docs_zipf", "--policy", bad])
        assert e.value.code == 2
