"""Flow control's admission rules without sockets (gateway.admission): the room rule and the
ledger that keeps an engine report current, classification (weights and classes from the keys
file, JWT claims and config, in that order; the priority header's rules), Retry-After, and the
flow config's validation naming the field."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.admission import (FlowRules, SlotLedger, TenantFlow, backlog_s, has_room, load_tenant_flows,
                               occupancy_reqs, retry_after_s)
from gateway.auth import Identity, load_api_keys_file, tenant_hash
from gateway.config import ConfigError, FlowConfig, FlowTenantConfig, config_from_dict
from gateway.errors import ApiError
from gateway.context import Routing
from gateway.flow import FlowControl, Ticket
from policies.base import Candidate, Decision, ReplicaView, RequestView
from replica_agent.feed import LoadReport


def _report(running: int, waiting: int, ts: float) -> LoadReport:
    return LoadReport(running, waiting, 0.5, 0.0, 0.0, 1000, 16, ts)


# ----------------------------------------------------------------------------------- room


def test_ledger_brings_a_report_up_to_date_and_forgets_what_it_covers():
    led = SlotLedger(horizon_s=30.0)
    led.add("r", 10.0, +1)  # before the report: the report counts it
    led.add("r", 11.0, +1)
    led.add("r", 12.0, -1)
    assert led.since("r", 10.5) == 0  # +1 -1 after the report
    assert led.since("r", 11.5) == -1
    led.add("r", 13.0, +1)
    assert led.since("r", 11.5) == 0  # an older report than the newest applied: the newest's view
    assert led.since("r", 14.0) == 0
    assert led.since("other", 0.0) == 0
    led.add("r", 100.0, +1)  # the horizon drops events older than 30 s
    assert led.since("r", 0.0) == 1


def test_occupancy_is_the_report_plus_our_changes_never_below_what_we_know():
    rep = _report(running=6, waiting=2, ts=0.0)
    assert occupancy_reqs(rep, -3, own_active=1, own_inflight=0, others_open=0) == 5  # 3 finished since
    assert occupancy_reqs(rep, +2, own_active=0, own_inflight=0, others_open=0) == 10
    assert occupancy_reqs(rep, -8, own_active=2, own_inflight=1, others_open=1) == 4  # the floor
    assert occupancy_reqs(None, 5, own_active=2, own_inflight=1, others_open=3) == 6  # no report: the floor


def test_room_needs_health_a_free_slot_and_little_prefill_ahead():
    v = ReplicaView("r", healthy=True, waiting_reqs=0, inflight_prefill_tokens=400, prefill_s_per_token=1e-3)
    assert backlog_s(v) == pytest.approx(0.4)
    kw = dict(slots=4, engine_queue_reqs=0, max_queue_penalty_s=1.0)
    assert has_room(v, 3, **kw)
    assert not has_room(v, 4, **kw)  # slots full
    assert has_room(v, 4, **{**kw, "engine_queue_reqs": 1})  # one may wait inside the engine
    assert not has_room(v, 0, **{**kw, "max_queue_penalty_s": 0.3})  # 0.4 s of prefill ahead
    assert not has_room(ReplicaView("r", healthy=False), 0, **kw)
    waiting = ReplicaView("r", waiting_reqs=3, inflight_prefill_tokens=100, prefill_s_per_token=1e-3,
                          mean_uncached_prefill_tokens=500.0)
    assert backlog_s(waiting) == pytest.approx(1.5)  # the waiting ones priced at the mean uncached prefill


def test_retry_after_is_the_drain_time_at_the_tenants_release_rate():
    assert retry_after_s(10, 2.0, 30.0) == 5
    assert retry_after_s(1, 50.0, 30.0) == 1
    assert retry_after_s(1000, 1.0, 30.0) == 30  # at most the queue's maximum wait
    assert retry_after_s(3, 0.0, 12.5) == 13  # nothing released lately: the maximum wait


# ----------------------------------------------------------------------------------- classification


def _rules(**flow) -> FlowRules:
    cfg = config_from_dict({"flow": flow}, env={}).flow
    return FlowRules(cfg)


def test_weights_and_classes_come_from_claims_then_keys_file_then_config_then_defaults(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("plain: [k0]\n"
                    "weighted: {keys: [k1], weight: 3, priority: batch, allowed_priorities: [interactive]}\n"
                    "configured: {keys: [k2]}\n")
    assert load_api_keys_file(keys)["weighted"] and len(load_api_keys_file(keys)) == 3  # keys still load
    flows = load_tenant_flows(keys, ["interactive", "standard", "batch"])
    assert flows["weighted"] == TenantFlow(3.0, "batch", frozenset({"interactive"}))
    rules = _rules(tenants={"configured": {"weight": 2.0, "priority": "interactive"},
                            "weighted": {"weight": 9.0, "priority": "standard"}}, default_weight=0.5)
    rules.key_flows = flows
    c = rules.classify(Identity("plain"), {})
    assert (c.weight, c.priority_name, c.priority, c.tenant) == (0.5, "standard", 1, tenant_hash("plain"))
    c = rules.classify(Identity("weighted"), {})
    assert (c.weight, c.priority_name) == (3.0, "batch")  # the keys file over flow.tenants
    c = rules.classify(Identity("configured"), {})
    assert (c.weight, c.priority_name) == (2.0, "interactive")
    jwt_id = Identity("weighted", None, "jwt", {"warmroute_weight": 7, "warmroute_priority": "standard"})
    c = rules.classify(jwt_id, {})
    assert (c.weight, c.priority_name) == (7.0, "standard")  # the token's claims first


def test_the_priority_header_lowers_freely_and_raises_only_when_allowed():
    rules = _rules(tenants={"t": {"allowed_priorities": ["interactive"]}})
    h = "X-Warmroute-Priority"
    assert rules.classify(Identity("t"), {h: "interactive"}).priority_name == "interactive"
    assert rules.classify(Identity("u"), {h: "batch"}).priority_name == "batch"  # lower: anyone
    assert rules.classify(Identity("u"), {h: "standard"}).priority_name == "standard"  # its own
    with pytest.raises(ApiError) as e:
        rules.classify(Identity("u"), {h: "interactive"})
    assert (e.value.status, e.value.code, e.value.param) == (403, "priority_not_allowed", h)
    with pytest.raises(ApiError) as e:
        rules.classify(Identity("t"), {h: "urgent"})
    assert (e.value.status, e.value.code) == (400, "invalid_priority") and "interactive, standard, batch" in e.value.message
    claims = Identity("u", None, "jwt", {"warmroute_allowed_priorities": ["interactive"]})
    assert rules.classify(claims, {h: "interactive"}).priority_name == "interactive"


def test_bad_flow_claims_are_refused_as_invalid_tokens():
    rules = _rules()
    for claims in ({"warmroute_weight": 0}, {"warmroute_weight": "3"}, {"warmroute_weight": True},
                   {"warmroute_priority": "urgent"}, {"warmroute_allowed_priorities": "interactive"}):
        with pytest.raises(ApiError) as e:
            rules.classify(Identity("t", None, "jwt", claims), {})
        assert (e.value.status, e.value.code) == (401, "invalid_token"), claims


def test_keys_file_flow_fields_are_checked_naming_tenant_and_field(tmp_path):
    p = tmp_path / "keys.yaml"
    for text, words in (("a: {keys: [k], weight: 0}\n", ("'a'", "weight")),
                        ("a: {keys: [k], weight: fast}\n", ("'a'", "weight")),
                        ("a: {keys: [k], priority: urgent}\n", ("'a'", "urgent")),
                        ("a: {keys: [k], allowed_priorities: batch}\n", ("'a'", "allowed_priorities")),
                        ("a: {keys: [k], wieght: 2}\n", ("'a'", "wieght"))):
        p.write_text(text)
        with pytest.raises(ValueError) as e:
            load_tenant_flows(p, ["interactive", "standard", "batch"])
        assert all(w in str(e.value) for w in words), (text, e.value)
    p.write_text("a: {weight: 2}\n")
    with pytest.raises(ValueError, match="needs a list of keys"):
        load_api_keys_file(p)


def test_flow_config_defaults_and_errors_name_the_field():
    f = FlowConfig()
    assert f.enabled and f.default_weight == 1.0 and f.default_priority in f.priorities
    bad = [({"max_num_seqs": 0}, "flow.max_num_seqs"), ({"engine_queue_reqs": -1}, "flow.engine_queue_reqs"),
           ({"max_queue_reqs_per_tenant": -1}, "flow.max_queue_reqs_per_tenant"),
           ({"max_queue_wait_s": 0}, "flow.max_queue_wait_s"), ({"busy_exchange_s": 0}, "flow.busy_exchange_s"), ({"max_queue_penalty_s": float("inf")}, "flow.max_queue_penalty_s"),
           ({"priorities": []}, "flow.priorities"), ({"priorities": ["a", "a"]}, "flow.priorities[1]"),
           ({"default_priority": "vip"}, "flow.default_priority"), ({"priority_header": "X Bad"}, "flow.priority_header"),
           ({"default_weight": 0}, "flow.default_weight"), ({"weight_claim": ""}, "flow.weight_claim"),
           ({"tenants": {"t": {"weight": -1}}}, "flow.tenants.t.weight"),
           ({"tenants": {"t": {"priority": "vip"}}}, "flow.tenants.t.priority"),
           ({"tenants": {"t": {"allowed_priorities": ["vip"]}}}, "flow.tenants.t.allowed_priorities[0]"),
           ({"tenants": {"t": {"wieght": 1}}}, "flow.tenants.t.wieght")]
    for flow, field in bad:
        with pytest.raises(ConfigError) as e:
            config_from_dict({"flow": flow}, env={})
        assert str(e.value).startswith(field + ":"), (flow, e.value)
    cfg = config_from_dict({}, env={"WARMROUTE_FLOW__ENABLED": "false"})
    assert cfg.flow.enabled is False  # switched off from the environment
    assert isinstance(config_from_dict({"flow": {"tenants": {"t": {"weight": 2}}}}, env={}).flow.tenants["t"], FlowTenantConfig)


def _grant_on(first_room: bool, others: dict, first_matched: int = 40, *, free: frozenset = frozenset(),
              spill_s: float = 0.0):
    """FlowControl._grant on a ranking r0 (the policy's first choice), then `others` in order:
    replica -> (has room, matched blocks); r0 has `first_matched` blocks and room or not; `free`:
    the replicas with a free sequence slot (prefill 1 ms per token everywhere)."""
    room = {"r0": first_room, **{r: ok for r, (ok, _) in others.items()}}
    matched = {"r0": first_matched, **{r: m for r, (_, m) in others.items()}}
    views = tuple(ReplicaView(r, matched_blocks_gpu=matched[r], matched_blocks_cpu=matched[r], prefill_s_per_token=1e-3)
                  for r in room)
    ranked = tuple(Candidate(r, -i, {}) for i, r in enumerate(room))
    ctx = SimpleNamespace(routing=Routing(RequestView(prompt_tokens=0, block_size=16), views, Decision("p", ranked), 0.0))

    def _room(v, reserve=0, *, free_slot=False, need=1):
        return v.replica_id in free if free_slot else room[v.replica_id]

    fake = SimpleNamespace(_room=_room, _need=lambda seqs, reserve: 1, _count_grant=lambda t, rid: setattr(t, "replica", rid))
    t = Ticket(None, 0.0)
    ok = FlowControl._grant(fake, ctx, t, spill_s=spill_s)
    return ok, t.replica, [c.replica_id for c in ctx.routing.decision.ranked]


def test_a_grant_keeps_the_policys_choice_unless_a_free_replica_loses_nothing():
    # first choice has room: it
    assert _grant_on(True, {"r1": (True, 40)}) == (True, "r0", ["r0", "r1"])
    # first choice full; the free one holds less of the prefix: still the policy's choice (a miss
    # elsewhere would be seconds of prefill and an eviction)
    assert _grant_on(False, {"r1": (True, 0), "r2": (False, 40)}) == (True, "r0", ["r0", "r1", "r2"])
    # a free one holding as much: the request goes there, the rest keep their order for retries
    assert _grant_on(False, {"r1": (True, 0), "r2": (True, 40)}) == (True, "r2", ["r2", "r0", "r1"])
    # nothing free: held
    assert _grant_on(False, {"r1": (False, 40)})[0] is False


def test_light_spill_takes_a_free_slot_elsewhere_only_for_a_short_loss():
    """flow.light_spill_s: a light tenant's request whose first choice has room only to wait in the
    engine (no free slot) goes to the best-ranked replica with a free slot if the prefill it loses
    there costs at most spill_s (blocks x 16 tokens x 1 ms here); off (0) it waits on r0."""
    # r0 holds 40 blocks, has room but no free slot; r1 is free and holds 10: 30 x 16 x 1 ms = 0.48 s lost
    assert _grant_on(True, {"r1": (True, 10)}, free=frozenset({"r1"}))[1] == "r0"  # off
    assert _grant_on(True, {"r1": (True, 10)}, free=frozenset({"r1"}), spill_s=0.5) == (True, "r1", ["r1", "r0"])
    assert _grant_on(True, {"r1": (True, 10)}, free=frozenset({"r1"}), spill_s=0.4)[1] == "r0"  # loss too long
    # the first choice has a free slot itself: it keeps the request
    assert _grant_on(True, {"r1": (True, 40)}, free=frozenset({"r0", "r1"}), spill_s=0.5)[1] == "r0"
    # the best-ranked free replica within the bound, not the one holding most
    got = _grant_on(True, {"r1": (True, 0), "r2": (True, 20), "r3": (True, 39)}, free=frozenset({"r2", "r3"}), spill_s=0.5)
    assert got == (True, "r2", ["r2", "r3", "r0", "r1"])
    # no replica with room at all: still held
    assert _grant_on(False, {"r1": (False, 40)}, spill_s=0.5)[0] is False


def _flow_control(replicas: int, clock=lambda: 100.0, **flow) -> FlowControl:
    """FlowControl over `replicas` replicas r0.. of 4 slots each, with `flow` config, at clock 100."""
    from prometheus_client import CollectorRegistry

    from gateway.auth import TenantLimiter
    from gateway.index import KVIndex
    from gateway.load import LoadTracker
    from gateway.membership import Membership
    from gateway.routing import RoutingState
    from policies.calibration import Calibrator

    mem = Membership()
    mem.set_members({f"r{i}": f"http://r{i}" for i in range(replicas)})
    rs = RoutingState(KVIndex(max_entries=100, stale_after_s=10.0), LoadTracker(), Calibrator(), speculative_ttl_s=2.0)
    return FlowControl(config_from_dict({"flow": flow}, env={}), routing=rs, membership=mem, limiter=TenantLimiter({}),
                       slots=4, registry=CollectorRegistry(), clock=clock)


def test_per_tenant_state_of_long_idle_tenants_is_dropped_by_the_timer():
    """sweep (the timer) drops, every _FORGET_EVERY_S, the release rate and the published counters
    of tenants idle for IDLE_FORGET_S, except those with requests granted here: memory and the
    board's row follow the tenants active lately, not every tenant seen (JWT tenants churn)."""
    from gateway.flow import _FORGET_EVERY_S
    from gateway.flow_share import IDLE_FORGET_S

    now = [100.0]
    fc = _flow_control(1, clock=lambda: now[0])
    for i in range(50):
        fc.peers.count_ask(f"t{i}", now[0])
        fc._count_release(f"t{i}")
    fc._granted = {"t7": 1}
    fc.sweep()
    assert len(fc._rate) == 50 and len(fc.share_row()) == 50
    now[0] += IDLE_FORGET_S + 1
    fc.sweep()
    assert set(fc._rate) == {"t7"} and set(fc.share_row()) == {"t7"}
    fc._granted = {}
    now[0] += _FORGET_EVERY_S / 2
    fc.sweep()  # not yet: the next drop is _FORGET_EVERY_S after the last
    assert set(fc._rate) == {"t7"}
    now[0] += _FORGET_EVERY_S
    fc.sweep()
    assert fc._rate == {} and fc.share_row() == {}


def test_light_spill_only_for_a_light_tenant_beside_a_heavy_one():
    """_spill_for: light_spill_s while the requester is under its share and another tenant granted
    here is over it; 0 when it is alone, when it is itself heavy, or when nobody else is heavy."""
    assert config_from_dict({}, env={}).flow.light_spill_s == 0.5  # on by default
    fc = _flow_control(2, light_spill_s=0.5)
    # 2 replicas x 4 slots = 8, two tenants of weight 1: a fair share of 4 slots each
    fc._granted = {"quiet": 1, "noisy": 6}
    assert fc._spill_for("quiet") == 0.5
    assert fc._spill_for("noisy") == 0.0  # over its share
    fc._granted = {"quiet": 1, "noisy": 3}
    assert fc._spill_for("quiet") == 0.0  # nobody over its share
    fc._granted = {"quiet": 1}
    assert fc._spill_for("quiet") == 0.0  # alone
    off = _flow_control(2, light_spill_s=0)
    off._granted = {"quiet": 1, "noisy": 6}
    assert off._spill_for("quiet") == 0.0  # switched off
    with pytest.raises(ConfigError) as e:
        config_from_dict({"flow": {"light_spill_s": -1}}, env={})
    assert str(e.value).startswith("flow.light_spill_s:")


def test_one_admission_builds_the_fair_share_predicate_once():
    """_fairness: the three questions of one admission (straight on, headroom, spill) share one
    `_fair_slots` predicate, built on first use, with the same answers as a fresh one."""
    fc = _flow_control(2, light_spill_s=0.5, headroom_reqs=1)
    fc._granted = {"quiet": 1, "noisy": 6}
    fc._arrived("noisy", 100.0)
    fc._arrived("quiet", 100.0)
    built = []
    real = fc._fair_slots
    fc._fair_slots = lambda tenant, now: built.append(tenant) or real(tenant, now)
    light = fc._fairness("noisy", 100.0)
    assert built == []  # nothing asked yet: nothing built
    assert fc._reserve_for("noisy", light) == 1  # heavy, beside a light tenant: keep one slot free
    assert fc._spill_for("noisy", light) == 0.0
    assert light("noisy") is False and light("quiet") is True
    assert built == ["noisy"]
    assert fc._reserve_for("noisy") == 1 and built == ["noisy", "noisy"]  # without one: its own


def test_room_counts_the_slots_other_gateways_hold_not_only_their_requests_in_flight():
    """With several gateways, the others' requests past their first token still hold sequence
    slots: the shared open counter keeps them in the occupancy floor between engine reports."""
    fc = _flow_control(1, engine_queue_reqs=0)
    rs = fc.routing
    v = ReplicaView("r0", healthy=True)
    assert fc._room(v)  # no report, nothing known there
    rs.load.dispatch("r0", 10)  # one of ours,
    rs.load.take_pending()  # flushed to the shared counters
    rs.load.set_shared({"r0": (2, 20, 4)})  # ours (1, 10, 1) and another gateway's: 1 in flight, 2 decoding
    assert rs.load.get("r0").others_reqs == 1
    assert not fc._room(v)  # 1 + 3 = 4 slots held
    rs.load.set_shared({"r0": (2, 20, 3)})  # one of theirs finished
    assert fc._room(v)


def test_gateways_holding_requests_split_the_slots_under_the_headroom():
    """With another gateway holding requests too, a heavy grant (one that must leave the headroom
    free) is allowed only while this gateway's own open requests on the replica are under its part
    of the slots under the headroom: each sees the other's grants only at the next exchange, and
    two gateways granting into the same free slots filled the headroom the light tenant was owed.
    The parts are an equal split among the holders, the remainder rotated by replica, adding up to
    the slots exactly; nobody else holding: the shared rule alone."""
    fc = _flow_control(2, engine_queue_reqs=0)  # 4 slots per replica; headroom 1 -> 3 under it
    fc.peers.owner = "gw-a"
    v0, v1 = ReplicaView("r0", healthy=True), ReplicaView("r1", healthy=True)
    for _ in range(2):
        fc.routing.load.dispatch("r0", 10)  # two of ours open on r0
    assert fc._room(v0, 1)  # alone: 2 < 4 - 1
    fc.peers.others_holding = ("gw-b",)
    parts = {rid: fc._my_part(rid, 3) for rid in ("r0", "r1")}
    assert sorted(parts.values()) in ([1, 2], [2, 2], [1, 1]) and all(p in (1, 2) for p in parts.values())
    assert fc._room(v0, 1) is (2 < parts["r0"])
    assert fc._room(v1, 1)  # none of ours on r1: under any part
    assert fc._room(v0, 0)  # a light tenant's request (no reserve) is not limited by the split
    # every holder's part, over any set of holders and replicas, adds up to the slots exactly
    for owners in (("gw-a", "gw-b"), ("gw-a", "gw-b", "gw-c"), ("x", "y", "z", "w")):
        for rid in ("r0", "r1", "10.0.0.7:8000"):
            for slots in range(0, 9):
                total = 0
                for me in owners:
                    fc.peers.owner, fc.peers.others_holding = me, tuple(o for o in owners if o != me)
                    total += fc._my_part(rid, slots)
                assert total == slots, (owners, rid, slots)
    # the remainder rotates: with two holders and an odd count, the extra slot is not always one gateway's
    fc.peers.owner, fc.peers.others_holding = "gw-a", ("gw-b",)
    extra = {fc._my_part(f"r{i}", 3) for i in range(8)}
    assert extra == {1, 2}, extra


def test_the_exchanges_quicken_while_any_of_several_gateways_holds_requests(monkeypatch):
    """On a saturated pool (requests held here, or at another gateway as of the last exchange) each
    gateway's grants must reach the others before they grant into the same free slots: the
    in-flight and fair-share exchanges then run every `flow.busy_exchange_s` instead of their
    periods; a gateway alone has nobody to tell and keeps its periods."""
    import asyncio
    import threading

    from gateway import background

    class Load:  # gateway.load.LoadTracker's one question here
        def __init__(self, others: bool) -> None:
            self.others = others

        def others_active(self) -> bool:
            return self.others

    fc = _flow_control(2, busy_exchange_s=0.02)
    assert not fc.contended()  # nothing held anywhere
    fc.queue.push("t", object(), now=100.0, cls=0, weight=1.0)
    assert not fc.contended()  # held here, but no other gateway seen
    fc.peers.n_gateways = 2
    assert fc.contended()
    fc.queue.pop()
    assert not fc.contended()
    fc.peers.others_holding = ("gw-b",)
    assert fc.contended()  # another gateway holds requests

    period = background._inflight_period
    assert period(Load(True), 0.1, fc.contended, 0.02) == 0.02
    assert period(Load(False), 0.1, fc.contended, 0.02) == 0.02
    assert period(Load(True), 0.01, fc.contended, 0.02) == 0.01  # never slower than the normal period
    fc.peers.others_holding = ()
    assert period(Load(True), 0.1, fc.contended, 0.02) == 0.1
    assert period(Load(False), 0.1, fc.contended, 0.02) == background.QUIET_EXCHANGE_S
    assert period(Load(True), 0.1, None, None) == 0.1  # flow control off
    assert period(Load(False), 0.1, None, None, keeping=True) == 0.1  # keep-alive's refreshes must reach the others

    class Board:  # replica_agent.feed.FairShareBoard: another gateway holding requests from the 3rd exchange
        owner = "gw-a"

        def __init__(self) -> None:
            self.calls = 0

        async def exchange_shares(self, row):
            self.calls += 1
            from replica_agent.feed import TenantShare
            return {"gw-b": {"t": TenantShare(0.0, 1 if self.calls >= 3 else 0, 0, 0, 0, 0)}}

    slept: list[float] = []
    real_sleep, here = asyncio.sleep, threading.get_ident()

    async def sleep(s: float, *args, **kwargs):
        if threading.get_ident() != here:  # the patch is process-wide: another test's server thread, on its own loop
            return await real_sleep(s, *args, **kwargs)
        slept.append(s)
        if len(slept) == 4:
            raise asyncio.CancelledError

    class Health:
        def ok(self) -> None: ...

        def failed(self, exc) -> None:
            raise AssertionError(exc)

    monkeypatch.setattr(background.asyncio, "sleep", sleep)  # the loop's periods, without waiting them
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(background.run_share_exchange(fc, Board(), Health(), 0.1, 0.02))
    assert slept == [0.1, 0.1, 0.02, 0.02]


def test_a_gateway_alone_on_the_board_exchanges_its_shares_at_the_quiet_period():
    """The fair-share exchange is a Redis round trip; a gateway that saw no other at its last
    exchange slows to QUIET_EXCHANGE_S (a gateway that starts reads our row at its first exchange,
    we hear of it at most that late), and quickens again as soon as it sees another."""
    from gateway import background

    fc = _flow_control(2, busy_exchange_s=0.02)
    period = background._share_period
    assert period(fc, 0.1, 0.02) == 0.1  # no exchange yet: not known to be alone
    fc.apply_shares({})  # the board answered: nobody else on it
    assert fc.peers.shared and fc.peers.n_gateways == 1
    assert period(fc, 0.1, 0.02) == background.QUIET_EXCHANGE_S
    assert period(fc, 5.0, 0.02) == 5.0  # never quicker than the configured period
    fc.queue.push("t", object(), now=100.0, cls=0, weight=1.0)
    assert period(fc, 0.1, 0.02) == background.QUIET_EXCHANGE_S  # held here with nobody to tell
    from replica_agent.feed import TenantShare
    fc.apply_shares({"gw-b": {"t": TenantShare()}})  # another gateway appears
    assert period(fc, 0.1, 0.02) == 0.02  # held here and another gateway to tell: busy
    fc.queue.pop()
    assert period(fc, 0.1, 0.02) == 0.1
    fc.board_lost()  # the board away: its retries are the loop's business; not "alone"
    assert period(fc, 0.1, 0.02) == 0.1


def test_the_benchmarks_hot_path_runs_the_stage_as_the_gateway_does():
    """`python -m loadtests.bench_flow --hot-path-only` drives the admission stage with a request as
    the pipeline hands it (a parsed request, a decision); it broke once when the stage began to read
    the request's sequences, unseen until the benchmark was run."""
    from loadtests.bench_flow import hot_path_us

    r = hot_path_us(n=200, replicas=2)
    assert r["on_us"] > 0 and r["off_us"] > 0 and abs(r["added_us"] - (r["on_us"] - r["off_us"])) < 0.02


def test_a_request_of_several_sequences_needs_room_for_all_while_headroom_is_kept():
    """`n` > 1 (or a batch): while a light tenant's headroom is kept, a grant needs room for every
    sequence under the headroom (else the rest wait in the engine ahead of the light tenant's next
    request); otherwise room for its first (nobody to protect: no slot idles waiting for more)."""
    fc = _flow_control(1, engine_queue_reqs=0)  # 4 slots
    assert fc._need(4, 0) == 1 and fc._need(4, 1) == 3 and fc._need(2, 1) == 2 and fc._need(1, 1) == 1
    v = ReplicaView("r0", healthy=True)
    fc.routing.load.dispatch("r0", 10)  # one request open there: 3 slots free, 2 under the headroom
    assert fc._room(v, 1, need=2) and not fc._room(v, 1, need=3)
    assert fc._room(v, 0, need=fc._need(4, 0))  # no headroom: its first sequence fits
