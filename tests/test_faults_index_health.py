"""A stale or wrong index is detected (gateway.index_health): the rule's numbers on plain data, the
routing hook, and end to end a gateway whose chat template differs from the engine's: its
predictions disagree with the engine's cached tokens, the replica is distrusted within the stated
number of requests (metric, log, /readyz), routed by load only, and trusted again once requests
whose tokenization both sides share (completions: no template) agree."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil

import aiohttp
import pytest

from gateway.config import config_from_dict
from gateway.context import Outcome
from gateway.index import KVIndex
from gateway.learn import learn
from gateway.index_health import DISTRUST_BELOW, MIN_SAMPLES, RETRY_AFTER_S, TRUST_FROM, WINDOW_REQS, IndexHealth
from gateway.load import LoadTracker
from gateway.routing import RoutingState
from gateway.server import start_gateway
from gateway.tokenization import TokenizerService
from loadtests.sim.server import SimConfig, start_sim_server
from policies.cache_aware import CacheAwarePolicy
from policies.calibration import Calibrator
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import FeedEvent, open_feed
from tests.conftest import free_port

MODEL = "warmroute-sim"


# ------------------------------------------------------------------------------- the rule
def test_stated_numbers():
    assert (WINDOW_REQS, MIN_SAMPLES, DISTRUST_BELOW, TRUST_FROM, RETRY_AFTER_S) == (16, 8, 0.5, 0.8, 60.0)
    # From an empty window: the 8th zero-agreement sample distrusts.
    h = IndexHealth()
    verdicts = [h.observe("r", 0, 320) for _ in range(8)]
    assert verdicts == [None] * 7 + [False] and not h.trusted("r")
    # From a window of perfect agreement: the 9th.
    h = IndexHealth()
    for _ in range(16):
        assert h.observe("r", 160, 160) is None
    verdicts = [h.observe("r", 160, 0) for _ in range(9)]
    assert verdicts == [None] * 8 + [False]
    # From a full window of zeros: 13 exact samples trust it again.
    h = IndexHealth()
    for _ in range(16):
        h.observe("r", 0, 64)
    verdicts = [h.observe("r", 64, 64) for _ in range(13)]
    assert verdicts == [None] * 12 + [True] and h.trusted("r")
    assert h.distrusted_counts() == {"r": 1}


def test_no_evidence_partial_agreement_and_hysteresis():
    h = IndexHealth()
    for _ in range(100):  # predicted 0 and engine 0: nothing learnt
        assert h.observe("r", 0, 0) is None
    assert h.agreement("r") is None and h.trusted("r")
    for _ in range(16):  # half the tokens predicted: agreement 0.5, not below the threshold
        h.observe("r", 64, 128)
    assert h.agreement("r") == pytest.approx(0.5) and h.trusted("r")
    h.observe("r", 0, 128)  # one miss tips the mean below 0.5
    assert not h.trusted("r")
    for _ in range(16):  # 0.75 agreement: between the thresholds, stays distrusted
        h.observe("r", 96, 128)
    assert h.agreement("r") == pytest.approx(0.75) and not h.trusted("r")
    assert h.distrusted() == {"r": pytest.approx(0.75)}
    h.forget("r")
    assert h.trusted("r") and h.distrusted() == {}
    with pytest.raises(ValueError):
        IndexHealth(min_samples=0)
    with pytest.raises(ValueError):
        IndexHealth(distrust_below=0.9, trust_from=0.8)


def test_half_open_after_retry_delay():
    t = [0.0]
    h = IndexHealth(clock=lambda: t[0])
    for _ in range(8):
        h.observe("r", 0, 64)
    assert not h.trusted("r")
    t[0] += RETRY_AFTER_S - 1
    assert not h.trusted("r")
    t[0] += 1
    assert h.trusted("r") and h.agreement("r") is None  # another chance, window emptied
    verdicts = [h.observe("r", 0, 64) for _ in range(8)]  # still wrong: distrusted again after 8
    assert verdicts[-1] is False and not h.trusted("r") and h.distrusted_counts() == {"r": 2}


def test_over_prediction_counts_like_under_prediction():
    h = IndexHealth()
    for _ in range(8):  # the index says cached, the engine found nothing: a stale index
        h.observe("r", 256, 0)
    assert not h.trusted("r")


def test_over_predictions_after_a_long_queue_wait_are_no_evidence():
    """A busy replica evicts the blocks a queued request was routed for: after a wait over
    queued_evict_s the engine finding less than predicted says nothing about the index. The same
    over-prediction without the wait (a stale index: the engine prefilled what was predicted
    cached) and an under-prediction after the wait still count."""
    h = IndexHealth()
    for _ in range(20):
        assert h.observe("a", 64, 0, queued_s=5.0) is None
    assert h.trusted("a") and h.agreement("a") is None
    for _ in range(8):
        h.observe("b", 64, 0, queued_s=0.5)
    assert not h.trusted("b")
    for _ in range(8):
        h.observe("c", 0, 64, queued_s=5.0)
    assert not h.trusted("c")


def test_learn_measures_the_queue_wait_beyond_the_requests_own_prefill():
    cal = Calibrator(prior_prefill_s_per_token=0.001)
    usage = {"prompt_tokens": 3100, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3000}}
    out = Outcome("r0", 5.0, 3000, 100, 0.0, 0, usage, None)
    lesson = learn(out, cal, CacheAwarePolicy())
    rate = cal.prefill_s_per_token("r0")
    assert lesson.uncached_tokens == 100 and abs(lesson.queued_s - (5.0 - 100 * rate)) < 1e-9 and lesson.queued_s > 4.0
    cold = learn(Outcome("r0", 3.0, 0, 3100, 0.0, 0, {**usage, "prompt_tokens_details": {"cached_tokens": 0}}, None),
                 cal, CacheAwarePolicy())
    assert cold.queued_s < 0.5  # a cold prefill's TTFT is its prefill, not a wait


def test_distrusted_replica_is_routed_by_load_only():
    """The views hook: a distrusted replica's matches stop counting exactly like a silent feed."""
    t = [100.0]
    index = KVIndex(clock=lambda: t[0])
    rs = RoutingState(index, LoadTracker(), Calibrator(), speculative_ttl_s=2.0, clock=lambda: t[0])
    keys = [11, 12, 13, 14]
    for rid in ("a", "b"):
        index.apply(FeedEvent(rid, 1, "stored", keys, "GPU"))
    views = {v.replica_id: v for v in rs.views(["a", "b"], keys, {"a": True, "b": True})}
    assert views["a"].index_live and views["b"].index_live and views["a"].matched_blocks_gpu == 4
    for _ in range(8):
        rs.checked("a", 0, 64)
    views = {v.replica_id: v for v in rs.views(["a", "b"], keys, {"a": True, "b": True})}
    assert not views["a"].index_live and views["b"].index_live
    assert views["a"].matched_blocks_gpu == 4  # still computed: predictions keep being checked
    rs.forget("a")
    assert rs.health.trusted("a")
    # A silent feed is not evidence against the index: its matches did not count anyway.
    t[0] += 60.0
    for _ in range(20):
        rs.checked("b", 0, 64)
    assert rs.health.trusted("b") and rs.health.agreement("b") is None


# ------------------------------------------------------------------------------- end to end
def _wrong_template_dir(src, dst):
    """The built-in tokenizer with a chat template that differs from the engine's by one character
    per message (a colon after the role): every chat prompt tokenizes differently from block 0."""
    shutil.copytree(src, dst)
    tpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (dst / "chat_template.jinja").write_text(tpl)
    conf = json.loads((dst / "tokenizer_config.json").read_text())
    conf["chat_template"] = tpl
    (dst / "tokenizer_config.json").write_text(json.dumps(conf))
    return dst


def _doc(i: int) -> str:
    return " ".join(f"document {i} section {j} explains the cache routing contract." for j in range(24))


@pytest.mark.slow
async def test_wrong_chat_template_is_detected_and_recovers(tokenizer_dir, tmp_path, caplog):
    wrong = _wrong_template_dir(tokenizer_dir, tmp_path / "tok-wrong")
    tok = TokenizerService(wrong)
    feed = open_feed("memory://index-health")
    port = free_port()
    sim = await start_sim_server(SimConfig(model=MODEL, kv_events_endpoint=f"tcp://*:{port}"))
    agent = await start_agent(AgentConfig(replica_id="r", kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                          engine_url=sim.url, load_interval_s=0.2), feed)
    ttl_s = 0.3  # speculative entries (the gateway's own guess) expire fast; the real ones decide
    cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                            "membership": {"replicas": [f"r={sim.url}"], "health_interval_s": 0.5},
                            "auth": {"enabled": False}, "feed": {"url": "memory://index-health", "speculative_ttl_s": ttl_s},
                            "model": {"tokenizer_dir": str(wrong)}}, env={})
    g = await start_gateway(cfg, feed=feed, tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            async def send(kind, text, question):
                if kind == "chat":
                    body = {"model": MODEL, "max_tokens": 1,
                            "messages": [{"role": "system", "content": text}, {"role": "user", "content": question}]}
                else:
                    body = {"model": MODEL, "max_tokens": 1, "prompt": text + " " + question}
                async with s.post(f"{g.url}/v1/{'chat/' if kind == 'chat' else ''}completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

            with caplog.at_level(logging.INFO, logger="warmroute.gateway.index_health"):
                # Round 1 warms 8 documents (no evidence: nothing predicted, nothing cached); round 2
                # asks new questions about them after the speculative entries expired: the engine
                # finds each document cached, the index (keyed on the gateway's tokenization) nothing.
                for i in range(8):
                    await send("chat", _doc(i), "first question?")
                await asyncio.sleep(ttl_s + 0.3)
                n_to_distrust = None
                for i in range(8):
                    assert await send("chat", _doc(i), "second question?") > 0  # the engine hits its own cache
                    if n_to_distrust is None and not gw.routing.health.trusted("r"):
                        n_to_distrust = i + 1
                assert n_to_distrust == MIN_SAMPLES, n_to_distrust
                async with s.get(g.admin_url + "/readyz") as r:
                    ready = await r.json()
                assert r.status == 200 and any("replica r: index disagrees" in d for d in ready["degraded"]), ready
                async with s.get(g.admin_url + "/metrics") as r:
                    text = await r.text()
                assert 'warmroute_gateway_index_trusted{replica="r"} 0.0' in text
                assert 'warmroute_gateway_index_distrusted_total{replica="r"} 1.0' in text
                # Routed by load only: the decision ignores the replica's matches.
                async with s.post(g.admin_url + "/debug/route", json={"model": MODEL, "prompt": _doc(0)}) as r:
                    why = await r.json()
                assert why["replicas"][0]["index_live"] is False and why["replicas"][0]["terms"]["matched_tokens"] == 0

                # Completions prompts tokenize identically on both sides: predictions are exact again.
                for i in range(13):
                    await send("completions", _doc(100 + i), "tell me.")
                await asyncio.sleep(ttl_s + 0.3)
                n_to_trust = None
                for i in range(13):
                    assert await send("completions", _doc(100 + i), "tell me more.") > 0
                    if n_to_trust is None and gw.routing.health.trusted("r"):
                        n_to_trust = i + 1
                assert n_to_trust == 13, n_to_trust
            msgs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "warmroute.gateway.index_health"]
            assert msgs == [("WARNING", "index disagrees with the engine: routing the replica by load only"),
                            ("INFO", "index agrees with the engine again: matches count for the replica")], msgs
            async with s.get(g.admin_url + "/readyz") as r:
                degraded = (await r.json())["degraded"]
            # The index agrees again; the tokenizer check (gateway.tokenize_check) caught the
            # template at the first chat request, and only a matching check clears it.
            assert [d.split(" (")[0] for d in degraded] == ["replica r: tokenizes differently from the gateway"], degraded
            assert gw.metrics.tokenize_checks.labels("r", "mismatch")._value.get() == 1
    finally:
        await g.close()
        await agent.close()
        await sim.close()
        tok.close()
