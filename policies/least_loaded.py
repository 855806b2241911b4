"""least_loaded: fewest outstanding requests first, ignoring the cache.

Rule: score = -load_reqs with ``load_reqs = running_reqs + max(waiting_reqs, inflight_reqs)``
(`_common`); ties go to fewer in-flight uncached prefill tokens, then a draw from `rng`.
Terms: load_reqs, inflight_prefill_tokens, score. Stateless.
"""
from __future__ import annotations

import random
from typing import ClassVar, Sequence

from policies._common import load_reqs
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["LeastLoadedPolicy"]


class LeastLoadedPolicy(PolicyBase):
    name: ClassVar[str] = "least_loaded"

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        keyed = [(load_reqs(v), v.inflight_prefill_tokens, rng.random(), v) for v in replicas if v.healthy]
        keyed.sort(key=lambda k: k[:3])
        return Decision(
            self.name,
            tuple(
                Candidate(v.replica_id, -float(ld), {"load_reqs": float(ld), "inflight_prefill_tokens": float(tok), "score": -float(ld)})
                for ld, tok, _, v in keyed
            ),
        )
