"""The virtual-time simulator's router: the gateway's own decision code, on virtual time.

Rule: it routes through `gateway.routing.RoutingState` (the KV index, the load tracker, the view
assembly and the in-flight accounting the gateway uses) and learns through `gateway.learn`, fed
the way a gateway is fed, so a policy default measured here is the gateway's behaviour:
- the replicas' stored/removed blocks arrive as feed records after `event_delay_s` (the agent);
- every `report_interval_s` each replica's running and waiting requests, KV usage and KV blocks
  arrive as a `load` record (the agent's scrape of the engine's /metrics);
- dispatch, first token and finish move the request's in-flight count exactly like the
  gateway's `Flight` (dispatch also inserts its keys speculatively for `spec_ttl_s`);
- a finished request is learned from with its TTFT (arrival -> first token), the engine's cached
  tokens and its mean inter-token interval: calibration and the policy's `observe` hook.
The clock of the index and the tracker is the simulation's (`VClock`), so liveness, speculative
TTLs and routed rates run on virtual time.
"""
from __future__ import annotations

import random

from gateway.config import FeedConfig
from gateway.context import Outcome
from gateway.index import KVIndex
from gateway.keepalive import planned_root
from gateway.learn import learn
from gateway.load import ROUTED_TAU_S, LoadTracker
from gateway.routing import RoutingState, predicted_matched_tokens, queued_prefill_tokens
from policies.base import RequestView
from policies.calibration import Calibrator
from replica_agent.feed import FeedEvent, LoadReport
from replica_agent.feed.records import merge_adapters

__all__ = ["VClock", "SimRouter", "SimGateways"]

_STALE_AFTER_S = FeedConfig().stale_after_s  # the gateway's default (10 s)
INFLIGHT_POLL_S = FeedConfig().inflight_poll_s  # the gateway's in-flight exchange period (0.1 s)


class VClock:
    """The simulation's time, as a clock the gateway's objects can read."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class SimRouter:
    def __init__(self, n: int, p, policy, rng: random.Random, clock: VClock) -> None:
        self.p = p  # loadtests.vtime.SimParams
        self.policy = policy
        self.rng = rng
        self.clock = clock
        self.rids = [f"r{i}" for i in range(n)]
        self.available = {rid: True for rid in self.rids}  # no health failures are modelled
        self.offsets = [0] * n  # feed offsets per replica
        self.routing = RoutingState(
            KVIndex(max_entries=max(4_000_000, 2 * n * p.num_blocks), stale_after_s=_STALE_AFTER_S, clock=clock),
            LoadTracker(routed_tau_s=getattr(policy, "routed_tau_s", ROUTED_TAU_S)),
            Calibrator(prior_prefill_s_per_token=p.prior_prefill_s_per_token, prior_decode_step_s=p.prior_decode_step_s),
            speculative_ttl_s=p.spec_ttl_s, clock=clock)
        self.flights: dict = {}  # request index -> (Flight, Outcome without its measured parts)
        self.warm: tuple | None = None  # the last route()'s background warm: (replica index, prefix keys)
        self.root_blocks = 0  # the last route()'s planned root, in blocks (0: unplanned)

    @property
    def cal(self) -> Calibrator:
        return self.routing.calibrator

    def _record(self, ri: int, kind: str, **kw) -> None:
        self.offsets[ri] += 1
        self.routing.index.apply(FeedEvent(self.rids[ri], self.offsets[ri], kind, **kw))

    def apply_events(self, ri: int, stored: list, removed: list) -> None:
        if stored:
            self._record(ri, "stored", keys=tuple(stored))
        if removed:
            self._record(ri, "removed", keys=tuple(removed))

    def report(self, reps: list, now: float) -> None:
        for i, rep in enumerate(reps):
            slots = (rep.p.max_loras, *rep.lora_adapters()) if rep.p.max_loras and rep.p.lora_metrics else ()
            load = LoadReport(rep.n_running, len(rep.waiting), rep.kv_usage(), 0.0, 0.0, rep.p.num_blocks,
                              rep.p.block_size, now, *slots)
            self._record(i, "load", load=load)

    def route(self, now: float, r) -> int:
        """Decide where request `r` goes (the gateway's plan + dispatch accounting); its replica index."""
        rv = RequestView(r.prompt, self.p.block_size, tuple(r.keys), r.max_out, "", r.wr.request_id, lora=r.lora)
        routing = self.routing.decide(rv, self.available, self.policy, self.rng)
        self.routing.placed(self.policy, rv, routing.decision)
        cand = routing.decision.ranked[0]
        view = routing.view_of(cand.replica_id)
        predicted = predicted_matched_tokens(rv, view)
        uncached = max(0, r.prompt - predicted)
        flight = self.routing.dispatched(cand.replica_id, r.keys, uncached, r.max_out, view, lora=r.lora)
        self.flights[id(r)] = (flight, Outcome(cand.replica_id, None, predicted, uncached, queued_prefill_tokens(view),
                                               view.running_reqs if view is not None else 0, None, None))
        r.pred_uncached = uncached
        self.root_blocks = planned_root(cand.terms)
        self.warm = None
        for c in routing.decision.ranked[1:]:
            n = int(c.terms.get("warm_blocks", 0.0))
            if n > 0:  # cache_plan(copy_in_background): warm this prefix there (loadtests/vtime_pacing.py)
                self.warm = (int(c.replica_id[1:]), tuple(r.keys[:n]))
                break
        return int(cand.replica_id[1:])

    def warm_dispatched(self, ri: int, prefix: tuple):
        """A background warm of `prefix` goes to replica `ri`: its prefill counts there in flight
        (no speculative entries: the replica is a holder once its events say so); the Flight."""
        return self.routing.dispatched(self.rids[ri], (), len(prefix) * self.p.block_size, 1)

    def first_token(self, r) -> None:
        self.flights[id(r)][0].first_token()

    def aborted(self, r) -> None:
        """The client gave up (timeout): the request leaves the in-flight counts."""
        flight, _ = self.flights.pop(id(r))
        flight.finish()

    def finished(self, r) -> None:
        flight, base = self.flights.pop(id(r))
        flight.finish()
        decode = (r.finish_s - r.first_s) / (r.max_out - 1) if r.max_out > 1 else None
        usage = {"prompt_tokens": r.prompt, "completion_tokens": r.max_out,
                 "prompt_tokens_details": {"cached_tokens": max(0, r.cached)}}
        learn(Outcome(base.replica_id, r.first_s - r.arrival, base.predicted_cached_tokens, base.uncached_tokens,
                      base.backlog_tokens, base.running_reqs, usage, decode), self.cal, self.policy)


class SimGateways:
    """Several gateway processes in front of the same replicas (`--workers N`, or N gateway pods),
    each a SimRouter with its own policy instance, index, calibration and in-flight counts, fed
    the same KV events and load reports (each process reads the whole feed). Each request goes to
    one of them at random (a fresh connection per request, spread by the kernel's SO_REUSEPORT or
    the Service), which routes, tracks and learns from it alone. The gateways' exchange through
    the feed's shared counters (the gateway's `run_inflight_exchange`, through the same LoadTracker
    calls: take_pending, gauges, adapters, set_shared: in-flight counts, dispatch gauges and the
    LoRA adapters of each one's requests (each gateway gets the others'); take_shared,
    apply_shared: copies in progress; take_placements, apply_placements: the plan's placements)
    runs every `feed.inflight_poll_s` (0.1 s; at the first arrival after it) and with every load
    report. Not shared, as in the gateway: speculative index entries of short new parts (under
    gateway.routing.SHARE_MIN_NEW_BLOCKS) and calibration. Keep-alive, when on, runs one retainer
    for all (as if one process kept every planned root: what the gateways' traded refreshes and
    ranks come to, gateway.keepalive) and reads the first gateway's index."""

    def __init__(self, routers: list, rng: random.Random) -> None:
        if not routers:
            raise ValueError("SimGateways needs at least one router")
        self.routers = routers
        self.rng = rng
        self.of: dict = {}  # id(request) -> the router that routed it
        self.rids = routers[0].rids
        self.routing = routers[0].routing  # keep-alive's held_blocks (every index sees the same feed)
        self.warm = None
        self.root_blocks = 0
        self.shared: dict = {}  # the feed's in-flight counters: replica -> (reqs, tokens, open), all gateways
        for g in routers:
            g.routing.share_copies = True  # as a gateway with a feed does
        self.exchange_s = INFLIGHT_POLL_S
        self.exchanged_t = 0.0

    @property
    def cal(self) -> Calibrator:
        return self.routers[0].cal

    def _exchange(self, now: float) -> None:
        self.exchanged_t = now
        gauges: dict = {}  # replica -> every gateway's dispatch gauges, summed (each publishes its own)
        for g in self.routers:
            load = g.routing.load
            for rid, delta in load.take_pending().items():
                self.shared[rid] = tuple(a + b for a, b in zip(self.shared.get(rid, (0, 0, 0)), delta))
            for rid, gs in load.gauges(now).items():
                gauges[rid] = tuple(a + b for a, b in zip(gauges.get(rid, (0.0, 0.0, 0.0)), gs))
        board = {rid: self.shared.get(rid, (0, 0, 0)) + gauges.get(rid, (0.0, 0.0, 0.0))
                 for rid in set(self.shared) | set(gauges)}
        published = [g.routing.load.adapters() for g in self.routers]
        trades = [(g, g.routing.take_shared(), g.routing.take_placements()) for g in self.routers]
        for i, g in enumerate(self.routers):
            if any(published):  # the others' adapters, as the feed gives each gateway
                loras = merge_adapters(p for j, p in enumerate(published) if j != i)
                g.routing.load.set_shared({rid: board.get(rid, (0, 0, 0, 0.0, 0.0, 0.0)) + loras.get(rid, ((), ()))
                                           for rid in set(board) | set(loras)})
            else:
                g.routing.load.set_shared(board)
            for src, entries, placements in trades:
                if src is not g:
                    g.routing.apply_shared(entries)
                    g.routing.apply_placements(g.policy, placements)

    def apply_events(self, ri: int, stored: list, removed: list) -> None:
        for g in self.routers:
            g.apply_events(ri, stored, removed)

    def report(self, reps: list, now: float) -> None:
        self._exchange(now)
        for g in self.routers:
            g.report(reps, now)

    def route(self, now: float, r) -> int:
        if now - self.exchanged_t >= self.exchange_s:
            self._exchange(now)  # the gateways' own exchange period (on the next arrival after it)
        g = self.routers[self.rng.randrange(len(self.routers))]
        self.of[id(r)] = g
        ri = g.route(now, r)
        self.warm, self.root_blocks = g.warm, g.root_blocks
        return ri

    def warm_dispatched(self, ri: int, prefix: tuple):
        return self.routers[0].warm_dispatched(ri, prefix)

    def first_token(self, r) -> None:
        self.of[id(r)].first_token(r)

    def aborted(self, r) -> None:
        self.of.pop(id(r)).aborted(r)

    def finished(self, r) -> None:
        self.of.pop(id(r)).finished(r)
