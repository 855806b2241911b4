"""power_of_two: sample two healthy replicas at random, take the less loaded (Mitzenmacher).

Rule: draw two distinct healthy replicas with `rng`; the one with the smaller
``load_reqs`` (`_common`; ties: the first drawn) ranks first, the other second, then every other
healthy replica by load (ties by an `rng` draw) so a retry still has somewhere to go. With one
healthy replica it is ranked alone. Terms: load_reqs, sampled (1.0 for the two drawn), score.
Stateless.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import healthy, load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["PowerOfTwoPolicy"]


class PowerOfTwoPolicy(PolicyBase):
    name: ClassVar[str] = "power_of_two"

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        ok = healthy(replicas)
        if not ok:
            return Decision(self.name, ())
        if len(ok) == 1:
            picked = [0]
        else:
            picked = rng.sample(range(len(ok)), 2)
            if load_reqs(ok[picked[1]]) < load_reqs(ok[picked[0]]):
                picked.reverse()
        rest = [(load_reqs(ok[i]), rng.random(), i) for i in range(len(ok)) if i not in picked]
        rest.sort()
        order = picked + [i for _, _, i in rest]
        out = []
        for pos, i in enumerate(order):
            v = ok[i]
            out.append(Candidate(v.replica_id, -float(pos), {"load_reqs": float(load_reqs(v)), "sampled": 1.0 if pos < len(picked) else 0.0, "score": -float(pos)}))
        return Decision(self.name, tuple(out))
