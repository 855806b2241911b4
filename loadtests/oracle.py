"""Oracle bounds on cacheable prompt tokens: how far a router is from the limit.

Rule: both bounds walk the requests in arrival order over their chained block keys (keys include
the tenant's salt, so tenants never share). A hit on block j is counted only for
j < (prompt_tokens - 1) // block_size (the engine recomputes the last token). Because keys are
chained, a block whose key was seen implies every block before it was seen too, so per-block
counting equals counting leading runs. Generated answer blocks that later prompts quote (multi-
turn) are inserted when their request is served, not counted.

- `infinite_bound`: every distinct block misses once (first occurrence per tenant), every later
  occurrence hits. Ignores capacity and timing: an upper bound for any router.
- `pooled_belady_bound(capacity_blocks)`: one pooled cache with the replicas' total KV capacity,
  managed by Belady's optimal offline rule (evict the block used farthest in the future, or do not
  insert a block whose next use is farther than every cached one). Any placement on replicas
  whose capacities sum to that can be replayed in this pool (the union of their contents fits),
  and per-block hits overcount prefix runs, so it is still an upper bound for every router, and
  much tighter than the infinite one when KV is smaller than the working set. It ignores blocks
  pinned by running requests and concurrency (a request arriving before its prefix was computed
  is counted a hit), both of which only make it looser.

Warm-up (`warmup=n`): the first n requests are served (their blocks enter the cache) but neither
their prompt tokens nor their hits count, as vtime's pre-warm requests.

Both return `OracleResult(prompt_tokens, cached_tokens)`; `hit_ratio` is their ratio.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

__all__ = ["OracleResult", "infinite_bound", "pooled_belady_bound"]


@dataclass(frozen=True, slots=True)
class OracleResult:
    kind: str  # "infinite" | "pooled_belady"
    prompt_tokens: int
    cached_tokens: int
    capacity_blocks: int = 0  # 0: unbounded

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def infinite_bound(prompt_tokens: Sequence[int], prompt_keys: Sequence[Sequence[int]], output_keys: Sequence[Sequence[int] | None], block_size: int, warmup: int = 0) -> OracleResult:
    seen: set = set()
    cached = 0
    for i, (n, keys, out) in enumerate(zip(prompt_tokens, prompt_keys, output_keys)):
        cap = min(len(keys), (n - 1) // block_size)
        j = 0
        while j < cap and keys[j] in seen:
            j += 1
        if i >= warmup:
            cached += j * block_size
        seen.update(keys)
        if out:
            seen.update(out)
    return OracleResult("infinite", int(sum(prompt_tokens[warmup:])), cached)


def pooled_belady_bound(
    prompt_tokens: Sequence[int],
    prompt_keys: Sequence[Sequence[int]],
    output_keys: Sequence[Sequence[int] | None],
    block_size: int,
    capacity_blocks: int,
    warmup: int = 0,
) -> OracleResult:
    if capacity_blocks <= 0:
        raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
    # the access stream: (key, counted?) ; output keys are inserts (never counted)
    stream_keys: list = []
    stream_count: list = []
    for i, (n, keys, out) in enumerate(zip(prompt_tokens, prompt_keys, output_keys)):
        cap = min(len(keys), (n - 1) // block_size) if i >= warmup else 0
        stream_keys.extend(keys)
        stream_count.extend([True] * cap + [False] * (len(keys) - cap))
        if out:
            stream_keys.extend(out)
            stream_count.extend([False] * len(out))
    n_acc = len(stream_keys)
    never = n_acc + 1
    next_use = [never] * n_acc
    last: dict = {}
    for pos in range(n_acc - 1, -1, -1):
        k = stream_keys[pos]
        next_use[pos] = last.get(k, never)
        last[k] = pos
    cache: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key), lazily cleaned
    hits = 0
    for pos in range(n_acc):
        k = stream_keys[pos]
        nu = next_use[pos]
        if k in cache:
            if stream_count[pos]:
                hits += 1
            cache[k] = nu
            heapq.heappush(heap, (-nu, k))
            continue
        if nu == never:
            continue  # never used again: do not keep it
        if len(cache) < capacity_blocks:
            cache[k] = nu
            heapq.heappush(heap, (-nu, k))
            continue
        while True:
            far, fk = heap[0]
            if cache.get(fk) == -far:
                break
            heapq.heappop(heap)
        if -far > nu:
            heapq.heappop(heap)
            del cache[fk]
            cache[k] = nu
            heapq.heappush(heap, (-nu, k))
    # a cached block whose next use is `never` is dead weight; the heap keeps it first in line
    return OracleResult("pooled_belady", int(sum(prompt_tokens[warmup:])), hits * block_size, capacity_blocks)
