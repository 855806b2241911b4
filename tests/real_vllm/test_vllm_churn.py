"""The index stays true under churn on real vLLM: KV small enough that blocks are evicted all the
time (the two engines hold 512 blocks of 32 tokens each; the workload's documents need about 1.4x
that), and enough concurrent long requests that the engines preempt (8 running requests of ~2,900
prompt tokens need ~730 blocks, more than 512). Through the gateway (conftest `e2e_system`), every
request's predicted cached tokens (span attribute) is compared with the engine's `cached_tokens`.

What must hold: agreement on at least 99.5% of requests (200 requests: at most 1 may differ), with
evictions and preemptions both seen (agents' BlockRemoved count, engines' `vllm:num_preemptions`).
The workload never has one document in flight twice at once: that race (the gateway predicts a hit
from its own speculative entry before the engine has computed the first copy) is a known, separate
effect measured in test_vllm_e2e.py ("bursts"); here it would hide what this test looks for, an
index that misses evictions. Every request that differs is printed with its direction.
"""
from __future__ import annotations

import random
import re
import threading
import time

import httpx
import pytest

from .test_vllm_e2e import WORDS, _predicted, _text, _via_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

N_REQUESTS, N_DOCS, DOC_WORDS, CONCURRENCY, MAX_TOKENS = 200, 14, 2300, 10, 48


def _preemptions(rep) -> float:
    text = httpx.get(rep.url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


def test_index_true_under_eviction_and_preemption(vllm_replicas, e2e_system):
    system = e2e_system
    rng = random.Random(random.SystemRandom().randrange(1 << 30))
    docs = [f"Churn document {d} ({rng.randrange(1 << 30)}): " + _text(DOC_WORDS, rng) for d in range(N_DOCS)]
    removed0 = {rid: a.translator.stats.removed_blocks for rid, a in system.agents.items()}
    preempt0 = {r.name: _preemptions(r) for r in vllm_replicas}
    lock = threading.Lock()
    in_flight: set[int] = set()
    rows: list[dict] = []
    todo = list(range(N_REQUESTS))

    def next_doc() -> int:
        while True:
            with lock:
                free = [d for d in range(N_DOCS) if d not in in_flight]
                if free:
                    d = rng.choice(free)
                    in_flight.add(d)
                    return d
            time.sleep(0.005)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                n = todo.pop()
            d = next_doc()
            try:
                body = {"prompt": f"{docs[d]}\n\nQ{n}: {rng.choice(WORDS)} {rng.choice(WORDS)}?\nA:", "max_tokens": MAX_TOKENS}
                res = _via_gateway(system, "acme", body, timeout=300)
            finally:
                with lock:
                    in_flight.discard(d)
            with lock:
                rows.append({"n": n, "doc": d, "res": res})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bad = [(r["res"].status, r["res"].body) for r in rows if r["res"].status != 200]
    assert not bad, bad[:3]
    for r in rows:
        r["pred"], r["cached"], r["pt"] = _predicted(system, r["res"]), r["res"].cached, r["res"].prompt_tokens
        r["replica"] = r["res"].replica
    removed = {rid: a.translator.stats.removed_blocks - removed0[rid] for rid, a in system.agents.items()}
    preempted = {r.name: _preemptions(r) - preempt0[r.name] for r in vllm_replicas}
    exact = [r for r in rows if r["pred"] == r["cached"]]
    over = [r for r in rows if r["pred"] > r["cached"]]
    under = [r for r in rows if r["pred"] < r["cached"]]
    hit = sum(r["cached"] for r in rows) / sum(r["pt"] for r in rows)
    print(f"\nchurn: {len(rows)} requests ({N_DOCS} docs of ~{sum(r['pt'] for r in rows) // len(rows)} tokens, "
          f"{CONCURRENCY} concurrent, max_tokens {MAX_TOKENS}) in {wall:.0f} s; blocks evicted {removed}; "
          f"preemptions {preempted}; engine hit ratio {hit:.3f}")
    print(f"prediction == engine cached_tokens: {len(exact)}/{len(rows)} = {len(exact) / len(rows):.4f}; "
          f"over-predicted {len(over)}, under-predicted {len(under)}")
    for r in over + under:
        print(f"  differs: request {r['n']} doc {r['doc']} on {r['replica']}: predicted {r['pred']} engine {r['cached']}")
    assert sum(removed.values()) > 0, "no eviction happened: the test did not churn"
    assert sum(preempted.values()) > 0, "no preemption happened"
    assert hit > 0.3, "the workload is warm enough for predictions to matter"
    assert len(exact) / len(rows) >= 0.995, f"{len(exact)}/{len(rows)}"
