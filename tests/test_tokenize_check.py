"""The tokenizer drift check (gateway.tokenize_check): the comparison, the /tokenize body and the
sampling on plain data; end to end against the simulator's real /tokenize, with the engine's
tokenizer (every check matches) and with a chat template that differs from the engine's (the
mismatch is counted, logged without the prompt and listed on /readyz until a check matches), and
against a replica without /tokenize (an error, counted; the client's request unaffected)."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from gateway.config import config_from_dict
from gateway.config_rules import ConfigError
from gateway.context import CHAT, COMPLETIONS, RESPONSES, ParsedRequest
from gateway.parse import parse_request
from gateway.server import start_gateway
from gateway.tokenization import TokenizerService
from gateway.tokenize_check import DriftCheck, Verdict, compare, tokenize_body
from loadtests.sim.server import SimConfig, start_sim_server
from tests.conftest import serve_chat
from tests.test_faults_index_health import _wrong_template_dir

MODEL = "warmroute-sim"


# ------------------------------------------------------------------------------- pure parts
def test_compare():
    assert compare([1, 2, 3], [1, 2, 3]) == Verdict("match", 3, 3)
    assert compare([1, 2, 3], [1, 9, 3]) == Verdict("mismatch", 3, 3, 1)
    assert compare([1, 2, 3], [1, 2]) == Verdict("mismatch", 3, 2, 2)  # a length difference: at the shorter end
    # a prompt cut before its first media item: the engine's (media expanded) must begin with ours and go on
    assert compare([1, 2], [1, 2, 7, 7, 3], prefix=True) == Verdict("match", 2, 5)
    assert compare([1, 2], [1, 9, 7], prefix=True) == Verdict("mismatch", 2, 3, 1)
    assert compare([1, 2], [1, 2], prefix=True) == Verdict("mismatch", 2, 2, 2)  # nothing where the media should be
    assert compare([1, 2], [1, 2, 3]) == Verdict("mismatch", 2, 3, 2)
    assert compare([], []) == Verdict("match", 0, 0)
    for bad in (None, "1 2 3", [1, "2"], [1, True], {"tokens": [1]}):
        v = compare([1, 2], bad)
        assert v.result == "error" and v.ours == 2 and v.reason, bad


def _chat(**kw) -> ParsedRequest:
    return ParsedRequest(CHAT, MODEL, True, False, 16, messages=[{"role": "user", "content": "hi"}], **kw)


def test_tokenize_body_chat():
    payload = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "x", "stream": True}
    assert tokenize_body(_chat(), payload, MODEL) == {
        "model": MODEL, "messages": payload["messages"], "add_generation_prompt": True,
        "continue_final_message": False, "add_special_tokens": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = _chat(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"x": 1}, tools=tools)
    body = tokenize_body(req, {**payload, "add_special_tokens": True}, None)
    assert body == {"messages": payload["messages"], "add_generation_prompt": False, "continue_final_message": True,
                    "add_special_tokens": True, "chat_template_kwargs": {"x": 1}, "tools": tools}
    # Only what /tokenize takes: no salt, no sampling options, no stream flag.
    assert not {"cache_salt", "stream", "max_tokens"} & body.keys()


def test_tokenize_body_responses_is_the_rendered_chat_with_chats_part_types():
    payload = {"model": MODEL, "instructions": "be brief", "tools": [{"type": "function", "name": "f"}],
               "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                        {"type": "input_image", "image_url": "u"}]},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "b"}], "status": "incomplete"}]}
    req = parse_request(RESPONSES, payload, MODEL)
    body = tokenize_body(req, payload, MODEL)
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_image", "image_url": "u"}]},
        {"role": "assistant", "content": "b"}]  # /tokenize refuses input_text parts; vLLM renders them as text
    assert (body["add_generation_prompt"], body["continue_final_message"]) == (False, True)
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    assert payload["input"][0]["content"][0]["type"] == "input_text"  # the client's body is untouched


def test_tokenize_body_completions():
    req = ParsedRequest(COMPLETIONS, MODEL, False, False, 16, prompts=["a text", "a second one"])
    assert tokenize_body(req, {"prompt": ["a text", "a second one"]}, MODEL) == {
        "model": MODEL, "prompt": "a text", "add_special_tokens": True}  # the first prompt: the one routed on
    assert tokenize_body(req, {"add_special_tokens": False}, MODEL)["add_special_tokens"] is False
    assert tokenize_body(req, {"add_special_tokens": "yes"}, MODEL)["add_special_tokens"] is True  # not a bool: default
    ids = ParsedRequest(COMPLETIONS, MODEL, False, False, 16, prompts=[[1, 2, 3]])
    assert tokenize_body(ids, {"prompt": [1, 2, 3]}, MODEL) is None  # token ids: nothing to check
    embeds = ParsedRequest(COMPLETIONS, MODEL, False, False, 16, prompts=["text too"], embeds=True)
    assert tokenize_body(embeds, {"prompt": "text too", "prompt_embeds": "AAAA"}, MODEL) is None  # embeddings: nor these


def test_drift_check_sampling():
    d = DriftCheck(60.0)
    assert d.due("a", 100.0) and d.due("a", 100.0)  # asking does not start a check
    assert d.take("a", 100.0)  # a replica's first answer is checked at once
    assert not d.due("a", 100.0)
    assert not d.take("a", 100.0)  # one at a time (and not due before 160 anyway)
    assert d.take("b", 100.0)  # per replica
    d.done("a", Verdict("match", 5, 5))
    assert not d.take("a", 159.9)
    assert d.take("a", 160.0)
    d.done("a", Verdict("mismatch", 5, 6, 4))
    assert d.mismatched == {"a": Verdict("mismatch", 5, 6, 4)}
    [line] = d.degraded()
    assert line.startswith("replica a: tokenizes differently") and "6 tokens against our 5" in line and "token 4" in line
    assert d.take("a", 220.0)
    d.done("a", Verdict("error", 5, reason="HTTP 500"))
    assert "a" in d.mismatched  # an error says nothing either way
    assert d.failed == {"a": "HTTP 500"} and d.describe()["failed"] == {"a": "HTTP 500"}  # why, for /debug/index
    assert d.take("a", 280.0)
    d.done("a", Verdict("match", 5, 5))
    assert d.mismatched == {} and d.failed == {} and d.degraded() == []
    d.done("b", Verdict("mismatch", 1, 2, 1))
    d.forget("b")
    assert d.degraded() == [] and d.take("b", 100.5)  # a replica that comes back is checked at once
    off = DriftCheck(0.0)
    assert not off.take("a", 0.0) and not off.take("a", 1e9)


def test_config_bound():
    assert config_from_dict({}, env={}).model.tokenize_check_s == 60.0
    assert config_from_dict({"model": {"tokenize_check_s": 0}}, env={}).model.tokenize_check_s == 0
    with pytest.raises(ConfigError, match="model.tokenize_check_s"):
        config_from_dict({"model": {"tokenize_check_s": -1}}, env={})


# ------------------------------------------------------------------------------- end to end
def _cfg(url: str, check_s: float, **model) -> dict:
    return config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                             "membership": {"replicas": [f"r={url}"], "health_interval_s": 0.5},
                             "auth": {"enabled": False}, "feed": {"load_only": True},
                             "model": {"name": MODEL, "tokenize_check_s": check_s, **model}}, env={})


def _checks(gw, result: str) -> float:
    return gw.metrics.tokenize_checks.labels("r", result)._value.get()


async def _settled(gw, n: int, timeout_s: float = 10.0) -> None:
    """Until `n` checks have finished (they run after the answer, in the background)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sum(_checks(gw, r) for r in ("match", "mismatch", "error")) < n:
        assert asyncio.get_running_loop().time() < deadline, "tokenize checks did not finish"
        await asyncio.sleep(0.02)


async def _send(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with s.post(url + path, json={"model": MODEL, "max_tokens": 2, **body}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


BODIES = [
    {"messages": [{"role": "system", "content": "You route requests."}, {"role": "user", "content": "Where to?"}]},
    {"messages": [{"role": "user", "content": "Grüße 🦔 <|im_end|> done"}], "chat_template_kwargs": {"x": 1}},
    {"messages": [{"role": "user", "content": "continue me"}], "add_generation_prompt": False},
    {"prompt": "The quick brown fox jumps over the lazy dog."},
    {"prompt": "special <|endoftext|> strings", "add_special_tokens": False},
]


async def test_checks_against_the_simulator_match(tok):
    sim = await start_sim_server(SimConfig(model=MODEL))
    g = await start_gateway(_cfg(sim.url, 1e-6), tokenizer=tok)  # due at every answer (one at a time)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            for i, body in enumerate(BODIES):
                await _send(s, g.url, body)
                await _settled(gw, i + 1)  # each request's check over before the next request
            await _send(s, g.url, {"prompt": [1, 2, 3, 4]})  # token ids: not checked
            await asyncio.sleep(0.2)
            async with s.get(g.admin_url + "/metrics") as r:
                text = await r.text()
            async with s.get(g.admin_url + "/readyz") as r:
                ready = await r.json()
        assert (_checks(gw, "match"), _checks(gw, "mismatch"), _checks(gw, "error")) == (len(BODIES), 0, 0)
        assert f'warmroute_gateway_tokenize_checks_total{{replica="r",result="match"}} {len(BODIES)}.0' in text
        assert ready["degraded"] == []
    finally:
        await g.close()
        await sim.close()


async def test_a_different_chat_template_is_reported_until_a_check_matches(tokenizer_dir, tmp_path, caplog):
    wrong = _wrong_template_dir(tokenizer_dir, tmp_path / "tok-wrong")
    tok = TokenizerService(wrong)
    sim = await start_sim_server(SimConfig(model=MODEL))
    g = await start_gateway(_cfg(sim.url, 1e-6), tokenizer=tok)
    gw = g.gateway
    secret_words = "the quarterly figures of tenant zeta"
    try:
        async with aiohttp.ClientSession() as s:
            with caplog.at_level(logging.DEBUG, logger="warmroute.gateway.tokenize_check"):
                await _send(s, g.url, {"messages": [{"role": "user", "content": secret_words}]})
                await _settled(gw, 1)
            assert _checks(gw, "mismatch") == 1
            async with s.get(g.admin_url + "/readyz") as r:
                ready = await r.json()
            assert r.status == 200  # serving: degraded, not unready
            [line] = ready["degraded"]
            async with s.get(g.admin_url + "/metrics") as r:
                assert 'warmroute_gateway_tokenizer_mismatch{replica="r"} 1.0' in await r.text()  # the alert's gauge
            v = gw.tokenize_checker.drift.mismatched["r"]
            async with s.get(g.admin_url + "/debug/index") as r:
                view = (await r.json())["tokenize_check"]
            assert view == {"interval_s": 1e-6, "checking": [], "failed": {},
                            "mismatched": {"r": {"engine_tokens": v.theirs, "gateway_tokens": v.ours, "first_diff": 2}}}
            assert line.startswith("replica r: tokenizes differently from the gateway")
            assert v.first_diff == 2  # <|im_start|>, "user", then ":\n" (ours) against the engine's "\n"
            [rec] = [r for r in caplog.records if r.name == "warmroute.gateway.tokenize_check"]
            assert rec.levelname == "WARNING" and rec.fields == {
                "replica": "r", "engine_tokens": v.theirs, "gateway_tokens": v.ours, "first_diff": 2}
            assert "quarterly" not in rec.getMessage() and "quarterly" not in str(rec.fields)
            # A completions prompt has no template: both sides agree, and the replica is cleared.
            await _send(s, g.url, {"prompt": "no template here"})
            await _settled(gw, 2)
            async with s.get(g.admin_url + "/readyz") as r:
                assert (await r.json())["degraded"] == []
            async with s.get(g.admin_url + "/metrics") as r:
                assert 'warmroute_gateway_tokenizer_mismatch{replica="r"} 0.0' in await r.text()
        assert (_checks(gw, "match"), _checks(gw, "mismatch")) == (1, 1)
    finally:
        await g.close()
        await sim.close()
        tok.close()


async def test_default_interval_checks_a_replicas_first_answer_only(tok):
    sim = await start_sim_server(SimConfig(model=MODEL))
    g = await start_gateway(_cfg(sim.url, 60.0), tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            for body in BODIES:
                await _send(s, g.url, body)
            await _settled(gw, 1)
            await asyncio.sleep(0.2)
        assert (_checks(gw, "match"), _checks(gw, "mismatch"), _checks(gw, "error")) == (1, 0, 0)
    finally:
        await g.close()
        await sim.close()


async def test_a_replica_without_tokenize_counts_an_error_and_serves_on(tok):
    runner, url = await serve_chat()  # answers chat; /tokenize is a 404
    g = await start_gateway(_cfg(url, 1e-6), tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(g.url + "/v1/chat/completions",
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200
                await _settled(gw, _ + 1)
            async with s.get(g.admin_url + "/readyz") as r:
                assert (await r.json())["degraded"] == []
            async with s.get(g.admin_url + "/debug/index") as r:
                assert (await r.json())["tokenize_check"]["failed"] == {"r": "HTTP 404"}
        assert (_checks(gw, "error"), _checks(gw, "match"), _checks(gw, "mismatch")) == (2, 0, 0)
    finally:
        await g.close()
        await runner.cleanup()


async def test_close_cancels_a_check_in_flight(tok):
    held = asyncio.Event()

    async def slow_tokenize(request):
        held.set()
        await asyncio.sleep(30)
        return aiohttp.web.json_response({"tokens": []})

    from aiohttp import web

    from tests.conftest import serve_app

    async def chat(request):
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", slow_tokenize)
    async def health(request):
        return web.Response()

    app.router.add_get("/health", health)
    runner, url = await serve_app(app, shutdown_timeout=0.1)
    g = await start_gateway(_cfg(url, 1e-6), tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200
        await asyncio.wait_for(held.wait(), 5)
        t0 = asyncio.get_running_loop().time()
        await g.close()
        assert asyncio.get_running_loop().time() - t0 < 5  # not the check's 10 s timeout, nor the replica's 30 s
        assert not g.gateway.tokenize_checker._tasks
    finally:
        await g.close()
        await runner.cleanup()
