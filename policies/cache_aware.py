"""cache_aware: send each request where its first token comes soonest (the product's policy).

The rule
--------
Every term is in seconds of this request's time to first token (TTFT), per replica r::

    matched_tokens   = min(gpu_blocks, cap) x block_size                         (GPU run counts fully)
                     + cpu_weight x (min(cpu_blocks, cap) - min(gpu_blocks, cap)) x block_size
                       where cap = (prompt_tokens - 1) // block_size; 0 when not index_live
    cache_benefit_s  = matched_tokens x prefill_s_per_token(r)
    backlog_tokens   = max(waiting_reqs x uncached_tokens_per_req(r), inflight_prefill_tokens)
    slots_full       = waiting_reqs > 0 AND running_reqs >= max_num_seqs                (0/1)
    slot_wait_s      = (waiting_reqs + 1) x output_tokens_per_req(r) x decode_step_s(r) / max_num_seqs
                       if slots_full else 0
    lora_full        = the request runs LoRA adapter A, max_lora(r) > 0, A not in lora_running(r)
                       AND |lora_running(r) + lora_waiting(r) + A| > max_lora(r)        (0/1)
    lora_wait_s      = generation(r) = output_tokens_per_req(r) x decode_step_s(r)  if lora_full else 0
    lora_spread_s    = generation(r) x slots_taken
                       if A runs on another healthy replica, not on r, and r has a free slot, else 0
                       (slots_taken: the share of the healthy replicas' LoRA slots held or wanted)
    queue_penalty_s  = max(backlog_tokens x prefill_s_per_token(r), slot_wait_s, lora_wait_s)
                     + running_reqs x running_step_share x decode_step_s(r)
                     + (decode_step_s(r) x busy_step_share  if the replica has any work)
    cache_fill       = kv_cached_frac (share of r's KV holding cached prefixes), else
                       default_cache_fill                                         (0..1)
    evict_penalty_s  = cache_fill x uncached_tokens x prefill_s_per_token(r)
    kv_pressure      = max(0, kv_usage - kv_threshold) / (1 - kv_threshold)      (0..1)
    kv_penalty_s     = kv_pressure x uncached_tokens x prefill_s_per_token(r)
    load_over        = load_reqs(r) > balance_rel x mean_load AND load_reqs(r) - mean_load >= balance_abs_reqs
    structural       = routed_rps(r) > balance_rate_rel x mean_routed_rps          (true when rates unknown)
    rate_over        = structural AND (routed_rps(r) - mean_routed_rps) x routed_tau_s >= balance_abs_reqs
                       (false when rates unknown)
    sole_copy        = matched blocks (GPU or CPU, capped) on r > others_blocks, the longest match on any
                       other healthy replica of this decision
    balance_guard    = load_over OR rate_over                                          if not sole_copy
                     = load_over AND structural AND load_reqs(r) > balance_exclusive_rel x mean_load
                                                                                       if sole_copy
                       (means over the healthy replicas of this decision; routed_rps =
                       routed_rps, the gateway's EWMA of requests it sent there per second;
                       terms() called without others_blocks treats the request as not a sole copy)
    balance_penalty_s= (w_cache + w_evict x cache_fill) x cache_benefit_s  if balance_guard else 0
    score            = w_cache x cache_benefit_s - w_queue x queue_penalty_s
                       - w_evict x evict_penalty_s - w_kv x kv_penalty_s - balance_penalty_s - lora_spread_s

Highest score wins. Ties (scores within 1 ns) go to the smaller queue penalty, then the fewer
outstanding requests (`_common.load_reqs`), then a draw from `rng`.

A new prefix when several gateways share the pool. A prompt no healthy replica holds any block
of (a new document, a new system prompt's first chat) goes to a replica drawn from `rng` among
those scoring within slack = min(new_prefix_slack_s, own_prefill_s) x others_share of the best,
where own_prefill_s = the request's uncached tokens x prefill_s_per_token on the best replica
(what one such placement adds to a queue: the others' unseen placements of new prefixes are
about that size each, and rankings closer than that are their noise) and others_share =
sum(others_routed_rps) / sum(routed_rps) over the healthy replicas: the share of the pool's
requests that other gateways route (0 with one gateway: the rule above, unchanged). Why: the
gateways (pods, or `--workers` processes) learn each other's dispatches only at their exchange
(every 0.1 s); between two they rank on the same view, and the exact order sends every new prefix
any of them sees to the same replica, which becomes the only holder of all of them and carries
their conversations from then on. Measured in virtual time (four processes, cache_plan, busy
multi_turn, seeds 0-19, median per-seed TTFT p50 / p99): 1.20 / 29.0 s with 25 requests
unfinished -> 1.12 / 22.4 s with none; on the worst seed the first eight system prompts had gone
5 / 1 / 1 / 1 to the replicas, four of them to r0 from four processes within one exchange period.
Drawing among near-best replicas for every request cost one gateway, which ranks on fresh counts,
a longer median (0.80 -> 0.96 s): hence new prefixes only, and only beside other gateways. The
own-prefill cap: without it, where every prompt is new and prefill is fast (no_sharing,
GPU-speed prefill, 16 replicas, two processes) the draw was nearly random, TTFT p99 0.195 ->
0.271 s (with it 0.203; the busy multi-turn figures above are the same with or without it). A
slack from the others' unseen dispatches (their routed rate x 0.1 s x mean request) avoided that
but not the herd (the rates start at zero).

What a miss really costs. Sending a request where its prefix is not cached costs (1) its own
prefill of the uncached tokens (what cache_benefit_s saves, counted relative to a cold replica),
and (2) the KV room those tokens take: on a replica whose cache is full of live prefixes every new
block evicts a cached one, which some later request must prefill again. `evict_penalty_s` prices
(2) at one re-prefill per evicted block, scaled by how full of cached prefixes the replica is (an
empty or idle cache evicts nothing). In a warm pool the two together make a miss cost about
twice its prefill: this is the principled part of what the previous fixed ``w_cache = 2`` did,
and it vanishes where it should (cold caches, no_sharing, where every replica misses equally).

Why the balance guard. The score is a per-request TTFT comparison. A hot prefix's requests are
cheap on its holders (one decode slot each, a few tokens of prefill), so a holder's *TTFT* queue
stays small while it carries many times the mean number of requests (their decode steps, ITL and
end-to-end latency suffer, which TTFT does not see). Pricing that with a smaller w_cache spreads
every prefix earlier and tips shared documents at ~70% load into a thrash cascade (spill ->
evictions -> misses -> longer queues -> more spill). So the trade-off is split: the score keeps
prefixes sticky, and a guard in the style of SGLang's (relative AND absolute threshold, so small
absolute noise on lightly loaded replicas never fires it) withdraws a replica's whole cache credit
while its outstanding requests exceed the mean by both. A guarded replica then competes on load
alone; the request goes to the best unguarded replica, which is another holder when there is one
(the spill stays warm) and otherwise the least-loaded one, which becomes a new holder through the
speculative insertion. The guard measures requests, not seconds, on purpose: the imbalance it
corrects is exactly the one that seconds of TTFT queue do not show.

Which requests it moves. Moving a request costs what the holder's match saves over the best other
replica's: nothing when another replica holds as long a match (a hot prefix with several holders, a
chat's first turn, which matches only its shared system prompt), the whole prefill of the
difference when the holder has the only copy (a conversation's history, a document's sole copy).
So the guard sheds the *free* requests readily and the sole copies only at a severe overload:
- a free request (not sole_copy) moves on either sign of imbalance, each relative AND absolute:
  the outstanding requests (load_over; the decode batch, ITL), or the share of arrivals
  (rate_over: routed_rps above balance_rate_rel x the mean, by at least balance_abs_reqs requests
  over the rate's window routed_tau_s). Both are needed: by Little's law a holder of cheap
  requests (a hot prefix: a few tokens of prefill each) turns them over faster than replicas
  prefilling whole documents, so its outstanding count sits near the mean while it receives 1.7x
  the mean number of requests (hot_prefix at 64 replicas, when only load_over counted); and a
  replica receiving its share can still hold a burst of outstanding requests.
- a sole copy moves only when its replica is over the load thresholds, receives more than its
  share (structural: a hot prefix whose holder keeps *receiving* more, not noise) and carries
  more than balance_exclusive_rel x the mean outstanding requests (seeding a second holder of a
  hot prefix; after that its requests are free). Below that the replica sheds its free requests
  instead. Without this rule the guard fired on the noise of outstanding counts (conversations
  are sticky: at 64 replicas a replica's count sits 1.4x over the mean now and then) and moved
  conversations whose whole history then missed: 10% of multi_turn requests moved at 64 replicas,
  and those moves were the p99 (0.129 s, against 0.053 s since). The shared system prompts are
  what needs spreading there (8 prompts on 64 replicas pin new chats to their holders; without
  the guard some replicas get no chat at all), and their first turns are free requests.
It cannot raise a score: more load or more routed rate on a replica can only switch its guard on,
a longer match elsewhere only makes its requests free, and at equal loads and rates it never fires.

Why these pieces
----------------
- The engine always recomputes the last prompt token, and hits are whole blocks: a prompt that is
  entirely cached saves at most ``(prompt_tokens - 1) // block_size`` blocks (`cap`).
- ``matched_blocks_cpu`` is the run counting GPU *or* CPU-offload blocks (>= the GPU run); the part
  beyond the GPU run must be copied back, so it counts with `cpu_weight` (llm-d uses 0.8).
- A replica whose feed is not live (`index_live` False) is routed by load only: its matches are
  ignored rather than trusted.
- Backlog: the engine reports request *counts*; a waiting request costs its uncached prefill,
  which we estimate per replica as the view's ``mean_uncached_prefill_tokens`` when the gateway
  tracks it (mean uncached tokens of requests recently sent there) and `prior_uncached_tokens`
  otherwise. The gateways' in-flight work (requests without a first token yet, with their
  uncached tokens) is the fresh view of the same queue; the two overlap, so the larger counts.
- Saturation (slot wait). The engine admits a waiting request at the next step unless the step's
  token budget is spent (a prefill burst: it drains at the prefill rate, which backlog_tokens
  prices), or every sequence slot is taken (`running_reqs >= max_num_seqs`), or KV blocks are
  short. With the slots full a waiting request is admitted only when a running one *finishes*:
  the newcomer waits for waiting_reqs + 1 completions, and a full batch of max_num_seqs requests
  completes at about max_num_seqs / (output_tokens x decode_step_s) per second, which gives
  `slot_wait_s`: seconds of decoding, typically far more than any prefill the cache saves
  (18 requests held on a 8-slot CPU replica: ~2 s against a ~0.03 s cache benefit). The gate
  is positive evidence of saturation on purpose: a scrape shows waiting requests on every busy
  replica (arrivals since the last step, prefill bursts under the token budget), and those are
  admitted within a step or two whatever the decode length, so pricing them by completions would
  spread every prefix. The two estimates are alternative bottlenecks of the same queue (slots
  freed by completions, or budget freed by prefills; admitted prefills overlap the others'
  decodes), so the slower one counts: max, not sum. Dividing by max_num_seqs (equal to
  running_reqs whenever the gate is on) rather than by running_reqs keeps the term
  non-decreasing in every load signal. output_tokens_per_req(r) is the view's ``mean_output_tokens``
  (the gateway's moving mean of max_tokens of requests it sent there; an upper bound of what they
  generate, which errs toward leaving a saturated replica) else `prior_output_tokens`.
  Not modelled: waiting for KV blocks with free slots (the view lacks the replica's block count
  and a request's block need); `w_kv`'s kv_penalty is the only KV signal.
- LoRA slots are the same kind of wait: an engine batches at most `max_lora` adapters (vLLM
  `--max-loras`), and its scheduler skips a waiting request whose adapter is not among the running
  ones while those fill the slots, until one of them drains (its last running request finishes
  with none of it waiting): at least about one whole generation (`lora_wait_s`), longer while the
  slots' adapters keep getting work. The adapters waiting there want slots too, and the engine
  admits in queue order: a request gets a slot at once only if its adapter runs there or the
  running and waiting adapters with it fit in `max_lora`. `lora_running` and `lora_waiting` are
  the engine's report (vllm:lora_requests_info, through the agent) plus the adapters of this
  gateway's requests sent there since, and of the other gateways' as of their last exchange
  (generating: running; no first token yet: waiting unless their adapter runs). Taking a free
  slot for an adapter that already runs elsewhere costs other requests instead (as evicting
  does): the slot is held about a generation, and a request for an adapter that runs nowhere
  waits if it then finds none free, so a second slot is priced at a
  generation times the share of the pool's slots held or wanted (`lora_spread_s`: free when slots
  are plentiful, about a generation when all are wanted). An adapter's requests so gather where
  it runs (the Inference Extension's LoRA affinity) unless that replica's queue costs more.
  Measured (loadtests/bench_lora.py, its README command: 4 replicas, 8 adapters, 2 slots each,
  two rounds): TTFT p99 728 / 827 ms and 3 / 5 of 360 requests waiting in an engine for a slot,
  against 1,481 / 1,654 ms and 25 / 32 with `lora_spread_s` left out (a tree with it at 0: worse
  than not seeing the slots at all, in the p99), and 1,281-1,423 ms and 146-166 with the slots
  hidden from the gateway. An estimate of the longer wait (a generation x e^n / k, k holders with n
  requests in flight each, as Poisson streams) measured no different from the generation (714 /
  736 ms, 4 / 3 waiting), so the simpler price stays; at a load the pool cannot carry (prompts of
  ~700 tokens at the same rate) neither kept the slots from starving.
- Running requests are mostly decoding: with continuous batching each one lengthens every step
  this request's prefill shares, by about ``running_step_share`` of a decode step; and a busy
  replica is mid-step when the request lands (on average ``busy_step_share`` of a step to wait).
- Cache fill: the gateway's index knows how many blocks it holds per replica; divided by the
  replica's KV capacity that is `kv_cached_frac`. Unknown: `default_cache_fill` (1.0, i.e. assume a
  warm, full cache: the conservative side, which keeps prefixes sticky).
- KV pressure (off by default): near a full KV cache (blocks held by running requests), admitting
  a request preempts; the penalty is the share of its own prefill at risk.

Parameters (constructor, all keyword; config and Helm values use the same names)
--------------------------------------------------------------------------------
w_cache              weight of cache_benefit_s; dimensionless, >= 0 (default 2.0, see below)
w_queue              weight of queue_penalty_s; dimensionless, >= 0 (default 1.0)
w_evict              weight of evict_penalty_s; dimensionless, >= 0 (default 1.0: one re-prefill
                     per evicted live block; 0 switches the term off)
w_kv                 weight of kv_penalty_s; dimensionless, >= 0 (default 0.0 = off)
cpu_weight           value of a CPU-offload block relative to a GPU block; 0..1 (default 0.8)
prior_uncached_tokens  uncached prefill tokens assumed per waiting request when the gateway has
                     no per-replica mean; tokens, >= 0 (default 512)
running_step_share   fraction of a decode step each running request adds to the wait; 0..1
                     (default 0.02: a 50-sequence batch roughly doubles a bare step)
busy_step_share      fraction of a decode step a request waits for the step in progress on a
                     busy replica; 0..1 (default 0.5)
max_num_seqs         the engines' sequence-slot limit (vLLM --max-num-seqs); requests, >= 1
                     (default 256, vLLM's default; set it to the deployment's value: too high and
                     saturation is never priced, too low and a busy replica's passing waiting
                     requests are priced as a full queue)
prior_output_tokens  output tokens assumed per request when the gateway has no per-replica mean
                     (`mean_output_tokens`); tokens, >= 0 (default 256)
kv_threshold         KV usage above which pressure starts; 0..1 (default 0.9)
default_cache_fill   cache_fill when the view has no `kv_cached_frac`; 0..1 (default 1.0)
balance_rel          guard's relative threshold: load_reqs above this multiple of the mean;
                     >= 1, inf disables the guard (default 1.3; SGLang uses 1.5, which let hot
                     holders settle just above 1.5x the mean request count)
balance_abs_reqs     guard's absolute threshold: outstanding requests above the mean; requests,
                     >= 0 (default 4; SGLang uses 64 in-flight, far too coarse for small pools)
balance_rate_rel     guard's share condition: routed_rps above this multiple of the mean (rate_over,
                     structural); >= 1 (1 = any above-mean share), inf switches rate_over off and
                     keeps every sole copy (default 1.25); ignored when the views do not carry routed_rps
balance_exclusive_rel  a sole copy's guard also needs load_reqs above this multiple of the mean;
                     >= 1, inf: a sole copy never moves (default 2.0)
new_prefix_slack_s   a new prefix goes to a replica drawn among those within this much of the best
                     score (at most its own prefill), scaled by the other gateways' share of the
                     pool's routed requests (above); seconds, >= 0 (default 0.2; 0: the exact order)
routed_tau_s         time constant of the gateway's routed_rps EWMA (gateway.load.ROUTED_TAU_S): turns
                     a rate excess into requests for rate_over's absolute threshold; seconds, > 0
                     (default 10.0)

Defaults (tuned with ``python -m loadtests.vtime_report``; see loadtests/results/vtime.md). The
knife edge: at ~70% load on shared documents with KV for about a third of the working set, the
effective price of a miss relative to the queue must stay near 2x its prefill or more; at 1.8x
the pool tips into the thrash cascade (hit ratio 0.46, p99 > 20 s), at 1.9x it half-recovers
(0.82), at 2x it holds (0.89). `evict_penalty_s` supplies most of that second prefill from the
replicas' actual cache fill (about 0.8-0.85 in those runs), and w_cache = 2 keeps a margin on top
(effective ~2.8x), because spilling a shared prefix is cheap to undo late and ruinous to do early.
The guard (1.3x and 4 requests over the mean, or 1.25x the mean routed rate and 4 requests
routed over the mean; a sole copy at 2x the mean) then does the spreading the score deliberately
does not.

Every candidate's `terms`: matched_blocks, matched_blocks_cpu, matched_tokens, uncached_tokens,
cache_benefit_s, backlog_tokens, slots_full (0/1), output_tokens, slot_wait_s, lora_full (0/1),
lora_wait_s, lora_spread_s, queue_penalty_s,
cache_fill, evict_penalty_s, kv_pressure, kv_penalty_s, load_reqs, mean_load_reqs (-1 when terms() ran without one), routed_rps (-1 when
unknown), others_blocks (-1 when terms() ran without it), sole_copy (0/1), balance_guard (0/1),
balance_penalty_s, score.
Pure: no I/O, no state; `rng` is used for the final tie-break (one draw per candidate) and, for a
new prefix beside other gateways, one more draw among the replicas within the slack.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import SCORE_RESOLUTION_S, load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["CacheAwarePolicy"]


def lora_pool_state(lora: str | None, live: Sequence[ReplicaView]) -> tuple[frozenset, float] | None:
    """(the replicas running `lora`, the share of the pool's LoRA slots held or wanted) over
    `live`; None for a base-model request or a pool that reports no LoRA slots."""
    if lora is None:
        return None
    slots = sum(v.max_lora for v in live)
    if not slots:
        return None
    taken = sum(min(len(v.lora_running) + len(v.lora_waiting), v.max_lora) for v in live if v.max_lora)
    return frozenset(v.replica_id for v in live if lora in v.lora_running), taken / slots


def _lora_costs(lora: str | None, v: ReplicaView, generation_s: float,
                pool: tuple[frozenset, float] | None) -> tuple[bool, float, float]:
    """(lora_full, lora_wait_s, lora_spread_s) of a request running `lora` on `v` (module header)."""
    if lora is None or v.max_lora <= 0 or lora in v.lora_running:
        return False, 0.0, 0.0
    wanting = len(v.lora_running) + len(v.lora_waiting) + (lora not in v.lora_waiting)
    if wanting > v.max_lora:
        return True, generation_s, 0.0  # a slot frees with an adapter's last running request (module header)
    if pool is not None and pool[0] - {v.replica_id}:
        return False, 0.0, generation_s * pool[1]  # a second slot for an adapter that runs elsewhere
    return False, 0.0, 0.0


class CacheAwarePolicy(PolicyBase):
    """Rank by the score of the module header (cache benefit - queue - eviction - KV - guard)."""

    name: ClassVar[str] = "cache_aware"

    def __init__(
        self,
        *,
        w_cache: float = 2.0,
        w_queue: float = 1.0,
        w_evict: float = 1.0,
        w_kv: float = 0.0,
        cpu_weight: float = 0.8,
        prior_uncached_tokens: float = 512.0,
        running_step_share: float = 0.02,
        busy_step_share: float = 0.5,
        kv_threshold: float = 0.9,
        default_cache_fill: float = 1.0,
        balance_rel: float = 1.3,
        balance_abs_reqs: float = 4.0,
        balance_rate_rel: float = 1.25,
        balance_exclusive_rel: float = 2.0,
        routed_tau_s: float = 10.0,
        max_num_seqs: float = 256,
        prior_output_tokens: float = 256.0,
        new_prefix_slack_s: float = 0.2,
    ) -> None:
        for label, val in (
            ("w_cache", w_cache), ("w_queue", w_queue), ("w_evict", w_evict), ("w_kv", w_kv),
            ("prior_uncached_tokens", prior_uncached_tokens), ("balance_abs_reqs", balance_abs_reqs),
            ("prior_output_tokens", prior_output_tokens), ("new_prefix_slack_s", new_prefix_slack_s),
        ):
            if not val >= 0:
                raise ValueError(f"{label} must be >= 0, got {val!r}")
        for label, val in (("cpu_weight", cpu_weight), ("running_step_share", running_step_share), ("busy_step_share", busy_step_share), ("default_cache_fill", default_cache_fill)):
            if not 0.0 <= val <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {val!r}")
        if not 0.0 <= kv_threshold < 1.0:
            raise ValueError(f"kv_threshold must be in [0, 1), got {kv_threshold!r}")
        if not balance_rate_rel >= 1.0:
            raise ValueError(f"balance_rate_rel must be >= 1 (inf disables the guard), got {balance_rate_rel!r}")
        if not balance_exclusive_rel >= 1.0:
            raise ValueError(f"balance_exclusive_rel must be >= 1 (inf: a sole copy never moves), got {balance_exclusive_rel!r}")
        if not routed_tau_s > 0.0:
            raise ValueError(f"routed_tau_s must be > 0, got {routed_tau_s!r}")
        if not max_num_seqs >= 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs!r}")
        if not balance_rel >= 1.0:
            raise ValueError(f"balance_rel must be >= 1 (inf disables the guard), got {balance_rel!r}")
        self.w_cache = float(w_cache)
        self.w_queue = float(w_queue)
        self.w_evict = float(w_evict)
        self.w_kv = float(w_kv)
        self.cpu_weight = float(cpu_weight)
        self.prior_uncached_tokens = float(prior_uncached_tokens)
        self.running_step_share = float(running_step_share)
        self.busy_step_share = float(busy_step_share)
        self.kv_threshold = float(kv_threshold)
        self.default_cache_fill = float(default_cache_fill)
        self.balance_rel = float(balance_rel)
        self.balance_abs_reqs = float(balance_abs_reqs)
        self.balance_rate_rel = float(balance_rate_rel)
        self.balance_exclusive_rel = float(balance_exclusive_rel)
        self.routed_tau_s = float(routed_tau_s)
        self.max_num_seqs = float(max_num_seqs)
        self.prior_output_tokens = float(prior_output_tokens)
        self.new_prefix_slack_s = float(new_prefix_slack_s)

    def params(self) -> dict[str, float]:
        """The constructor parameters, for reports and spans."""
        return {
            "w_cache": self.w_cache,
            "w_queue": self.w_queue,
            "w_evict": self.w_evict,
            "w_kv": self.w_kv,
            "cpu_weight": self.cpu_weight,
            "prior_uncached_tokens": self.prior_uncached_tokens,
            "running_step_share": self.running_step_share,
            "busy_step_share": self.busy_step_share,
            "kv_threshold": self.kv_threshold,
            "default_cache_fill": self.default_cache_fill,
            "balance_rel": self.balance_rel,
            "balance_abs_reqs": self.balance_abs_reqs,
            "balance_rate_rel": self.balance_rate_rel,
            "balance_exclusive_rel": self.balance_exclusive_rel,
            "routed_tau_s": self.routed_tau_s,
            "max_num_seqs": self.max_num_seqs,
            "prior_output_tokens": self.prior_output_tokens,
            "new_prefix_slack_s": self.new_prefix_slack_s,
        }

    def terms(self, request: RequestView, v: ReplicaView, mean_load_reqs: float | None = None, mean_routed_rps: float | None = None, others_blocks: float | None = None,
              lora_pool: tuple[frozenset, float] | None = None) -> dict[str, float]:
        """The score and its terms for one replica (see the module header).

        `mean_load_reqs` is the mean `load_reqs` over the healthy replicas of the decision (what
        the balance guard compares against); None switches the guard off for this call.
        `mean_routed_rps` is the mean `routed_rps` over them (None: the signal is missing
        and the guard uses the load condition alone). `others_blocks` is the longest match (capped
        blocks, GPU or CPU) on any other healthy replica of the decision (None: not a sole copy).
        `lora_pool` is (the replicas running the request's adapter, the share of the pool's LoRA
        slots held or wanted) over the healthy replicas (`lora_pool_state`; None: no spread priced).
        """
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
        per_req = v.mean_uncached_prefill_tokens if v.mean_uncached_prefill_tokens is not None else self.prior_uncached_tokens
        backlog_tokens = max(v.waiting_reqs * per_req, float(v.inflight_prefill_tokens))
        out_tokens = max(0.0, v.mean_output_tokens) if v.mean_output_tokens is not None else self.prior_output_tokens
        slots_full = v.waiting_reqs > 0 and v.running_reqs >= self.max_num_seqs
        # saturated: the newcomer waits for waiting + 1 completions of a full batch (module header)
        slot_wait_s = (v.waiting_reqs + 1) * out_tokens * step / self.max_num_seqs if slots_full else 0.0
        lora_full, lora_wait_s, lora_spread_s = _lora_costs(request.lora, v, out_tokens * step, lora_pool)
        busy = v.running_reqs > 0 or v.waiting_reqs > 0 or v.inflight_reqs > 0
        queue_penalty_s = (
            max(backlog_tokens * p, slot_wait_s, lora_wait_s)
            + v.running_reqs * self.running_step_share * step
            + (self.busy_step_share * step if busy else 0.0)
        )
        cache_benefit_s = matched_tokens * p
        fill = v.kv_cached_frac if v.kv_cached_frac is not None else self.default_cache_fill
        cache_fill = min(1.0, max(0.0, fill))
        evict_penalty_s = cache_fill * uncached_tokens * p
        kv_pressure = max(0.0, v.kv_usage - self.kv_threshold) / (1.0 - self.kv_threshold)
        kv_penalty_s = kv_pressure * uncached_tokens * p
        lr = load_reqs(v)
        routed = v.routed_rps if v.routed_rps is not None else -1.0
        rate_known = mean_routed_rps is not None and v.routed_rps is not None
        if mean_load_reqs is None:
            guard = False
        else:
            # outstanding requests, relative AND absolute
            load_over = lr > self.balance_rel * mean_load_reqs and lr - mean_load_reqs >= self.balance_abs_reqs
            # receiving more than its share (the structural sign of a hot prefix)
            structural = not rate_known or routed > self.balance_rate_rel * mean_routed_rps
            if others_blocks is None or any_blocks <= others_blocks:
                # free to move (another replica matches as long): either imbalance sheds it; the
                # share of arrivals also relative AND absolute (excess requests routed within the window)
                rate_over = rate_known and structural and (routed - mean_routed_rps) * self.routed_tau_s >= self.balance_abs_reqs
                guard = load_over or rate_over
            else:
                # the sole copy of its match: moves only on a structural, severe overload
                guard = load_over and structural and lr > self.balance_exclusive_rel * mean_load_reqs
        # while the guard fires the replica's cache earns nothing: it competes on load alone
        balance_penalty_s = (self.w_cache + self.w_evict * cache_fill) * cache_benefit_s if guard else 0.0
        score = (
            self.w_cache * cache_benefit_s
            - self.w_queue * queue_penalty_s
            - self.w_evict * evict_penalty_s
            - self.w_kv * kv_penalty_s
            - balance_penalty_s
            - lora_spread_s
        )
        return {
            "matched_blocks": float(gpu_blocks),
            "matched_blocks_cpu": float(any_blocks),
            "matched_tokens": float(matched_tokens),
            "uncached_tokens": float(uncached_tokens),
            "cache_benefit_s": cache_benefit_s,
            "backlog_tokens": float(backlog_tokens),
            "slots_full": 1.0 if slots_full else 0.0,
            "output_tokens": out_tokens,
            "slot_wait_s": slot_wait_s,
            "lora_full": 1.0 if lora_full else 0.0,
            "lora_wait_s": lora_wait_s,
            "lora_spread_s": lora_spread_s,
            "queue_penalty_s": queue_penalty_s,
            "cache_fill": cache_fill,
            "evict_penalty_s": evict_penalty_s,
            "kv_pressure": kv_pressure,
            "kv_penalty_s": kv_penalty_s,
            "load_reqs": float(lr),
            "mean_load_reqs": float(mean_load_reqs) if mean_load_reqs is not None else -1.0,
            "routed_rps": routed,
            "others_blocks": float(others_blocks) if others_blocks is not None else -1.0,
            "sole_copy": 1.0 if (others_blocks is not None and any_blocks > others_blocks) else 0.0,
            "balance_guard": 1.0 if guard else 0.0,
            "balance_penalty_s": balance_penalty_s,
            "score": score,
        }

    def _spread_new_prefix(self, keyed: list, live: Sequence[ReplicaView], rng: random.Random) -> None:
        """Move to the front a replica drawn among those within the slack of the best (module
        header: a new prefix beside other gateways); nothing with one gateway."""
        pool = sum(v.routed_rps or 0.0 for v in live)
        others = sum(v.others_routed_rps for v in live)
        own_prefill_s = keyed[0][5]["uncached_tokens"] * next(v.prefill_s_per_token for v in live if v.replica_id == keyed[0][4])
        slack = min(self.new_prefix_slack_s, own_prefill_s) * min(1.0, others / pool) if pool > 0.0 else 0.0
        if slack <= 0.0:
            return
        floor = keyed[0][5]["score"] - slack
        near = [i for i, k in enumerate(keyed) if k[5]["score"] >= floor]
        if len(near) > 1:
            keyed.insert(0, keyed.pop(near[int(rng.random() * len(near))]))

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        live = [v for v in replicas if v.healthy]
        mean = sum(load_reqs(v) for v in live) / len(live) if live else 0.0
        rates = [v.routed_rps for v in live]
        mean_rate = sum(rates) / len(rates) if live and all(r is not None for r in rates) else None
        keyed = []
        bs = request.block_size
        cap_blocks = max(0, (request.prompt_tokens - 1) // bs) if bs > 0 else 0
        runs = [min(max(v.matched_blocks_cpu, v.matched_blocks_gpu), cap_blocks) if v.index_live else 0 for v in live]
        top2 = sorted(runs, reverse=True)[:2] + [0, 0]
        lora_pool = lora_pool_state(request.lora, live)
        for i, v in enumerate(live):
            others = top2[1] if runs[i] == top2[0] else top2[0]
            t = self.terms(request, v, mean, mean_rate, others, lora_pool)
            keyed.append((-round(t["score"] / SCORE_RESOLUTION_S), t["queue_penalty_s"], t["load_reqs"], rng.random(), v.replica_id, t))
        keyed.sort(key=lambda k: k[:4])
        if top2[0] == 0 and len(keyed) > 1 and self.new_prefix_slack_s > 0.0:
            self._spread_new_prefix(keyed, live, rng)
        return Decision(self.name, tuple(Candidate(k[4], k[5]["score"], k[5]) for k in keyed))
