"""The gateway's KV index: which replica holds which block keys, per medium (pure, no I/O).

Rule: `match(keys)` returns, per replica, the length of the *leading run* of `keys` it holds (block i
counts only if blocks 0..i-1 count too), once on GPU (`gpu_blocks`) and once on any medium
(`any_blocks`, GPU or CPU or other tiers; always >= gpu_blocks). Replicas with a zero run are absent;
empty `keys` gives `{}`. What counts for replica r:
  - real entries from its feed (`apply` / `load_snapshot`), but only while r is live: it produced a
    feed record (any kind) or a snapshot within `stale_after_s`; a silent replica's entries stop
    counting (they are kept, and count again as soon as r reports);
  - speculative entries (`insert_speculative`), counted as GPU, until their TTL passes, a stored
    record for that (key, replica) makes them real, or r's cache is cleared. A removal does not end
    them: a removal of a key not stored since the request was routed is usually of an older copy,
    delivered late, that the routed request computes again (ending them there left the index
    short of the new copy until its store arrived: a request routed in that gap was predicted
    under what the engine had). The price: a block the routed request found cached (no store
    follows) and the engine evicts within the TTL still counts until the TTL ends, an
    over-prediction; rare, since the request's blocks are the most recently used there. They
    count whatever r's liveness: they are the gateway's own knowledge.

Layout (for speed and memory): each replica gets a slot (a bit position); per medium class (GPU, and
"other" for CPU/storage) one dict maps key -> int bitmask of slots. One dict lookup per key and medium
answers for every replica; a match walks the keys once, AND-ing a running mask and recording the
position where each replica's bit drops out. Single-bit masks come from a shared table, so a key held
by one replica costs a dict slot plus the key's int (about 80 bytes at 1M keys, measured in
loadtests/bench_index.py); a key shared by n replicas costs about that once, not n times.

Budget and eviction: `max_entries` bounds the (key, replica, medium) entries. Eviction is LRU *by
last store*, per medium dict (dict order is the LRU list): a stored record for a key moves it to the
back (hits re-reported by the engine under `kv_cache_report_mode="full"`, when the gateway sets it,
count as use), and a run is inserted deepest-first so a chain's first blocks, which every longer
match needs, are evicted last. When the budget is exceeded the front keys are dropped with all their
replicas' bits, in batches of 1% of the budget, CPU/other tiers before GPU. Evicting only loses
routing benefit, never correctness: an evicted key simply does not match.
NOTE: `match` is read-only on purpose. Touching matched keys (pop + reinsert) made every lookup
write up to 512 dict entries (+15-20% lookup time measured) and, through that churn, brought the
dict's periodic O(n) compaction onto the request path; recency from the feed costs nothing there.

Clearing (a "cleared" record, `load_snapshot`, `purge`) is O(1) for matching: no per-replica key
lists are kept (they would double memory), so instead the replica moves to a fresh slot and its old
slot is *retired*: no live replica owns its bits, so they never count, and they are swept away
incrementally (`maintain`, a few thousand keys per `apply`) before the slot is reused. A full scan
costs ~60-100 ns per key in the index (a 4M-key index: ~0.3 s), too long to block the event loop.
"""
from __future__ import annotations

import heapq
import sys
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Sequence

from replica_agent.feed import MEDIUM_GPU, FeedEvent, Hello, LoadReport, Snapshot

__all__ = ["KVIndex", "Match", "IndexStats"]

_MAX_SLOTS_HINT = 256  # single-bit masks precomputed up to this slot; more replicas still work


@dataclass(frozen=True, slots=True)
class Match:
    """A replica's leading run for one request."""

    gpu_blocks: int  # leading blocks held on GPU (or speculatively)
    any_blocks: int  # leading blocks held on any medium (>= gpu_blocks)


@dataclass(frozen=True, slots=True)
class IndexStats:
    entries: int  # (key, replica, medium) entries from feeds (speculative ones excluded)
    bytes_estimate: int  # estimated bytes held by the index's dicts and key ints
    evictions: int  # entries dropped by the budget since start
    replicas: int  # replicas with a slot
    entries_by_replica: dict[str, int] = field(default_factory=dict)  # replica -> entries
    feed_lag_s_by_replica: dict[str, float] = field(default_factory=dict)  # replica -> publish-to-apply lag
    speculative_entries: int = 0  # (key, replica) speculative entries alive or not yet swept
    live_replicas: int = 0  # replicas whose entries count now


class KVIndex:
    """Per replica and medium, the block keys it holds; see the module docstring for the rules."""

    def __init__(self, *, max_entries: int = 4_000_000, stale_after_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self.sweep_keys_per_call = 4096  # retired-slot sweep work done per apply/clear (keys)
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._gpu: dict[int, int] = {}  # key -> slot bitmask, GPU medium
        self._other: dict[int, int] = {}  # key -> slot bitmask, CPU and other tiers
        self._slot_of: dict[str, int] = {}  # replica -> slot
        self._replica_of: dict[int, str] = {}  # slot -> replica
        self._free_slots: list[int] = []  # swept slots, reused first (lowest first keeps masks small)
        self._next_slot = 0  # next never-used slot
        self._zombies: dict[int, None] = {}  # retired slots waiting for the next sweep pass
        self._sweep: list | None = None  # the sweep pass under way (see maintain)
        self._all_mask = 0  # bits of every assigned slot
        self._bits: list[int] = [1 << i for i in range(_MAX_SLOTS_HINT)]  # shared single-bit masks
        self._entries_by_slot: dict[int, int] = {}  # slot -> entries
        self._entries = 0
        self._evictions = 0
        self._last_seen: dict[int, float] = {}  # slot -> clock() of its last feed record/snapshot
        self._live_mask = 0
        self._live_valid_until = -1.0  # clock() at which _live_mask must be recomputed
        self._loads: dict[str, LoadReport] = {}
        self._hellos: dict[str, Hello] = {}
        self._offsets: dict[str, int] = {}  # replica -> last applied offset
        self._lag_s: dict[str, float] = {}  # replica -> feed lag (set by the consumer)
        # speculative entries: key -> mask; (key, slot) -> expiry; heap of batches to sweep
        self._spec: dict[int, int] = {}
        self._spec_until: dict[int, dict[int, float]] = {}  # slot -> key -> expiry (no tuple per key)
        self._spec_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._spec_seq = 0

    # ---------------------------------------------------------------- slots and liveness
    def _bit(self, slot: int) -> int:
        return self._bits[slot] if slot < _MAX_SLOTS_HINT else 1 << slot

    def _slot(self, replica_id: str) -> int:
        slot = self._slot_of.get(replica_id)
        if slot is None:
            slot = self._new_slot()
            self._slot_of[replica_id] = slot
            self._replica_of[slot] = replica_id
            self._entries_by_slot[slot] = 0
            self._all_mask |= self._bit(slot)
        return slot

    def _new_slot(self) -> int:
        if self._free_slots:
            self._free_slots.sort(reverse=True)
            return self._free_slots.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def _seen(self, slot: int) -> None:
        self._last_seen[slot] = self._clock()
        if not self._live_mask & self._bit(slot):
            self._live_valid_until = -1.0  # recompute: a replica came (back) to life

    def _live(self) -> int:
        now = self._clock()
        if now < self._live_valid_until:
            return self._live_mask
        mask = 0
        until = float("inf")
        for slot, seen in self._last_seen.items():
            expires = seen + self.stale_after_s
            if expires > now:
                mask |= self._bit(slot)
                until = min(until, expires)
        self._live_mask = mask
        self._live_valid_until = until
        return mask

    def is_live(self, replica_id: str) -> bool:
        """True if the replica produced a feed record or snapshot within stale_after_s."""
        slot = self._slot_of.get(replica_id)
        if slot is None:
            return False
        seen = self._last_seen.get(slot)
        return seen is not None and self._clock() - seen < self.stale_after_s

    # ---------------------------------------------------------------- feed side
    def apply(self, event: FeedEvent) -> None:
        """Apply one feed record. Ordering and gaps are the consumer's job (IndexSync)."""
        if self._zombies or self._sweep:
            self.maintain(self.sweep_keys_per_call)
        slot = self._slot(event.replica_id)
        self._seen(slot)
        if event.offset:
            self._offsets[event.replica_id] = event.offset
        kind = event.kind
        if kind == "stored":
            self._store(slot, event.keys, event.medium)
        elif kind == "removed":
            self._remove(slot, event.keys, event.medium)
        elif kind == "cleared":
            self._clear_slot(slot, speculative=True)
        elif kind == "load":
            if event.load is not None:
                self._loads[event.replica_id] = event.load
        elif kind == "hello":
            if event.hello is not None:
                self._hellos[event.replica_id] = event.hello
        else:
            raise ValueError(f"unknown feed record kind {kind!r} from {event.replica_id}@{event.offset}")

    def _store(self, slot: int, keys: Sequence[int], medium: str) -> None:
        d = self._gpu if medium == MEDIUM_GPU else self._other
        bit = self._bit(slot)
        added = 0
        pop = d.pop
        for k in reversed(keys):  # chain order reversed: block 0 ends up most recent (evicted last)
            m = pop(k, 0)  # pop + reinsert: the key moves to the LRU back
            if not m & bit:
                added += 1
                m = bit if not m else m | bit
            d[k] = m
        if self._spec and medium == MEDIUM_GPU:
            self._drop_spec(slot, keys)
        if added:
            self._entries += added
            self._entries_by_slot[slot] += added
            if self._entries > self.max_entries:
                self._evict()

    def _remove(self, slot: int, keys: Sequence[int], medium: str) -> None:
        d = self._gpu if medium == MEDIUM_GPU else self._other
        bit = self._bit(slot)
        removed = 0
        get = d.get
        for k in keys:
            m = get(k)
            if m is not None and m & bit:
                removed += 1
                m ^= bit
                if m:
                    d[k] = m
                else:
                    del d[k]
        # Speculative entries stay (module header): a removal of a key not stored since it was
        # speculated is usually of an older copy (feed lag) that the routed request computes
        # again; a store in between would have made it real, and then this removal takes it.
        self._entries -= removed
        self._entries_by_slot[slot] -= removed

    def _clear_slot(self, slot: int, *, speculative: bool) -> None:
        """Drop every real entry of the slot's replica in O(1): the replica moves to a fresh slot and
        the old one is retired; its bits are swept incrementally (`maintain`), then it is reused."""
        if speculative and self._spec:
            bit = self._bit(slot)
            self._drop_spec(slot, [k for k, m in self._spec.items() if m & bit])
        if not self._entries_by_slot.get(slot, 0):
            return
        rid = self._replica_of.pop(slot)
        new = self._new_slot()
        self._slot_of[rid] = new
        self._replica_of[new] = rid
        self._entries_by_slot[new] = 0
        self._all_mask = (self._all_mask & ~self._bit(slot)) | self._bit(new)
        if slot in self._last_seen:
            self._last_seen[new] = self._last_seen.pop(slot)
        self._live_valid_until = -1.0
        # speculative bits of the old slot that were kept (load_snapshot) move with the replica
        if self._spec:
            bit, nbit = self._bit(slot), self._bit(new)
            for k, m in list(self._spec.items()):
                if m & bit:
                    self._spec[k] = (m & ~bit) | nbit
            moved = self._spec_until.pop(slot, None)
            if moved:
                self._spec_until[new] = moved
            self._spec_heap = [(u, q, new if sl == slot else sl, ks) for u, q, sl, ks in self._spec_heap]
            heapq.heapify(self._spec_heap)
        self._zombies[slot] = None
        self.maintain(self.sweep_keys_per_call)

    def maintain(self, max_keys: int = 50_000) -> int:
        """Sweep up to `max_keys` keys of retired slots' bits; returns how many slots are left to sweep.

        One pass sweeps every slot retired before it started (one combined mask over one snapshot of
        the keys); slots retired meanwhile wait for the next pass. `apply` calls this with a small
        budget, so an index fed by IndexSync needs nothing else; call it when idle to finish sooner."""
        budget = max_keys
        while budget > 0:
            sweep = self._sweep
            if sweep is None:
                if not self._zombies:
                    break
                slots = list(self._zombies)
                self._zombies.clear()
                mask = 0
                for sl in slots:
                    mask |= self._bit(sl)
                sweep = self._sweep = [mask, slots, 0, None, 0]  # mask, slots, dict index, keys, position
            mask, slots = sweep[0], sweep[1]
            dicts = (self._gpu, self._other)
            while sweep[2] < 2 and budget > 0:
                d = dicts[sweep[2]]
                if sweep[3] is None:
                    sweep[3] = list(d)  # C-speed snapshot of the keys; the sweep itself is chunked
                    sweep[4] = 0
                keys, pos = sweep[3], sweep[4]
                end = min(len(keys), pos + budget)
                get = d.get
                by_slot = self._entries_by_slot
                for i in range(pos, end):
                    k = keys[i]
                    m = get(k)
                    if m is not None:
                        dead = m & mask
                        if dead:
                            m ^= dead
                            if m:
                                d[k] = m
                            else:
                                del d[k]
                            while dead:
                                low = dead & -dead
                                by_slot[low.bit_length() - 1] -= 1
                                self._entries -= 1
                                dead ^= low
                budget -= end - pos
                sweep[4] = end
                if end >= len(keys):
                    sweep[2] += 1
                    sweep[3] = None
            if sweep[2] >= 2:
                # keys inserted after a snapshot never carry a retired bit: these slots are clean
                for sl in slots:
                    self._entries -= self._entries_by_slot.pop(sl, 0)
                    self._free_slots.append(sl)
                self._sweep = None
        return len(self._zombies) + (len(self._sweep[1]) if self._sweep else 0)

    def _evict(self) -> None:
        """Drop least-recently stored keys until 1% under budget (batched)."""
        target = self.max_entries - max(1, self.max_entries // 100)
        bits_of = self._replica_bits
        for d in (self._other, self._gpu):  # lower tiers go first
            while self._entries > target and d:
                batch = list(islice(d, max(1, min(len(d), self._entries - target))))
                for k in batch:
                    m = d.pop(k)
                    for slot in bits_of(m):
                        self._entries_by_slot[slot] -= 1
                        self._entries -= 1
                        self._evictions += 1
            if self._entries <= target:
                return

    @staticmethod
    def _replica_bits(mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    def load_snapshot(self, replica_id: str, snapshot: Snapshot) -> None:
        """Replace the replica's real entries with the snapshot's (speculative ones are kept)."""
        self._clear_slot(self._slot(replica_id), speculative=False)
        slot = self._slot(replica_id)  # a fresh slot if the old one held entries
        for medium, keys in snapshot.keys_by_medium.items():
            self._store(slot, keys, medium)
        self._offsets[replica_id] = snapshot.offset
        self._seen(slot)

    def purge(self, replica_id: str) -> None:
        """Forget the replica entirely (removed from the pool): entries, speculation, load, slot."""
        slot = self._slot_of.get(replica_id)
        if slot is None:
            return
        self._clear_slot(slot, speculative=True)  # retires the slot if it held entries
        slot = self._slot_of.pop(replica_id)
        self._replica_of.pop(slot, None)
        self._entries_by_slot.pop(slot, None)
        self._last_seen.pop(slot, None)
        self._live_valid_until = -1.0
        for d in (self._loads, self._hellos, self._offsets, self._lag_s):
            d.pop(replica_id, None)
        self._all_mask &= ~self._bit(slot)
        self._free_slots.append(slot)  # it holds no bits: reusable at once

    # ---------------------------------------------------------------- speculation
    def insert_speculative(self, replica_id: str, keys: Sequence[int], ttl_s: float = 2.0) -> None:
        """Count `keys` as held on GPU by the replica for ttl_s (a request was just routed there)."""
        if not keys:
            return
        slot = self._slot(replica_id)
        bit = self._bit(slot)
        now = self._clock()
        self._expire_spec(now)
        until = now + ttl_s
        spec = self._spec
        get = spec.get
        for k in keys:
            spec[k] = get(k, 0) | bit
        su = self._spec_until.get(slot)
        if su is None:
            su = self._spec_until[slot] = {}
        su.update(dict.fromkeys(keys, until))  # C speed: one expiry per (key, slot), the latest wins
        self._spec_seq += 1
        heapq.heappush(self._spec_heap, (until, self._spec_seq, slot, tuple(keys)))

    def speculative_keys(self) -> int:
        """Keys with a speculative entry on some replica (expired ones not yet swept included)."""
        return len(self._spec)

    def _drop_spec(self, slot: int, keys: Sequence[int]) -> None:
        bit = self._bit(slot)
        spec = self._spec
        su = self._spec_until.get(slot)
        for k in keys:
            m = spec.get(k)
            if m is not None and m & bit:
                m ^= bit
                if m:
                    spec[k] = m
                else:
                    del spec[k]
                if su is not None:
                    su.pop(k, None)
        if su is not None and not su:
            del self._spec_until[slot]

    def _expire_spec(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, _, slot, keys = heapq.heappop(heap)
            su = self._spec_until.get(slot)
            if su is None:
                continue
            later = now + 1
            due = [k for k in keys if su.get(k, later) <= now]
            self._drop_spec(slot, due)

    # ---------------------------------------------------------------- match
    def match(self, keys: Sequence[int]) -> dict[str, Match]:
        """Each replica's leading run of `keys` (one pass); replicas with no match are absent."""
        if not keys:
            return {}
        if self._spec_heap:
            self._expire_spec(self._clock())
        live = self._live()
        spec = self._spec
        a = self._all_mask if spec else live
        if not a:
            return {}
        if self._other:
            gpu_run, any_run = _tier_runs(keys, a, live, self._gpu.get, self._other.get, spec.get if spec else None)
        else:  # GPU only: gpu run == any run
            gpu_run = any_run = _gpu_runs(keys, a, live, self._gpu.get, spec.get if spec else None)
        out: dict[str, Match] = {}
        replica_of = self._replica_of
        for slot, run in any_run.items():
            if run:
                out[replica_of[slot]] = Match(gpu_run.get(slot, 0), run)
        return out

    def gpu_run(self, replica_id: str, keys: Sequence[int]) -> int:
        """One replica's leading run of `keys` on GPU (or speculative); 0 when it holds none."""
        m = self.match(keys).get(replica_id)
        return m.gpu_blocks if m is not None else 0

    def event_run(self, replica_id: str, keys: Sequence[int]) -> int:
        """One replica's leading run of `keys` on GPU from its feed's entries alone (no speculative
        entries, liveness aside): diagnostics, what the index would say without its own guesses."""
        slot = self._slot_of.get(replica_id)
        if slot is None:
            return 0
        bit, get, n = self._bit(slot), self._gpu.get, 0
        for k in keys:
            if not get(k, 0) & bit:
                break
            n += 1
        return n

    # ---------------------------------------------------------------- read side
    def last_load(self, replica_id: str) -> LoadReport | None:
        return self._loads.get(replica_id)

    def waiting_reqs(self, replica_id: str) -> int:
        """Requests the replica's engine last reported waiting (0: no report yet)."""
        rep = self._loads.get(replica_id)
        return rep.waiting_reqs if rep is not None else 0

    def kv_capacity_blocks(self, replica_id: str) -> int:
        """The replica's KV in blocks, as its engine last reported (0: unknown)."""
        rep = self._loads.get(replica_id)
        return rep.num_gpu_blocks if rep is not None else 0

    def hello(self, replica_id: str) -> Hello | None:
        return self._hellos.get(replica_id)

    def offset(self, replica_id: str) -> int:
        """Last applied feed offset for the replica (0: none)."""
        return self._offsets.get(replica_id, 0)

    def replicas(self) -> list[str]:
        return list(self._slot_of)

    def set_feed_lag(self, replica_id: str, lag_s: float) -> None:
        """Record the consumer's view of the replica's feed lag (shown in stats)."""
        self._lag_s[replica_id] = lag_s

    def entries_of(self, replica_id: str) -> int:
        """Keys indexed for one replica (event-backed, not speculative); 0 when unknown. O(1)."""
        slot = self._slot_of.get(replica_id)
        return self._entries_by_slot.get(slot, 0) if slot is not None else 0

    def stats(self) -> IndexStats:
        live = self._live()
        nkeys = len(self._gpu) + len(self._other)
        # dict tables + one int object per key (u64 keys are 36-byte ints) + multi-bit masks (rough)
        bytes_estimate = (sys.getsizeof(self._gpu) + sys.getsizeof(self._other) + 36 * nkeys
                          + 32 * max(0, self._entries - nkeys))
        return IndexStats(
            entries=self._entries,
            bytes_estimate=bytes_estimate,
            evictions=self._evictions,
            replicas=len(self._slot_of),
            entries_by_replica={r: self._entries_by_slot.get(s, 0) for r, s in self._slot_of.items()},
            feed_lag_s_by_replica=dict(self._lag_s),
            speculative_entries=sum(len(su) for su in self._spec_until.values()),
            live_replicas=bin(live).count("1"),
        )


def _gpu_runs(keys: Sequence[int], a: int, live: int, gpu_get, spec_get) -> dict[int, int]:
    """Slot -> leading run over the GPU medium (and speculative entries when `spec_get`)."""
    runs: dict[int, int] = {}
    if spec_get is None:
        # `a` starts as the live mask, so `a & held` needs no extra masking
        for i, k in enumerate(keys):
            na = a & gpu_get(k, 0)
            if na != a:
                _record(runs, a ^ na, i)
                a = na
                if not a:
                    return runs
    else:
        for i, k in enumerate(keys):
            na = a & ((gpu_get(k, 0) & live) | spec_get(k, 0))
            if na != a:
                _record(runs, a ^ na, i)
                a = na
                if not a:
                    return runs
    _record(runs, a, len(keys))
    return runs


def _tier_runs(keys: Sequence[int], a: int, live: int, gpu_get, oth_get, spec_get) -> tuple[dict[int, int], dict[int, int]]:
    """(GPU runs, any-medium runs) by slot when other tiers hold keys too."""
    gpu_run: dict[int, int] = {}
    any_run: dict[int, int] = {}
    g = a
    for i, k in enumerate(keys):
        hg = gpu_get(k, 0) & live
        if spec_get is not None:
            hg |= spec_get(k, 0)
        if g:
            ng = g & hg
            if ng != g:
                _record(gpu_run, g ^ ng, i)
                g = ng
        na = a & (hg | (oth_get(k, 0) & live))
        if na != a:
            _record(any_run, a ^ na, i)
            a = na
            if not a:
                break
    n = len(keys)
    if g:
        _record(gpu_run, g, n)
    if a:
        _record(any_run, a, n)
    return gpu_run, any_run


def _record(runs: dict[int, int], dropped: int, i: int) -> None:
    while dropped:
        low = dropped & -dropped
        runs[low.bit_length() - 1] = i
        dropped ^= low
