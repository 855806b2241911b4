"""Reference routers for the virtual-time simulator only (never the gateway's policies).

Rule: each is a policy object (`rank`/`observe`, as policies.base.Policy) that `vtime.simulate`
accepts in place of a registry name, so the product policy can be compared in one run with:

- `SglangCacheAware`: the algorithm sglang-router 0.3 and vllm-router 0.1 run as `cache_aware`
  (PEERS: an approximate prefix tree of what the router itself sent to each worker, its own
  in-flight counts; when (max - min) in-flight > `balance_abs` and max > `balance_rel` x min it
  routes to the least loaded worker; otherwise to the worker with the longest match if the
  match covers more than `cache_threshold` of the prompt, else to the worker whose tree is
  smallest; the request's prefix is then inserted into the chosen worker's tree). Here the tree
  is the set of block keys routed to each worker (a leading run of keys is a prefix match; the
  peers match characters or token ids, which for these workloads give the same winners); it is
  never trimmed (their trees are trimmed every 120 s to a size these runs never reach). Ties
  between workers with equally long matches go to the one that got the prefix first.
- `StaticPlan`: an offline plan that knows each document's popularity: a table prefix key ->
  holder replicas, built by `static_plan_for`; a request goes to the least-loaded holder of its
  document (in-flight + running), a request without an entry to the least-loaded replica. The
  "naive static plan" of the issue (hot document on two replicas, the rest on one by share).
  A planned document's candidates carry `plan` and `root_blocks` (the common prefix of its
  requests' block keys), so `--keep-alive` keeps its documents as it keeps cache_plan's roots.
  With `warm_new_holders` (`vtime_report --copy-in-background`, as for cache_plan) a document's
  requests go to the planned holders that hold it (a leading match of 90% of its root) while any
  does, and a planned holder that does not is warmed in the background (the candidate's
  `warm_blocks`, which vtime sends as paced chunks: loadtests/vtime_pacing.py), again at most
  once per WARM_RETRY_REQS requests of the plan: no client waits for a copy's prefill.
  With `blind_prewarm` (`static_plan_blind`) the pre-warm is placed as a router that does not yet
  know popularity must place it: each document not yet seen goes to the next replica in turn
  (the plain static plan's pre-warm goes to the planned holders, which knows the shares before any
  traffic); at the first request of a document already placed (the measured stream's start) the
  plan is packed from the known shares keeping each document where the pre-warm put it while
  that replica stays within `stay_tol` of the mean (`pack_documents`), and the rest moves: by a
  copy miss, or warmed in the background with `warm_new_holders`.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import load_reqs
from policies.base import Candidate, Decision, ReplicaView, RequestView

__all__ = ["SglangCacheAware", "StaticPlan", "pack_documents", "static_plan_for"]


class SglangCacheAware:
    name: ClassVar[str] = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.trees: dict[str, set] = {}  # worker -> block keys routed there
        self.first_holder: dict = {}  # key -> workers in the order they got it
        self.inflight: dict[str, int] = {}

    def params(self) -> dict:
        return {"cache_threshold": self.cache_threshold, "balance_abs": self.balance_abs, "balance_rel": self.balance_rel}

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        live = [v.replica_id for v in replicas if v.healthy]
        if not live:
            return Decision(self.name, ())
        for w in live:
            self.trees.setdefault(w, set())
            self.inflight.setdefault(w, 0)
        loads = {w: self.inflight[w] for w in live}
        hi, lo = max(loads.values()), min(loads.values())
        keys = request.keys
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            choice = min(live, key=lambda w: (loads[w], w))
        else:
            # longest leading run of keys any worker's tree holds
            cands = list(live)
            m = 0
            for k in keys:
                holders = [w for w in cands if k in self.trees[w]]
                if not holders:
                    break
                cands = holders
                m += 1
            rate = (m * request.block_size) / request.prompt_tokens if request.prompt_tokens else 0.0
            if m and rate > self.cache_threshold:
                order = self.first_holder.get(keys[m - 1], [])
                choice = next((w for w in order if w in cands), cands[0])
            else:
                choice = min(live, key=lambda w: (len(self.trees[w]), w))
        tree = self.trees[choice]
        for k in keys:
            if k not in tree:
                tree.add(k)
                self.first_holder.setdefault(k, []).append(choice)
        self.inflight[choice] += 1
        ranked = [choice] + [w for w in live if w != choice]
        return Decision(self.name, tuple(Candidate(w, 1.0 if w == choice else 0.0, {}) for w in ranked))

    def placed(self, request: RequestView, decision: Decision) -> None:
        return None  # the peers insert into their trees when they route (rank), as they do

    def observe(self, replica_id: str, ttft_s: float, uncached_tokens: int) -> None:
        # vtime calls observe when a request finishes: its in-flight count drops (the peers count
        # a request until its response ends)
        if self.inflight.get(replica_id, 0) > 0:
            self.inflight[replica_id] -= 1


WARM_RETRY_REQS = 300  # a warm of a document on a replica is asked again only after this many requests
KV_PLAN_FRAC = 0.85  # a blind plan's documents stay under this share of a replica's KV (cache_plan's kv_room_frac)


class StaticPlan:
    name: ClassVar[str] = "static_plan"

    def __init__(self, plan: dict, probe_block: int, root_blocks: dict | None = None, warm_new_holders: bool = False,
                 blind_prewarm: tuple | None = None) -> None:
        self.plan = plan  # key at block `probe_block` -> replica ids holding that document
        self.probe_block = probe_block
        self.root_blocks = root_blocks or {}  # the same key -> the document's blocks (its requests' common prefix)
        self.warm_new_holders = warm_new_holders
        self._n = 0  # requests ranked
        self._warmed: dict = {}  # (document, replica) -> self._n when its warm was asked
        # (document -> request count, stay_tol): the plan is packed once the pre-warm is placed
        self._blind = blind_prewarm
        self._prewarm: dict = {}  # document -> [the replica the blind pre-warm put it on]

    def params(self) -> dict:
        return {"documents": len(self.plan), "probe_block": self.probe_block}

    def _place_blind(self, doc, live: dict) -> str | None:
        """Blind pre-warm: a document not yet placed goes to the next replica in turn (None once
        the plan is made); the first request of a placed document makes the plan."""
        if doc not in self._prewarm:
            rid = sorted(live)[len(self._prewarm) % len(live)]
            self._prewarm[doc] = [rid]
            return rid
        count, stay_tol = self._blind
        cap = min(v.kv_capacity_blocks for v in live.values())
        self.plan = pack_documents(count, len(live), stay=self._prewarm, stay_tol=stay_tol, sizes=self.root_blocks,
                                   budget=KV_PLAN_FRAC * cap)
        self._blind = None
        return None

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        live = {v.replica_id: v for v in replicas if v.healthy}
        keys = request.keys
        if self._blind is not None and len(keys) > self.probe_block and live:
            rid = self._place_blind(keys[self.probe_block], live)
            if rid is not None:
                return Decision(self.name, tuple(Candidate(w, -i, {}) for i, w in enumerate([rid] + [w for w in live if w != rid])))
        holders = self.plan.get(keys[self.probe_block]) if len(keys) > self.probe_block else None
        pool = [w for w in (holders or ()) if w in live] or list(live)
        # a planned document names its root (keep-alive keeps it, as it keeps cache_plan's roots)
        root = self.root_blocks.get(keys[self.probe_block], 0) if holders else 0
        warm_to = None
        if self.warm_new_holders and root:
            self._n += 1
            held = [w for w in pool if max(live[w].matched_blocks_gpu, live[w].matched_blocks_cpu) >= 0.9 * root]
            if held and len(held) < len(pool):
                doc = keys[self.probe_block]
                warm_to = next((w for w in pool if w not in held
                                and self._n - self._warmed.get((doc, w), -WARM_RETRY_REQS) >= WARM_RETRY_REQS), None)
                if warm_to is not None:
                    self._warmed[(doc, warm_to)] = self._n
                pool = held
        ranked = sorted(pool, key=lambda w: (load_reqs(live[w]), live[w].inflight_prefill_tokens, w))
        ranked += [w for w in live if w not in ranked]
        terms = {"plan": 1.0, "root_blocks": float(root)} if root else {}
        return Decision(self.name, tuple(Candidate(w, -i, {**terms, "warm_blocks": float(root)} if w == warm_to else terms)
                                         for i, w in enumerate(ranked)))

    def placed(self, request: RequestView, decision: Decision) -> None:
        return None

    def observe(self, replica_id: str, ttft_s: float, uncached_tokens: int) -> None:
        return None


def pack_documents(count: dict, n_replicas: int, hot_holders: int = 2, n_hot: int = 1, stay: dict | None = None,
                   stay_tol: float = 0.0, sizes: dict | None = None, budget: float = 0.0) -> dict:
    """Documents onto replicas `r0..r{n-1}` by share: the `n_hot` most requested on `hot_holders`
    replicas each, every other on one, greedily (largest share first onto the replica with the
    least planned share; a shared one's share split evenly). `stay` (document -> the replicas it
    is on now) keeps a document on those while each one's planned share stays within (1 +
    stay_tol) of the mean. `sizes` (document -> blocks) and `budget` (blocks, > 0): a replica
    takes no document its planned blocks cannot hold while another can. Document -> replica ids."""
    docs = sorted(count, key=lambda d: -count[d])
    mean = sum(count.values()) / n_replicas if n_replicas else 0.0
    load = [0.0] * n_replicas
    used = [0.0] * n_replicas  # planned blocks
    plan: dict = {}
    for i, d in enumerate(docs):
        n = min(n_replicas, hot_holders if i < n_hot else 1)
        size = (sizes or {}).get(d, 0)
        fits = [budget <= 0 or used[r] + size <= budget for r in range(n_replicas)]
        picks: list = []
        for w in (stay or {}).get(d, ()):
            r = int(w[1:])
            if len(picks) < n and r not in picks and fits[r] and load[r] + count[d] / n <= (1.0 + stay_tol) * mean:
                picks.append(r)
        picks += sorted((r for r in range(n_replicas) if r not in picks), key=lambda r: (not fits[r], load[r], r))[:n - len(picks)]
        for r in picks:
            load[r] += count[d] / n
            used[r] += size
        plan[d] = [f"r{r}" for r in picks]
    return plan


def static_plan_for(workload, keys, n_replicas: int, hot_holders: int = 2, probe_block: int = 100, n_hot: int = 1,
                    warm_new_holders: bool = False, blind_stay_tol: float | None = None) -> StaticPlan:
    """The issue's naive static plan: documents by measured share (request counts of `workload`),
    packed by `pack_documents`. `blind_stay_tol`: the pre-warm placed blind, the plan packed
    after it, documents staying within that tolerance (StaticPlan, module header)."""
    count: dict = {}
    common: dict = {}  # document -> its requests' common prefix of block keys (the document's root)
    for r, k in zip(workload.requests, keys):
        if len(k.prompt) > probe_block:
            d = k.prompt[probe_block]
            count[d] = count.get(d, 0) + 1
            c = common.get(d)
            if c is None:
                common[d] = list(k.prompt)
            else:
                n = next((i for i, (a, b) in enumerate(zip(c, k.prompt)) if a != b), min(len(c), len(k.prompt)))
                del c[n:]
    roots = {d: len(common[d]) for d in count if count[d] > 1}
    if blind_stay_tol is not None:
        return StaticPlan({}, probe_block, roots, warm_new_holders, blind_prewarm=(count, blind_stay_tol))
    return StaticPlan(pack_documents(count, n_replicas, hot_holders, n_hot), probe_block, roots, warm_new_holders)
