"""A design probe in virtual time: the router keeps long prefixes alive on their replicas (the
gateway does not).

Why: on the busy regime's documents the engines' LRU evicts a cold document (one request every
2-4 s) between two of its requests, because every finished request's question and answer blocks
enter the LRU as its most recent entries and push out whatever was used ~5-7 s ago. The next
request of that document then prefills 3,000 tokens and stalls its replica for ~3 s: 7-12 such
misses per run are the Zipf case's p99. No placement avoids it (README, busy regime); a router
that refreshes the document before the LRU reaches it can: a request of the document's block
prefix plus one token, max_tokens 1, is a cache hit of every block (the engine computes one token
and one decode step) and puts the document back at the LRU's tail when it finishes, so the blocks
evicted instead are those of finished requests, which nothing reuses.

What it models (`simulate(..., keep_alive=KeepAlive(...))`, `vtime_report --keep-alive IDLE_S`):
- what is kept is the plan's: a request cache_plan planned (its candidates' `root_blocks` term)
  keeps its root (a document; a chat's system prompt) on the replica it went to, when the root
  is at least `min_blocks` long (a shorter miss costs under a second of prefill: not worth a
  refresh's slot; a 700-token system prompt is not kept, and on the multi-turn case keeping it
  only delayed turns). A conversation's history is never a root, so never kept: each turn
  extends it and nothing else reuses it;
- every load report, each replica's kept prefixes, busiest first (requests per second, decayed
  over `forget_s`), are taken while their blocks fit in `kv_frac` of its KV; one not used for
  `idle_s` (by a request or a refresh) gets a refresh, cut to what the index still shows there
  (a prefix partly evicted is refreshed as far as it is held; one under `min_blocks` is dropped);
  one no request used for `forget_s` is dropped;
- a refresh is a request of the prefix's blocks plus one token, max_tokens 1: it takes a sequence
  slot and one prefill token in the engine's FCFS queue like any request, and carries no client,
  no timeout and no in-flight count.

What a gateway would need to do the same (not built): keep each kept prefix's token ids and cache
salt (from the request that made it), send the refresh as a completion of those ids plus one, with
that salt and max_tokens 1, and count it on the replica's metrics, not its clients'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from loadtests.vtime_replica import SimReq

__all__ = ["KeepAlive", "Retainer", "KEEPALIVE"]

KEEPALIVE = "keepalive"  # SimReq.pace of a refresh (no chain, no client)
_REFRESH_ID_BASE = 1 << 41  # refresh requests' indices, above any workload's and the pace chunks'


@dataclass(frozen=True, slots=True)
class KeepAlive:
    idle_s: float = 2.0  # refresh a kept prefix not used for this long
    min_blocks: int = 64  # only prefixes at least this long are kept (1,024 tokens at 16 per block)
    forget_s: float = 30.0  # a prefix no request used for this long is not kept
    kv_frac: float = 0.9  # a replica's kept blocks stay under this share of its KV

    def __post_init__(self) -> None:
        if self.idle_s <= 0 or self.min_blocks < 1 or self.forget_s <= 0 or not 0 < self.kv_frac <= 1:
            raise ValueError("keep-alive needs idle_s > 0, min_blocks >= 1, forget_s > 0 and 0 < kv_frac <= 1")


@dataclass(slots=True)
class _Kept:
    prefix: tuple  # block keys, in order
    used: float  # last request or refresh
    requested: float  # last request
    rate: float  # requests per second, decayed over forget_s, as of `requested`


class Retainer:
    """The kept prefixes of every replica, and which are due for a refresh (module header)."""

    def __init__(self, ka: KeepAlive, n_replicas: int, num_blocks: int, block_size: int) -> None:
        self.ka = ka
        self.bs = block_size
        self.budget = ka.kv_frac * num_blocks
        self.kept: list[dict] = [{} for _ in range(n_replicas)]  # per replica: last key -> _Kept
        self.sent = 0

    def used(self, ri: int, keys, root_blocks: int, t: float) -> None:
        """A request with `keys` was routed to replica `ri`, its planned root `root_blocks` long (0: none)."""
        kept = self.kept[ri]
        if root_blocks < self.ka.min_blocks:
            return
        k = keys[root_blocks - 1]
        e = kept.get(k)
        if e is None:
            kept[k] = e = _Kept(tuple(keys[:root_blocks]), t, t, 0.0)
            decay = 0.0
        else:
            decay = math.exp(-(t - e.requested) / self.ka.forget_s)
        e.rate = e.rate * decay + 1.0 / self.ka.forget_s
        e.requested = e.used = t

    def due(self, t: float, held_blocks: Callable[[int, tuple], int]) -> list[SimReq]:
        """The refreshes to send now; `held_blocks(ri, prefix)`: the index's leading match there."""
        out = []
        for ri, kept in enumerate(self.kept):
            for k in [k for k, e in kept.items() if t - e.requested > self.ka.forget_s]:
                del kept[k]
            room = self.budget
            for k, e in sorted(kept.items(), key=lambda kv: -kv[1].rate * math.exp(-(t - kv[1].requested) / self.ka.forget_s)):
                if len(e.prefix) > room:
                    continue
                room -= len(e.prefix)
                if t - e.used < self.ka.idle_s:
                    continue
                n = held_blocks(ri, e.prefix)
                if n < self.ka.min_blocks:
                    del kept[k]
                    continue
                e.used = t
                out.append(self._refresh(ri, e.prefix[:n], t))
        return out

    def _refresh(self, ri: int, prefix: tuple, t: float) -> SimReq:
        self.sent += 1
        wr = SimpleNamespace(prompt_tokens=len(prefix) * self.bs + 1, max_output_tokens=1, request_id=f"keepalive-{self.sent}")
        r = SimReq(_REFRESH_ID_BASE + self.sent, wr, SimpleNamespace(prompt=list(prefix), output=None), t)
        r.pace = KEEPALIVE
        r.rep = ri
        return r
