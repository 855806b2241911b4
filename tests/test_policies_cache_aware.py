"""cache_aware's properties (hypothesis): longest match wins at equal load; a queue costing more
than the prefill it saves (now and, via the eviction term, later) loses to an idle cold replica;
load never raises a score; a replica whose sequence slots are full prices its queue by completions
(and a waiting queue with free slots does not); the balance guard fires only past both thresholds and then withdraws
exactly the replica's cache credit; never an unhealthy replica; deterministic for a seed."""
from __future__ import annotations

import dataclasses
import random

import hypothesis.strategies as st
import pytest
from hypothesis import assume, given, settings

from policies import ReplicaView, RequestView
from policies.cache_aware import CacheAwarePolicy

load_st = st.fixed_dictionaries(
    {
        "running_reqs": st.integers(0, 200),
        "waiting_reqs": st.integers(0, 100),
        "inflight_reqs": st.integers(0, 50),
        "inflight_prefill_tokens": st.integers(0, 50_000),
        "kv_usage": st.floats(0, 1),
    }
)


@settings(max_examples=150, deadline=None)
@given(load=load_st, matches=st.lists(st.integers(0, 100), min_size=2, max_size=8, unique=True), seed=st.integers(0, 2**32))
def test_equal_loads_longest_match_wins(load, matches, seed):
    req = RequestView(prompt_tokens=101 * 16, block_size=16)
    reps = [ReplicaView(f"r{i}", matched_blocks_gpu=m, matched_blocks_cpu=m, **load) for i, m in enumerate(matches)]
    d = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    assert d.winner == f"r{matches.index(max(matches))}"
    assert d.ranked[0].terms["matched_blocks"] == max(matches)


@settings(max_examples=150, deadline=None)
@given(matched=st.integers(1, 200), extra_tokens=st.integers(1, 100_000), seed=st.integers(0, 2**32), cold_fill=st.one_of(st.none(), st.floats(0, 1)))
def test_warm_replica_with_costly_queue_loses_to_idle_cold(matched, extra_tokens, seed, cold_fill):
    pol = CacheAwarePolicy()
    req = RequestView(prompt_tokens=matched * 16 + 1, block_size=16)
    p = 5e-5
    fill = pol.default_cache_fill if cold_fill is None else cold_fill
    # what the warm replica saves: the prefill now (w_cache) and the re-prefill of what the cold
    # replica would evict for it (w_evict x its cache fill), net of the warm one's own 1 token
    saved_s = (matched * 16 * p * pol.w_cache + pol.w_evict * fill * (req.prompt_tokens - 1) * p) / pol.w_queue
    backlog_tokens = int(saved_s / p) + extra_tokens  # its queue costs more than the prefill it saves
    warm = ReplicaView("warm", matched_blocks_gpu=matched, matched_blocks_cpu=matched, inflight_reqs=3, inflight_prefill_tokens=backlog_tokens)
    cold = ReplicaView("cold", kv_cached_frac=cold_fill)
    assert pol.rank(req, [warm, cold], random.Random(seed)).winner == "cold"
    assert pol.rank(req, [cold, warm], random.Random(seed)).winner == "cold"


@settings(max_examples=300, deadline=None)
@given(
    base=load_st,
    add=load_st,
    matched=st.integers(0, 100),
    mean_tokens=st.one_of(st.none(), st.floats(0, 5000)),
    w=st.tuples(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5), st.floats(0, 5)),
    fill=st.floats(0, 1),
    others=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    slots=st.integers(1, 300),
    out_tokens=st.one_of(st.none(), st.floats(0, 4000)),
)
def test_adding_load_never_raises_the_score(base, add, matched, mean_tokens, w, fill, others, slots, out_tokens):
    pol = CacheAwarePolicy(w_cache=w[0], w_queue=w[1], w_kv=w[2], w_evict=w[3], max_num_seqs=slots)
    req = RequestView(prompt_tokens=2000, block_size=16)
    v = ReplicaView("r", matched_blocks_gpu=matched, matched_blocks_cpu=matched, kv_cached_frac=fill,
                    mean_uncached_prefill_tokens=mean_tokens, mean_output_tokens=out_tokens, **base)
    more = {k: (min(1.0, base[k] + add[k]) if k == "kv_usage" else base[k] + add[k]) for k in base}
    v2 = dataclasses.replace(v, **more)
    assert pol.terms(req, v2)["score"] <= pol.terms(req, v)["score"] + 1e-12
    # and inside a decision, where the balance guard compares against the mean load (which the
    # added load also raises): the loaded replica's score still never goes up
    rest = [ReplicaView(f"o{i}", running_reqs=n) for i, n in enumerate(others)]
    def score_of(x):
        return next(c.score for c in pol.rank(req, [x] + rest, random.Random(0)).ranked if c.replica_id == "r")
    assert score_of(v2) <= score_of(v) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    slots=st.integers(1, 64),
    over=st.integers(0, 8),
    waiting=st.integers(1, 60),
    out_tokens=st.floats(16, 2000),
    step=st.floats(0.005, 0.1),
    matched=st.integers(1, 200),
    seed=st.integers(0, 2**32),
)
def test_saturated_replica_prices_its_queue_by_completions(slots, over, waiting, out_tokens, step, matched, seed):
    """Every sequence slot taken and requests waiting: the newcomer waits for waiting + 1
    completions of a full batch, seconds of decoding, whatever the waiting prompts' (cached,
    short) prefill; once that exceeds what the warm replica's cache saves, an idle cold one wins."""
    pol = CacheAwarePolicy(max_num_seqs=slots)
    req = RequestView(prompt_tokens=matched * 16 + 1, block_size=16)
    hot = dict(matched_blocks_gpu=matched, matched_blocks_cpu=matched)
    warm = ReplicaView("warm", running_reqs=slots + over, waiting_reqs=waiting, decode_step_s=step,
                       mean_output_tokens=out_tokens, mean_uncached_prefill_tokens=20.0, kv_cached_frac=0.5, **hot)
    t = pol.terms(req, warm)
    expect = (waiting + 1) * out_tokens * step / slots
    assert t["slots_full"] == 1.0 and abs(t["slot_wait_s"] - expect) <= 1e-12 * max(1.0, expect)
    assert t["queue_penalty_s"] >= expect  # the prefill backlog (waiting x 20 tokens) is far smaller
    cold = ReplicaView("cold", decode_step_s=step, kv_cached_frac=0.5)
    c = pol.terms(req, cold)
    d = pol.rank(req, [warm, cold], random.Random(seed))
    if t["score"] < c["score"] - 1e-9:
        assert d.winner == "cold"
    # a warm replica saving what a short document's prefill costs loses to the queue whenever the
    # completions it waits for take longer than that saving
    saved = pol.w_cache * t["cache_benefit_s"] + pol.w_evict * (c["evict_penalty_s"] - t["evict_penalty_s"])
    if pol.w_queue * (t["queue_penalty_s"] - c["queue_penalty_s"]) > saved + 1e-9:
        assert d.winner == "cold"
    # the same waiting queue with a free slot (a prefill burst, arrivals since the last step) is
    # priced by its prefill only: admitted at the next steps, it does not wait for completions
    burst = dataclasses.replace(warm, running_reqs=slots - 1)
    tb = pol.terms(req, burst)
    assert tb["slots_full"] == 0.0 and tb["slot_wait_s"] == 0.0
    assert tb["queue_penalty_s"] < 20.0 * waiting * 5e-5 + (slots * pol.running_step_share + 1) * step + 1e-12


def test_saturation_example_from_real_vllm():
    """The case seen on real vLLM: 18 requests of 250 output tokens held on an 8-slot replica (8
    running, 10 waiting) with the gateway's document cached there: the queue now costs seconds
    (11 completions of a batch of 8 at ~250 x 12 ms) against a ~0.03 s cache benefit."""
    pol = CacheAwarePolicy(max_num_seqs=8)
    req = RequestView(prompt_tokens=620, block_size=32)
    warm = ReplicaView("warm", matched_blocks_gpu=19, matched_blocks_cpu=19, running_reqs=8, waiting_reqs=10,
                       prefill_s_per_token=4.5e-5, decode_step_s=0.012, mean_uncached_prefill_tokens=30.0)
    cold = ReplicaView("cold", prefill_s_per_token=4.5e-5, decode_step_s=0.012)
    t = pol.terms(req, warm)
    assert t["slot_wait_s"] > 3.0 and t["queue_penalty_s"] > 10 * pol.w_cache * t["cache_benefit_s"]
    assert pol.rank(req, [warm, cold], random.Random(0)).winner == "cold"
    # with the default 256 slots the same counts are not saturation: the old, prefill-only price
    t256 = CacheAwarePolicy().terms(req, warm)
    assert t256["slots_full"] == 0.0 and t256["queue_penalty_s"] < 0.05


@settings(max_examples=60, deadline=None)
@given(max_lora=st.integers(1, 4), extra=st.integers(0, 2), out_tokens=st.floats(8, 512), step=st.floats(0.005, 0.05),
       matched=st.integers(0, 60), seed=st.integers(0, 2**32))
def test_lora_slots_held_by_other_adapters_cost_a_generation(max_lora, extra, out_tokens, step, matched, seed):
    """An engine batches at most max_lora adapters: where others hold or want them all, a request
    for adapter A waits about a generation for one to drain; where A runs, or a slot is free for
    it, it does not wait, and a base-model request or an engine without LoRA slots is priced as
    before."""
    pol = CacheAwarePolicy()
    req = RequestView(prompt_tokens=matched * 16 + 17, block_size=16, lora="A")
    others = tuple(f"o{i}" for i in range(max_lora + extra))
    full = ReplicaView("full", max_lora=max_lora, lora_running=others, running_reqs=3, decode_step_s=step,
                       mean_output_tokens=out_tokens, matched_blocks_gpu=matched, matched_blocks_cpu=matched)
    t = pol.terms(req, full)
    assert t["lora_full"] == 1.0 and t["lora_wait_s"] == pytest.approx(out_tokens * step)
    assert t["queue_penalty_s"] >= t["lora_wait_s"]
    running_a = dataclasses.replace(full, lora_running=("A",) + others[1:max_lora])
    free_slot = dataclasses.replace(full, lora_running=others[:max_lora - 1])
    for v in (running_a, free_slot, dataclasses.replace(full, max_lora=0)):
        tv = pol.terms(req, v)
        assert tv["lora_full"] == 0.0 and tv["lora_wait_s"] == 0.0 and tv["queue_penalty_s"] < t["queue_penalty_s"]
    base = dataclasses.replace(req, lora=None)
    assert pol.terms(base, full)["lora_full"] == 0.0 and pol.terms(base, full)["score"] == pol.terms(base, running_a)["score"]
    # the replica running A without the prefix against the one holding it with the slots taken:
    # the higher score wins, and with a generation of seconds against a short prompt's prefill
    # that is the one running A
    cold_a = dataclasses.replace(running_a, replica_id="cold", matched_blocks_gpu=0, matched_blocks_cpu=0)
    tc = pol.terms(req, cold_a)
    d = pol.rank(req, [full, cold_a], random.Random(seed))
    if abs(tc["score"] - t["score"]) > 1e-9:
        assert d.winner == ("cold" if tc["score"] > t["score"] else "full")
    if out_tokens * step > 1.0 and matched <= 20:  # >= 1 s of waiting, <= 0.02 s of prefill saved
        assert d.winner == "cold"


def test_a_second_slot_for_an_adapter_that_runs_elsewhere_costs_the_slot_time_others_may_need():
    """Four replicas with two LoRA slots each: adapter A runs on `home`; another replica's free slot
    costs no wait but a generation x the share of the pool's slots in use (the slot another adapter
    may need), so A's requests stay home at equal queues; with every other slot free the spread is
    cheap, and a home whose queue costs more than that loses."""
    from policies.cache_aware import lora_pool_state

    pol = CacheAwarePolicy()
    req = RequestView(prompt_tokens=200, block_size=16, lora="A")
    gen = 64 * 0.015
    def view(rid, running, **kw):
        return ReplicaView(rid, max_lora=2, lora_running=running, decode_step_s=0.015, mean_output_tokens=64, **kw)
    busy = [view("home", ("A", "B")), view("r1", ("C",)), view("r2", ("D", "E")), view("r3", ("F",))]
    pool = lora_pool_state("A", busy)
    assert pool == (frozenset({"home"}), 6 / 8)
    t = {v.replica_id: pol.terms(req, v, lora_pool=pool) for v in busy}
    assert t["home"]["lora_spread_s"] == 0.0 and t["home"]["lora_wait_s"] == 0.0
    assert t["r1"]["lora_spread_s"] == pytest.approx(gen * 6 / 8) and t["r1"]["lora_wait_s"] == 0.0
    assert t["r2"]["lora_full"] == 1.0 and t["r2"]["lora_spread_s"] == 0.0  # full: it waits instead
    assert pol.rank(req, busy, random.Random(0)).winner == "home"
    quiet = [view("home", ("A",)), view("r1", ())]
    qp = lora_pool_state("A", quiet)
    assert qp == (frozenset({"home"}), 1 / 4)
    assert pol.terms(req, quiet[1], lora_pool=qp)["lora_spread_s"] == pytest.approx(gen / 4)
    queued = dataclasses.replace(quiet[0], waiting_reqs=20, mean_uncached_prefill_tokens=500, prefill_s_per_token=1e-3)
    assert pol.rank(req, [queued, quiet[1]], random.Random(0)).winner == "r1"  # 10 s of queue against 0.24 s
    assert lora_pool_state(None, busy) is None and lora_pool_state("A", [ReplicaView("x")]) is None
    # adapters waiting there want the free slot first (the engine admits in queue order)
    wanted = view("r1", ("C",), lora_waiting=("G",))
    assert pol.terms(req, wanted, lora_pool=pool)["lora_full"] == 1.0
    assert pol.terms(req, view("r1", ("C",), lora_waiting=("A",)), lora_pool=pool)["lora_full"] == 0.0  # A is next
    assert pol.terms(dataclasses.replace(req, lora=None), busy[1], lora_pool=pool)["lora_spread_s"] == 0.0


def test_terms_cap_cpu_weight_and_dead_index():
    pol = CacheAwarePolicy(cpu_weight=0.5)
    req = RequestView(prompt_tokens=160, block_size=16)  # 10 blocks; at most 9 usable
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=10, matched_blocks_cpu=10))
    assert t["matched_blocks"] == 9 and t["matched_tokens"] == 144 and t["uncached_tokens"] == 16
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=2, matched_blocks_cpu=6))
    assert t["matched_tokens"] == (2 + 0.5 * 4) * 16
    t = pol.terms(req, ReplicaView("r", matched_blocks_gpu=8, matched_blocks_cpu=8, index_live=False))
    assert t["matched_tokens"] == 0 and t["cache_benefit_s"] == 0
    for key in ("matched_blocks", "matched_tokens", "cache_benefit_s", "queue_penalty_s", "slots_full", "output_tokens",
                "slot_wait_s", "lora_full", "lora_wait_s", "kv_pressure", "score"):
        assert key in t


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 10))
def test_ties_go_to_less_load_then_rng_deterministically(seed, n):
    req = RequestView(prompt_tokens=100, block_size=16)
    reps = [ReplicaView(f"r{i}") for i in range(n)]
    a = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    b = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    assert [c.replica_id for c in a.ranked] == [c.replica_id for c in b.ranked]
    assume(n > 1)
    busy = reps[:-1] + [ReplicaView(f"r{n - 1}", running_reqs=0, waiting_reqs=0)]
    assert CacheAwarePolicy().rank(req, busy, random.Random(seed)).winner in {r.replica_id for r in busy}


def test_eviction_term_prices_the_miss_by_cache_fill():
    pol = CacheAwarePolicy(w_evict=1.0)
    req = RequestView(prompt_tokens=3201, block_size=16)
    full = pol.terms(req, ReplicaView("r", kv_cached_frac=1.0))
    half = pol.terms(req, ReplicaView("r", kv_cached_frac=0.5))
    empty = pol.terms(req, ReplicaView("r", kv_cached_frac=0.0))
    unknown = pol.terms(req, ReplicaView("r"))
    assert full["evict_penalty_s"] == 3201 * 5e-5 and half["evict_penalty_s"] == 0.5 * full["evict_penalty_s"]
    assert empty["evict_penalty_s"] == 0 and unknown["cache_fill"] == pol.default_cache_fill
    assert full["score"] < half["score"] < empty["score"]
    # an idle replica with an empty cache beats an idle one whose cache is full of live prefixes
    d = pol.rank(req, [ReplicaView("full", kv_cached_frac=1.0), ReplicaView("empty", kv_cached_frac=0.0)], random.Random(0))
    assert d.winner == "empty"
    for key in ("cache_fill", "evict_penalty_s", "balance_guard", "balance_penalty_s", "mean_load_reqs"):
        assert key in d.ranked[0].terms


def test_balance_guard_needs_both_thresholds_and_withdraws_the_cache_credit():
    pol = CacheAwarePolicy(balance_rel=1.5, balance_abs_reqs=8, balance_rate_rel=1.25)
    req = RequestView(prompt_tokens=3201, block_size=16)
    hot = dict(matched_blocks_gpu=200, matched_blocks_cpu=200)
    # relative exceeded (3 vs mean 1.5) but not the absolute gap: the holder keeps its prefix
    d = pol.rank(req, [ReplicaView("holder", running_reqs=3, **hot), ReplicaView("cold", running_reqs=0)], random.Random(0))
    assert d.winner == "holder" and d.ranked[0].terms["balance_guard"] == 0.0
    # both exceeded (30 vs mean 16, gap 14 >= 8, 30 > 1.5 x 16), but it holds the only copy and is
    # under balance_exclusive_rel x the mean: the sole copy stays
    d = pol.rank(req, [ReplicaView("holder", running_reqs=30, **hot), ReplicaView("a", running_reqs=2), ReplicaView("b", running_reqs=16)], random.Random(0))
    assert d.winner == "holder" and d.ranked[0].terms["balance_guard"] == 0.0
    # a severe overload (40 vs mean ~19.3, > 2 x): the sole copy loses its credit too, load decides
    d = pol.rank(req, [ReplicaView("holder", running_reqs=40, **hot), ReplicaView("a", running_reqs=2), ReplicaView("b", running_reqs=16)], random.Random(0))
    t = {c.replica_id: c.terms for c in d.ranked}
    assert t["holder"]["balance_guard"] == 1.0 and t["a"]["balance_guard"] == 0.0
    credit = (pol.w_cache + pol.w_evict * t["holder"]["cache_fill"]) * t["holder"]["cache_benefit_s"]
    assert abs(t["holder"]["balance_penalty_s"] - credit) < 1e-12
    assert d.winner == "a"
    # a second holder under the threshold is preferred to a cold replica: the spill stays warm
    # (with a second copy the request is free to move, so the plain thresholds fire)
    d = pol.rank(req, [ReplicaView("holder", running_reqs=30, **hot), ReplicaView("a", running_reqs=2), ReplicaView("holder2", running_reqs=16, **hot)], random.Random(0))
    assert d.ranked[-1].replica_id != "holder2" and d.winner == "holder2"
    assert {c.replica_id: c.terms for c in d.ranked}["holder"]["balance_guard"] == 1.0
    # terms() without a mean never fires the guard
    assert pol.terms(req, ReplicaView("holder", running_reqs=300, **hot))["balance_guard"] == 0.0


@settings(max_examples=100, deadline=None)
@given(load=load_st, n=st.integers(1, 8), seed=st.integers(0, 2**32))
def test_balance_guard_never_fires_at_equal_loads_and_skips_unhealthy(load, n, seed):
    req = RequestView(prompt_tokens=1601, block_size=16)
    reps = [ReplicaView(f"r{i}", matched_blocks_gpu=i, matched_blocks_cpu=i, **load) for i in range(n)]
    reps.append(ReplicaView("sick", healthy=False, matched_blocks_gpu=99, matched_blocks_cpu=99))
    d = CacheAwarePolicy().rank(req, reps, random.Random(seed))
    assert "sick" not in [c.replica_id for c in d.ranked]
    assert all(c.terms["balance_guard"] == 0.0 for c in d.ranked)
    assert d.winner == f"r{n - 1}"


def test_parameters_are_validated():
    import pytest

    for bad in (dict(w_evict=-1), dict(balance_rel=0.9), dict(balance_abs_reqs=-1), dict(default_cache_fill=2),
                dict(max_num_seqs=0), dict(prior_output_tokens=-1), dict(balance_exclusive_rel=0.5), dict(routed_tau_s=0)):
        with pytest.raises(ValueError):
            CacheAwarePolicy(**bad)


def test_balance_guard_rate_condition_separates_hot_prefix_from_noise():
    """Overloaded now but not receiving more than its share (noise): no guard; receiving more than
    balance_rate_rel x the mean routed rate as well (a hot prefix): guard."""
    pol = CacheAwarePolicy(balance_rel=1.3, balance_abs_reqs=4, balance_rate_rel=1.25)
    req = RequestView(prompt_tokens=3201, block_size=16)
    hot = dict(matched_blocks_gpu=200, matched_blocks_cpu=200)

    def rank(holder_rate):
        reps = [
            ReplicaView("holder", running_reqs=30, routed_rps=holder_rate, **hot),
            ReplicaView("a", running_reqs=2, routed_rps=10.0),
            ReplicaView("b", running_reqs=10, routed_rps=10.0),
        ]
        return {c.replica_id: c.terms for c in pol.rank(req, reps, random.Random(0)).ranked}, pol.rank(req, reps, random.Random(0)).winner

    t, win = rank(10.0)  # its share of traffic: a transient, keep the prefix
    assert t["holder"]["balance_guard"] == 0.0 and win == "holder" and t["holder"]["routed_rps"] == 10.0
    t, win = rank(20.0)  # 20 > 1.25 x mean 13.3: structural, spread it
    assert t["holder"]["balance_guard"] == 1.0 and win == "a"


def test_balance_guard_sheds_free_requests_on_either_signal_and_keeps_sole_copies():
    """A request another replica can serve with as long a match is free to move: the guard sheds it
    on the outstanding-load thresholds OR on the routed share (relative AND absolute). A request
    whose match only this replica holds (a conversation's history) stays below the severe threshold."""
    pol = CacheAwarePolicy(balance_rel=1.3, balance_abs_reqs=4, balance_rate_rel=1.25, routed_tau_s=10.0)
    req = RequestView(prompt_tokens=3201, block_size=16)
    sys_only = dict(matched_blocks_gpu=90, matched_blocks_cpu=90)
    history = dict(matched_blocks_gpu=180, matched_blocks_cpu=180)

    def terms(holder_match, holder_rate, holder_load=10):
        reps = [
            ReplicaView("holder", running_reqs=holder_load, routed_rps=holder_rate, **holder_match),
            ReplicaView("peer", running_reqs=10, routed_rps=10.0, **sys_only),
            ReplicaView("c", running_reqs=10, routed_rps=10.0),
        ]
        d = pol.rank(req, reps, random.Random(0))
        return {c.replica_id: c.terms for c in d.ranked}, d.winner

    # equal loads, the holder receives twice its share (excess 10 rps x 10 s >> 4 requests): a free request moves
    t, win = terms(sys_only, 20.0)
    assert t["holder"]["balance_guard"] == 1.0 and win == "peer"
    # the same share excess but below the absolute gap (0.3 rps x 10 s = 3 < 4 requests, rates small): stays
    reps_small = [
        ReplicaView("holder", running_reqs=10, routed_rps=0.6, **sys_only),
        ReplicaView("peer", running_reqs=10, routed_rps=0.3, **sys_only),
        ReplicaView("c", running_reqs=10, routed_rps=0.3),
    ]
    t2 = {c.replica_id: c.terms for c in pol.rank(req, reps_small, random.Random(0)).ranked}
    assert t2["holder"]["balance_guard"] == 0.0
    # a conversation's history only the holder has: the routed share alone never moves it
    t, win = terms(history, 20.0)
    assert t["holder"]["balance_guard"] == 0.0 and win == "holder"
    # nor a moderate outstanding overload (16 vs mean 12, < 2 x)
    t, win = terms(history, 20.0, holder_load=16)
    assert t["holder"]["balance_guard"] == 0.0 and win == "holder"
    # a severe, structural overload (40 vs mean 20: 2 x) does
    t, win = terms(history, 20.0, holder_load=41)
    assert t["holder"]["balance_guard"] == 1.0 and win != "holder"


def _new_prefix_pool(others_rps: float) -> list[ReplicaView]:
    """Four idle-ish replicas whose queues differ by a few tokens (r0 least), none holding the
    prompt, each routed 2 requests/s of which `others_rps` by other gateways; r3's queue is a
    second longer."""
    toks = (794, 799, 804, 1800)
    return [ReplicaView(f"r{i}", inflight_reqs=1, inflight_prefill_tokens=t, prefill_s_per_token=1e-3,
                        routed_rps=2.0, others_routed_rps=others_rps) for i, t in enumerate(toks)]


def test_a_new_prefix_beside_other_gateways_is_drawn_among_the_near_best():
    """With one gateway (no others' rate) a new prefix goes to the exact best every time; when
    other gateways route most of the pool's requests it is drawn among the replicas within the
    slack (r0-r2, 10 ms apart), never to one a second worse (r3); a prompt some replica holds, or
    one whose own prefill is shorter than the gaps, keeps the exact order."""
    pol, req = CacheAwarePolicy(), RequestView(prompt_tokens=800, block_size=16)
    alone = {CacheAwarePolicy().rank(req, _new_prefix_pool(0.0), random.Random(s)).winner for s in range(200)}
    assert alone == {"r0"}
    shared = [pol.rank(req, _new_prefix_pool(1.5), random.Random(s)).winner for s in range(300)]
    assert set(shared) == {"r0", "r1", "r2"} and min(shared.count(r) for r in ("r0", "r1", "r2")) > 60
    held = [dataclasses.replace(v, matched_blocks_gpu=2, matched_blocks_cpu=2) if v.replica_id == "r1" else v
            for v in _new_prefix_pool(1.5)]
    assert {pol.rank(req, held, random.Random(s)).winner for s in range(100)} == {"r1"}
    exact = CacheAwarePolicy(new_prefix_slack_s=0.0)
    assert {exact.rank(req, _new_prefix_pool(1.5), random.Random(s)).winner for s in range(100)} == {"r0"}
    # a short prompt's own prefill (4 ms here) caps the slack below the 5 ms between r0 and r1
    short = RequestView(prompt_tokens=4, block_size=16)
    assert {pol.rank(short, _new_prefix_pool(1.5), random.Random(s)).winner for s in range(100)} == {"r0"}
