"""cache_aware: send each request where its first token comes soonest (the product's policy).

The rule
--------
Every term is in seconds of this request's time to first token (TTFT), per replica r::

    matched_tokens   = min(gpu_blocks, cap) x block_size                         (GPU run counts fully)
                     + cpu_weight x (min(cpu_blocks, cap) - min(gpu_blocks, cap)) x block_size
                       where cap = (prompt_tokens - 1) // block_size; 0 when not index_live
    cache_benefit_s  = matched_tokens x prefill_s_per_token(r)
    backlog_tokens   = max(waiting_reqs x uncached_tokens_per_req(r), inflight_prefill_tokens)
    queue_penalty_s  = backlog_tokens x prefill_s_per_token(r)
                     + running_reqs x running_step_share x decode_step_s(r)
                     + (decode_step_s(r) x busy_step_share  if the replica has any work)
    kv_pressure      = max(0, kv_usage - kv_threshold) / (1 - kv_threshold)      (0..1)
    kv_penalty_s     = kv_pressure x uncached_tokens x prefill_s_per_token(r)
    score            = w_cache x cache_benefit_s - w_queue x queue_penalty_s - w_kv x kv_penalty_s

Highest score wins. Ties (scores within 1 ns) go to the smaller queue penalty, then the fewer
outstanding requests (`_common.load_reqs`), then a draw from `rng`. With all weights 1 the score is
``prompt_tokens x prefill_s_per_token - predicted TTFT``: ranking by score is ranking by predicted
TTFT, so a warm replica wins exactly while its queue costs less than the prefill it saves. A
prefix too hot for one replica therefore spills on its own: as the holder's backlog grows, a cold
replica's smaller penalty outweighs the holder's benefit, the request goes there, and the
gateway's speculative insertion (then the engine's events) make that replica a second holder.

Why these pieces
----------------
- The engine always recomputes the last prompt token, and hits are whole blocks: a prompt that is
  entirely cached saves at most ``(prompt_tokens - 1) // block_size`` blocks (`cap`).
- ``matched_blocks_cpu`` is the run counting GPU *or* CPU-offload blocks (>= the GPU run); the part
  beyond the GPU run must be copied back, so it counts with `cpu_weight` (llm-d uses 0.8).
- A replica whose feed is not live (`index_live` False) is routed by load only: its matches are
  ignored rather than trusted.
- Backlog: the engine reports request *counts*; a waiting request costs its uncached prefill,
  which we estimate per replica as ``extra["mean_uncached_prefill_tokens"]`` when the gateway
  tracks it (mean uncached tokens of requests recently sent there) and `prior_uncached_tokens`
  otherwise. The gateways' in-flight work (requests without a first token yet, with their
  uncached tokens) is the fresh view of the same queue; the two overlap, so the larger counts.
- Running requests are mostly decoding: with continuous batching each one lengthens every step
  this request's prefill shares, by about ``running_step_share`` of a decode step; and a busy
  replica is mid-step when the request lands (on average ``busy_step_share`` of a step to wait).
- KV pressure (off by default): near a full KV cache, admitting a request evicts cached blocks
  or preempts; the penalty is the share of its own prefill at risk.

Parameters (constructor, all keyword; config and Helm values use the same names)
--------------------------------------------------------------------------------
w_cache              weight of cache_benefit_s; dimensionless, >= 0 (default 2.0, see below)
w_queue              weight of queue_penalty_s; dimensionless, >= 0 (default 1.0). A larger
                     w_cache / w_queue holds on to warm replicas longer; a smaller one spreads
                     load earlier.
w_kv                 weight of kv_penalty_s; dimensionless, >= 0 (default 0.0 = off)
cpu_weight           value of a CPU-offload block relative to a GPU block; 0..1 (default 0.8)
prior_uncached_tokens  uncached prefill tokens assumed per waiting request when the gateway has
                     no per-replica mean; tokens, >= 0 (default 512)
running_step_share   fraction of a decode step each running request adds to the wait; 0..1
                     (default 0.02: a 50-sequence batch roughly doubles a bare step)
busy_step_share      fraction of a decode step a request waits for the step in progress on a
                     busy replica; 0..1 (default 0.5)
kv_threshold         KV usage above which pressure starts; 0..1 (default 0.9)

Why w_cache = 2 by default (tuned in loadtests/vtime_report.py runs): with w_cache = 1 the rule is
myopic. It prices a miss at this request's own prefill only, but the miss also costs the chosen
replica KV room (it evicts other prefixes) and GPU time that delays everything queued behind it.
At ~70% load on shared documents with KV for a third of the working set, w_cache <= 1.5 tips into
a thrash cascade (spill -> evictions -> more misses -> longer queues -> more spill: hit ratio 0.4,
p99 minutes), while w_cache = 2 stays at 0.95 hit ratio. The price: a hot prefix stays on fewer
replicas (each holder accepts up to about twice the saved prefill in queueing before it spills).

Every candidate's `terms`: matched_blocks, matched_blocks_cpu, matched_tokens, uncached_tokens,
cache_benefit_s, backlog_tokens, queue_penalty_s, kv_pressure, kv_penalty_s, load_reqs, score.
Pure: no I/O, no state; `rng` is used for the final tie-break only (one draw per candidate).
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import SCORE_RESOLUTION_S, load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["CacheAwarePolicy", "MEAN_UNCACHED_EXTRA"]

# ReplicaView.extra key: mean uncached prefill tokens of requests recently sent to the replica.
MEAN_UNCACHED_EXTRA = "mean_uncached_prefill_tokens"


class CacheAwarePolicy(PolicyBase):
    """Rank by w_cache x cache_benefit_s - w_queue x queue_penalty_s - w_kv x kv_penalty_s."""

    name: ClassVar[str] = "cache_aware"

    def __init__(
        self,
        *,
        w_cache: float = 2.0,
        w_queue: float = 1.0,
        w_kv: float = 0.0,
        cpu_weight: float = 0.8,
        prior_uncached_tokens: float = 512.0,
        running_step_share: float = 0.02,
        busy_step_share: float = 0.5,
        kv_threshold: float = 0.9,
    ) -> None:
        for label, val in (("w_cache", w_cache), ("w_queue", w_queue), ("w_kv", w_kv), ("prior_uncached_tokens", prior_uncached_tokens)):
            if not val >= 0:
                raise ValueError(f"{label} must be >= 0, got {val!r}")
        for label, val in (("cpu_weight", cpu_weight), ("running_step_share", running_step_share), ("busy_step_share", busy_step_share)):
            if not 0.0 <= val <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {val!r}")
        if not 0.0 <= kv_threshold < 1.0:
            raise ValueError(f"kv_threshold must be in [0, 1), got {kv_threshold!r}")
        self.w_cache = float(w_cache)
        self.w_queue = float(w_queue)
        self.w_kv = float(w_kv)
        self.cpu_weight = float(cpu_weight)
        self.prior_uncached_tokens = float(prior_uncached_tokens)
        self.running_step_share = float(running_step_share)
        self.busy_step_share = float(busy_step_share)
        self.kv_threshold = float(kv_threshold)

    def params(self) -> dict[str, float]:
        """The constructor parameters, for reports and spans."""
        return {
            "w_cache": self.w_cache,
            "w_queue": self.w_queue,
            "w_kv": self.w_kv,
            "cpu_weight": self.cpu_weight,
            "prior_uncached_tokens": self.prior_uncached_tokens,
            "running_step_share": self.running_step_share,
            "busy_step_share": self.busy_step_share,
            "kv_threshold": self.kv_threshold,
        }

    def terms(self, request: RequestView, v: ReplicaView) -> dict[str, float]:
        """The score and its terms for one replica (see the module header)."""
        bs = request.block_size
        cap_blocks = max(0, (request.prompt_tokens - 1) // bs) if bs > 0 else 0
        if v.index_live:
            gpu_blocks = min(v.matched_blocks_gpu, cap_blocks)
            any_blocks = min(max(v.matched_blocks_cpu, v.matched_blocks_gpu), cap_blocks)
        else:
            gpu_blocks = any_blocks = 0
        matched_tokens = (gpu_blocks + self.cpu_weight * (any_blocks - gpu_blocks)) * bs
        uncached_tokens = max(0, request.prompt_tokens - gpu_blocks * bs - (any_blocks - gpu_blocks) * bs)
        p = v.prefill_s_per_token
        step = v.decode_step_s
        per_req = v.extra.get(MEAN_UNCACHED_EXTRA, self.prior_uncached_tokens) if v.extra else self.prior_uncached_tokens
        backlog_tokens = max(v.waiting_reqs * per_req, float(v.inflight_prefill_tokens))
        busy = v.running_reqs > 0 or v.waiting_reqs > 0 or v.inflight_reqs > 0
        queue_penalty_s = (
            backlog_tokens * p
            + v.running_reqs * self.running_step_share * step
            + (self.busy_step_share * step if busy else 0.0)
        )
        cache_benefit_s = matched_tokens * p
        kv_pressure = max(0.0, v.kv_usage - self.kv_threshold) / (1.0 - self.kv_threshold)
        kv_penalty_s = kv_pressure * uncached_tokens * p
        score = self.w_cache * cache_benefit_s - self.w_queue * queue_penalty_s - self.w_kv * kv_penalty_s
        return {
            "matched_blocks": float(gpu_blocks),
            "matched_blocks_cpu": float(any_blocks),
            "matched_tokens": float(matched_tokens),
            "uncached_tokens": float(uncached_tokens),
            "cache_benefit_s": cache_benefit_s,
            "backlog_tokens": float(backlog_tokens),
            "queue_penalty_s": queue_penalty_s,
            "kv_pressure": kv_pressure,
            "kv_penalty_s": kv_penalty_s,
            "load_reqs": float(load_reqs(v)),
            "score": score,
        }

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        keyed = []
        for v in replicas:
            if not v.healthy:
                continue
            t = self.terms(request, v)
            keyed.append((-round(t["score"] / SCORE_RESOLUTION_S), t["queue_penalty_s"], t["load_reqs"], rng.random(), v.replica_id, t))
        keyed.sort(key=lambda k: k[:4])
        return Decision(self.name, tuple(Candidate(k[4], k[5]["score"], k[5]) for k in keyed))
