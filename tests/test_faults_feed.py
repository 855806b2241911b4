"""Feed faults, end to end through the gateway: Redis restarted on the same port (the gateway serves
throughout, says so on /readyz and in metrics, reconnects with backoff, relearns); an agent process
SIGKILLed (its replica routed by load only, relearned from the engine's replay when a new agent
starts); an engine whose KV events stop arriving (caught by the index check, resynchronised and
relearned when they resume); reordered batches (the index ends equal to the engine's state)."""
from __future__ import annotations

import asyncio
import collections
import base64
import logging
import time

import aiohttp
import pytest

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.conftest import free_port
from tests.fault_harness import MODEL, Procs, metric_sum, metrics_text

pytestmark = pytest.mark.slow  # async tests run under asyncio_mode = auto (pyproject)


def _cfg(replicas: list[str], feed_url: str, **feed) -> object:
    return config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": replicas, "health_interval_s": 0.3},
        "auth": {"enabled": False},
        "feed": {"url": feed_url, "inflight_poll_s": 0.1, **feed},
        "model": {"name": MODEL, "max_model_len": 8192}}, env={})


def _doc(name: str) -> str:
    return " ".join(f"{name} paragraph {j} on routing requests to warm replicas." for j in range(30))


async def until(pred, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.05)


class Checks:
    """Records every (replica, predicted, engine-reported) cached-token pair the gateway checked."""

    def __init__(self, gw) -> None:
        self.pairs: list[tuple[str, int, int]] = []
        orig = gw.routing.checked

        def rec(rid, predicted, reported, queued_s=0.0):
            self.pairs.append((rid, predicted, reported))
            orig(rid, predicted, reported, queued_s)

        gw.routing.checked = rec


async def _send(s, url: str, text: str, question: str = "what is it about?") -> tuple[int, str]:
    body = {"model": MODEL, "max_tokens": 2, "prompt": f"{text}\nQ: {question}"}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers["X-Warmroute-Replica"]


async def _sim_with_events():
    pub, rep = free_port(), free_port()
    sim = await start_sim_server(SimConfig(model=MODEL, kv_events_endpoint=f"tcp://*:{pub}",
                                           replay_endpoint=f"tcp://127.0.0.1:{rep}"))
    return sim, pub, rep


@pytest.mark.redis
async def test_redis_restart_gateway_serves_throughout_and_relearns(tok, redis_server, caplog):
    sims, agents = [], []
    for i in range(2):
        sim, pub, rep = await _sim_with_events()
        sims.append(sim)
        agents.append(await start_agent(AgentConfig(replica_id=f"r{i}", kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                                                    replay_endpoint=f"tcp://127.0.0.1:{rep}", engine_url=sim.url,
                                                    load_interval_s=0.2, snapshot_interval_s=0.5),
                                        open_feed(redis_server.url)))
    stale_s = 2.0
    g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims)], redis_server.url,
                                 stale_after_s=stale_s, speculative_ttl_s=0.3), tokenizer=tok)
    gw = g.gateway
    checks = Checks(gw)
    try:
        async with aiohttp.ClientSession() as s:
            await until(lambda: all(gw.index.is_live(f"r{i}") for i in range(2)), what="both replicas live")
            doc = _doc("warm")
            _, home = await _send(s, g.url, doc)
            await asyncio.sleep(0.5)
            cached, rid = await _send(s, g.url, doc, "again?")
            assert rid == home and cached > 0 and checks.pairs[-1][1:] == (cached, cached)

            with caplog.at_level(logging.INFO, logger="warmroute"):
                redis_server.stop()
                t_down = time.monotonic()
                live_early, live_late, served, degraded = None, None, 0, None
                while time.monotonic() - t_down < stale_s + 2.0:
                    await _send(s, g.url, _doc(f"outage {served}"))  # every request is answered
                    served += 1
                    if live_early is None and time.monotonic() - t_down > 0.5:
                        live_early = gw.index.is_live(home)
                        async with s.get(g.admin_url + "/readyz") as r:
                            degraded = (r.status, await r.json())
                    await asyncio.sleep(0.05)
                live_late = gw.index.is_live(home)
                text = await metrics_text(s, g.admin_url)
                feed_errors_outage = metric_sum(text, "warmroute_gateway_feed_errors_total")
                assert live_early is True, "the last known index is used at first"
                assert live_late is False, "then the silent replicas are routed by load only"
                assert degraded[0] == 200 and any(d.startswith("feed unreachable") for d in degraded[1]["degraded"]), degraded
                assert metric_sum(text, "warmroute_gateway_feed_up") == 0.0
                # Backoff: a few failed calls per second of outage, not one per poll (0.1 s).
                outage_s = time.monotonic() - t_down
                assert 1 <= feed_errors_outage <= 6 * outage_s, (feed_errors_outage, outage_s)

                during_outage = [r.getMessage() for r in caplog.records
                                 if r.name == "warmroute.gateway" and "unavailable" in r.getMessage()]
                redis_server.start()  # same port, empty (no persistence): the agents republish
                await until(lambda: gw.feed_ok and all(gw.index.is_live(f"r{i}") for i in range(2)), 20.0,
                            what="feed back, replicas live")
                await until(lambda: all(a.stats.feed_republishes >= 1 for a in agents), 20.0, what="agents republished")
                keys = gw.keychain.request_keys(tok.encode_prompt(doc + "\nQ: x"), salt=gw.salter.salt_for("default"))
                await until(lambda: gw.index.match(keys).get(home) is not None, 20.0, what="index relearned")
                cached, rid = await _send(s, g.url, doc, "after the restart?")
                assert rid == home and cached > 0 and checks.pairs[-1][1:] == (cached, cached)
                async with s.get(g.admin_url + "/readyz") as r:
                    assert r.status == 200 and (await r.json())["degraded"] == []
                assert metric_sum(await metrics_text(s, g.admin_url), "warmroute_gateway_feed_up") == 1.0
            # No flood: per dependency on the feed (the index sync's reads, the shared in-flight
            # counters, flow control's fair shares) a line when the outage starts and one when its
            # error changes (connection closed -> refused), not one per poll; and it recovered.
            deps = collections.Counter(m.split(" failed:")[0].split(" still failing")[0] for m in during_outage)
            assert set(deps) == {"feed (index sync)", "feed (shared in-flight counters)", "feed (flow control's fair shares)"}, deps
            assert max(deps.values()) <= 2 and feed_errors_outage > len(during_outage), (during_outage, feed_errors_outage)
            assert any("recovered" in r.getMessage() for r in caplog.records if r.name == "warmroute.gateway")
    finally:
        await g.close()
        for a in agents:
            await a.close()
            await a.feed.close()
        for sim in sims:
            await sim.close()


@pytest.mark.redis
async def test_agent_killed_load_only_then_relearned(tok, redis_server, tmp_path):
    sim, pub, rep = await _sim_with_events()
    stale_s = 1.0
    g = await start_gateway(_cfg([f"r={sim.url}"], redis_server.url, stale_after_s=stale_s, speculative_ttl_s=0.3),
                            tokenizer=tok)
    gw = g.gateway
    checks = Checks(gw)
    try:
        with Procs(tmp_path) as procs:
            agent = procs.agent("r", sim.url, pub, rep, redis_server.url)
            await until(lambda: gw.index.is_live("r"), 30.0, what="agent up, replica live")
            async with aiohttp.ClientSession() as s:
                doc = _doc("agent")
                await _send(s, g.url, doc)
                await asyncio.sleep(0.5)
                cached, _ = await _send(s, g.url, doc, "warm?")
                assert cached > 0 and checks.pairs[-1][1:] == (cached, cached)

                agent.kill9()
                await until(lambda: not gw.index.is_live("r"), stale_s + 3.0, what="replica stale")
                async with s.post(g.admin_url + "/debug/route", json={"model": MODEL, "prompt": doc}) as r:
                    why = await r.json()
                assert why["replicas"][0]["index_live"] is False  # routed by load only
                n_checked = len(checks.pairs)
                for i in range(3):  # still served; no evidence taken against the index meanwhile
                    assert (await _send(s, g.url, doc, f"while the agent is down {i}?"))[0] > 0
                assert len(checks.pairs) == n_checked + 3 and gw.routing.health.agreement("r") == 1.0

                procs.agent("r", sim.url, pub, rep, redis_server.url)  # a new agent (new epoch)
                await until(lambda: gw.index.is_live("r"), 30.0, what="new agent live")
                # Its first engine batch shows seq > 0: it replays the engine's buffer from 0 and
                # relearns every block, including the document's.
                await _send(s, g.url, _doc("trigger"))
                keys = gw.keychain.request_keys(tok.encode_prompt(doc + "\nQ: x"), salt=gw.salter.salt_for("default"))
                await until(lambda: getattr(gw.index.match(keys).get("r"), "gpu_blocks", 0) >= 10, 20.0, what="document relearned")
                await asyncio.sleep(0.4)  # no speculative entry left: the prediction is the relearned index's
                cached, _ = await _send(s, g.url, doc, "relearned?")
                assert cached > 0 and checks.pairs[-1][1:] == (cached, cached)
    finally:
        await g.close()
        await sim.close()


async def test_events_stopped_caught_by_the_index_check_then_resynchronised(tok):
    """The engine's KV events stop (every batch lost) while the agent's heartbeats go on, so the
    replica still looks live: the index check sees the predictions miss and routes it by load
    only; when events resume, the gap is noticed, the agent resynchronises, the index relearns and
    the check trusts it again. At no point after the resync does the index claim more than the engine has."""
    sim, pub, rep = await _sim_with_events()
    feed = open_feed("memory://events-stopped")
    agent = await start_agent(AgentConfig(replica_id="r", kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                                          replay_endpoint=f"tcp://127.0.0.1:{rep}", engine_url=sim.url,
                                          load_interval_s=0.2), feed)
    ttl_s = 0.3
    g = await start_gateway(_cfg([f"r={sim.url}"], "memory://events-stopped", speculative_ttl_s=ttl_s),
                            feed=feed, tokenizer=tok)
    gw = g.gateway
    checks = Checks(gw)
    try:
        async with aiohttp.ClientSession() as s:
            await until(lambda: gw.index.is_live("r"), what="live")
            sim.server.apply_fault({"kind": "drop_events", "fraction": 1.0})
            docs = [_doc(f"unseen {i}") for i in range(8)]
            for d in docs:
                await _send(s, g.url, d)
            await asyncio.sleep(ttl_s + 0.2)
            for d in docs:
                assert (await _send(s, g.url, d, "second?"))[0] > 0
            assert gw.index.is_live("r") and not gw.routing.health.trusted("r")

            sim.server.apply_fault({"kind": "clear"})
            fresh = [_doc(f"after {i}") for i in range(13)]
            for d in fresh:
                await _send(s, g.url, d)
            await until(lambda: agent.stream.seq.stats.resyncs >= 1, what="gap noticed, resync")
            n_before = len(checks.pairs)
            await asyncio.sleep(ttl_s + 0.2)
            for d in fresh:
                await _send(s, g.url, d, "second?")
            after = checks.pairs[n_before:]
            assert gw.routing.health.trusted("r"), after
            assert all(p == r for _, p, r in after), after
            # The documents sent while events were lost are unknown to the index (the resync dropped
            # what it could not vouch for): predicted 0, never a block the engine does not hold.
            for d in docs[:3]:
                await _send(s, g.url, d, "third?")
            assert all(p <= r for _, p, r in checks.pairs[n_before:])
    finally:
        await g.close()
        await agent.close()
        await sim.close()


async def test_reordered_batches_leave_the_index_equal_to_the_engine(vllm_fixture):
    """Captured vLLM batches sent out of order (two swapped pairs): the agent replays or resyncs,
    and the index ends with exactly the engine's blocks."""
    from tests.test_agent_zmq import expected_keys, index_keys, run_case, stop

    frames = [[base64.b64decode(x) for x in f] for f in vllm_fixture["live_frames"]]
    n = 30
    order = list(range(n))
    order[5], order[6] = order[6], order[5]
    order[17], order[18] = order[18], order[17]
    want = expected_keys([f[2] for f in frames[:n]])
    engine, agent, index, sync, task = await run_case(frames, "memory://reorder", publish_plan=[(i, i, False) for i in order],
                                                      generated_in_order=True)
    try:
        await until(lambda: "r1" in index.replicas() and index_keys(index, "r1") == want, 10.0, what="index equals engine")
        assert set(agent.translator.keys()) == want
        st = agent.stream.seq.stats
        assert st.gaps >= 2  # each swap was seen
    finally:
        await stop(engine, agent, task)


@pytest.mark.redis
async def test_shared_inflight_counts_survive_a_redis_restart(tok, redis_server):
    """Two gateways share in-flight counts through Redis; Redis restarts empty while gateway 1 has
    4 requests in flight. Afterwards each gateway still sees exactly the other's work: the 2 that
    finished do not push gateway 1's counters negative, the 2 still in flight are counted again."""
    from tests.conftest import serve_chat

    gates = {name: asyncio.Event() for name in ("first", "second", "third")}

    async def hold(body):
        await gates[body["messages"][0]["content"].split()[0]].wait()  # no first byte until released

    runner, url = await serve_chat(hold)
    g1 = await start_gateway(_cfg([f"r={url}"], redis_server.url), tokenizer=tok)
    g2 = await start_gateway(_cfg([f"r={url}"], redis_server.url), tokenizer=tok)

    def others(g):
        return g.gateway.load.get("r").others_reqs

    async def settle(pred, what):
        await until(pred, 10.0, what=what)
        await asyncio.sleep(0.5)  # and stays so over several polls
        assert pred(), what

    try:
        async with aiohttp.ClientSession() as s:
            def post(g, gate):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"{gate} " + "word " * 50}]}
                return asyncio.create_task(s.post(g.url + "/v1/chat/completions", json=body))

            held = [post(g1, "first") for _ in range(2)] + [post(g1, "second") for _ in range(2)]
            await settle(lambda: others(g2) == 4, "g2 sees g1's 4")
            redis_server.stop()
            await asyncio.sleep(0.5)
            redis_server.start()
            gates["first"].set()  # 2 of g1's requests finish after the restart
            await settle(lambda: others(g2) == 2 and g1.gateway.feed_ok, "g2 sees g1's remaining 2")
            held += [post(g2, "third") for _ in range(3)]
            await settle(lambda: others(g1) == 3 and others(g2) == 2, "each sees exactly the other's")
            gates["second"].set()
            gates["third"].set()
            for t in held:
                (await t).release()
            await settle(lambda: others(g1) == 0 and others(g2) == 0, "nothing left in flight")
    finally:
        for e in gates.values():
            e.set()
        await g1.close()
        await g2.close()
        await runner.cleanup()


def test_load_tracker_notices_lost_counters_and_restores_failed_flushes():
    from gateway.load import LoadTracker

    lt = LoadTracker()
    flights = [lt.dispatch("r", 100) for _ in range(4)]
    assert lt.take_pending() == {"r": (4, 400, 4)}
    assert not lt.lost_by_feed({"r": (6, 700, 9)})  # ours (4, 400, 4) plus another gateway's
    assert lt.lost_by_feed({"r": (6, 700, 3)})  # fewer open than ours: some of ours are gone
    flights[0].finish()
    flights[1].finish()
    flights[3].first_token()  # in flight no more, still open
    assert lt.lost_by_feed({})  # the feed restarted empty
    lt.rebase()
    assert lt.take_pending() == {"r": (1, 100, 2)}  # what is in flight and open now, whole
    flights[2].finish()
    pending = lt.take_pending()
    lt.restore_pending(pending)  # that flush failed
    assert lt.take_pending() == {"r": (-1, -100, -1)}
