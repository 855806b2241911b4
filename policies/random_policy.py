"""random: a uniformly random order of the healthy replicas (registered as "random").

Rule: one `rng` draw per healthy replica, sorted; deterministic for an `rng` state. Terms:
``load_reqs`` only; score is minus the rank position. Stateless.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import healthy, load_reqs, shuffled
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["RandomPolicy"]


class RandomPolicy(PolicyBase):
    name: ClassVar[str] = "random"

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        order = shuffled(healthy(replicas), rng)
        return Decision(
            self.name,
            tuple(Candidate(v.replica_id, -float(i), {"load_reqs": float(load_reqs(v)), "score": -float(i)}) for i, v in enumerate(order)),
        )
