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

from gateway.context import Outcome
from gateway.index import KVIndex
from gateway.keepalive import planned_root
from gateway.learn import learn
from gateway.load import ROUTED_TAU_S, LoadTracker
from gateway.routing import RoutingState, predicted_matched_tokens, queued_prefill_tokens
from policies.base import RequestView
from policies.calibration import Calibrator
from replica_agent.feed import FeedEvent, LoadReport

__all__ = ["VClock", "SimRouter"]

_STALE_AFTER_S = 10.0  # the gateway's feed.stale_after_s default


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
            load = LoadReport(rep.n_running, len(rep.waiting), rep.kv_usage(), 0.0, 0.0, rep.p.num_blocks,
                              rep.p.block_size, now)
            self._record(i, "load", load=load)

    def route(self, now: float, r) -> int:
        """Decide where request `r` goes (the gateway's plan + dispatch accounting); its replica index."""
        rv = RequestView(r.prompt, self.p.block_size, tuple(r.keys), r.max_out, "", r.wr.request_id)
        routing = self.routing.decide(rv, self.available, self.policy, self.rng)
        self.policy.placed(rv, routing.decision)
        cand = routing.decision.ranked[0]
        view = routing.view_of(cand.replica_id)
        predicted = predicted_matched_tokens(rv, view)
        uncached = max(0, r.prompt - predicted)
        flight = self.routing.dispatched(cand.replica_id, r.keys, uncached, r.max_out, view)
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
