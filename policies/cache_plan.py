"""cache_plan: plan which replicas hold each shared prefix from its measured demand, and send each
request to a holder of its prefix, chosen by plan and queue (cache_aware for requests with none).

The rule
--------
Per request, with m_r = the capped leading match on replica r (GPU or CPU run, as cache_aware
counts it; 0 when the replica's feed is not live) and m* = max_r m_r over the healthy replicas:

- planned, when its leading match (m* blocks) reaches a known root, whatever share of the prompt
  that covers; or, reaching none, when m* x block_size >= match_min_frac x prompt_tokens, and
  then keys[m* - 1] becomes a new root (of m* blocks). Its root is the shortest planned prefix
  the request extends: the first of its keys that is a known root's key. A document is a root; a
  chat's system prompt is the root of its conversations. The holders of a prefix of b blocks are
  the replicas with m_r >= holder_frac x b. Why a known root always plans: a late turn whose
  history the engines evicted matches only its system prompt, under match_min_frac of its long
  prompt; left to cache_aware it was placed by a per-request score outside the plan (and away
  from its root's holders when their queue looked long), unmeasured by the plan's loads. Planned,
  it is a request of its root (it goes to a holder, its work counts for the root). On the busy
  regime's multi_turn case, seeds 0-2, TTFT p50 0.907 / 0.747 / 0.691 s -> 0.544 / 0.684 / 0.700 s,
  hit 0.705 -> 0.729 (mean); the document cases plan the same requests as before.
  Planned too: a request whose match stops short of a known root it extends (the engines' LRU
  evicted the root's tail, on every replica), when a replica holding the match (its home) has KV
  room for the root (the room rule of a new holder, below). It is a request of that root: it goes
  home, recomputes the tail there and the document stays where the plan has it; when the match
  is only what every prompt shares (the chat template's first block: the whole document was
  evicted), every replica is a home and the plan's dispatch (below) picks among them (while any
  has room). Why: left to cache_aware, such a request (a cold document's tail evicted between two
  of its requests, under match_min_frac of its prompt cached) was placed by a per-request score,
  often on another replica, which prefilled the whole document and took it on beside its own (a
  copy miss, and one more document in that replica's KV, which then evicted others'). Busy Zipf,
  median / mean per-seed TTFT p50 over seeds 0-19: 0.881 / 1.011 s -> 0.672 / 0.762 s (seeds
  20-59: 0.781 / 1.298 -> 0.647 / 1.071), p99 median 6.17 -> 6.00 s (6.25 -> 5.58), mean 6.82 ->
  6.50 s (7.22 -> 7.39); with keep-alive p50 0.398 / 0.585 -> 0.400 / 0.554 (0.365 / 0.797 ->
  0.338 / 0.606), p99 median 3.51 -> 3.78 (3.77 -> 3.91); uniform, multi-turn and no sharing
  unchanged. Without the room rule a replica that had taken on more documents than its KV holds
  kept every one of them and thrashed (seed 11: p99 27.8 s).
- unplanned, otherwise (a new document, a prompt that shares nothing, a short common system
  prompt no planned request has made a root): ranked by cache_aware (score, guard and all).
  - A child (m* longer than its root: a conversation's history) goes to the holder of its
    longest match with the least predicted TTFT (cache_aware's queue_penalty_s + uncached_tokens
    x prefill_s_per_token). It does not move for balance (but see "left", below).
  - A request of the root itself: if the plan gives the root a new holder c now (below), it goes
    to c, which computes the copy (the gateway's speculative index entries make c a holder for
    the requests that follow). Else it goes to a holder: among those whose predicted TTFT is
    within queue_slack_s of the best, the one furthest below its planned part of the root's work
    (below). A holder is not left for balance: a prefix with one holder keeps it through queues
    that per-request scoring would spill it on (cache_aware's rule: the holder unless its queue
    costs more than the prefill it saves).
  - Left, either kind: when even the best holder's predicted TTFT is more than leave_factor x
    the best of the other replicas' (their queue + the whole uncached prefill there), the request
    goes there instead, and that replica computes a copy (a new holder, recorded as one). The
    gateway's promise is the replica where the first token comes soonest; the plan bends it only
    by leave_factor, the margin a miss's cost to the others (its prefill in their steps, the
    prefix it evicts) may claim. Why the rule: with no way out, a holder flooded from elsewhere
    (requests sent to its engine directly, a slow replica) kept every request of its prefixes
    however long its queue, and on the busy multi-turn case a conversation waited out a holder's
    queue many times longer than recomputing its history elsewhere (its p99 below, leave_factor).

The plan. Demand is measured on the requests this policy planned, with the request count as the
clock (every measure is an exponential moving mean over planned requests with weight 1 /
window_reqs: shares of the stream, no wall clock):
- the work of a planned request is its steady cost once its prefix is in place (a copy's
  one-off prefill is not demand), in prefill tokens: (prompt_tokens - m* x block_size) +
  max_output_tokens x running_step_share x decode_step_s / prefill_s_per_token (its uncached
  prefill on a holder and its share of the decode steps it runs in, with cache_aware's
  running_step_share and the medians of the replicas' rates; max_output_tokens 0: cache_aware's
  prior_output_tokens),
  counted for its root (a conversation's turns count for its system prompt: placing a first turn
  places the conversation);
- load_r = the mean work per planned request that went to r; G_g,r = the same for root g's
  requests and children alone, G_g = sum_r G_g,r; mean = sum_r load_r / (healthy replicas);
- the water level of a holder set S for g: pour G_g over S on top of base_r = load_r - G_g,r
  (r's load without g): the level w with sum_{r in S} max(0, w - base_r) = G_g; r's planned part
  of g is max(0, w - base_r), and peak(S) = max(w, max base_r) is the busiest holder's load once
  g is split that way (which the dispatch above realises);
- g gets the new holder c = the least-loaded healthy non-holder that is not building a copy
  and whose KV has room, when all hold. Building a copy: its in-flight prefill is over half of
  g's tokens; when the holders are far over the mean (peak(H) >= 2 x mean), over the holders'
  best predicted TTFT for this request too (in c's prefill tokens): waiting for a quiet replica
  then costs more than sharing a busy one. Why: at a cold start on 16 replicas every replica was
  prefilling a new document, and a hot prefix's only holder took 14x the mean load for its first
  380 planned requests, waiting for one that was not (hot_prefix, 16 replicas: requests per
  replica max / mean 1.60 -> 1.25; the busy regime's cases, 4 replicas, unchanged on 40 seeds).
  - overloaded: peak(H) >= (1 + spread_rel) x mean;
  - the copy pays: it lowers the peak, peak(H + c) < peak(H), and c's part of g's work after it
    (the work it takes off the holders, max(0, level(H + c) - load_c)) is >= spread_gain x mean.
    With one holder that part is the peak's drop; with n holders the drop is about 1/n of it, and
    a rule on the drop stopped a hot prefix at 32 holders of 64 replicas, 1.4-1.8x the mean,
    whose holders took 1.7x the mean number of requests (now 1.37-1.48x over four seeds;
    cache_aware 1.26x, with a longer TTFT p99 on every seed);
  - hot: g's share of the work, G_g / (R x mean), exceeds hot_min / R by two standard errors of a
    share measured on min(requests, window_reqs) requests (only a prefix that carries a good
    part of one replica's load is worth a copy; noise never makes a typical document hot);
  - the hottest: no other root carries more work to g's busiest holder (spread what loads it
    most, not whichever request came first);
  - room: the blocks of the roots c holds (seen within 5 windows) + g's <= kv_room_frac x c's KV
    blocks (`ReplicaView.kv_capacity_blocks`; 0 = unknown: not checked);
  - g got no new holder in its last cooldown_reqs x min(1, mean / (peak(H) - mean)) planned
    requests (the split must show in the measures before the next copy; far over the mean, as a
    hot prefix at start-up on many replicas, copies come faster), and min_reqs requests were seen.

Why this and not a per-request score
------------------------------------
With long shared prefixes on busy replicas a miss costs a replica seconds of prefill (3 s for a
3,000-token document at 1 ms/token), and while that prefill holds the step budget every request
queued behind it waits (chunked prefill serves running prefills first): one miss is a TTFT spike
for every request of that replica for a few seconds, and its blocks evict the least recently used
prefix there, which the next request of that prefix must prefill again. A per-request comparison
(cache_aware's score, its balance guard) sees one request's TTFT, not the spike its miss causes
for the others nor the eviction its blocks cause: under skew it spreads the hot document's
overflow over every replica, each spill a miss, each copy an eviction of some colder document,
and the misses feed the queues that trigger more spills. The plan spends misses only where the
measured demand pays for them (one new holder at a time, for a prefix whose holders are
overloaded and whose copy lowers the busiest replica's load), and otherwise never leaves a holder;
dispatch among several holders by queue balances the hot prefix's load without any miss.

Parameters (constructor, keyword only; the cache_aware ones go to the embedded cache_aware)
-------------------------------------------------------------------------------------------
match_min_frac   a request that reaches no known root is planned (its match a new root) when the
                 longest cached match covers at least this share of its prompt; 0..1 (default 0.5)
holder_frac      a replica is a holder when its match is at least this share of the prefix's;
                 0..1 (default 0.9: a copy whose last blocks were evicted still counts)
window_reqs      planned requests one measure averages over (1 / weight); >= 1 (default 200)
spread_rel       holders overloaded at peak >= (1 + spread_rel) x mean; >= 0 (default 0.2)
spread_gain      a copy must take spread_gain x mean of the prefix's work off its holders; >= 0
                 (default 0.05)
hot_min          a root spreads only when its share of the work is above hot_min / R; >= 0
                 (default 0.5: half of one replica's share, 12.5% of the work on 4 replicas; a
                 document of 24 has ~4%. A copy costs a whole prefill where it lands and evicts a
                 document there, for a split that takes little off the holder of a prefix under
                 that share. Busy regime, median per-seed TTFT p50 over seeds 0-19 / 20-39 / 40-59:
                 Zipf 1.01 / 1.52 / 1.04 s at 0.2 (the default until 2026-12-05) -> 0.88 / 0.90 /
                 0.77 s, mean per-seed p99 8.3 / 8.5 / 8.3 -> 6.8 / 8.2 / 6.2 s; uniform p99 mean
                 1.39 / 1.23 -> 1.06 / 1.12 s (no chance copies); 0.3-0.8 in between. Multi-turn's
                 8 system prompts (~12.5% each) straddle it: median p50 0.85 / 0.82 -> 0.79 / 0.79 s,
                 p99 15.0 / 13.5 -> 13.4 / 13.6 s, but mean p50 1.28 / 1.05 -> 1.34 / 1.42 s.
                 0.1 copies typical documents by chance: uniform p99 0.97 -> 2.7 s)
kv_room_frac     a new holder's planned blocks stay under this share of its KV; 0..1 (default 0.85)
cooldown_reqs    planned requests between two new holders of a root (shorter when its holders are
                 far over the mean, see above); >= 0 (default 50)
min_reqs         planned requests measured before anything spreads; >= 0 (default 30)
leave_factor     a request leaves its holders when their best predicted TTFT exceeds leave_factor x
                 the best elsewhere (see "Left"); 0: never; 0 or >= 1 (default 6: on the busy
                 regime's multi-turn case, 40 seeds, median per-seed TTFT p99 18.3 / 16.7 s ->
                 15.0 / 13.5 s, p50 0.80 / 0.81 -> 0.85 / 0.82; 3 left too often, p50 1.9 s;
                 10 kept less of the tail, p99 16.2 / 15.6; the documents' cases unchanged)
queue_slack_s    holders within this much predicted TTFT of the best are chosen by the plan;
                 seconds, >= 0 (default 0.1; 0: by queue alone)
copy_in_background  a design probe, virtual time only (loadtests/vtime_pacing.py): the request
                 that makes a new holder c goes to a holder as if none were made, and c's
                 candidate carries warm_blocks (the prefix to warm there, in blocks; the
                 simulator warms it beside the traffic). The gateway does not warm: leave it off
                 there (default False)
Defaults tuned with `python -m loadtests.vtime_report --regime busy` (loadtests/results/vtime_busy.md).

Candidates' terms: plan (1 planned, 0 unplanned: then cache_aware's terms), holder (0/1),
predicted_ttft_s, matched_blocks, group_work, group_holders, root_blocks (the request's root, in
blocks: the prefix its holders keep), root_at (the root's last key's index in the request's keys)
and work_tokens (the request's planned work: what placed() records), load_share, peak_share,
spread (1 on the replica chosen to build a new copy), left (1 where a request left its holders
for their queue: a copy too, so spread is 1 there as well), warm_blocks (copy_in_background: the
prefix to warm on that replica, 0 elsewhere), score (= -position: the chosen replica, the
other holders by predicted TTFT, then the rest in cache_aware's order).
State: the measures above. rank() reads them and changes nothing; placed() records a request
where it was sent (its decision's first candidate: the gateway calls it once per request, after
flow control, which may move it to another holder). Why two steps: a request can be ranked more
than once (flow control decides a held request again when it releases it; /debug/route ranks
without sending), and recording in rank() counted a held request's work twice, once on a replica
it never went to, and could plan a copy for a request that was not sent.
Several gateways (pods, `--workers` processes): placed() returns its record (root key, root
blocks, replica, work, copied, holders) and the gateway trades them through the feed with every
in-flight exchange (0.1 s); placed_elsewhere() applies another gateway's exactly as placed() does,
so each instance measures the whole stream, up to one exchange late, instead of its process's
share. Without it, four processes planned on a quarter each: more copies than one (103 against
54 over twenty busy Zipf seeds) and a longer median TTFT (loadtests/results/busy_regime_log.md,
"Several gateway processes").
Pure: no I/O, no clock; `rng` only in cache_aware's ties.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from policies._common import load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView
from policies.cache_aware import CacheAwarePolicy

__all__ = ["CachePlanPolicy", "water_level", "water_peak"]


def water_level(bases: Sequence[float], amount: float) -> float:
    """The level w with sum over bins of max(0, w - base) = amount: `amount` poured over bins at
    `bases`, each filled from its base up to a common level (bins above it get nothing)."""
    if not bases:
        return 0.0
    bs = sorted(bases)
    rest = max(0.0, amount)
    for i in range(len(bs)):
        nxt = bs[i + 1] if i + 1 < len(bs) else float("inf")
        room = (nxt - bs[i]) * (i + 1)  # work that raises the i+1 lowest bins to the next base
        if rest <= room:
            return bs[i] + rest / (i + 1)
        rest -= room
    return bs[-1]  # pragma: no cover - the last room is infinite


def water_peak(bases: Sequence[float], amount: float) -> float:
    """Highest load after pouring `amount` over bins at `bases`: max(level, max(bases))."""
    return max(water_level(bases, amount), max(bases)) if bases else 0.0


def _median(xs: list) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class _Mean:
    """Exponential moving mean over the planned-request clock, decayed lazily."""

    __slots__ = ("v", "at")

    def __init__(self) -> None:
        self.v = 0.0
        self.at = 0

    def get(self, now: int, keep: float) -> float:
        if now > self.at:  # only forward: rank() reads one request ahead of placed()'s clock
            self.v *= keep ** (now - self.at)
            self.at = now
        return self.v


@dataclass(slots=True)
class _Group:
    blocks: int  # length of the cached prefix (m*)
    holders: frozenset = frozenset()  # replicas holding it at its last request
    work: dict = field(default_factory=dict)  # replica -> _Mean of this group's work routed there
    count: int = 0  # planned requests seen (its own and its children's)
    last_seen: int = 0  # clock at its last request
    last_spread: int = -(10**9)  # clock when it last got a new holder


class CachePlanPolicy(PolicyBase):
    """Holders planned from measured demand, dispatch by queue (module header)."""

    name: ClassVar[str] = "cache_plan"
    shares_placements: ClassVar[bool] = True  # every gateway's plan measures the whole stream
    PARAMS_FROM: ClassVar[type] = CacheAwarePolicy  # **cache_aware_params go to the embedded cache_aware

    def __init__(
        self,
        *,
        match_min_frac: float = 0.5,
        holder_frac: float = 0.9,
        window_reqs: float = 200.0,
        spread_rel: float = 0.2,
        spread_gain: float = 0.05,
        hot_min: float = 0.5,
        kv_room_frac: float = 0.85,
        cooldown_reqs: int = 50,
        min_reqs: int = 30,
        queue_slack_s: float = 0.1,
        leave_factor: float = 6.0,
        copy_in_background: bool = False,
        **cache_aware_params,
    ) -> None:
        for label, val in (("match_min_frac", match_min_frac), ("holder_frac", holder_frac), ("kv_room_frac", kv_room_frac)):
            if not 0.0 <= val <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {val!r}")
        for label, val in (("spread_rel", spread_rel), ("spread_gain", spread_gain), ("hot_min", hot_min),
                           ("cooldown_reqs", cooldown_reqs), ("min_reqs", min_reqs), ("queue_slack_s", queue_slack_s)):
            if not val >= 0:
                raise ValueError(f"{label} must be >= 0, got {val!r}")
        if not (leave_factor == 0 or leave_factor >= 1):
            raise ValueError(f"leave_factor must be 0 (never) or >= 1, got {leave_factor!r}")
        if not window_reqs >= 1:
            raise ValueError(f"window_reqs must be >= 1, got {window_reqs!r}")
        self.fallback = CacheAwarePolicy(**cache_aware_params)
        self.match_min_frac = float(match_min_frac)
        self.holder_frac = float(holder_frac)
        self.window_reqs = float(window_reqs)
        self.spread_rel = float(spread_rel)
        self.spread_gain = float(spread_gain)
        self.hot_min = float(hot_min)
        self.kv_room_frac = float(kv_room_frac)
        self.cooldown_reqs = int(cooldown_reqs)
        self.min_reqs = int(min_reqs)
        self.queue_slack_s = float(queue_slack_s)
        self.leave_factor = float(leave_factor)
        self.copy_in_background = bool(copy_in_background)
        self._keep = 1.0 - 1.0 / self.window_reqs
        self._now = 0  # planned requests so far: the clock of every measure
        self._load: dict[str, _Mean] = {}
        self._groups: dict[int, _Group] = {}

    def params(self) -> dict[str, float]:
        return {
            **self.fallback.params(),
            "match_min_frac": self.match_min_frac, "holder_frac": self.holder_frac, "window_reqs": self.window_reqs,
            "spread_rel": self.spread_rel, "spread_gain": self.spread_gain, "hot_min": self.hot_min,
            "kv_room_frac": self.kv_room_frac, "cooldown_reqs": self.cooldown_reqs, "min_reqs": self.min_reqs,
            "queue_slack_s": self.queue_slack_s, "leave_factor": self.leave_factor, "copy_in_background": float(self.copy_in_background),
        }

    # -- measures --------------------------------------------------------------------------------
    def load_share(self, replica_id: str, now: int | None = None) -> float:
        """Mean planned work per planned request sent to the replica (prefill tokens), at `now`
        (planned requests; default: so far). Reading at a later clock only decays (no change)."""
        m = self._load.get(replica_id)
        return m.get(self._now if now is None else now, self._keep) if m is not None else 0.0

    def _group_work(self, g: _Group, rid: str, now: int) -> float:
        m = g.work.get(rid)
        return m.get(now, self._keep) if m is not None else 0.0

    def _planned_blocks(self, rid: str, now: int, skip: _Group | None = None) -> int:
        horizon = now - 5 * self.window_reqs
        return sum(g.blocks for g in self._groups.values() if g is not skip and rid in g.holders and g.last_seen >= horizon)

    def _record(self, g: _Group, rid: str, work: float) -> None:
        a = 1.0 - self._keep
        m = self._load.setdefault(rid, _Mean())
        m.get(self._now, self._keep)
        m.v += a * work
        gm = g.work.setdefault(rid, _Mean())
        gm.get(self._now, self._keep)
        gm.v += a * work

    def _dispatch(self, holders, ttft, loads, gw, g_total, by_id) -> str:
        """Among the holders: those whose predicted TTFT is within queue_slack_s of the best, and of
        them the one furthest below its planned part of g's work (the water-filling split: r's
        part is max(0, level - base_r)); ties by predicted TTFT. The plan evens the load over the
        window, the queue check keeps a burst on one holder from growing."""
        if len(holders) == 1:
            return holders[0]
        best_ttft = min(ttft[r] for r in holders)
        ok = [r for r in holders if ttft[r] <= best_ttft + self.queue_slack_s]
        if g_total <= 0.0 or len(ok) == 1:
            return min(ok, key=lambda r: (ttft[r], load_reqs(by_id[r]), r))
        bases = {r: loads[r] - gw[r] for r in holders}
        level = water_level(list(bases.values()), g_total)
        return max(ok, key=lambda r: (max(0.0, level - bases[r]) - gw[r], -ttft[r], r))

    def _is_hot(self, g: _Group, g_total: float, mean: float, n_replicas: int, now: int) -> bool:
        """g's share of the planned work is above hot_min / n_replicas with two standard errors to
        spare (a share measured on n requests varies by sqrt(p (1 - p) / n): early on, or for a
        typical document, noise alone must not make a prefix look hot)."""
        total = mean * n_replicas
        p = g_total / total if total > 0 else 0.0
        n = min(float(now), self.window_reqs)
        return p - 2.0 * (p * (1.0 - p) / n) ** 0.5 >= self.hot_min / n_replicas

    def _hottest_on(self, g: _Group, rid: str, now: int) -> bool:
        """No active group carries more work to `rid` than g (spread the prefix that loads the
        busiest holder most, not whichever request of it came first)."""
        mine = self._group_work(g, rid, now)
        horizon = now - 5 * self.window_reqs
        return not any(o is not g and rid in o.holders and o.last_seen >= horizon and self._group_work(o, rid, now) > mine
                       for o in self._groups.values())

    def _root_past_match(self, keys, best: int, runs: dict, live) -> int:
        """The index in `keys` of a known root that the request extends past its match (the
        engines evicted the root's tail everywhere), when a replica holding the match (its home)
        has KV room for the root; else -1 (module header, "planned")."""
        j = next((j for j in range(best, len(keys)) if keys[j] in self._groups), -1)
        if j < 0:
            return -1
        g = self._groups[keys[j]]
        now = self._now + 1
        for v in live:
            if runs[v.replica_id] == best:
                cap = v.kv_capacity_blocks
                if cap <= 0 or self._planned_blocks(v.replica_id, now, skip=g) + g.blocks <= self.kv_room_frac * cap:
                    return j
        return -1

    def _prune(self) -> None:
        horizon = self._now - 5 * self.window_reqs
        for k in [k for k, g in self._groups.items() if g.last_seen < horizon]:
            del self._groups[k]

    # -- the decision ----------------------------------------------------------------------------
    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        base = self.fallback.rank(request, replicas, rng)
        live = [v for v in replicas if v.healthy]
        bs = request.block_size
        cap = max(0, (request.prompt_tokens - 1) // bs) if bs > 0 else 0
        runs = {v.replica_id: (min(max(v.matched_blocks_cpu, v.matched_blocks_gpu), cap) if v.index_live else 0) for v in live}
        best = max(runs.values(), default=0)
        keys = request.keys
        roots = self._groups
        # the root: the shortest planned prefix this request extends (a document; a chat's system
        # prompt, whose conversations are its children); a request that reaches one is planned
        # whatever share of its prompt the match covers (match_min_frac gates new roots only)
        root_at = next((j for j in range(min(best, len(keys))) if keys[j] in roots), -1)
        if root_at < 0 and 0 < best <= len(keys):
            root_at = self._root_past_match(keys, best, runs, live)
        if (not live or best == 0 or best > len(keys)
                or (root_at < 0 and best * bs < self.match_min_frac * request.prompt_tokens)):
            return Decision(self.name, tuple(Candidate(c.replica_id, c.score, {**c.terms, "plan": 0.0}) for c in base.ranked))
        now = self._now + 1  # this request's place on the plan's clock, if it is placed
        by_id = {v.replica_id: v for v in live}
        if root_at < 0:  # none known: its own longest match becomes a new root (when placed)
            root_at = best - 1
        g = roots.get(keys[root_at])
        if g is None:
            g = _Group(best)
        holders_g = frozenset(rid for rid, m in runs.items() if m >= self.holder_frac * g.blocks)
        child = best > g.blocks  # a longer match than its root (a conversation's history): it stays
        holders = [rid for rid, m in runs.items() if m >= self.holder_frac * best]
        # steady cost, in prefill tokens: uncached on a holder + its share of the decode steps
        out_tokens = request.max_output_tokens or self.fallback.prior_output_tokens
        step_tokens = _median([v.decode_step_s for v in live]) / max(1e-12, _median([v.prefill_s_per_token for v in live]))
        work = max(1, request.prompt_tokens - best * bs) + out_tokens * self.fallback.running_step_share * step_tokens
        # predicted TTFT on each replica (cache_aware's queue_penalty_s + uncached_tokens x
        # prefill_s_per_token), from the terms cache_aware's ranking already computed
        predicted = {c.replica_id: c.terms["queue_penalty_s"] + c.terms["uncached_tokens"] * by_id[c.replica_id].prefill_s_per_token
                     for c in base.ranked if c.replica_id in by_id}
        ttft = {rid: predicted[rid] for rid in holders}
        # the plan: measures without this request
        loads = {rid: self.load_share(rid, now) for rid in by_id}
        mean = sum(loads.values()) / len(loads)
        gw = {rid: self._group_work(g, rid, now) for rid in by_id}
        g_total = sum(gw.values())
        peak_h = water_peak([loads[r] - gw[r] for r in holders], g_total)
        spread_to = None
        peak_new = peak_h
        # the cooldown shrinks when the holders are far over the mean (a hot prefix at start-up on
        # many replicas needs many copies soon): cooldown_reqs x min(1, mean / (peak - mean))
        over = peak_h / mean - 1.0 if mean > 0.0 else 0.0
        cooldown = self.cooldown_reqs * min(1.0, 1.0 / over) if over > 0.0 else self.cooldown_reqs
        if (not child and now > self.min_reqs and mean > 0.0 and now - g.last_spread >= cooldown
                and peak_h >= (1.0 + self.spread_rel) * mean and self._is_hot(g, g_total, mean, len(loads), now)
                and self._hottest_on(g, max(holders, key=lambda r: (loads[r], r)), now)):
            others = sorted((rid for rid in by_id if rid not in holders_g), key=lambda r: (loads[r], r))
            for c in others:
                building = best * bs // 2  # in-flight prefill tokens that mean c is building a copy
                if over >= 1.0:  # far over the mean: a busy c beats the holders' queue (module header)
                    building = max(building, min(ttft.values()) / max(1e-12, by_id[c].prefill_s_per_token))
                if by_id[c].inflight_prefill_tokens > building:
                    continue  # building another copy: one at a time per replica
                cap_blocks = by_id[c].kv_capacity_blocks
                if cap_blocks > 0 and self._planned_blocks(c, now, skip=g) + best > self.kv_room_frac * cap_blocks:
                    continue
                bases_c = [loads[r] - gw[r] for r in holders] + [loads[c]]
                peak_c = water_peak(bases_c, g_total)
                taken = water_level(bases_c, g_total) - loads[c]  # c's part of g: the work it takes off
                if peak_c < peak_h and taken >= self.spread_gain * mean:
                    spread_to, peak_new = c, peak_c
                break  # the least-loaded replica with room is the only candidate
        if spread_to is not None and not self.copy_in_background:
            winner = spread_to
            holders_g = holders_g | {spread_to}
        elif spread_to is not None:  # the request goes to a holder; spread_to is warmed beside it
            winner = self._dispatch(holders, ttft, loads, gw, g_total, by_id)
        elif child:
            winner = min(holders, key=lambda r: (ttft[r], load_reqs(by_id[r]), r))
        else:
            winner = self._dispatch(holders, ttft, loads, gw, g_total, by_id)
        left = None
        if spread_to is None and self.leave_factor > 0:
            away = [(t, rid) for rid, t in predicted.items() if rid not in ttft]
            if away:
                best_away, alt = min(away)
                if min(ttft.values()) > self.leave_factor * best_away:
                    left = spread_to = winner = alt  # it computes a copy there: a new holder
                    holders_g = holders_g | {alt}
                    ttft[alt] = best_away
        # ranking: the winner, the other holders by predicted TTFT, then cache_aware's order
        order = [winner] + sorted((r for r in holders if r != winner), key=lambda r: (ttft[r], load_reqs(by_id[r]), r))
        seen = set(order)
        order += [c.replica_id for c in base.ranked if c.replica_id not in seen]
        cands = []
        for i, rid in enumerate(order):
            t = {
                "plan": 1.0,
                "holder": 1.0 if rid in holders_g else 0.0,
                "predicted_ttft_s": ttft.get(rid, -1.0),
                "matched_blocks": float(runs.get(rid, 0)),
                "group_work": g_total,
                "group_holders": float(len(holders_g)),
                "root_blocks": float(g.blocks),
                "root_at": float(root_at),
                "work_tokens": work,
                "load_share": loads.get(rid, 0.0) / (mean * len(loads)) if mean > 0 else 0.0,
                "peak_share": (peak_new if rid == spread_to else peak_h) / mean if mean > 0 else 0.0,
                "spread": 1.0 if rid == spread_to else 0.0,
                "left": 1.0 if rid == left else 0.0,
                "warm_blocks": float(best) if rid == spread_to and rid != winner else 0.0,
                "score": float(-i),
            }
            cands.append(Candidate(rid, float(-i), t))
        return Decision(self.name, tuple(cands))

    def placed(self, request: RequestView, decision: Decision) -> list | None:
        """The request was sent to `decision`'s first candidate: record it in the plan (the
        request's root, its holders as ranked, a new holder if one was planned, its work on the
        replica it went to) and return that record for the other gateways' plans. Nothing (None)
        for an unplanned decision."""
        if not decision.ranked or not decision.ranked[0].terms.get("plan"):
            return None
        t0 = decision.ranked[0].terms
        root_at = int(t0["root_at"])
        keys = request.keys
        if not 0 <= root_at < len(keys):
            return None
        went = decision.ranked[0]
        # a planned copy is made when the request went to the new holder (or, copy_in_background,
        # beside it); a request moved elsewhere (flow control: no room there) made none
        copied = bool(t0.get("spread") or (self.copy_in_background and any(c.terms.get("spread") for c in decision.ranked)))
        holders = sorted(c.replica_id for c in decision.ranked
                         if c.terms.get("holder") and (c is went or not c.terms.get("spread")))
        record = [keys[root_at], int(t0["root_blocks"]), went.replica_id, float(t0["work_tokens"]), copied, holders]
        self._apply(*record)
        return record

    def placed_elsewhere(self, record: list) -> None:
        """Another gateway's placement (its `placed` record): counted in this plan as if placed
        here, so that every gateway's plan measures the whole stream. A malformed record raises
        ValueError and changes nothing."""
        try:
            key, blocks, rid, work, copied, holders = record
            ok = (isinstance(key, int) and isinstance(blocks, int) and blocks > 0 and isinstance(rid, str)
                  and isinstance(work, (int, float)) and math.isfinite(work) and work >= 0 and isinstance(copied, bool)
                  and isinstance(holders, list) and all(isinstance(h, str) for h in holders))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("not a cache_plan placement record")
        self._apply(key, blocks, rid, float(work), copied, holders)

    def _apply(self, key: int, blocks: int, rid: str, work: float, copied: bool, holders: list) -> None:
        self._now += 1
        now = self._now
        if now % 1000 == 0:
            self._prune()
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(blocks)
        g.count += 1
        g.last_seen = now
        g.holders = frozenset(holders)
        if copied:
            g.last_spread = now
        self._record(g, rid, work)
