"""The simulator's pure core: block pool (hits, LRU eviction, reference counts, salt isolation) and
scheduler (time model, token budget, decode priority, preemption). No sockets."""
from __future__ import annotations

from hashing import vllm_hash
from loadtests.sim.blockpool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, LLAMA3_8B, num_blocks_for_budget
from loadtests.sim.scheduler import EngineConfig, SimEngine, SimRequest, TimeModel

BS = 16


def _engine(num_blocks: int = 64, **kw) -> SimEngine:
    tm = kw.pop("time", TimeModel(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0005))
    return SimEngine(EngineConfig(block_size=BS, num_blocks=num_blocks, time=tm, **kw))


def _run(engine: SimEngine, max_steps: int = 10_000) -> tuple[float, dict[str, float], dict[str, SimRequest]]:
    """Drive in virtual time; returns (end time, first-token time per request, finished requests)."""
    now = 0.0
    ttft: dict[str, float] = {}
    done: dict[str, SimRequest] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        out = engine.step()
        now += out.duration_s
        for r in out.tokens:
            if r.num_output_tokens == 1:
                ttft[r.request_id] = now
        for r in out.finished:
            done[r.request_id] = r
    assert not engine.has_work
    return now, ttft, done


def _prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- block pool --------------------------------------------------------------------------------
def test_capacity_from_model_shape() -> None:
    assert LLAMA3_8B.kv_bytes_per_token == 131072  # 2 x 32 x 8 x 128 x 2
    assert num_blocks_for_budget(16, 40 * 1024**3) == 20480
    assert num_blocks_for_budget(32, 1024**3) == 256


def test_pool_lru_eviction_order_and_refcounts() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = pool.allocate(2)
    assert a is not None and [b.ref_cnt for b in a] == [1, 1]
    pool.cache_full_blocks(a, [b"h0", b"h1"], 0, 2, _prompt(32))
    ev = pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored) and ev[0].block_hashes == [b"h0", b"h1"] and ev[0].parent_block_hash is None
    # a second holder of the same blocks: freeing once keeps them used
    pool.touch(a)
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free(a[::-1])
    assert pool.num_free_blocks == 2 and pool.find_prefix([b"h0", b"h1"], 2) == a
    pool.free(a[::-1])  # now free but still cached: tail (h1) first in the eviction order
    assert pool.num_free_blocks == 4 and pool.find_prefix([b"h0", b"h1"], 2) == a
    assert pool.take_events() == []  # freeing never emits
    # the two never-used blocks go first, then the least recently freed cached block (h1)
    got = pool.allocate(3)
    assert got is not None
    ev = pool.take_events()
    assert ev == [BlockRemoved([b"h1"])]
    assert pool.find_prefix([b"h0"], 1) == [a[0]]  # h0 still cached
    assert pool.find_prefix([b"h0", b"h1"], 2) == [a[0]]  # a run stops at the first miss
    assert pool.allocate(2) is None and pool.num_free_blocks == 1  # not enough: nothing changes


def test_pool_hit_on_free_block_protects_it_from_eviction() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = pool.allocate(2)
    pool.cache_full_blocks(a, [b"x0", b"x1"], 0, 2, _prompt(32))
    pool.free(a[::-1])
    hit = pool.find_prefix([b"x0"], 1)
    pool.touch(hit)  # x0 leaves the free queue
    pool.take_events()
    assert pool.allocate(2) is not None
    assert pool.take_events() == [BlockRemoved([b"x1"])]
    assert pool.find_prefix([b"x0"], 1) == hit


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    a = pool.allocate(1)
    pool.cache_full_blocks(a, [b"z"], 0, 1, _prompt(16))
    pool.free(a)
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.find_prefix([b"z"], 1) == []
    assert pool.take_events() == [AllBlocksCleared()]


# -- engine: hits, salts, hashes -------------------------------------------------------------
def test_engine_hashes_and_hits_match_vllm() -> None:
    eng = _engine()
    p = _prompt(40)
    eng.add_request(SimRequest("a", p, max_tokens=1))
    _, _, done = _run(eng)
    ev = eng.take_events()
    stored = [e for e in ev if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == vllm_hash.block_hashes(p, BS, "sha256_cbor")
    assert vllm_hash.event_int(stored[0].block_hashes[0]) == 2233398808101521225  # vLLM's sha256_cbor vector (tests/test_hashing.py)
    assert done["a"].num_cached_tokens == 0
    # same prompt: 2 full blocks hit; a prompt of exactly 2 blocks hits only 1 (last token recomputed)
    eng.add_request(SimRequest("b", p, max_tokens=1))
    eng.add_request(SimRequest("c", p[:32], max_tokens=1))
    _, _, done = _run(eng)
    assert done["b"].num_cached_tokens == 32
    assert done["c"].num_cached_tokens == 16
    assert eng.prefix_cache_hits_tokens_total == 48


def test_salt_isolates_and_is_reported_in_block0_extra_keys() -> None:
    eng = _engine()
    p = _prompt(48)
    eng.add_request(SimRequest("a", p, max_tokens=1, cache_salt="tenant-a"))
    _run(eng)
    ev = [e for e in eng.take_events() if isinstance(e, BlockStored)]
    assert ev[0].extra_keys == [["tenant-a"], None, None]
    assert ev[0].block_hashes == vllm_hash.block_hashes(p, BS, "sha256_cbor", cache_salt="tenant-a")
    for rid, salt, want in (("b", None, 0), ("c", "tenant-b", 0), ("d", "tenant-a", 32)):
        eng.add_request(SimRequest(rid, p, max_tokens=1, cache_salt=salt))
        _, _, done = _run(eng)
        assert done[rid].num_cached_tokens == want, rid


def test_report_mode_full_rereports_hits() -> None:
    eng = _engine()
    p = _prompt(40)
    eng.add_request(SimRequest("a", p, max_tokens=1))
    _run(eng)
    eng.take_events()
    eng.add_request(SimRequest("b", p, max_tokens=1))
    _run(eng)
    assert eng.take_events() == []  # plain hits: nothing
    eng.add_request(SimRequest("c", p, max_tokens=1, report_full_hits=True))
    _run(eng)
    ev = eng.take_events()
    assert len(ev) == 1 and ev[0].parent_block_hash is None and len(ev[0].block_hashes) == 2


def test_decode_blocks_are_stored_with_parent() -> None:
    eng = _engine()
    p = _prompt(30)  # 1 full block + 14 tokens; outputs fill block 1 at output token 2
    eng.add_request(SimRequest("a", p, max_tokens=20))
    _, _, done = _run(eng)
    stored = [e for e in eng.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [1, 1, 1]  # prompt block, then 2 decode blocks (30+19 computed = 49)
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    full = done["a"].token_ids
    assert stored[2].block_hashes == vllm_hash.block_hashes(full[:48], BS, "sha256_cbor")[2:]


# -- engine: time model and scheduling --------------------------------------------------------
def test_ttft_grows_with_uncached_tokens_and_warm_prefix_cuts_it() -> None:
    ttfts = []
    for n in (64, 512, 2048):
        eng = _engine(num_blocks=512)
        eng.add_request(SimRequest("a", _prompt(n), max_tokens=2))
        _, ttft, _ = _run(eng)
        ttfts.append(ttft["a"])
    assert ttfts[0] < ttfts[1] < ttfts[2]
    assert abs(ttfts[1] - (0.01 + 0.512)) < 1e-9  # overhead + 512 x 1 ms
    eng = _engine(num_blocks=512)
    doc = _prompt(2000)
    eng.add_request(SimRequest("cold", doc + [7, 8, 9], max_tokens=2))
    _, cold, _ = _run(eng)
    eng.add_request(SimRequest("warm", doc + [10, 11, 12], max_tokens=2))
    _, warm, done = _run(eng)
    assert done["warm"].num_cached_tokens == 2000 // BS * BS
    assert warm["warm"] < cold["cold"] / 10


def test_token_budget_respected_and_chunked_prefill() -> None:
    eng = _engine(num_blocks=1024, max_num_batched_tokens=256)
    for i in range(4):
        eng.add_request(SimRequest(f"r{i}", _prompt(600, start=10_000 * i), max_tokens=4))
    steps = 0
    while eng.has_work:
        out = eng.step()
        steps += 1
        assert out.num_prefill_tokens + out.num_decode_seqs <= 256
    assert steps >= (4 * 600) // 256


def test_decodes_never_starve_behind_a_long_prefill() -> None:
    eng = _engine(num_blocks=2048, max_num_batched_tokens=512)
    for i in range(8):
        eng.add_request(SimRequest(f"d{i}", _prompt(20, start=1000 * i), max_tokens=40))
    for _ in range(3):  # get them decoding
        eng.step()
    decoders = [r for r in eng.running if r.num_output_tokens > 0]
    assert len(decoders) == 8
    eng.add_request(SimRequest("long", _prompt(8000, start=500_000), max_tokens=2))
    for _ in range(10):  # the long prompt is prefilled in chunks; every decoder gets a token each step
        before = {r.request_id: r.num_output_tokens for r in decoders if r.status == 1}
        out = eng.step()
        assert out.num_decode_seqs == len(before)
        assert out.num_prefill_tokens == 512 - len(before)
        for r in decoders:
            if r.request_id in before:
                assert r.num_output_tokens == before[r.request_id] + 1


def test_preemption_when_blocks_run_out_and_everything_completes() -> None:
    eng = _engine(num_blocks=12, max_num_seqs=8)
    for i in range(4):  # each needs 3 prompt blocks + up to 2 more for output
        eng.add_request(SimRequest(f"p{i}", _prompt(40, start=1000 * i), max_tokens=40))
    _, _, done = _run(eng)
    assert len(done) == 4 and all(r.num_output_tokens == 40 for r in done.values())
    assert eng.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in done.values()) == eng.num_preemptions_total
    assert eng.pool.num_free_blocks == 12  # everything released


def _admission_order(policy: str) -> list[str]:
    """One slot: "busy" runs, then five requests wait; the order in which they get the slot."""
    eng = _engine(num_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    eng.add_request(SimRequest("busy", _prompt(8), max_tokens=3))
    eng.step()
    for rid, prio in (("n1", 1), ("n2", 1), ("q1", 0), ("n3", 1), ("q2", 0)):
        eng.add_request(SimRequest(rid, _prompt(8, start=100 * len(rid) + prio + 10 * int(rid[1])), max_tokens=2, priority=prio))
    order: list[str] = []
    while eng.has_work:
        out = eng.step()
        order += [r.request_id for r in out.tokens if r.num_output_tokens == 1]
    return order


def test_priority_policy_admits_by_priority_then_arrival_and_fcfs_by_arrival() -> None:
    assert _admission_order("priority") == ["q1", "q2", "n1", "n2", "n3"]
    assert _admission_order("fcfs") == ["n1", "n2", "q1", "n3", "q2"]


def test_priority_policy_preempts_the_lowest_priority_first() -> None:
    eng = _engine(num_blocks=12, max_num_seqs=8, scheduling_policy="priority")
    for i, prio in enumerate((0, 1, 0, 1)):  # each needs 3 prompt blocks + up to 2 more for output
        eng.add_request(SimRequest(f"p{i}", _prompt(40, start=1000 * i), max_tokens=40, priority=prio))
    _, _, done = _run(eng)
    assert len(done) == 4 and eng.num_preemptions_total > 0
    assert done["p0"].num_preemptions == done["p2"].num_preemptions == 0  # only priority 1 was preempted


def test_abort_frees_blocks() -> None:
    eng = _engine(num_blocks=16)
    eng.add_request(SimRequest("a", _prompt(100), max_tokens=50))
    eng.step()
    assert eng.pool.num_used_blocks == 7
    assert eng.abort("a") and not eng.abort("a")
    assert eng.pool.num_used_blocks == 0 and not eng.has_work


def test_virtual_time_throughput_is_reasonable() -> None:
    """The virtual-time simulator drives 100k+ requests: a few thousand must take well under a second per 1k."""
    import time

    eng = _engine(num_blocks=4096, time=TimeModel())
    doc = _prompt(512)
    t0 = time.perf_counter()
    n = 1000
    for i in range(n):
        eng.add_request(SimRequest(f"q{i}", doc + [i % 50_000 + 100_000] * 20, max_tokens=8))
    _, _, done = _run(eng, max_steps=100_000)
    elapsed = time.perf_counter() - t0
    assert len(done) == n
    assert sum(r.num_cached_tokens for r in done.values()) >= (n - 1) * 512
    assert elapsed < 5.0, elapsed
