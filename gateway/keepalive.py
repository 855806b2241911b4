"""Keep-alive of long shared prefixes on the replicas that hold them: which to keep, when one is
due for a refresh, and the refresh request. Pure (no I/O, no clock): the gateway's loop
(gateway.background.run_keep_alive) and the virtual-time simulator (loadtests/vtime.py) drive it.

Why: on busy replicas with more shared documents than one replica's cache holds, the engines'
LRU evicts a cold document between two of its requests: every finished request's question and
answer blocks enter the LRU as its most recent entries, so a document unused for a few seconds is
the oldest. Its next request then prefills the whole document and stalls its replica for seconds.
A request of the document's blocks plus one token, max_tokens 1, is a cache hit of every block
(one token of prefill, one decode step) and puts the document back at the LRU's tail when it
finishes, so what is evicted instead is finished requests' blocks, which nothing reuses.

Rules:
- what is kept is the plan's: a request the policy planned (cache_plan's `root_blocks` candidate
  term) keeps its root (a document; a chat's system prompt) on the replica that served it, when
  the root is at least `min_blocks` long (a shorter miss costs too little prefill to be worth a
  refresh's slot in the engine's queue). A conversation's history is never a root, so never kept:
  each turn extends it and nothing else reuses it;
- each check, a replica's kept prefixes, busiest first (requests per second, decayed over
  `forget_s`), are taken while their blocks fit in `kv_frac` of its KV (unknown KV: no bound); one
  not used for `idle_s` (by a request or a refresh) is due, cut to what the index still shows
  there (a prefix partly evicted is refreshed as far as it is held; one under `min_blocks` is
  dropped); one no request used for `forget_s` is dropped; at most `max_per_replica` are kept per
  replica (the least busy go first), so memory is bounded whatever tenants send;
- a refresh is in flight from `due()` until its sender calls `done()` (answered, failed or timed
  out): a prefix is never refreshed twice at once, and a replica has at most `max_in_flight`
  refreshes out (of those due, the longest idle first: the engine's LRU evicts it first; the
  rest wait for a later check). Without this a replica whose queue outgrew `idle_s` was sent a
  new refresh of every kept prefix each `idle_s` while the earlier ones still waited in that
  queue: the busier the replica, the more refreshes piled up in it;
- a replica whose last load report has more than `max_waiting` requests waiting gets no refresh
  at that check: a refresh behind a long queue arrives after the LRU has taken part of its
  prefix and prefills the lost part on the replica least able to afford it (busy regime, wall
  clock, without this rule: the busiest replica's refreshes computed 3-16k prompt tokens a run,
  each other replica's 0.2-4.8k; with it 1.2-3.3k in all: loadtests/results/busy_regime_log.md);
- with several gateways (pods, `--workers`), each keeps the roots it routed, and what the others
  did counts as if done here (`touched`: their requests, from the plan's shared placements, and
  their refreshes, traded the same way; gateway.routing): a root any gateway used within `idle_s`
  is not due anywhere. Each gateway draws a random `rank`, which its refreshes carry; a root whose
  refreshes came from a lower-ranked gateway within `forget_s` is due here only after `idle_s +
  defer_s` (the gateway sets it over its check period and two exchange periods), by when that
  gateway's refresh has arrived and counted as a use: one gateway refreshes each root, and if it
  stops, the others do `defer_s` later, once: a gateway that refreshes a root has no rival for it
  until it hears one again (before 2026-12-06 it deferred to a stopped gateway's rank for
  `forget_s`, 30 s: every refresh of the root `defer_s` late). Without this each gateway
  measured idleness on its own share of the stream, and with four processes a root was refreshed
  by each of them: 4.5x the refreshes of one (loadtests/results/busy_regime_log.md);
- a refresh carries the root's own token ids, cache salt (the tenant's, from the request that
  made it) and LoRA adapter (it runs under the adapter's name, whose blocks are keyed apart from
  the base model's), so its blocks are exactly the root's;
- with `engine_priority` it also carries vLLM priority -1, ahead of every client request (flow
  control's engine priority uses 0 and 1; clients' own are dropped): on engines run with
  `--scheduling-policy priority` it is admitted at the next step instead of waiting in the queue
  while the LRU goes on evicting what it was sent to keep (on the busy regime's wall clock the
  refreshes recomputed 17-40k prompt tokens a run without it, 1.7-28k with it:
  loadtests/results/busy_regime_log.md). An engine that refuses the priority
  (gateway.rewrite.refuses_priority: its default policy) gets its refreshes without one for
  gateway.rewrite.PRIORITY_RETRY_S, then is tried with it again (it may have been restarted with
  it).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable

__all__ = ["KeepAlive", "REFRESH_PRIORITY", "Refresh", "Retainer", "planned_root", "refresh_body",
           "refresh_computed_tokens"]


@dataclass(frozen=True, slots=True)
class KeepAlive:
    idle_s: float = 2.0  # refresh a kept prefix not used for this long
    min_blocks: int = 64  # only prefixes at least this long are kept (1,024 tokens at 16 per block)
    forget_s: float = 30.0  # a prefix no request used for this long is not kept
    kv_frac: float = 0.9  # a replica's kept blocks stay under this share of its KV
    max_per_replica: int = 256  # kept prefixes per replica at most
    max_in_flight: int = 4  # refreshes out at once per replica
    max_waiting: int = 2  # no refresh to a replica reporting more requests waiting than this
    defer_s: float = 0.0  # longer idle before a refresh where a lower-ranked gateway refreshes (module rules)

    @classmethod
    def from_config(cls, k, block_size: int, *, defer_s: float = 0.0) -> "KeepAlive":
        """The rules of the gateway's `keep_alive` section (gateway.config.KeepAliveConfig): token
        counts become blocks (min_tokens rounded down, at least one)."""
        return cls(idle_s=k.idle_s, min_blocks=max(1, k.min_tokens // block_size), forget_s=k.forget_s,
                   kv_frac=k.kv_frac, max_per_replica=k.max_per_replica, max_in_flight=k.max_in_flight,
                   max_waiting=k.max_waiting, defer_s=defer_s)

    def __post_init__(self) -> None:
        if (self.idle_s <= 0 or self.min_blocks < 1 or self.forget_s <= 0 or not 0 < self.kv_frac <= 1
                or self.max_per_replica < 1 or self.max_in_flight < 1 or self.max_waiting < 0 or not self.defer_s >= 0):
            raise ValueError("keep-alive needs idle_s > 0, min_blocks >= 1, forget_s > 0, 0 < kv_frac <= 1, "
                             "max_per_replica >= 1, max_in_flight >= 1, max_waiting >= 0 and defer_s >= 0")


@dataclass(frozen=True, slots=True)
class Refresh:
    replica: Hashable
    keys: tuple  # the block keys refreshed (the kept prefix, cut to what the index holds)
    payload: Any  # what the prefix was kept with (the gateway: its token ids, salt and LoRA adapter)
    kept: Hashable = None  # the kept prefix's last key (its name in the Retainer), for done()


@dataclass(slots=True)
class _Kept:
    keys: tuple  # block keys, in order
    payload: Any
    used: float  # last request or refresh
    requested: float  # last request
    rate: float  # requests per second, decayed over forget_s, as of `requested`
    rival: float = math.inf  # the lowest rank of another gateway seen refreshing it (Retainer.rank)
    rival_at: float = -math.inf  # when that was heard

    def busy(self, t: float, forget_s: float) -> float:
        return self.rate * math.exp(-(t - self.requested) / forget_s)


class Retainer:
    """The kept prefixes of every replica, and which are due for a refresh (module rules). `rank`:
    this gateway's place among several (any number; the lowest refreshes, the others defer)."""

    def __init__(self, ka: KeepAlive, rank: float = 0.0) -> None:
        self.ka = ka
        self.rank = float(rank)
        self.kept: dict = {}  # replica -> {last key: _Kept}
        self.sent = 0  # refreshes handed out by due()
        self.in_flight: dict = {}  # replica -> {kept prefix's last key}: handed out, not done()

    def used(self, replica: Hashable, keys, root_blocks: int, t: float,
             payload: Callable[[], Any] | None = None) -> None:
        """A request with block `keys` was served by `replica`, its planned root `root_blocks`
        long (0: none); `payload()` (called only for a new prefix) is what a refresh will need."""
        if root_blocks < self.ka.min_blocks or root_blocks > len(keys):
            return
        kept = self.kept.setdefault(replica, {})
        k = keys[root_blocks - 1]
        e = kept.get(k)
        if e is None:
            if len(kept) >= self.ka.max_per_replica:
                del kept[min(kept, key=lambda x: kept[x].busy(t, self.ka.forget_s))]
            kept[k] = e = _Kept(tuple(keys[:root_blocks]), payload() if payload is not None else None, t, t, 0.0)
        e.rate = e.busy(t, self.ka.forget_s) + 1.0 / self.ka.forget_s
        e.requested = e.used = t

    def touched(self, replica: Hashable, key: Hashable, t: float, *, rank: float | None = None) -> None:
        """Another gateway used the prefix kept here as `key` (its last block key) on `replica` at
        about `t`: sent a request of it there (`rank` None) or refreshed it (`rank`: that gateway's).
        Counted as if here (module rules); nothing when this gateway does not keep it (it has no
        token ids to refresh it with)."""
        e = self.kept.get(replica, {}).get(key)
        if e is None:
            return
        e.used = max(e.used, t)
        if rank is None:
            if t >= e.requested:
                e.rate = e.busy(t, self.ka.forget_s) + 1.0 / self.ka.forget_s
                e.requested = t
        elif rank <= e.rival or t - e.rival_at > self.ka.forget_s:
            e.rival, e.rival_at = rank, t

    def keeping(self) -> bool:
        """Whether any prefix is kept (on any replica)."""
        return any(self.kept.values())

    def forget(self, replica: Hashable) -> None:
        """The replica left (or restarted empty): nothing is kept there."""
        self.kept.pop(replica, None)
        self.in_flight.pop(replica, None)

    def done(self, rf: Refresh) -> None:
        """Refresh `rf` is over (answered, failed or abandoned): its prefix may be refreshed again."""
        out = self.in_flight.get(rf.replica)
        if out is not None:
            out.discard(rf.kept)

    def due(self, t: float, held_blocks: Callable[[Hashable, tuple], int],
            capacity_blocks: Callable[[Hashable], int],
            waiting_reqs: Callable[[Hashable], int] | None = None) -> list[Refresh]:
        """The refreshes to send now. `held_blocks(replica, keys)`: the index's leading match there;
        `capacity_blocks(replica)`: its KV in blocks (0: unknown); `waiting_reqs(replica)`: the
        requests its engine last reported waiting (0: unknown)."""
        ka, out = self.ka, []
        for replica, kept in self.kept.items():
            for k in [k for k, e in kept.items() if t - e.requested > ka.forget_s]:
                del kept[k]
            if waiting_reqs is not None and waiting_reqs(replica) > ka.max_waiting:
                continue
            cap = capacity_blocks(replica)
            room = ka.kv_frac * cap if cap > 0 else math.inf
            out_here = self.in_flight.setdefault(replica, set())
            due = []
            for k, e in sorted(kept.items(), key=lambda kv: -kv[1].busy(t, ka.forget_s)):
                if len(e.keys) > room:
                    continue
                room -= len(e.keys)
                defer = ka.defer_s if e.rival < self.rank and t - e.rival_at <= ka.forget_s else 0.0
                if t - e.used >= ka.idle_s + defer and k not in out_here:
                    due.append((k, e))
            due.sort(key=lambda ke: ke[1].used)  # the longest idle first: the engine's LRU evicts it first
            for k, e in due:
                if len(out_here) >= ka.max_in_flight:
                    break
                n = held_blocks(replica, e.keys)
                if n < ka.min_blocks:
                    del kept[k]
                    continue
                e.used = t
                e.rival = math.inf  # refreshed here: a lower-ranked rival missed its turn; none till heard again
                self.sent += 1
                out_here.add(k)
                out.append(Refresh(replica, e.keys[:n], e.payload, k))
        return out


def planned_root(terms: dict) -> int:
    """The root to keep for a request a policy ranked with these candidate terms, in blocks: the
    candidate's `root_blocks` when the request was planned, else 0."""
    return int(terms.get("root_blocks", 0.0)) if terms.get("plan") else 0


REFRESH_PRIORITY = -1  # vLLM's priority of a refresh with engine_priority: lower goes first


def refresh_body(model: str, token_ids, blocks: int, block_size: int, salt: str, *,
                 priority: int | None = None) -> dict:
    """The completion that refreshes `blocks` blocks of `token_ids`: those tokens plus the next one
    (a partial block, so every full block is a hit and one token is computed), max_tokens 1, with
    the tenant's cache salt and, when given, vLLM's `priority`; `token_ids` must hold at least
    blocks x block_size + 1 tokens."""
    n = blocks * block_size
    if len(token_ids) <= n:
        raise ValueError("a refresh needs the token after its blocks")
    body = {"model": model, "prompt": list(token_ids[: n + 1]), "max_tokens": 1, "stream": False}
    if salt:
        body["cache_salt"] = salt
    if priority is not None:
        body["priority"] = priority
    return body


def refresh_computed_tokens(raw: bytes, prompt_tokens: int) -> int:
    """Prompt tokens a refresh made the engine compute, from its completion's `usage` (prompt tokens
    minus cached ones); the whole prompt when the answer does not say (no usage, no cached count:
    an engine without prefix-cache reporting is assumed to have computed it all)."""
    try:
        usage = json.loads(raw).get("usage") or {}
        prompt = int(usage.get("prompt_tokens", prompt_tokens))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
    except (ValueError, TypeError, AttributeError):
        return prompt_tokens
    return max(0, prompt - cached)
