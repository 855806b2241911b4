"""loadtests/vtime.py and oracle.py: determinism, accounting, and the behaviours the router needs
(cache-aware beats round-robin on shared documents; a hot prefix spills instead of piling up)."""
from __future__ import annotations

import dataclasses

from loadtests.oracle import infinite_bound, pooled_belady_bound
from loadtests.vtime import SimParams, prepare_keys, simulate
from loadtests.workloads import build_workload


def _small(name, n=600, rate=40.0, **kw):
    return build_workload(name, n, seed=1, rate_rps=rate, **kw)


def test_deterministic_for_a_seed_and_complete():
    w = _small("shared_docs", n_docs=12)
    p = SimParams(num_blocks=2500)
    a = simulate(w, "cache_aware", 4, p, seed=5).summary()
    b = simulate(w, "cache_aware", 4, p, seed=5).summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    assert a["completed"] == a["requests"] == 600
    assert 0 < a["hit_ratio"] < 1


def test_keys_memo_equals_direct_hashing():
    from hashing import KeyChain
    from loadtests.workloads import render_token_ids

    chain = KeyChain("vtime-model", 16)
    for w in (build_workload("multi_turn", 40, seed=2, rate_rps=4.0, turns=4),
              build_workload("no_sharing", 40, seed=2, rate_rps=4.0, prompt_tokens=100, adapters=3)):
        keys = prepare_keys(w, 16, "vtime-model")
        for r, k in zip(w.requests, keys):
            assert k.prompt == chain.request_keys(render_token_ids(r), salt=r.salt, lora=r.lora)
    assert {r.lora for r in w.requests} == {"adapter-0", "adapter-1", "adapter-2"}


def test_oracle_bounds_every_policy():
    w = _small("shared_docs", n_docs=12)
    p = SimParams(num_blocks=2500)
    keys = prepare_keys(w)
    args = ([r.prompt_tokens for r in w.requests], [k.prompt for k in keys], [k.output for k in keys], 16)
    inf = infinite_bound(*args)
    bel = pooled_belady_bound(*args, 4 * p.num_blocks)
    tiny = pooled_belady_bound(*args, 200)
    assert tiny.hit_ratio <= bel.hit_ratio <= inf.hit_ratio
    for pol in ("cache_aware", "round_robin", "prefix_hash"):
        s = simulate(w, pol, 4, p, keys=keys).summary()
        assert s["hit_ratio"] <= bel.hit_ratio + 1e-9


def test_cache_aware_beats_round_robin_on_shared_documents():
    w = _small("shared_docs", n=1500, rate=80.0, n_docs=40)
    p = SimParams(num_blocks=2500)
    keys = prepare_keys(w)
    ca = simulate(w, "cache_aware", 4, p, keys=keys).summary()
    rr = simulate(w, "round_robin", 4, p, keys=keys).summary()
    assert ca["hit_ratio"] > rr["hit_ratio"] + 0.3
    assert ca["ttft_p99_s"] < rr["ttft_p99_s"] / 3


def test_hot_prefix_spills_to_other_replicas():
    """One document carries all traffic: its first holder cannot serve it alone, so others warm up."""
    w = _small("hot_prefix", n=1500, rate=120.0, hot_share=1.0)
    p = SimParams(num_blocks=2500)
    keys = prepare_keys(w)
    res = simulate(w, "cache_aware", 4, p, keys=keys)  # default weights and balance guard
    s = res.summary()
    assert s["load_max_over_mean"] < 1.5  # no replica above 1.5x the mean
    assert s["hit_ratio"] > 0.9  # the spill warmed the others instead of missing every time
    # without the guard the holders keep the prefix longer (the guard is what spreads it)
    unguarded = simulate(w, "cache_aware", 4, p, policy_params={"balance_rel": float("inf")}, keys=keys).summary()
    assert unguarded["load_max_over_mean"] >= s["load_max_over_mean"]


def test_collapse_stops_early_and_is_marked():
    """A policy whose queue grows without bound is stopped once a request waits > collapse_ttft_s."""
    w = _small("shared_docs", n=1500, rate=200.0, n_docs=60)
    p = SimParams(num_blocks=2500)
    keys = prepare_keys(w)
    rr = simulate(w, "round_robin", 2, p, keys=keys, collapse_ttft_s=3.0)
    s = rr.summary()
    assert s["collapsed"] and rr.stopped_at_s > 0
    assert s["ttft_max_s"] >= 3.0 and len(rr.ttft_s) <= 1500 and s["completed"] < 1500
    again = simulate(w, "round_robin", 2, p, keys=keys, collapse_ttft_s=3.0).summary()
    s.pop("wall_s"), again.pop("wall_s")
    assert s == again  # deterministic, early stop included
    ok = simulate(_small("shared_docs", n=300, rate=20.0, n_docs=8), "cache_aware", 4, p, collapse_ttft_s=3.0).summary()
    assert not ok["collapsed"] and ok["completed"] == 300


def test_closed_loop_runs():
    w = dataclasses.replace(build_workload("no_sharing", 200, seed=0, rate_rps=None, concurrency=8))
    s = simulate(w, "least_loaded", 2, SimParams(num_blocks=2000)).summary()
    assert s["completed"] == 200


def test_multi_turn_turn_waits_for_the_previous_answer():
    """Compressed think times: a turn is sent only after the previous turn of its conversation
    finished, so the answer it quotes is cached (cache_aware hits it almost always)."""
    from loadtests.vtime import _Replica  # noqa: F401  (module import check)

    w = build_workload("multi_turn", 240, seed=3, rate_rps=400.0, turns=4, think_s=0.01)
    p = SimParams(num_blocks=6000)
    res = simulate(w, "cache_aware", 2, p)
    s = res.summary()
    assert s["completed"] == 240
    keys = prepare_keys(w)
    bound = infinite_bound([r.prompt_tokens for r in w.requests], [k.prompt for k in keys], [k.output for k in keys], 16)
    assert s["hit_ratio"] >= 0.9 * bound.hit_ratio


# -- the replica model is loadtests/sim's engine, request by request --------------------------------

def _drive_engine(w, num_blocks, budget, seqs, max_loras=0):
    """loadtests.sim's SimEngine in virtual time: arrivals join before the next step."""
    from loadtests.sim.scheduler import EngineConfig, SimEngine, SimRequest, TimeModel
    from loadtests.workloads import render_token_ids

    eng = SimEngine(EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                 time=TimeModel.wallclock(), hash_algo="sha256", max_loras=max_loras))
    reqs, i, t, out = list(w.requests), 0, 0.0, {}
    while i < len(reqs) or eng.has_work:
        if not eng.has_work:
            t = max(t, reqs[i].arrival_s)
        while i < len(reqs) and reqs[i].arrival_s <= t:
            r = reqs[i]
            eng.add_request(SimRequest(r.request_id, render_token_ids(r), r.max_output_tokens, cache_salt=r.salt, lora=r.lora))
            i += 1
        step = eng.step()
        t += step.duration_s
        for r in step.tokens:
            out.setdefault(r.request_id, [t, None, None])
        for r in step.finished:
            out[r.request_id][1:] = [t, r.num_cached_tokens]
    return out, eng.num_preemptions_total, eng.pool.num_evicted_blocks, eng.num_lora_waits_total


def _drive_model(w, num_blocks, budget, seqs, max_loras=0):
    """vtime's ReplicaModel alone, stepped the way simulate() steps it."""
    import heapq

    from loadtests.vtime_replica import ReplicaModel, SimReq

    p = SimParams.wallclock(num_blocks=num_blocks, max_batched_tokens=budget, max_num_seqs=seqs, cache_answers=False,
                            max_loras=max_loras)
    keys = prepare_keys(w, 16, p.model)
    rep = ReplicaModel(0, p, cache_answers=False)
    ev = [(r.arrival_s, j, 1) for j, r in enumerate(w.requests)]
    heapq.heapify(ev)
    n, out = len(ev), {}

    def kick(t):
        nonlocal n
        d = rep.start_step()
        rep.stepping = d is not None
        if d is not None:
            n += 1
            heapq.heappush(ev, (t + d, n, 0))

    while ev:
        t, j, kind = heapq.heappop(ev)
        if kind == 1:
            rep.waiting.append(SimReq(j, w.requests[j], keys[j], t))
            if not rep.stepping:
                kick(t)
            continue
        firsts, fin = [], []
        rep.end_step(t, firsts, fin)
        for r in firsts:
            out[r.wr.request_id] = [t, None, None]
        for r in fin:
            out[r.wr.request_id][1:] = [t, r.cached]
        kick(t)
    return out, rep.n_preemptions, rep.n_evicted, rep.n_lora_waits


import pytest  # noqa: E402


@pytest.mark.parametrize("name,kw,rate,num_blocks,budget,seqs,max_loras", [
    ("shared_docs", dict(n_docs=6, doc_tokens=1000, output_tokens=40), 3.0, 3000, 512, 16, 0),  # fits: no eviction
    ("shared_docs", dict(n_docs=6, doc_tokens=1000, output_tokens=40), 12.0, 700, 512, 64, 0),  # evictions and preemptions
    ("shared_docs", dict(n_docs=6, doc_tokens=1000, output_tokens=40), 8.0, 600, 8192, 64, 0),  # whole prompts in one step
    ("multi_turn", dict(turns=4, system_tokens=200, user_tokens=60, answer_tokens=50), 12.0, 500, 512, 64, 0),
    ("no_sharing", {}, 4.0, 400, 512, 32, 0),  # preempted decoders resume with one token left
    ("no_sharing", dict(prompt_tokens=200, output_tokens=48, adapters=6, zipf_s=0.5), 12.0, 400, 512, 32, 2),  # LoRA slots
])
def test_replica_model_equals_the_wall_clock_engine(name, kw, rate, num_blocks, budget, seqs, max_loras):
    """Same stream, one replica: every request's first-token time, finish time and cached tokens,
    and the preemption, eviction and LoRA-slot wait counts, equal loadtests/sim's SimEngine's (what
    the wall-clock comparison runs), so vtime predicts it."""
    w = build_workload(name, 300, seed=1, rate_rps=rate, **kw)
    eng, eng_pre, eng_ev, eng_lw = _drive_engine(w, num_blocks, budget, seqs, max_loras)
    mod, mod_pre, mod_ev, mod_lw = _drive_model(w, num_blocks, budget, seqs, max_loras)
    assert set(eng) == set(mod) and len(eng) == 300
    for rid, (first, fin, cached) in eng.items():
        assert mod[rid] == pytest.approx([first, fin, cached], abs=1e-9), rid
    assert (mod_pre, mod_ev, mod_lw) == (eng_pre, eng_ev, eng_lw)
    if num_blocks < 1000:
        assert eng_ev > 0  # the case exercises eviction
    if max_loras:
        assert eng_lw > 10  # the case exercises the slots


def test_client_timeout_aborts_and_counts_unfinished():
    """An overloaded pool (round robin over 60 documents, KV for a few): requests the client gives
    up on leave their replica and count as unfinished; nothing finished took longer than that."""
    w = _small("shared_docs", n=800, rate=60.0, n_docs=60)
    p = SimParams(num_blocks=2500, request_timeout_s=3.0)
    res = simulate(w, "round_robin", 2, p)
    s = res.summary()
    assert s["unfinished"] > 0 and s["completed"] + s["unfinished"] == 800
    assert res.e2e_s.max() <= 3.0 + 1e-9
    again = simulate(w, "round_robin", 2, p).summary()
    s.pop("wall_s"), again.pop("wall_s")
    assert s == again
    assert simulate(w, "round_robin", 2, SimParams(num_blocks=2500)).summary()["unfinished"] == 0


def test_warmup_is_served_first_and_left_out_of_the_figures():
    from loadtests.workloads import warmup_requests

    w = _small("shared_docs", n=400, rate=20.0, n_docs=8)
    warm = warmup_requests(w)
    assert len(warm) == 8
    p = SimParams(num_blocks=2500)
    cold = simulate(w, "cache_aware", 2, p)
    hot = simulate(w, "cache_aware", 2, p, warmup=warm)
    assert sum(hot.per_replica_requests) == 400 == hot.completed
    assert hot.prompt_tokens == cold.prompt_tokens  # the warm-up's tokens are not counted
    assert hot.cached_tokens > cold.cached_tokens  # its documents were cached before the stream
    keys = prepare_keys(w)
    from loadtests.vtime import _KeyMemo

    memo = _KeyMemo("vtime-model", 16)
    allr = list(warm) + list(w.requests)
    allk = [memo.keys(r) for r in allr]
    args = ([r.prompt_tokens for r in allr], [k.prompt for k in allk], [k.output for k in allk], 16)
    bound = infinite_bound(*args, warmup=len(warm))
    assert bound.prompt_tokens == sum(r.prompt_tokens for r in w.requests)
    assert bound.hit_ratio > infinite_bound([r.prompt_tokens for r in w.requests], [k.prompt for k in keys], [k.output for k in keys], 16).hit_ratio
    assert hot.cached_tokens <= bound.cached_tokens
    assert pooled_belady_bound(*args, 4 * 2500, warmup=len(warm)).cached_tokens <= bound.cached_tokens
