"""Helpers shared by the policies: eligibility, the common load measure, tie-breaking.

Rule: everything here is pure and cheap; a policy never sees an unhealthy replica after
`healthy()`. Load measures (documented once, used by every policy that needs one):

- ``load_reqs(v) = running_reqs + max(waiting_reqs, inflight_reqs)``. The engine's waiting count
  (agent's last scrape, possibly stale) and the gateways' in-flight count (requests sent that have
  not yet produced a first token, always fresh) overlap: when every request comes through the
  gateways, a waiting request is also in flight. Taking the max counts each pending request once
  and lets the fresher signal win whichever way the staleness goes.
"""
from __future__ import annotations

import random
from typing import Sequence

from policies.base import ReplicaView

__all__ = ["healthy", "load_reqs", "SCORE_RESOLUTION_S"]

# Scores closer than this are ties (seconds): float noise must not decide a placement.
SCORE_RESOLUTION_S = 1e-9


def healthy(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The eligible replicas, in input order (empty when none is healthy)."""
    return [r for r in replicas if r.healthy]


def load_reqs(v: ReplicaView) -> int:
    """Outstanding requests on a replica as the gateway best knows them (see module header)."""
    return v.running_reqs + max(v.waiting_reqs, v.inflight_reqs)


def shuffled(items: list, rng: random.Random) -> list:
    """A copy of `items` in an order drawn from `rng` (one draw per item: deterministic per seed)."""
    keyed = [(rng.random(), i) for i in range(len(items))]
    keyed.sort()
    return [items[i] for _, i in keyed]
