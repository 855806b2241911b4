"""Routing assembly (pure): from a request's keys and what the gateway knows of each replica, the
`ReplicaView`s a policy ranks, and the explanation of its decision.

Per replica r (DESIGN.md "One request, end to end", steps 5-6):
- matched blocks: the index's leading run for r (GPU, and GPU-or-CPU); 0 when r is absent;
- load: the agent's last report (running, waiting, KV usage) plus in-flight work: this gateway's
  and the other gateways' requests without a first token yet, with their uncached prefill tokens.
  Without a report (load-only mode, or an agent not yet heard from) the running count is this
  gateway's own active requests;
- extras: mean uncached prefill tokens and mean max_tokens of requests sent there (LoadTracker),
  cache fill (index entries / KV blocks), routed requests per second;
- rates: the calibrator's prefill seconds per token and decode step seconds (priors at first);
- health: probes and passive ejection (`Membership`); index liveness from the feed.
Nothing here does I/O or reads a clock except through the arguments.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from policies.base import Decision, ReplicaView, RequestView

__all__ = ["build_views", "explain", "MEAN_UNCACHED_EXTRA", "CACHE_FILL_EXTRA", "ROUTED_RATE_EXTRA", "MEAN_OUTPUT_EXTRA"]

MEAN_UNCACHED_EXTRA = "mean_uncached_prefill_tokens"  # policies.cache_aware reads these extras
CACHE_FILL_EXTRA = "kv_cached_frac"  # share of the replica's KV blocks holding indexed prefixes
ROUTED_RATE_EXTRA = "routed_rps"  # requests routed to the replica per second (EWMA)
MEAN_OUTPUT_EXTRA = "mean_output_tokens"  # mean max_tokens of requests routed to the replica (EWMA)


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
) -> list[ReplicaView]:
    """One ReplicaView per replica id, in the given order.

    matches: rid -> Match(gpu_blocks, any_blocks) (absent: no match); available: rid -> healthy;
    live: rid -> the replica's feed is current; reports: rid -> LoadReport or None;
    loads: rid -> gateway.load.ReplicaLoad; rates: rid -> (prefill_s_per_token, decode_step_s);
    cached_frac: rid -> indexed blocks / the engine's KV blocks (absent: unknown);
    routed_rps: rid -> requests routed there per second (absent: unknown).
    """
    views = []
    for rid in replica_ids:
        m = matches.get(rid)
        rep = reports.get(rid)
        ld = loads.get(rid)
        prefill, decode = rates[rid]
        inflight_reqs = (ld.inflight_reqs + ld.others_reqs) if ld is not None else 0
        inflight_tokens = (ld.inflight_tokens + ld.others_tokens) if ld is not None else 0
        if rep is not None:
            running, waiting, kv = rep.running_reqs, rep.waiting_reqs, rep.kv_usage
        else:
            running, waiting, kv = (ld.active_reqs if ld is not None else 0), 0, 0.0
        extra = {}
        if ld is not None and ld.mean_uncached_tokens >= 0:
            extra[MEAN_UNCACHED_EXTRA] = ld.mean_uncached_tokens
        if ld is not None and ld.mean_output_tokens >= 0:
            extra[MEAN_OUTPUT_EXTRA] = ld.mean_output_tokens
        if cached_frac and rid in cached_frac:
            extra[CACHE_FILL_EXTRA] = cached_frac[rid]
        if routed_rps is not None:
            extra[ROUTED_RATE_EXTRA] = routed_rps.get(rid, 0.0)
        views.append(ReplicaView(
            replica_id=rid,
            healthy=bool(available.get(rid, False)),
            matched_blocks_gpu=m.gpu_blocks if m is not None else 0,
            matched_blocks_cpu=m.any_blocks if m is not None else 0,
            index_live=bool(live.get(rid, False)),
            running_reqs=running,
            waiting_reqs=waiting,
            inflight_reqs=inflight_reqs,
            inflight_prefill_tokens=inflight_tokens,
            kv_usage=kv,
            prefill_s_per_token=prefill,
            decode_step_s=decode,
            extra=extra,
        ))
    return views


def predicted_matched_tokens(request: RequestView, view: ReplicaView | None) -> int:
    """Tokens the engine should report as cached if the index is right (whole blocks, GPU or CPU)."""
    if view is None:
        return 0
    cap = max(0, (request.prompt_tokens - 1) // request.block_size)
    return min(view.matched_blocks_cpu, cap) * request.block_size


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
