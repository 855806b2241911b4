"""Read-only views of a running gateway's state: readiness, the scrape-time metrics state and the
`/debug/index` description (pure reads of a `gateway.server.Gateway`; no I/O).

Readiness (`/readyz` 200) needs: the tokenizer loaded, the model's name and context length known,
at least one replica, one of them available, not draining, and start-up finished: the request
pipeline built and, when the gateway serves the API, its port listening (the admin port answers
from the start of start-up; a 200 before the API port listens sent a load test's first request to
a closed port). What degrades routing without stopping
it is listed in `degraded()` (`/readyz` "degraded", 200 all the same): the feed unreachable (the
gateway serves from the last known index, then by load only as each replica's entries go stale;
taking every gateway out of service because the shared Redis is down would be an outage of its
own), and replicas whose index disagrees with their engine (gateway.index_health).
"""
from __future__ import annotations

import os

__all__ = ["readiness", "degraded", "state_for_metrics", "describe"]


def readiness(gw) -> tuple[bool, list[str]]:
    why = []
    if gw.tokenizer is None:
        why.append("tokenizer not loaded")
    if not gw.model.known:
        why.append("model name unknown (set model.name or make a replica answer /v1/models)")
    if gw.model.max_model_len is None:
        why.append("max_model_len unknown")
    if not gw.membership.ids():
        why.append("no replicas")
    elif not gw.membership.any_available():
        why.append("no replica available")
    if gw.draining:
        why.append("draining")
    if gw.pipeline is None or (gw.api_port and not gw.url):
        why.append("starting (the API port is not listening yet)" if gw.api_port else "starting")
    return not why, why


def degraded(gw) -> list[str]:
    """What makes routing worse without stopping it (module header), one sentence each."""
    out = []
    if not gw.cfg.feed.load_only and not gw.feed_ok:
        out.append(f"feed unreachable ({gw.board_health.failures} failed polls in a row): routing from the "
                   f"last known index, by load only for replicas silent over {gw.cfg.feed.stale_after_s:g}s")
    health = gw.routing.health
    for rid, mean in sorted(health.distrusted().items()):
        out.append(f"replica {rid}: index disagrees with the engine (mean agreement {mean:.2f} over the last "
                   f"{health.window_reqs} requests, below {health.distrust_below:g}): routed by load only")
    if gw.tokenize_checker is not None:
        out += gw.tokenize_checker.drift.degraded()
    return out


def state_for_metrics(gw) -> dict:
    index, load, cal = gw.routing.index, gw.routing.load, gw.routing.calibrator
    st = index.stats()
    now = gw.membership.clock()
    reps = {}
    for s in gw.membership.all():
        ld = load.get(s.replica_id)
        reps[s.replica_id] = {"available": s.available(now), "index_live": index.is_live(s.replica_id),
                              "inflight_reqs": ld.inflight_reqs, "active_reqs": ld.active_reqs,
                              "index_trusted": gw.routing.health.trusted(s.replica_id),
                              "index_agreement": gw.routing.health.agreement(s.replica_id)}
    rates = {rid: (cal.prefill_s_per_token(rid), cal.decode_step_s(rid)) for rid in gw.membership.ids()}
    return {"index_entries": st.entries, "index_bytes": st.bytes_estimate, "index_evictions": st.evictions,
            "index_speculative": st.speculative_entries, "feed_lag": st.feed_lag_s_by_replica,
            "background_held": len(gw.pipeline.holds) if gw.pipeline is not None and gw.pipeline.holds is not None else 0,
            "entries_by_replica": st.entries_by_replica, "rates": rates, "replicas": reps,
            "ready": readiness(gw)[0], "feed_up": gw.cfg.feed.load_only or gw.feed_ok,
            "feed_errors": gw.board_health.total_failures + (gw.index_sync.stats["feed_errors"] if gw.index_sync else 0),
            "index_distrusted": gw.routing.health.distrusted_counts(),
            "tokenizer_mismatch": set(gw.tokenize_checker.drift.mismatched) if gw.tokenize_checker is not None else set()}


def describe(gw) -> dict:
    index = gw.routing.index
    st = index.stats()
    return {
        "model": gw.model.name, "block_size": gw.cfg.model.block_size, "policy": gw.cfg.policy.name, "pid": os.getpid(),
        # LoRA adapters: configured (on every replica) and as each replica's /v1/models last listed them
        "lora_adapters": {"configured": sorted(gw.model.configured_adapters),
                          "listed": {rid: sorted(names) for rid, names in sorted(gw.model.listed.items())}},
        # placement records traded with the other gateways (cache_plan's plan): sent (taken for an
        # exchange; lost with it if it fails, like copies in progress), applied, and skipped as
        # malformed (another version's)
        "placements": dict(gw.routing.placements_traded),
        # keep-alive (off: None): this process's rank among the gateways (the lowest refreshes a
        # root they keep; gateway.keepalive), prefixes kept per replica, refreshes sent, and the
        # refresh records traded with the other gateways (sent, heard)
        "keep_alive": None if gw.retainer is None else {
            "rank": gw.retainer.rank, "kept": {rid: len(k) for rid, k in gw.retainer.kept.items()},
            "refreshes": gw.retainer.sent, "traded": dict(gw.routing.refreshes_traded)},
        # the tokenizer check (gateway.tokenize_check): replicas with a check in flight, and each
        # replica whose last check found other ids than ours (lengths, first differing position)
        "tokenize_check": None if gw.tokenize_checker is None else gw.tokenize_checker.drift.describe(),
        "feed": {"ok": gw.cfg.feed.load_only or gw.feed_ok, "failed_polls": gw.board_health.failures,
                 "sync": dict(gw.index_sync.stats) if gw.index_sync else None},
        "index": {"entries": st.entries, "bytes_estimate": st.bytes_estimate, "evictions": st.evictions,
                  "replicas": st.replicas, "live_replicas": st.live_replicas,
                  "speculative_entries": st.speculative_entries, "max_entries": gw.cfg.feed.index_max_entries},
        "replicas": [_replica(gw, s, st) for s in gw.membership.all()],
    }


def _replica(gw, s, st) -> dict:
    index, load, cal = gw.routing.index, gw.routing.load, gw.routing.calibrator
    now = gw.membership.clock()
    ld = load.get(s.replica_id)
    rep = index.last_load(s.replica_id)
    t = gw.routing.clock()  # the load tracker's clock
    return {
        "replica_id": s.replica_id, "url": s.url, "available": s.available(now), "probe_ok": s.probe_ok,
        "failures": s.failures, "ejected_for_s": max(0.0, s.ejected_until - now), "last_error": s.last_error,
        "index_live": index.is_live(s.replica_id), "entries": st.entries_by_replica.get(s.replica_id, 0),
        "index_trusted": gw.routing.health.trusted(s.replica_id),
        "index_agreement": gw.routing.health.agreement(s.replica_id),
        "feed_lag_s": st.feed_lag_s_by_replica.get(s.replica_id),
        "load_report": None if rep is None else {"running_reqs": rep.running_reqs, "waiting_reqs": rep.waiting_reqs,
                                                 "kv_usage": rep.kv_usage, **({"max_lora": rep.max_lora,
                                                 "lora_running": list(rep.lora_running),
                                                 "lora_waiting": list(rep.lora_waiting)} if rep.max_lora else {})},
        "inflight_reqs": ld.inflight_reqs, "inflight_tokens": ld.inflight_tokens, "active_reqs": ld.active_reqs,
        # this gateway's requests there per LoRA adapter: no first token yet, and generating
        "lora_reqs": {"inflight": dict(ld.inflight_loras or {}), "active": dict(ld.active_loras or {})},
        # the other gateways' adapters there as of the last exchange: generating, and not yet
        "others_loras": {"running": list(ld.others_lora_running), "wanting": list(ld.others_lora_wanting)},
        "others_inflight_reqs": ld.others_reqs,
        # requests routed there per second, by this gateway and by every gateway (gateway.load's
        # dispatch gauges), and the mean uncached tokens of those requests (by age; None: none yet)
        "routed_rps": round(load.routed_rps(s.replica_id, t), 4),
        "pool_routed_rps": round(load.pool_routed_rps(s.replica_id, t), 4),
        "pool_mean_uncached_tokens": (round(m, 1) if (m := load.pool_mean_uncached(s.replica_id, t)) >= 0 else None),
        "prefill_s_per_token": cal.prefill_s_per_token(s.replica_id),
        "decode_step_s": cal.decode_step_s(s.replica_id),
    }
