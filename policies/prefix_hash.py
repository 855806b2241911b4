"""prefix_hash: consistent hashing of the prompt's first blocks onto a ring of replicas.

Rule: the request's routing key is its block key number ``min(prefix_blocks, n_keys) - 1`` (keys
are chained, so that one key stands for every block before it and for the tenant's salt). Each
replica id owns `virtual_nodes` points on a 64-bit ring (xxh3_64 of ``"<id>#<i>"``). The request
goes to the owner of the first point clockwise from its key; the ranking continues clockwise over
distinct replicas, skipping unhealthy ones, so an unhealthy owner falls to the next replica on the
ring and a replica leaving moves only its own share of prefixes. A prompt shorter than one block
has no key and is placed by an `rng` draw. Load is ignored (that is the classic weakness: a hot
prefix stays on one replica). Terms: ring_position (0 = owner), load_reqs, score.

Parameters: prefix_blocks (>= 1, default 16: 256 tokens at block size 16, like SGLang's
prefix_token_count), virtual_nodes (>= 1, default 64). State: a cache of the ring per replica set.
"""
from __future__ import annotations

import bisect
import random
from typing import ClassVar, Sequence

import xxhash

from policies._common import load_reqs, shuffled
from policies.base import Candidate, Decision, PolicyBase, ReplicaView, RequestView

__all__ = ["PrefixHashPolicy"]


class PrefixHashPolicy(PolicyBase):
    name: ClassVar[str] = "prefix_hash"

    def __init__(self, *, prefix_blocks: int = 16, virtual_nodes: int = 64) -> None:
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ValueError(f"prefix_blocks and virtual_nodes must be >= 1, got {prefix_blocks}, {virtual_nodes}")
        self.prefix_blocks = int(prefix_blocks)
        self.virtual_nodes = int(virtual_nodes)
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        if ids != self._ring_ids:
            pts = sorted(
                (xxhash.xxh3_64_intdigest(f"{rid}#{i}".encode()), rid) for rid in sorted(set(ids)) for i in range(self.virtual_nodes)
            )
            self._ring_ids = ids
            self._points = [p for p, _ in pts]
            self._owners = [r for _, r in pts]
        return self._points, self._owners

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        by_id = {v.replica_id: v for v in replicas if v.healthy}
        if not by_id:
            return Decision(self.name, ())
        if not request.keys:
            order = shuffled(list(by_id.values()), rng)
        else:
            points, owners = self._ring(tuple(v.replica_id for v in replicas))
            key = request.keys[min(self.prefix_blocks, len(request.keys)) - 1]
            start = bisect.bisect_left(points, key)
            seen: set[str] = set()
            order = []
            n = len(points)
            for j in range(n):
                rid = owners[(start + j) % n]
                if rid in seen:
                    continue
                seen.add(rid)
                if rid in by_id:
                    order.append(by_id[rid])
                    if len(order) == len(by_id):
                        break
        return Decision(
            self.name,
            tuple(Candidate(v.replica_id, -float(i), {"ring_position": float(i), "load_reqs": float(load_reqs(v)), "score": -float(i)}) for i, v in enumerate(order)),
        )
