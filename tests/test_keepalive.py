"""Keep-alive of the plan's long roots (gateway/keepalive.py): which prefixes are kept, when one is
due, the refresh request; in virtual time (loadtests/vtime_keepalive.py) it stops the busy
regime's engines evicting cold documents; through a real gateway, agent and simulated replica a
kept document gets refreshes that are cache hits of its blocks under the tenant's salt, and with
`engine_priority` they carry vLLM's priority."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import pytest

from gateway.config import ConfigError, config_from_dict
from gateway.keepalive import REFRESH_PRIORITY, KeepAlive, Retainer, refresh_body, refresh_computed_tokens
from loadtests.vtime import simulate

BS = 16


def _doc(n, blocks=100, tail=6):
    """A request's keys: a document's `blocks` then its own question's `tail`."""
    return list(range(n * 10_000, n * 10_000 + blocks)) + list(range(n * 10_000 + 5_000, n * 10_000 + 5_000 + tail))


def _held(replica, keys):
    return len(keys)


def _cap(replica):
    return 1000


def test_an_idle_root_is_due_with_its_payload():
    ret = Retainer(KeepAlive(idle_s=2.0, min_blocks=64))
    keys = _doc(1)
    ret.used("b", keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    assert ret.due(1.5, _held, _cap) == []  # used 1.5 s ago: not idle yet
    (rf,) = ret.due(2.5, _held, _cap)
    assert rf.replica == "b" and rf.keys == tuple(keys[:100]) and rf.payload == ("ids", "salt")
    assert ret.due(3.0, _held, _cap) == []  # the refresh counts as a use
    ret.done(rf)
    ret.used("b", keys, 100, t=4.0, payload=lambda: pytest.fail("the payload is made once, for a new prefix"))
    assert ret.due(5.9, _held, _cap) == [] and len(ret.due(6.1, _held, _cap)) == 1
    assert ret.sent == 2


def test_another_gateways_request_or_refresh_counts_as_a_use_here():
    """With several gateways, a kept root another gateway sent a request of (or refreshed) is not
    idle here: it is due only idle_s after the last use by any of them; another gateway's use of a
    root this one does not keep changes nothing (it has no token ids to refresh it with)."""
    ka = KeepAlive(idle_s=1.0, min_blocks=64, forget_s=30.0)
    ret = Retainer(ka)
    keys = _doc(1)
    ret.used("a", keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    ret.touched("a", keys[99], 0.8)  # another gateway's request of it at 0.8 s
    assert ret.due(1.5, _held, _cap) == []
    ret.touched("a", keys[99], 1.7, rank=0.5)  # another gateway's refresh
    assert ret.due(2.5, _held, _cap) == []
    assert [rf.kept for rf in ret.due(2.8, _held, _cap)] == [keys[99]]  # defer_s 0: no deferring
    # others' requests keep it from being forgotten too; their refreshes do not (nobody asked for it)
    ret2 = Retainer(ka)
    ret2.used("a", keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    ret2.touched("a", keys[99], 25.0)
    ret2.touched("a", keys[99], 40.0, rank=0.5)
    assert len(ret2.due(45.0, _held, _cap)) == 1  # requested 20 s ago: still kept
    assert ret2.due(56.0, _held, _cap) == [] and ret2.kept["a"] == {}  # 31 s since the last request
    ret2.touched("a", keys[99], 57.0)
    ret2.touched("b", keys[99], 57.0)
    assert ret2.kept == {"a": {}}


def test_only_the_lowest_ranked_gateway_refreshes_a_root_and_another_takes_over_when_it_stops():
    """Gateways refreshing the same root: one that has heard a lower-ranked gateway's refresh of it
    waits defer_s longer, by when that refresh arrives as a use, so it sends none; a higher-ranked
    one's refreshes defer nothing here; once the lower-ranked one has missed its turn, it no longer
    defers (until that one is heard again)."""
    ka = KeepAlive(idle_s=1.0, min_blocks=64, forget_s=30.0, defer_s=0.5)
    low, high = Retainer(ka, rank=0.2), Retainer(ka, rank=0.7)
    keys = _doc(1)
    for ret in (low, high):
        ret.used("a", keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    sent = {"low": 0, "high": 0}
    mail: list = []  # (arrival, to, key, rank): each refresh reaches the other gateway 0.2 s after it is sent
    t = 0.0
    while t < 20.0:  # both check every 0.25 s
        t = round(t + 0.25, 2)
        for at, to, key, rank in [m for m in mail if m[0] <= t]:
            to.touched("a", key, at, rank=rank)
            mail.remove((at, to, key, rank))
        for name, ret, other in (("low", low, high), ("high", high, low)):
            for rf in ret.due(t, _held, _cap):
                sent[name] += 1
                ret.done(rf)
                mail.append((t + 0.2, other, rf.kept, ret.rank))
    # the first round both send (neither has heard the other yet), then low alone, one each idle_s
    assert sent["high"] == 1 and 16 <= sent["low"] <= 20
    low.touched("a", keys[99], 20.0, rank=0.7)  # a higher-ranked gateway's refresh defers nothing here
    assert len(low.due(21.0, _held, _cap)) == 1
    # low stops: high waits idle_s + defer_s once (low's turn), then refreshes every idle_s
    last = high.kept["a"][keys[99]].used
    assert high.due(last + 1.4, _held, _cap) == []
    (rf,) = high.due(last + 1.5, _held, _cap)
    high.done(rf)
    assert high.due(last + 2.4, _held, _cap) == []
    (rf,) = high.due(last + 2.5, _held, _cap)
    high.done(rf)
    # low is heard again: high defers to it again
    high.touched("a", keys[99], last + 3.0, rank=0.2)
    assert high.due(last + 4.4, _held, _cap) == [] and len(high.due(last + 4.5, _held, _cap)) == 1


def test_short_roots_and_unplanned_requests_are_not_kept():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64))
    ret.used("a", _doc(1, blocks=43), 43, t=0.0)  # a 700-token system prompt
    ret.used("a", _doc(2), 0, t=0.0)  # unplanned (no root)
    assert ret.due(5.0, _held, _cap) == []


def test_a_refresh_is_cut_to_what_the_index_still_holds_and_a_lost_root_is_dropped():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64))
    keys = _doc(1)
    ret.used("a", keys, 100, t=0.0)
    (rf,) = ret.due(2.0, lambda r, k: 80, _cap)  # the LRU took its last 20 blocks (a request's tail goes first)
    assert rf.keys == tuple(keys[:80])
    ret.done(rf)
    assert ret.due(4.0, lambda r, k: 10, _cap) == []  # under min_blocks: nothing worth keeping is left
    assert ret.kept["a"] == {}


def test_the_gateways_keep_alive_section_becomes_rules_in_blocks():
    """KeepAlive.from_config (what the gateway runs): min_tokens rounded down to whole blocks, at
    least one; the other fields as they are."""
    cfg = config_from_dict({"keep_alive": {"min_tokens": 1030, "idle_s": 1.5, "kv_frac": 0.7}}, env={})
    rules = KeepAlive.from_config(cfg.keep_alive, cfg.model.block_size)
    assert (rules.min_blocks, rules.idle_s, rules.kv_frac, rules.forget_s) == (64, 1.5, 0.7, cfg.keep_alive.forget_s)
    assert KeepAlive.from_config(cfg.keep_alive, 4096).min_blocks == 1


def test_the_budget_keeps_the_busiest_roots_and_forgets_unused_ones():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64, forget_s=30.0, kv_frac=0.5, max_in_flight=3))
    hot, cold, third = _doc(1), _doc(2), _doc(3)
    for t in (0.0, 0.5, 1.0):
        ret.used("a", hot, 100, t)
    ret.used("a", cold, 100, 1.0)
    ret.used("a", third, 100, 1.0)
    out = ret.due(3.0, _held, lambda r: 400)  # room for two of the three (200 of 400 blocks)
    assert [rf.keys[0] for rf in out] == [hot[0], cold[0]]  # the busiest, then the first of two equals
    assert len(Retainer(KeepAlive(idle_s=1.0, min_blocks=64)).due(3.0, _held, lambda r: 0)) == 0
    assert ret.due(40.0, _held, _cap) == [] and ret.kept["a"] == {}  # 30 s unused: forgotten


def test_unknown_kv_is_no_bound_and_the_count_per_replica_is():
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64, max_per_replica=2, max_in_flight=2))
    for n, t in ((1, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)):  # the third document pushes out the least busy (2)
        ret.used("a", _doc(n), 100, t)
    assert sorted(rf.keys[0] for rf in ret.due(2.0, _held, lambda r: 0)) == [_doc(1)[0], _doc(3)[0]]
    ret.forget("a")
    assert ret.due(9.0, _held, _cap) == []


def test_a_prefix_is_not_refreshed_twice_at_once_and_a_replica_has_max_in_flight_out():
    """A refresh still out when its prefix is due again (the replica's queue is longer than idle_s)
    is not doubled; a replica has at most max_in_flight out (of the due prefixes in its KV budget,
    the longest idle first), the others handed out as earlier ones are done; another replica's are
    its own."""
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64, max_in_flight=2))
    hot, warm, cold = _doc(1), _doc(2), _doc(3)
    for n, doc in enumerate((hot, hot, hot, warm, warm, cold)):
        ret.used("a", doc, 100, t=0.1 * n)
    ret.used("b", cold, 100, t=0.0)
    first = ret.due(2.0, _held, _cap)
    assert sorted((rf.replica, rf.keys[0]) for rf in first) == [("a", hot[0]), ("a", warm[0]), ("b", cold[0])]
    assert ret.due(5.0, _held, _cap) == []  # all three still out: none doubled, and "a" is at its two
    a_hot, a_warm = (next(rf for rf in first if rf.replica == "a" and rf.keys[0] == d[0]) for d in (hot, warm))
    ret.done(a_hot)
    (rf,) = ret.due(5.1, _held, _cap)  # one slot on "a": of the due, the longest idle (cold, since 0.5; hot since 2.0)
    assert (rf.replica, rf.keys[0]) == ("a", cold[0])
    assert ret.due(5.2, _held, _cap) == []
    ret.done(a_warm)
    (rf,) = ret.due(5.3, _held, _cap)
    assert (rf.replica, rf.keys[0]) == ("a", hot[0])  # hot and warm both idle since 2.0: the busier first
    ret.forget("a")  # a replica that left takes its refreshes out with it; a late done() is harmless
    ret.done(rf)
    assert ret.in_flight.get("a") is None


def test_no_refresh_goes_to_a_replica_reporting_more_waiting_than_max_waiting():
    """A refresh behind a long queue comes late, when the LRU has taken part of its prefix, and then
    prefills the lost part on the replica that can least afford it: a replica whose last load report
    has more than max_waiting requests waiting gets none until its queue shrinks; nothing is lost
    meanwhile (the prefix is due at the next check that finds room)."""
    ret = Retainer(KeepAlive(idle_s=1.0, min_blocks=64, max_waiting=2))
    ret.used("a", _doc(1), 100, t=0.0)
    ret.used("b", _doc(2), 100, t=0.0)
    queue = {"a": 3, "b": 2}
    out = ret.due(2.0, _held, _cap, queue.get)
    assert [rf.replica for rf in out] == ["b"]  # "a" has 3 waiting: over 2
    queue["a"] = 0
    (rf,) = ret.due(2.1, _held, _cap, queue.get)
    assert (rf.replica, rf.keys[0]) == ("a", _doc(1)[0])


def test_refresh_body_is_the_blocks_plus_one_token_with_the_salt():
    ids = list(range(1000, 1000 + 100 * BS + 7))
    body = refresh_body("m", ids, 80, BS, "salt-1")
    assert body == {"model": "m", "prompt": ids[: 80 * BS + 1], "max_tokens": 1, "stream": False, "cache_salt": "salt-1"}
    assert "cache_salt" not in refresh_body("m", ids, 80, BS, "")
    assert "priority" not in body  # FCFS engines refuse one: only with keep_alive.engine_priority
    assert refresh_body("m", ids, 80, BS, "salt-1", priority=REFRESH_PRIORITY) == {**body, "priority": -1}
    with pytest.raises(ValueError):
        refresh_body("m", ids[: 80 * BS], 80, BS, "s")  # no token after the blocks


def test_only_a_refused_priority_sends_refreshes_without_one():
    from gateway.rewrite import refuses_priority

    vllm = b'{"error": {"message": "Got priority -1 but Priority scheduling is not enabled.", "code": 400}}'
    assert refuses_priority(400, vllm)
    assert not refuses_priority(400, b'{"error": {"message": "prompt too long"}}')  # another 400
    assert not refuses_priority(500, vllm) and not refuses_priority(200, b"{}")


def test_a_replica_that_refused_a_priority_gets_none_for_a_while_and_is_named_once():
    from gateway.rewrite import PRIORITY_RETRY_S, PriorityRefusals

    r = PriorityRefusals()
    assert r.allows("a", 0.0)
    assert r.refused("a", 10.0) is True and not r.allows("a", 10.0) and r.allows("b", 10.0)
    assert r.refused("a", 20.0) is False  # known already: no second warning, the window restarts
    assert not r.allows("a", 20.0 + PRIORITY_RETRY_S - 1) and r.allows("a", 20.0 + PRIORITY_RETRY_S)
    assert r.refused("a", 20.0 + PRIORITY_RETRY_S + 1) is True  # tried again, refused again: said again


def test_a_refreshs_cost_is_read_from_the_engines_usage():
    usage = {"prompt_tokens": 1281, "prompt_tokens_details": {"cached_tokens": 1280}}
    assert refresh_computed_tokens(json.dumps({"usage": usage}).encode(), 1281) == 1
    usage = {"prompt_tokens": 1281, "prompt_tokens_details": {"cached_tokens": 960}}
    assert refresh_computed_tokens(json.dumps({"usage": usage}).encode(), 1281) == 321  # its tail was evicted
    # an answer that does not say what was cached: counted as computed in full
    assert refresh_computed_tokens(json.dumps({"usage": {"prompt_tokens": 1281}}).encode(), 1281) == 1281
    assert refresh_computed_tokens(b"not json", 1281) == 1281
    assert refresh_computed_tokens(b"[]", 1281) == 1281


def test_keep_alive_rejects_bad_parameters():
    for kw in ({"idle_s": 0}, {"min_blocks": 0}, {"forget_s": 0}, {"kv_frac": 0}, {"kv_frac": 1.5}, {"max_per_replica": 0},
               {"max_in_flight": 0}, {"max_waiting": -1}):
        with pytest.raises(ValueError):
            KeepAlive(**kw)


def test_config_refuses_bad_keep_alive_values():
    config_from_dict({"keep_alive": {"enabled": True}, "policy": {"name": "cache_plan"}}, env={})
    for field, value in (("idle_s", 0), ("min_tokens", 8), ("kv_frac", 2), ("max_per_replica", 0), ("max_in_flight", 0),
                         ("max_waiting", -1), ("timeout_s", -1)):
        with pytest.raises(ConfigError, match=f"keep_alive.{field}"):
            config_from_dict({"keep_alive": {field: value}}, env={})


def test_keep_alive_stops_the_busy_regime_evicting_cold_documents():
    """busy's Zipf case, seed 0: without refreshes the engines' LRU evicts cold documents between
    their requests (long misses no replica could serve warm); with them nearly none is."""
    from loadtests.vtime_regimes import REGIMES, build_case, policy_for

    reg = REGIMES["busy"]
    c = build_case("busy", "shared_docs_zipf", 0)

    def run(ka):
        return simulate(c.workload, policy_for("cache_plan", c.workload, c.keys, reg.replicas), reg.replicas, reg.params,
                        seed=0, keys=c.keys, warmup=c.warmup, keep_alive=ka)

    plain, kept = run(None), run(KeepAlive(idle_s=2.0))
    assert plain.refreshes == 0 and kept.refreshes > 0
    assert plain.misses_evicted >= 5
    assert kept.misses_evicted <= plain.misses_evicted // 3
    assert kept.completed == plain.completed and kept.unfinished == 0
    assert kept.summary()["hit_ratio"] > plain.summary()["hit_ratio"]


def test_the_static_plan_names_its_documents_as_roots_so_keep_alive_keeps_them():
    """vtime's static plan (the issue's oracle-share plan) gives each planned document's candidates
    `plan` and `root_blocks` = the block keys its requests share (the document, not a question):
    keep-alive then refreshes its documents as it does cache_plan's roots, and fewer are evicted."""
    from loadtests.vtime_regimes import REGIMES, build_case, policy_for

    reg = REGIMES["busy"]
    c = build_case("busy", "shared_docs_zipf", 0)
    pol = policy_for("static_plan", c.workload, c.keys, reg.replicas)
    assert len(pol.root_blocks) == 24
    assert all(3000 // BS <= b < min(len(k.prompt) for k in c.keys) for b in pol.root_blocks.values())

    def run(ka):
        return simulate(c.workload, policy_for("static_plan", c.workload, c.keys, reg.replicas), reg.replicas, reg.params,
                        seed=0, keys=c.keys, warmup=c.warmup, keep_alive=ka)

    plain, kept = run(None), run(KeepAlive(idle_s=2.0))
    assert plain.refreshes == 0 and kept.refreshes > 0
    assert kept.misses_evicted < plain.misses_evicted and kept.unfinished == 0


def test_refreshes_first_wait_ahead_of_requests_in_arrival_order():
    """vtime's model of keep_alive.engine_priority (vLLM's priority policy orders its waiting queue
    by (priority, arrival)): a refresh goes behind the refreshes already waiting and ahead of every
    request; without it, at the back (FCFS)."""
    from collections import deque
    from types import SimpleNamespace

    from loadtests.vtime_keepalive import KEEPALIVE, queue_refresh

    req = [SimpleNamespace(pace=None, n=i) for i in range(3)]
    ka = [SimpleNamespace(pace=KEEPALIVE, n=10 + i) for i in range(2)]
    w = deque(req)
    queue_refresh(w, ka[0], first=True)
    queue_refresh(w, ka[1], first=True)
    assert [x.n for x in w] == [10, 11, 0, 1, 2]
    w = deque(req)
    queue_refresh(w, ka[0], first=False)
    assert [x.n for x in w] == [0, 1, 2, 10]


def test_keep_alive_with_priority_runs_in_virtual_time():
    """busy's Zipf case, seed 2, refreshes at the back of the queue and ahead of it: both send and
    serve refreshes, count what they computed, and finish every request. (Before 2026-12-04, with
    the lighter token framing, refreshes ahead of the queue computed fewer prompt tokens on every
    seed; with the chat template's framing they compute more on seeds 1 and 2: README.)"""
    from loadtests.vtime_regimes import REGIMES, build_case, policy_for

    reg = REGIMES["busy"]
    c = build_case("busy", "shared_docs_zipf", 2)

    def run(first):
        return simulate(c.workload, policy_for("cache_plan", c.workload, c.keys, reg.replicas), reg.replicas, reg.params,
                        seed=2, keys=c.keys, warmup=c.warmup, keep_alive=KeepAlive(idle_s=2.0), refresh_first=first)

    for res in (run(False), run(True)):
        s = res.summary()
        assert res.refreshes > 100 and 0 < s["refresh_computed_tokens"] < 100 * 3_000
        assert res.unfinished == 0 and s["completed"] == 1500


def test_report_takes_keep_alive_only_with_a_regime(capsys):
    from loadtests.vtime_report import main

    for argv in (["--keep-alive", "2"], ["--regime", "busy", "--keep-alive", "-1"],
                 ["--regime", "busy", "--keep-alive", "2", "--keep-alive-kv-frac", "0"],
                 ["--regime", "busy", "--keep-alive", "2", "--keep-alive-in-flight", "0"],
                 ["--regime", "busy", "--keep-alive", "2", "--keep-alive-max-waiting", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "--keep-alive" in capsys.readouterr().err


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


@contextlib.asynccontextmanager
async def _kept_document(tok, tmp_path, monkeypatch, *, keep_alive: dict | None = None, sim_policy: str = "fcfs",
                         lora: str | None = None):
    """A real gateway (cache_plan, keep-alive every 0.3 s), an embedded agent and a simulated
    replica (`sim_policy`: its scheduling policy); a document asked twice (of the LoRA adapter
    `lora`, which the replica serves, when given), so it is planned and kept. Yields (gateway,
    sim, session, the document's root in tokens)."""
    from gateway.server import start_gateway
    from loadtests.sim.server import SimConfig, start_sim_server
    from replica_agent.agent import AgentConfig, start_agent
    from replica_agent.feed import open_feed
    from tests.conftest import free_port

    monkeypatch.setenv("WARMROUTE_SALT_SECRET", "keepalive-test-secret")
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenant-a: [key-a]\n")
    feed = open_feed("memory://keepalive")
    port = free_port()
    sim = await start_sim_server(SimConfig(model="warmroute-sim", kv_events_endpoint=f"tcp://*:{port}",
                                           scheduling_policy=sim_policy, lora_modules=(lora,) if lora else ()))
    agent = await start_agent(AgentConfig(replica_id="r0", kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                          engine_url=sim.url, load_interval_s=0.2), feed)
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"r0={sim.url}"], "health_interval_s": 0.2, "eject_base_s": 30.0},
        "auth": {"enabled": True, "api_keys_file": str(keys)},
        "policy": {"name": "cache_plan"},
        "keep_alive": {"enabled": True, "idle_s": 0.3, "min_tokens": 64, **(keep_alive or {})},
        "model": {"lora_adapters": [lora] if lora else []},
    }, env={})
    g = await start_gateway(cfg, feed=feed, tokenizer=tok)
    doc = " ".join(f"paragraph {i} of the kept document about routing." for i in range(60))
    body = {"model": lora or "warmroute-sim", "messages": [{"role": "user", "content": doc}], "max_tokens": 2}
    try:
        for _ in range(100):
            if g.gateway.index.is_live("r0"):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:
            async def chat():
                async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["usage"]

            u = await chat()
            for _ in range(100):  # the engine's BlockStored events reach the index
                if g.gateway.index.stats().entries_by_replica.get("r0", 0) >= u["prompt_tokens"] // 16:
                    break
                await asyncio.sleep(0.05)
            u2 = await chat()
            root_tokens = (u["prompt_tokens"] - 1) // 16 * 16
            assert u2["prompt_tokens_details"]["cached_tokens"] == root_tokens  # planned, its root is the document
            yield g, sim, s, root_tokens
    finally:
        await g.close()
        await agent.close()
        await sim.close()


async def _metrics(s, url) -> str:
    async with s.get(url + "/metrics") as r:
        return await r.text()


@pytest.mark.asyncio
@pytest.mark.parametrize("lora", [None, "sql-lora"])
async def test_a_gateway_refreshes_a_kept_document_as_a_cache_hit_under_the_tenants_salt(tok, tmp_path, monkeypatch, lora):
    """After a document's second request (planned: its root is the document) the replica gets
    refreshes, and each is a hit of the root's blocks, which it can only be if the refresh carries
    the same token ids, the tenant's salt and the LoRA adapter the requests had (an adapter's blocks
    are keyed apart from the base model's); a replica that is down gets none."""
    async with _kept_document(tok, tmp_path, monkeypatch, lora=lora) as (g, sim, s, root_tokens):
        hits0 = _metric(await _metrics(s, sim.url), "vllm:prefix_cache_hits_total")
        await asyncio.sleep(1.5)
        hits1 = _metric(await _metrics(s, sim.url), "vllm:prefix_cache_hits_total")
        text = await _metrics(s, g.admin_url)
        ok = _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="ok",replica="r0"}')
        assert ok >= 2, text[-2000:]
        assert _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="error"') == 0
        assert _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="partial"') == 0
        # each computed its one token past the blocks (engine usage), nothing more
        assert _metric(text, 'warmroute_gateway_keepalive_computed_tokens_total{replica="r0"}') == ok
        # every refresh since hits0 hit the whole root (refreshes sent before hits0 may be counted in ok too)
        assert hits1 - hits0 >= 2 * root_tokens and (hits1 - hits0) % root_tokens == 0
        g.gateway.membership.report_failure("r0", "test: down")  # ejected for 30 s: no refresh goes there
        await asyncio.sleep(0.3)  # one sent just before may still be answered
        before = _metric(await _metrics(s, g.admin_url), "warmroute_gateway_keepalive_refreshes_total")
        hits2 = _metric(await _metrics(s, sim.url), "vllm:prefix_cache_hits_total")
        await asyncio.sleep(1.0)
        assert _metric(await _metrics(s, g.admin_url), "warmroute_gateway_keepalive_refreshes_total") == before
        assert _metric(await _metrics(s, sim.url), "vllm:prefix_cache_hits_total") == hits2


@pytest.mark.asyncio
@pytest.mark.parametrize("sim_policy", ["priority", "fcfs"])
async def test_with_engine_priority_refreshes_carry_vllms_priority(tok, tmp_path, monkeypatch, caplog, sim_policy):
    """keep_alive.engine_priority: refreshes carry priority -1 (keepalive.REFRESH_PRIORITY). An
    engine run with --scheduling-policy priority serves them (hits of the whole root); one on the
    default policy refuses the first, as vLLM refuses a priority it does not schedule by (counted
    as an error: the priority really is sent), and the gateway says so once and sends the next
    ones without a priority, which it serves."""
    with caplog.at_level(logging.WARNING, logger="warmroute.gateway"):
        async with _kept_document(tok, tmp_path, monkeypatch, keep_alive={"engine_priority": True},
                                  sim_policy=sim_policy) as (g, sim, s, root_tokens):
            for _ in range(60):  # refreshes every idle_s (0.3 s): two served within 1.2 s on a quiet machine
                await asyncio.sleep(0.1)
                text = await _metrics(s, g.admin_url)
                if _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="ok",replica="r0"}') >= 2:
                    break
            await asyncio.sleep(0.5)  # and no other error after them
            text = await _metrics(s, g.admin_url)
    ok = _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="ok",replica="r0"}')
    errors = _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="error"')
    refused = [r for r in caplog.records if "refuses request priorities" in r.getMessage()]
    assert _metric(text, 'warmroute_gateway_keepalive_computed_tokens_total{replica="r0"}') == ok  # every one a hit
    if sim_policy == "priority":
        assert ok >= 2 and errors == 0 and not refused, text[-2000:]
    else:
        assert ok >= 2 and errors == 1 and len(refused) == 1, text[-2000:]


@pytest.mark.asyncio
async def test_two_gateways_keeping_one_document_refresh_it_about_as_often_as_one(tok, tmp_path, monkeypatch):
    """Two gateways on one feed, both routing a document (so both keep it): the refreshes each
    sends travel with their placements, the one that hears a lower-ranked gateway's refreshes
    defers to it, and the replica gets about one gateway's refreshes, not two gateways' (each
    gateway alone would refresh it every idle_s)."""
    from gateway.server import start_gateway
    from loadtests.sim.server import SimConfig, start_sim_server
    from replica_agent.agent import AgentConfig, start_agent
    from replica_agent.feed import open_feed
    from tests.conftest import free_port

    monkeypatch.setenv("WARMROUTE_SALT_SECRET", "keepalive-test-secret")
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenant-a: [key-a]\n")
    port = free_port()
    sim = await start_sim_server(SimConfig(model="warmroute-sim", kv_events_endpoint=f"tcp://*:{port}"))
    agent = await start_agent(AgentConfig(replica_id="r0", kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                          engine_url=sim.url, load_interval_s=0.2), open_feed("memory://keepalive-two"))
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"r0={sim.url}"], "health_interval_s": 0.2, "eject_base_s": 30.0},
        "auth": {"enabled": True, "api_keys_file": str(keys)},
        "policy": {"name": "cache_plan"},
        "keep_alive": {"enabled": True, "idle_s": 0.3, "min_tokens": 64},
    }, env={})
    gws = [await start_gateway(cfg, feed=open_feed("memory://keepalive-two"), tokenizer=tok) for _ in range(2)]
    doc = " ".join(f"paragraph {i} of the document two gateways keep." for i in range(60))
    body = {"model": "warmroute-sim", "messages": [{"role": "user", "content": doc}], "max_tokens": 2}
    try:
        for _ in range(100):
            if all(g.gateway.index.is_live("r0") for g in gws):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:
            for g in gws + gws:  # each gateway routes it twice: its second request is planned, and kept
                async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                await asyncio.sleep(0.3)  # the engine's events reach both indexes
            assert all(g.gateway.retainer.keeping() for g in gws)
            # until a gateway has heard another's records its exchange may be in its 1 s quiet
            # period (gateway.background): measured once both have
            await asyncio.sleep(2.0)
            assert all(g.gateway.routing.others_heard_at > 0 for g in gws)
            sent0 = [g.gateway.retainer.sent for g in gws]
            await asyncio.sleep(3.0)
            sent = [g.gateway.retainer.sent - s0 for g, s0 in zip(gws, sent0)]
            text = "".join([await _metrics(s, g.admin_url) for g in gws])
            views = []
            for g in gws:  # what an operator sees of it
                async with s.get(g.admin_url + "/debug/index") as r:
                    views.append((await r.json())["keep_alive"])
    finally:
        for g in gws:
            await g.close()
        await agent.close()
        await sim.close()
    # alone, each would send one every idle_s + check (0.3-0.375 s): 8-10 in 3 s, so 16-20 for two
    assert 5 <= sum(sent) <= 12, sent
    assert min(sent) <= 2, sent  # the higher-ranked one defers (its first round may be doubled)
    assert _metric(text, 'warmroute_gateway_keepalive_refreshes_total{outcome="error"') == 0
    low, high = sorted(views, key=lambda v: v["rank"])
    assert low["kept"] == high["kept"] == {"r0": 1}
    assert low["traded"]["sent"] >= 4 and high["traded"]["heard"] >= 4  # the refreshing one's records reached the other
    assert all(0 <= v["refreshes"] - v["traded"]["sent"] <= 1 for v in views)  # the last may await its exchange
