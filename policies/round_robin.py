"""round_robin: the healthy replicas in turn, ignoring cache and load (the baseline to beat).

Rule: a cursor advances by one per request sent (`placed`: a request ranked twice, as flow control
does at release, or ranked and not sent, takes one turn or none); the ranking is the healthy
replicas (input order) rotated so that position ``cursor mod n_healthy`` comes first. Terms:
``load_reqs`` only; score is minus the rank position. State: the cursor (one int); `rng` is not used.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import healthy, load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy(PolicyBase):
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0  # requests placed so far

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        ok = healthy(replicas)
        if not ok:
            return Decision(self.name, ())
        start = self._cursor % len(ok)
        order = ok[start:] + ok[:start]
        return Decision(
            self.name,
            tuple(Candidate(v.replica_id, -float(i), {"load_reqs": float(load_reqs(v)), "score": -float(i)}) for i, v in enumerate(order)),
        )

    def placed(self, request: RequestView, decision: Decision) -> None:
        self._cursor += 1
