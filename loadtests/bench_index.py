"""Benchmarks of the "what each replica holds" pipeline (not tests; prints tables).

    python -m loadtests.bench_index [--quick]

  1. agent translation: BlockStored events -> warmroute keys with reference counts (blocks/s, one
     core), alone and including msgpack decoding of the engine payload;
  2. index apply: stored/removed feed records into KVIndex (keys/s);
  3. lookup: one 8k-token request (512 keys of 16 tokens) against 64 replicas holding prefixes of
     it, in an index that also holds ~1M other entries (us per match);
  4. memory: bytes per (key, replica) entry at one million entries (tracemalloc), for keys held by
     one replica each (worst case) and by 4 replicas each.
Targets (issue 3): >= 200k blocks/s, >= 500k keys/s, < 0.5 ms per lookup, < 100 bytes per entry.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

import msgspec

from gateway.index import KVIndex
from replica_agent.decode import BlockRemoved, BlockStored, decode_payload
from replica_agent.feed.records import FeedEvent
from replica_agent.translate import Translator


def _row(name: str, value: str, target: str) -> None:
    print(f"| {name:<58} | {value:>18} | {target:>12} |")


def bench_translate(n_blocks: int, block_size: int = 16, run_blocks: int = 32) -> tuple[float, float]:
    rng = random.Random(1)
    events = []
    payloads = []
    enc = msgspec.msgpack.Encoder()
    h = 1
    for _ in range(n_blocks // run_blocks):
        toks = [rng.randrange(150_000) for _ in range(block_size * run_blocks)]
        hashes = list(range(h, h + run_blocks))
        h += run_blocks
        events.append(BlockStored(tuple(hashes), None, tuple(toks), block_size, "GPU", None, None))
        payloads.append(enc.encode([time.time(), [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                                   "token_ids": toks, "block_size": block_size, "lora_id": None,
                                                   "medium": "GPU", "lora_name": None, "extra_keys": None}], 0]))
    tr = Translator("bench-model", block_size)
    t0 = time.perf_counter()
    for ev in events:
        tr.apply(ev)
    t_translate = time.perf_counter() - t0
    tr2 = Translator("bench-model", block_size)
    t0 = time.perf_counter()
    for p in payloads:
        tr2.apply_all(decode_payload(p).events)
    t_both = time.perf_counter() - t0
    # removals (refcount path)
    t0 = time.perf_counter()
    for ev in events:
        tr.apply(BlockRemoved(ev.block_hashes, "GPU"))
    t_remove = time.perf_counter() - t0
    n = len(events) * run_blocks
    return n / t_translate, n / t_both, n / t_remove


def bench_apply(n_keys: int, replicas: int = 64, batch: int = 64) -> tuple[float, float]:
    rng = random.Random(2)
    ix = KVIndex(max_entries=10 * n_keys)
    evs = []
    for i in range(n_keys // batch):
        keys = tuple(rng.getrandbits(64) for _ in range(batch))
        evs.append(FeedEvent(f"r{i % replicas}", i + 1, "stored", keys))
    t0 = time.perf_counter()
    for e in evs:
        ix.apply(e)
    t_store = time.perf_counter() - t0
    rem = [FeedEvent(e.replica_id, e.offset, "removed", e.keys) for e in evs]
    t0 = time.perf_counter()
    for e in rem:
        ix.apply(e)
    t_remove = time.perf_counter() - t0
    return n_keys / t_store, n_keys / t_remove


def bench_lookup(background_entries: int, replicas: int = 64, n_keys: int = 512, rounds: int = 300) -> dict[str, float]:
    rng = random.Random(3)
    ix = KVIndex(max_entries=background_entries + replicas * n_keys + 1)
    per = background_entries // replicas
    for r in range(replicas):
        keys = tuple(rng.getrandbits(64) for _ in range(per))
        for i in range(0, per, 4096):
            ix.apply(FeedEvent(f"r{r}", 1, "stored", keys[i : i + 4096]))
    req = [rng.getrandbits(64) for _ in range(n_keys)]
    for r in range(replicas):  # replica r holds a prefix of length proportional to r
        ix.apply(FeedEvent(f"r{r}", 2, "stored", tuple(req[: (r + 1) * n_keys // replicas])))
    out: dict[str, float] = {}
    for label, spec in (("real entries only", False), ("with speculative entries", True)):
        if spec:
            for r in range(0, replicas, 8):
                ix.insert_speculative(f"r{r}", req, ttl_s=3600)
        times, cpu = [], []
        for _ in range(rounds):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            m = ix.match(req)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        assert m[f"r{replicas - 1}"].gpu_blocks == n_keys
        times.sort()
        cpu.sort()
        out[label + " p50"] = statistics.median(times) * 1e6
        out[label + " p99 (wall)"] = times[int(len(times) * 0.99) - 1] * 1e6
        out[label + " p99 (thread CPU)"] = cpu[int(len(cpu) * 0.99) - 1] * 1e6
    miss = [rng.getrandbits(64) for _ in range(n_keys)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        ix.match(miss)
    out["no replica holds block 0"] = (time.perf_counter() - t0) / rounds * 1e6
    return out


def bench_memory(entries: int, replicas_per_key: int, replicas: int = 64) -> float:
    rng = random.Random(4)
    n_keys = entries // replicas_per_key
    gc.collect()
    tracemalloc.start()  # before the keys are made: the index keeps the key ints alive, they count
    base = tracemalloc.get_traced_memory()[0]
    key_batches = []
    for i in range(0, n_keys, 4096):
        key_batches.append(tuple(rng.getrandbits(64) for _ in range(min(4096, n_keys - i))))
    ix = KVIndex(max_entries=entries + 1)
    for b, keys in enumerate(key_batches):
        for j in range(replicas_per_key):
            ix.apply(FeedEvent(f"r{(b * replicas_per_key + j) % replicas}", 1, "stored", keys))
    del key_batches  # the index keeps only what it needs (the key ints themselves)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = ix.stats()
    assert st.entries == n_keys * replicas_per_key, st.entries
    return used / st.entries, st.bytes_estimate / st.entries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    a = p.parse_args(argv)
    scale = 0.1 if a.quick else 1.0
    import os

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (wall p99 includes preemption)")
    print(f"| {'measure':<58} | {'value':>18} | {'target':>12} |")
    print(f"|{'-' * 60}|{'-' * 20}|{'-' * 14}|")
    tr, both, rem = bench_translate(int(200_000 * scale))
    _row("agent translate BlockStored (16-token blocks)", f"{tr:,.0f} blocks/s", ">= 200k")
    _row("agent decode msgpack + translate", f"{both:,.0f} blocks/s", "")
    _row("agent translate BlockRemoved (refcounts)", f"{rem:,.0f} blocks/s", "")
    st, rm = bench_apply(int(1_000_000 * scale))
    _row("index apply stored (64-key records, 64 replicas)", f"{st:,.0f} keys/s", ">= 500k")
    _row("index apply removed", f"{rm:,.0f} keys/s", "")
    for label, us in bench_lookup(int(1_000_000 * scale)).items():
        _row(f"lookup 512 keys x 64 reps, {label}", f"{us:,.1f} us", "< 500 us")
    for per in (1, 4):
        measured, est = bench_memory(int(1_000_000 * scale), per)
        _row(f"memory at 1M entries, {per} replica(s) per key", f"{measured:,.1f} B/entry", "< 100 B")
        _row(f"  (stats().bytes_estimate, same index)", f"{est:,.1f} B/entry", "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
