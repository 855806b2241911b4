"""The decide stage (pure): from a request's keys and what the gateway knows of each replica, the
`ReplicaView`s a policy ranks, the ranking, and the explanation of the decision.

`RoutingState` owns that knowledge (the KV index, the load tracker, the calibrated rates) and is
the one place both fronts and the virtual-time simulator (loadtests/vtime.py) decide through:
`decide()` assembles the views and ranks them, `dispatched()` records where a request went (its
in-flight work, and its keys speculatively in the index). Time comes from the injected clock.

Per replica r (the README's "What it does", steps 5-6):
- matched blocks: the index's leading run for r (GPU, and GPU-or-CPU); 0 when r is absent;
- load: the agent's last report (running, waiting, KV usage) plus in-flight work: this gateway's
  and the other gateways' requests without a first token yet, with their uncached prefill tokens.
  Without a report (load-only mode, or an agent not yet heard from) the running count is this
  gateway's own active requests;
- what was sent there: mean uncached prefill tokens and mean max_tokens of its requests, routed
  requests per second (LoadTracker); cache fill (index entries / the engine's KV blocks) and
  those KV blocks (the agent's load report);
- LoRA slots: the engine's `max_lora`, running and waiting adapters (the agent's load report),
  plus the adapters of this gateway's requests sent there and not finished;
- rates: the calibrator's prefill seconds per token and decode step seconds (priors at first);
- health: probes and passive ejection (`Membership`); index liveness from the feed, and trust in
  it (gateway.index_health: a replica whose predictions disagree with its engine counts as not live).
Nothing here does I/O or reads a clock except through the arguments.

Copies in progress, shared (`share_copies`, on with a feed): a request that brings a replica at
least SHARE_MIN_NEW_BLOCKS blocks it is not known to hold (a document's first request there, a
copy, a long new history) is queued by `dispatched` for the other gateways (`take_shared`), which
insert its keys speculatively as their own (`apply_shared`): until the engine's events say where
the blocks went, several seconds for a 3,000-token prefill on a busy replica, the others would
otherwise see no holder and each place the prefix's next requests, or make a copy, on their own.
Virtual time, busy regime, cache_aware, Zipf popularity, seeds 0-19, four gateway processes:
median TTFT p50 / p99 13.8 / 62.9 s, 290 requests unfinished, without it; with it see
loadtests/results/busy_regime_log.md ("Several gateway processes"). A request's shorter uncached
tail (a question) is nobody else's prefix: not shared.

Placements, shared (with `share_copies`, for a policy with `shares_placements`: cache_plan): the
record the policy's `placed` returns is queued for the other gateways (`take_placements`), whose
instances apply it (`apply_placements`), so each plan measures the whole stream, not its
process's share. Virtual time, busy regime, cache_plan, four processes, seeds 0-19, median TTFT
p50 / p99: see loadtests/results/busy_regime_log.md ("Several gateway processes"). With keep-alive
on, the same exchange carries each refresh this gateway sent (`refreshed`: a REFRESH_RECORD) and,
on the receiving side, every placement and refresh counts as a use of the root in its retainer
(gateway.keepalive, `touched`), so a root is refreshed by one gateway, not by each.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from typing import Any, Callable, Mapping, Sequence

from gateway.context import Routing
from gateway.index import KVIndex
from gateway.index_health import IndexHealth
from gateway.keepalive import Retainer
from gateway.load import Flight, LoadTracker
from policies.base import Decision, Policy, ReplicaView, RequestView
from policies.calibration import Calibrator

SHARE_MIN_NEW_BLOCKS = 32  # new blocks (512 tokens at 16 per block) from which a dispatch is shared
MAX_SHARED_PENDING = 1024  # dispatches (and placements) queued for the others between two exchanges (oldest dropped beyond)
REFRESH_RECORD = "refresh"  # first item of a keep-alive refresh's record among the placements: [it, replica, kept key, rank]

__all__ = ["RoutingState", "build_views", "explain", "predicted_matched_tokens", "reported_cached_tokens", "queued_prefill_tokens",
           "PRIOR_UNCACHED_TOKENS"]


class RoutingState:
    """Index, load and rates of the pool's replicas, read at decision time (module header)."""

    def __init__(self, index: KVIndex, load: LoadTracker, calibrator: Calibrator, *, speculative_ttl_s: float,
                 media_history_ttl_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index  # which replica holds which block keys (fed by the replicas' agents)
        self.load = load  # in-flight and routed work per replica (this gateway's and the others')
        self.calibrator = calibrator  # prefill and decode rates per replica
        self.speculative_ttl_s = speculative_ttl_s  # lifetime of a routed request's speculative keys
        self.media_history_ttl_s = media_history_ttl_s  # lifetime of a chat's keys past its media (linger); 0: none
        self.clock = clock  # monotonic seconds (virtual in the simulator)
        self.health = IndexHealth()  # predicted vs engine-reported cached tokens (fed by the learn stage)
        # called as a request starts planning, before it is tokenized: the index's feed consumer
        # reads what the engines published since its last read (IndexSync.wake); none without a feed
        self.freshen: Callable[[], None] = lambda: None
        self.share_copies = False  # queue long new prefixes for the other gateways (module header)
        # queued for the other gateways until the next exchange takes them (the oldest dropped beyond
        # MAX_SHARED_PENDING): dispatches (replica, keys, expiry by clock), the policy's placement
        # records, keep-alive's refreshes (REFRESH_RECORD records)
        self._shared: deque[tuple[str, tuple[int, ...], float]] = deque(maxlen=MAX_SHARED_PENDING)
        self._placements: deque = deque(maxlen=MAX_SHARED_PENDING)
        self._refreshes: deque = deque(maxlen=MAX_SHARED_PENDING)
        self.placements_traded = {"sent": 0, "applied": 0, "skipped": 0}  # for /debug/index
        self.refreshes_traded = {"sent": 0, "heard": 0}  # keep-alive's refresh records (for /debug/index)
        self.others_heard_at = -math.inf  # when another gateway's placement or refresh record last arrived (clock)
        self._history_read = False  # the first batch of placements applied (the feed's kept history)

    def views(self, replica_ids: Sequence[str], keys: Sequence[int], available: Mapping[str, bool]) -> list[ReplicaView]:
        """One view per replica for a request with `keys`; `available`: rid -> passes health."""
        index, cal, load = self.index, self.calibrator, self.load
        reports = {rid: index.last_load(rid) for rid in replica_ids}
        now = self.clock()
        return build_views(
            replica_ids,
            matches=index.match(keys) if keys else {},
            available=available,
            live={rid: index.is_live(rid) and self.health.trusted(rid) for rid in replica_ids},  # distrusted: load only
            reports=reports,
            loads={rid: load.get(rid) for rid in replica_ids},
            rates={rid: (cal.prefill_s_per_token(rid), cal.decode_step_s(rid)) for rid in replica_ids},
            cached_frac={rid: min(1.0, index.entries_of(rid) / rep.num_gpu_blocks)
                         for rid, rep in reports.items() if rep is not None and rep.num_gpu_blocks},
            routed_rps={rid: load.pool_routed_rps(rid, now) for rid in replica_ids},
            mean_uncached={rid: load.pool_mean_uncached(rid, now) for rid in replica_ids},
        )

    def decide(self, request: RequestView, available: Mapping[str, bool], policy: Policy,
               rng: random.Random) -> Routing:
        """Rank the replicas named in `available` for `request` (their order is the views' order)."""
        t0 = time.perf_counter()
        views = self.views(list(available), request.keys, available)
        decision = policy.rank(request, views, rng)
        return Routing(request, tuple(views), decision, time.perf_counter() - t0)

    def held_blocks(self, replica_id: str, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` the index says `replica_id` holds (any medium, speculative included)."""
        m = self.index.match(keys).get(replica_id)
        return 0 if m is None else m.any_blocks

    def dispatched(self, replica_id: str, keys: Sequence[int], uncached_tokens: int, max_tokens: int,
                   view: ReplicaView | None = None, *, lora: str | None = None, seqs: int = 1) -> Flight:
        """A request goes to `replica_id`: count its work there until `Flight.finish()`, and expect
        its keys there (speculatively) until the engine's events confirm them. The engine stores a
        block when its prefill completes, so the speculation lasts `speculative_ttl_s` plus the
        prefill the view says is ahead of the request and its own (a 3,000-token document on a
        1 ms/token replica takes 3 s: a fixed 2 s TTL would let the copy's last blocks lapse while
        the engine is still computing them)."""
        flight = self.load.dispatch(replica_id, uncached_tokens, self.clock(), max_tokens, lora, seqs)
        if keys:
            ttl = self.speculative_ttl_s
            if view is not None:
                ttl += (view.inflight_prefill_tokens + uncached_tokens) * view.prefill_s_per_token
            self.index.insert_speculative(replica_id, keys, ttl)
            known = max(view.matched_blocks_gpu, view.matched_blocks_cpu) if view is not None else 0
            if self.share_copies and len(keys) - known >= SHARE_MIN_NEW_BLOCKS:
                self._shared.append((replica_id, tuple(keys), self.clock() + ttl))
        return flight

    def linger(self, replica_id: str, keys: Sequence[int]) -> None:
        """A chat with media went to `replica_id`: the keys standing for its blocks past its first
        item (hashing.history_keys) count there speculatively for `media_history_ttl_s`, here and,
        when shared, at the other gateways; no event will confirm or remove them. Skipped while
        speculative keys exceed a quarter of the index's budget (their memory is bounded by it)."""
        if not keys or self.media_history_ttl_s <= 0 or self.index.speculative_keys() > self.index.max_entries // 4:
            return
        self.index.insert_speculative(replica_id, keys, self.media_history_ttl_s)
        if self.share_copies:
            self._shared.append((replica_id, tuple(keys), self.clock() + self.media_history_ttl_s))

    def take_shared(self) -> list[tuple[str, tuple[int, ...], float]]:
        """The dispatches queued for the other gateways since the last call, unexpired: (replica,
        keys, ttl_s left)."""
        now = self.clock()
        out = [(rid, keys, until - now) for rid, keys, until in self._shared if until > now]
        self._shared.clear()
        return out

    def apply_shared(self, entries: Sequence[tuple[str, Sequence[int], float]]) -> None:
        """Other gateways' dispatches (replica, keys, remaining ttl_s): their keys count speculatively
        on that replica here too, for the rest of their TTL (a replica outside this gateway's pool
        is never ranked here, so its entries only wait out their TTL)."""
        for rid, keys, ttl in entries:
            if ttl > 0:
                self.index.insert_speculative(rid, keys, ttl)

    def placed(self, policy: Policy, request: RequestView, decision: Decision) -> None:
        """The request goes where `decision` ranks it first: the policy's `placed` hook, and its
        record queued for the other gateways (when shared: module header)."""
        record = policy.placed(request, decision)
        if record is not None and self.share_copies and getattr(policy, "shares_placements", False):
            self._placements.append(record)

    def refreshed(self, replica_id: str, kept_key: int, rank: float) -> None:
        """Keep-alive sent a refresh of the root kept as `kept_key` to the replica (this gateway's
        retainer's `rank`): queued with the placements for the other gateways' retainers
        (gateway.keepalive, `touched`)."""
        if self.share_copies:
            self._refreshes.append([REFRESH_RECORD, replica_id, kept_key, rank])

    def take_placements(self) -> list:
        """The placement records queued since the last call, then the refresh records."""
        out = list(self._placements)
        self.placements_traded["sent"] += len(out)
        self.refreshes_traded["sent"] += len(self._refreshes)
        out += self._refreshes
        self._placements.clear()
        self._refreshes.clear()
        return out

    def apply_placements(self, policy: Policy, records: Sequence, retainer: Retainer | None = None,
                         now: float = 0.0) -> int:
        """Other gateways' placement records into `policy` and, with a `retainer` (keep-alive on),
        each placement's root and each refresh record as used there at `now`; a malformed record
        (another version's) is skipped. Returns how many placements were applied. The first call's
        records are the feed's kept history (the first read returns every batch it keeps, of any
        age): they feed the plan, not the retainer, which would take them as uses made `now`, and
        a gateway long gone as the lowest-ranked refresher."""
        applied = refreshes = 0
        if not self._history_read:
            self._history_read, retainer = True, None
        elif records:
            self.others_heard_at = self.clock()
        for record in records:
            if isinstance(record, list) and record[:1] == [REFRESH_RECORD]:
                refreshes += 1
                if (retainer is not None and len(record) == 4 and isinstance(record[1], str)
                        and isinstance(record[2], int) and isinstance(record[3], float)):
                    retainer.touched(record[1], record[2], now, rank=record[3])
                    self.refreshes_traded["heard"] += 1
                continue
            try:
                policy.placed_elsewhere(record)
                applied += 1
            except ValueError:
                continue
            if retainer is not None:
                retainer.touched(record[2], record[0], now)  # (root key, blocks, replica, ...)
        self.placements_traded["applied"] += applied
        self.placements_traded["skipped"] += len(records) - refreshes - applied
        return applied

    def checked(self, replica_id: str, predicted_tokens: int, reported_tokens: int, queued_s: float = 0.0) -> None:
        """The engine reported a request's cached tokens: check the index's prediction
        (gateway.index_health), unless the replica's feed is silent (its matches do not count then,
        so a miss says nothing about the index). `queued_s`: its wait in the engine's queue."""
        if self.index.is_live(replica_id):
            self.health.observe(replica_id, predicted_tokens, reported_tokens, queued_s)

    def forget(self, replica_id: str) -> None:
        """The replica left the pool: purge what is known of it."""
        self.index.purge(replica_id)
        self.load.forget(replica_id)
        self.calibrator.forget(replica_id)
        self.health.forget(replica_id)


def build_views(
    replica_ids: Sequence[str],
    *,
    matches: Mapping[str, Any],
    available: Mapping[str, bool],
    live: Mapping[str, bool],
    reports: Mapping[str, Any],
    loads: Mapping[str, Any],
    rates: Mapping[str, tuple[float, float]],
    cached_frac: Mapping[str, float] | None = None,
    routed_rps: Mapping[str, float] | None = None,
    mean_uncached: Mapping[str, float] | None = None,
) -> list[ReplicaView]:
    """One ReplicaView per replica id, in the given order.

    matches: rid -> Match(gpu_blocks, any_blocks) (absent: no match); available: rid -> healthy;
    live: rid -> the replica's feed is current; reports: rid -> LoadReport or None;
    loads: rid -> gateway.load.ReplicaLoad; rates: rid -> (prefill_s_per_token, decode_step_s);
    cached_frac: rid -> indexed blocks / the engine's KV blocks (absent: unknown);
    routed_rps: rid -> requests routed there per second (absent: unknown);
    mean_uncached: rid -> mean uncached tokens of the requests sent there, < 0 unknown (absent: the
    load's own `mean_uncached_tokens`).
    """
    views = []
    for rid in replica_ids:
        m = matches.get(rid)
        rep = reports.get(rid)
        ld = loads.get(rid)
        prefill, decode = rates[rid]
        mean_unc = mean_uncached.get(rid, -1.0) if mean_uncached is not None else (
            ld.mean_uncached_tokens if ld is not None else -1.0)
        if rep is not None:
            running, waiting, kv = rep.running_reqs, rep.waiting_reqs, rep.kv_usage
        else:
            running, waiting, kv = (ld.active_reqs if ld is not None else 0), 0, 0.0
        max_lora, lora_running, lora_waiting = _lora_slots(rep, ld)
        views.append(ReplicaView(
            replica_id=rid,
            healthy=bool(available.get(rid, False)),
            matched_blocks_gpu=m.gpu_blocks if m is not None else 0,
            matched_blocks_cpu=m.any_blocks if m is not None else 0,
            index_live=bool(live.get(rid, False)),
            running_reqs=running,
            waiting_reqs=waiting,
            inflight_reqs=(ld.inflight_reqs + ld.others_reqs) if ld is not None else 0,
            inflight_prefill_tokens=(ld.inflight_tokens + ld.others_tokens) if ld is not None else 0,
            kv_usage=kv,
            prefill_s_per_token=prefill,
            decode_step_s=decode,
            kv_capacity_blocks=rep.num_gpu_blocks if rep is not None else 0,
            kv_cached_frac=cached_frac.get(rid) if cached_frac else None,
            mean_uncached_prefill_tokens=mean_unc if mean_unc >= 0 else None,
            mean_output_tokens=ld.mean_output_tokens if ld is not None and ld.mean_output_tokens >= 0 else None,
            routed_rps=routed_rps.get(rid, 0.0) if routed_rps is not None else None,
            others_routed_rps=ld.others_rps if ld is not None else 0.0,
            max_lora=max_lora,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
        ))
    return views


def _lora_slots(rep, ld) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """(max_lora, the adapters holding slots, the others wanting one): the engine's last report,
    plus the requests there since of this gateway and (as of the last exchange) the others
    (generating: holding a slot; no first token yet: running or waiting, counted as wanting one
    unless their adapter holds a slot)."""
    if rep is None or not rep.max_lora:
        return 0, (), ()
    running, waiting = rep.lora_running, rep.lora_waiting
    if ld is not None and (ld.active_loras or ld.others_lora_running):
        running = tuple(dict.fromkeys((*running, *(ld.active_loras or ()), *ld.others_lora_running)))
    if ld is not None and (ld.inflight_loras or ld.others_lora_wanting):
        waiting = (*waiting, *(ld.inflight_loras or ()), *ld.others_lora_wanting)
    if waiting:
        held = set(running)
        waiting = tuple(a for a in dict.fromkeys(waiting) if a not in held)
    return rep.max_lora, running, waiting


PRIOR_UNCACHED_TOKENS = 512.0  # a waiting request's prefill when nothing is known (cache_aware's prior too)


def queued_prefill_tokens(view: ReplicaView | None) -> float:
    """Prefill work queued ahead of a new request on the replica, in tokens, whatever the policy:
    its waiting requests at their mean uncached size, or the gateways' in-flight uncached tokens,
    whichever is larger (two views of one queue: the engine's last count, and what was sent since).
    The rate calibration takes this wait out of a TTFT before it attributes the rest to prefill."""
    if view is None:
        return 0.0
    per_req = view.mean_uncached_prefill_tokens if view.mean_uncached_prefill_tokens is not None else PRIOR_UNCACHED_TOKENS
    return max(view.waiting_reqs * per_req, float(view.inflight_prefill_tokens))


def predicted_matched_tokens(request: RequestView, view: ReplicaView | None) -> int:
    """Tokens the engine should report as cached if the index is right (whole blocks, GPU or CPU)."""
    if view is None:
        return 0
    cap = max(0, (request.prompt_tokens - 1) // request.block_size)
    return min(view.matched_blocks_cpu, cap) * request.block_size


def reported_cached_tokens(request: RequestView, predicted: int, *, choices: int = 1, stream: bool = False,
                           last: tuple[int, int] | None = None, reads_cache: bool = True) -> int | None:
    """The cached tokens vLLM 0.32's usage will report for a request whose (first) prompt's index
    prediction is `predicted`. A stream reports its first output's request, a whole answer its
    last prompt's. With `choices` (`n`) > 1 vLLM runs n child requests on a prompt, queued
    together: the first computes it and the others find its full blocks (allocated in the same
    step, or an earlier one of its chunked prefill), and a whole answer's usage is the last child's:
    every full block of the prompt (cold n = 4 reported 1,184 of 1,210 prompt tokens whole, 0
    streamed). `last`: a completions batch's last prompt, (its tokens, its leading blocks held by
    the replica or computed by an earlier prompt of the batch, queued before it). `reads_cache`
    False (prompt logprobs asked): the engine reads no cached block, 0. None for a streamed batch:
    it reports whichever prompt's first token came first, which no one outside the engine knows
    (real vLLM, [cold b, warm a] streamed three times: 640, 0, 0)."""
    if not reads_cache:
        return 0
    if stream:
        return predicted if last is None else None
    tokens = request.prompt_tokens if last is None else last[0]
    cap = max(0, (tokens - 1) // request.block_size)
    if choices > 1:
        return cap * request.block_size
    return predicted if last is None else min(cap, last[1]) * request.block_size


def explain(request: RequestView, views: Sequence[ReplicaView], decision: Decision, decision_s: float) -> dict:
    """A JSON-able explanation: every replica's inputs, and every ranked candidate's terms."""
    ranked = {c.replica_id: (i, c) for i, c in enumerate(decision.ranked)}
    out_views = []
    for v in views:
        rank_c = ranked.get(v.replica_id)
        out_views.append({
            "replica_id": v.replica_id,
            "healthy": v.healthy,
            "index_live": v.index_live,
            "matched_blocks_gpu": v.matched_blocks_gpu,
            "matched_blocks_cpu": v.matched_blocks_cpu,
            "running_reqs": v.running_reqs,
            "waiting_reqs": v.waiting_reqs,
            "inflight_reqs": v.inflight_reqs,
            "inflight_prefill_tokens": v.inflight_prefill_tokens,
            "kv_usage": v.kv_usage,
            "prefill_s_per_token": v.prefill_s_per_token,
            "decode_step_s": v.decode_step_s,
            "kv_capacity_blocks": v.kv_capacity_blocks,
            "kv_cached_frac": v.kv_cached_frac,
            "mean_uncached_prefill_tokens": v.mean_uncached_prefill_tokens,
            "mean_output_tokens": v.mean_output_tokens,
            "routed_rps": v.routed_rps,
            "rank": rank_c[0] if rank_c else None,
            "score": rank_c[1].score if rank_c else None,
            "terms": dict(rank_c[1].terms) if rank_c else None,
        })
    return {
        "policy": decision.policy,
        "winner": decision.winner,
        "decision_s": decision_s,
        "request": {"prompt_tokens": request.prompt_tokens, "block_size": request.block_size,
                    "full_blocks": len(request.keys), "max_output_tokens": request.max_output_tokens,
                    "tenant_hash": request.tenant_hash},
        "ranked": [c.replica_id for c in decision.ranked],
        "replicas": out_views,
    }
