"""The Responses API (`POST /v1/responses`) through the gateway, end to end: the official `openai`
SDK streams and awaits responses; simulated replicas publish KV events through agents to the
gateway's index; a repeated input goes where it is cached and the engine's cached tokens equal
the prediction; a chat and a response with the same conversation share their blocks; tenants never
share, whatever salt a client sends; what the gateway does not route is refused clearly."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.server import start_gateway
from replica_agent.feed import open_feed
from tests.conftest import gateway_before_engine, keyed_gateway_config, sims_with_agents

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "warmroute-sim"
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
DOC = " ".join(f"clause {i} of the contract every answer cites." for i in range(70))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tok, tmp_path_factory):
    feed = open_feed("memory://responses-e2e")
    async with sims_with_agents(2, feed, MODEL) as sims:
        g = await start_gateway(keyed_gateway_config(tmp_path_factory.mktemp("responses"), sims, KEYS),
                                feed=feed, tokenizer=tok)
        for _ in range(100):
            if all(g.gateway.index.is_live(f"r{i}") for i in range(2)):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            yield g, s
        await g.close()


async def _respond(s, g, key: str, body: dict) -> tuple[dict, str]:
    """(usage, replica) of a streamed response through the gateway, read as a client reads it."""
    async with s.post(g.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "stream": True, **body},
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert any(e["type"] == "response.output_text.delta" for e in events)
    return events[-1]["response"]["usage"], r.headers["X-Warmroute-Replica"]


async def _until_indexed(g, replica: str, n_blocks: int) -> None:
    for _ in range(100):
        if g.gateway.index.stats().entries_by_replica.get(replica, 0) >= n_blocks:
            return
        await asyncio.sleep(0.05)


async def test_the_openai_sdk_streams_and_awaits_responses(stack):
    from openai import AsyncOpenAI

    g, _ = stack
    client = AsyncOpenAI(base_url=g.url + "/v1", api_key=KEYS["tenant-a"], max_retries=0)
    try:
        resp = await client.responses.create(model=MODEL, instructions="Answer briefly.", input="Say hello " * 10,
                                             max_output_tokens=5)
        assert resp.output_text and resp.usage.output_tokens == 5 and resp.usage.input_tokens > 20
        stream = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "stream " * 10}],
                                               max_output_tokens=4, stream=True)
        events = [e async for e in stream]
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 4
    finally:
        await client.close()


async def test_a_repeat_goes_where_it_is_cached_and_is_predicted_exactly(stack):
    g, s = stack
    body = {"instructions": "You cite the contract.", "input": DOC + " What does clause 3 say?"}
    u0, first = await _respond(s, g, KEYS["tenant-a"], body)
    assert u0["input_tokens_details"]["cached_tokens"] == 0
    async with s.post(g.admin_url + "/debug/route", params={"tenant": "tenant-a"}, json={"model": MODEL, **body}) as r:
        assert r.status == 200 and (await r.json())["request"]["prompt_tokens"] == u0["input_tokens"]
    await _until_indexed(g, first, u0["input_tokens"] // 16)
    for _ in range(3):
        u, rid = await _respond(s, g, KEYS["tenant-a"], body)
        assert rid == first and u["input_tokens"] == u0["input_tokens"]
        assert u["input_tokens_details"]["cached_tokens"] == (u["input_tokens"] - 1) // 16 * 16
    async with s.get(g.admin_url + "/metrics") as r:
        text = await r.text()
    assert f'warmroute_gateway_index_accuracy_ratio{{replica="{first}"}} 1.0' in text


async def test_a_chat_and_a_response_of_one_conversation_share_their_blocks(stack):
    g, s = stack
    system, question = "You summarise. " + DOC, "Summarise clause 9."
    chat = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    async with s.post(g.url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEYS['tenant-a']}"}) as r:
        assert r.status == 200
        cu, where = (await r.json())["usage"], r.headers["X-Warmroute-Replica"]
    await _until_indexed(g, where, cu["prompt_tokens"] // 16)
    u, rid = await _respond(s, g, KEYS["tenant-a"], {"instructions": system, "input": question})
    assert rid == where and u["input_tokens"] == cu["prompt_tokens"]  # the same rendering, token for token
    assert u["input_tokens_details"]["cached_tokens"] == (u["input_tokens"] - 1) // 16 * 16


async def test_tenants_never_share_whatever_salt_a_client_sends(stack):
    g, s = stack
    body = {"input": "only tenant a reads this: " + DOC}
    await _respond(s, g, KEYS["tenant-a"], body)
    u, _ = await _respond(s, g, KEYS["tenant-a"], body)
    assert u["input_tokens_details"]["cached_tokens"] > 0
    ub, _ = await _respond(s, g, KEYS["tenant-b"], {**body, "cache_salt": g.gateway.salter.salt_for("tenant-a")})
    assert ub["input_tokens_details"]["cached_tokens"] == 0


async def test_what_the_gateway_does_not_route_is_refused_clearly(stack):
    g, s = stack
    auth = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
    async with s.post(g.url + "/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_x"},
                      headers=auth) as r:
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "unsupported_parameter" and err["param"] == "previous_response_id"
    async with s.post(g.url + "/v1/responses", json={"model": MODEL, "input": "hi"}) as r:
        assert r.status == 401
    async with s.post(g.url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                      headers=auth) as r:  # still serving
        assert r.status == 200 and (await r.json())["status"] == "completed"


async def test_a_response_stream_cut_after_its_first_token_ends_with_an_error_event(tok):
    """The engine's stream stops after a delta (no response.completed): the client's stream ends
    with the Responses API's own `error` event, not chat's data-only one."""
    async def responses(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for kind, extra in (("response.created", {"response": {}}), ("response.in_progress", {"response": {}}),
                            ("response.output_text.delta", {"delta": "partial"})):
            await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **extra})}\n\n".encode())
        return resp  # ends the body without the last event

    async with gateway_before_engine(tok, {"POST /v1/responses": responses}, MODEL) as g:
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r:
                assert r.status == 200
                data = await asyncio.wait_for(r.read(), 10)
        events = [e for e in data.split(b"\n\n") if e]
        assert [e.split(b"\n")[0] for e in events] == [b"event: response.created", b"event: response.in_progress",
                                                       b"event: response.output_text.delta", b"event: error"]
        err = json.loads(events[-1].split(b"data: ", 1)[1])
        assert err["type"] == "error" and err["code"] == "upstream_failed" and "its last event" in err["message"]


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions"])
async def test_a_client_that_leaves_after_the_whole_answer_is_not_a_disconnect(tok, route):
    """The answer went out whole (its last event), the client closed, and the engine's body ends a
    moment later: the gateway counts a 200 and learns from it, not a 499 (vLLM's Responses API ends
    its body after response.completed, not with it)."""
    usage = {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    if route == "/v1/responses":
        events = [("response.created", {"response": {}}), ("response.output_text.delta", {"delta": "x"}),
                  ("response.completed", {"response": {"usage": {"input_tokens": 7, "output_tokens": 1,
                                                                 "input_tokens_details": {"cached_tokens": 0}}}})]
        frames = [f"event: {k}\ndata: {json.dumps({'type': k, **v})}\n\n".encode() for k, v in events]
    else:
        frames = [b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n',
                  b'data: ' + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n", b"data: [DONE]\n\n"]

    async def answer(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(frames))
        await asyncio.sleep(0.5)  # the client has everything and leaves meanwhile
        return resp

    body = {"model": MODEL, "stream": True, **({"input": "hi"} if route == "/v1/responses" else
                                                {"messages": [{"role": "user", "content": "hi"}]})}
    async with gateway_before_engine(tok, {f"POST {route}": answer}, MODEL) as g:
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + route, json=body) as r:
                assert r.status == 200
                await asyncio.wait_for(r.read(), 10)
        # the session is closed: the client left before the engine's body ended
        async with aiohttp.ClientSession() as s:
            for _ in range(40):
                async with s.get(g.admin_url + "/metrics") as m:
                    text = await m.text()
                if f'route="{route}",status="' in text:
                    break
                await asyncio.sleep(0.05)
        assert f'warmroute_gateway_requests_total{{replica="u",route="{route}",status="200"}} 1.0' in text, \
            [ln for ln in text.splitlines() if "requests_total" in ln]
        assert 'warmroute_gateway_prompt_tokens_total{replica="u"} 7.0' in text  # learnt from the usage
