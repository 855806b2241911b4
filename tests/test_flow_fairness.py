"""The flow-control ordering core (gateway.fairness), property-based: weighted fair shares between
tenants (the start-time fair queuing bound, over every stretch two tenants are both held), no
credit banked while idle, priority classes within a tenant, FIFO within a class, leaving changes
nothing for the others, expiry, and fair shares held across two queues that credit each other."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fairness import FairQueue

TENANTS = ("a", "b", "c", "d")
WEIGHTS = st.sampled_from((0.5, 1.0, 2.0, 3.0))

# An op: ("push", tenant, cls, cost) | ("pop",)
push_op = st.tuples(st.just("push"), st.sampled_from(TENANTS), st.integers(0, 2), st.sampled_from((1.0, 2.0, 3.0)))
ops_st = st.lists(st.one_of(push_op, st.just(("pop",))), min_size=1, max_size=120)


def _run(ops, weights, *, n_classes=3):
    """Apply ops; at each pop record (entry, the held entries just before it, served before)."""
    q = FairQueue(n_classes)
    log = []
    now = 0.0
    for op in ops:
        now += 1.0
        if op[0] == "push":
            _, t, c, cost = op
            q.push(t, (t, c, now), now=now, cls=c, weight=weights[t], cost=cost)
        else:
            held = list(q.entries())
            served = {t: q.served(t) for t in TENANTS}
            e = q.pop()
            assert (e is None) == (not held)  # work conserving
            if e is not None:
                log.append((e, held, served))
    return q, log


@settings(max_examples=300, deadline=None)
@given(ops_st, st.fixed_dictionaries({t: WEIGHTS for t in TENANTS}))
def test_fifo_within_a_class_and_classes_first_within_a_tenant(ops, weights):
    _, log = _run(ops, weights)
    for e, held, _ in log:
        mine = [h for h in held if h.tenant == e.tenant]
        assert all(h.cls >= e.cls for h in mine), "a higher class of the same tenant was held"
        same = [h for h in mine if h.cls == e.cls]
        assert e.seq == min(h.seq for h in same), "not the oldest of its class"


@settings(max_examples=300, deadline=None)
@given(ops_st, st.fixed_dictionaries({t: WEIGHTS for t in TENANTS}))
def test_every_request_comes_out_once(ops, weights):
    q, log = _run(ops, weights)
    popped = [e.seq for e, _, _ in log]
    assert len(popped) == len(set(popped))
    pushes = sum(1 for o in ops if o[0] == "push")
    assert len(popped) + len(q) == pushes


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({t: WEIGHTS for t in TENANTS}),
       st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(0, 2), st.sampled_from((1.0, 2.0, 3.0))), min_size=0, max_size=60),
       st.lists(st.integers(0, 3), min_size=10, max_size=80))
def test_weighted_shares_within_one_request_over_every_stretch_both_are_held(weights, extra, pattern):
    """Start-time fair queuing's bound: for tenants i, j held at every release of a stretch,
    |served_i/w_i - served_j/w_j| within the stretch <= c_max/w_i + c_max/w_j. Tenants a and b
    start with deep backlogs; c and d come and go (pushes interleaved with the pops by `pattern`)."""
    c_max = 3.0
    q = FairQueue(3)
    now = 0.0
    for i in range(40):
        for t in ("a", "b"):
            q.push(t, None, now=now, cls=i % 3, weight=weights[t], cost=(1.0, 2.0, 3.0)[i % 3])
    extra = list(extra)
    releases = []  # (entry, set of tenants held just before)
    for k in pattern:
        for _ in range(k):
            if extra:
                t, c, cost = extra.pop()
                now += 1
                q.push(t, None, now=now, cls=c, weight=weights[t], cost=cost)
        held = {e.tenant for e in q.entries()}
        e = q.pop()
        if e is None:
            break
        releases.append((e, held))
    for i, j in (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")):
        bound = c_max / weights[i] + c_max / weights[j] + 1e-9
        for start in range(len(releases)):
            si = sj = 0.0
            for e, held in releases[start:]:
                if i not in held or j not in held:
                    break
                if e.tenant == i:
                    si += e.cost
                elif e.tenant == j:
                    sj += e.cost
                assert abs(si / weights[i] - sj / weights[j]) <= bound, (i, j, start)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), WEIGHTS, WEIGHTS)
def test_no_credit_is_banked_while_idle(alone, wa, wb):
    """a and b share for a while, then a goes away and b is served `alone` requests; then a comes
    back with a backlog: from then on the two share by weight at once (a does not get `alone`
    requests in a row to catch up)."""
    q = FairQueue(1)
    for n in range(3):
        q.push("a", n, now=0.0, weight=wa)
    for n in range(alone + 53):
        q.push("b", n, now=0.0, weight=wb)
    while q.tenant_len("a"):
        q.pop()
    for _ in range(alone):
        assert q.pop().tenant == "b"
    for n in range(50):
        q.push("a", n, now=1.0, weight=wa)
    sa = sb = 0.0
    for _ in range(40):
        e = q.pop()
        sa += e.tenant == "a"
        sb += e.tenant == "b"
        assert abs(sa / wa - sb / wb) <= 1 / wa + 1 / wb + 1e-9


@settings(max_examples=300, deadline=None)
@given(ops_st, st.fixed_dictionaries({t: WEIGHTS for t in TENANTS}), st.data())
def test_a_request_that_leaves_changes_nothing_for_the_others(ops, weights, data):
    """Queue A holds request x and drops it (its client left) before x would come out; queue B
    never saw x. Everything else comes out of both in the same order."""
    pushes = [i for i, o in enumerate(ops) if o[0] == "push"]
    if not pushes:
        return
    x_at = data.draw(st.sampled_from(pushes))
    leave_at = data.draw(st.integers(x_at + 1, len(ops)))

    def run(with_x: bool):
        q = FairQueue(3)
        out, x = [], None
        for i, op in enumerate(ops + [("pop",)] * 130):
            if i == leave_at and x is not None and with_x:
                q.remove(x)
                x = None
            if op[0] == "push":
                if i == x_at and not with_x:
                    continue
                e = q.push(op[1], i, now=float(i), cls=op[2], weight=weights[op[1]], cost=op[3])
                if i == x_at:
                    x = e
            else:
                e = q.pop()
                if e is not None:
                    if e is x:
                        return None  # x came out before it left: not this case
                    out.append(e.payload)
        return out

    a = run(True)
    if a is not None:
        assert a == run(False)


@settings(max_examples=200, deadline=None)
@given(ops_st, st.fixed_dictionaries({t: WEIGHTS for t in TENANTS}), st.floats(1.0, 40.0))
def test_expiry_takes_exactly_the_requests_past_their_wait(ops, weights, max_wait):
    q, _ = _run(ops, weights)
    now = float(len(ops) + 1)
    held = {e.seq: e for e in q.entries()}
    gone = q.expired(now, max_wait)
    assert {e.seq for e in gone} == {s for s, e in held.items() if e.t_queued <= now - max_wait}
    assert all(e.t_queued > now - max_wait for e in q.entries())
    assert [e.seq for e in gone] == sorted(e.seq for e in gone)
    assert len(q) == len(held) - len(gone)


def test_weights_set_the_long_run_shares():
    q = FairQueue(1)
    for n in range(300):
        q.push("big", n, now=0.0, weight=3.0)
        q.push("small", n, now=0.0, weight=1.0)
    first = [q.pop().tenant for _ in range(200)]
    assert abs(first.count("big") - 150) <= 1 and first.count("big") + first.count("small") == 200


def test_a_weight_change_keeps_the_tenants_place():
    q = FairQueue(1)
    for n in range(10):
        q.push("a", n, now=0.0, weight=1.0)
        q.push("b", n, now=0.0, weight=1.0)
    for _ in range(6):
        q.pop()
    before = q.tag("a")
    q.push("a", "x", now=1.0, weight=4.0)
    assert q.tag("a") == pytest.approx(before)


@settings(max_examples=100, deadline=None)
@given(WEIGHTS, WEIGHTS, st.integers(1, 8))
def test_two_gateways_that_credit_each_other_share_by_weight(wx, wy, every):
    """Tenant x sends to both gateways, y only to gateway 1; each gateway releases one request per
    round. Alone, gateway 1 would split its releases and x would get 3/4 of the pool. With each
    gateway crediting the other's service every `every` rounds, the pool's shares follow the
    weights, within the staleness of the exchange."""
    g1, g2 = FairQueue(1), FairQueue(1)
    for n in range(2000):
        g1.push("x", n, now=0.0, weight=wx)
        g1.push("y", n, now=0.0, weight=wy)
        g2.push("x", n, now=0.0, weight=wx)
    served = {"x": 0.0, "y": 0.0}
    unsent = [{"x": 0.0, "y": 0.0}, {"x": 0.0, "y": 0.0}]
    rounds = 600
    for r in range(rounds):
        for i, g in enumerate((g1, g2)):
            e = g.pop()
            served[e.tenant] += 1
            unsent[i][e.tenant] += 1
        if r % every == every - 1:
            for t in ("x", "y"):
                g1.credit(t, unsent[1][t], weight=wx if t == "x" else wy)
                g2.credit(t, unsent[0][t], weight=wx if t == "x" else wy)
            unsent = [{"x": 0.0, "y": 0.0}, {"x": 0.0, "y": 0.0}]
    # y can use at most gateway 1's half of the releases: its fair share is min(w_y/(w_x+w_y), 1/2)
    want_y = min(wy / (wx + wy), 0.5) * 2 * rounds
    assert abs(served["y"] - want_y) <= 2 * rounds * 0.02 + 2 * every + 4


def test_prune_forgets_only_tenants_that_would_come_back_the_same():
    q = FairQueue(1)
    q.push("a", 1, now=0.0)
    q.push("b", 1, now=0.0)
    q.push("b", 2, now=0.0)
    q.pop(), q.pop()  # a then b (ties: the tenant key)
    assert q.prune() == 0  # a: served 1 > V; b still held
    q.pop()
    q.push("c", 1, now=0.0)
    q.pop()
    assert q.prune() >= 1
    assert q.tag("a") == q.vtime
