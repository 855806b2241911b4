"""The engine's tokenizer routes through the gateway (gateway.engine_routes), over real HTTP against
simulated replicas: `/tokenize` and `/detokenize` answer what a replica answers directly, in turn
among the replicas that serve the model, authenticated and limited like the generation routes; a
replica that refuses connections is ejected and the next one answers; bad input gets OpenAI's
error shape and disturbs nothing else."""
from __future__ import annotations

import json
import socket

import aiohttp
import pytest
import pytest_asyncio

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "You answer tersely."},
                                     {"role": "user", "content": "How many tokens is this? ünïcödé 🙂"}]}


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return port


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tok, tokenizer_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_routes")
    (d / "keys.yaml").write_text("tenant-a: [key-a]\ntenant-narrow: [key-narrow]\ntenant-slow: [key-slow]\n")
    (d / "salt.secret").write_text("salt-secret-engine-routes\n")
    sims = {rid: await start_sim_server(SimConfig(model=MODEL, tokenizer=str(tokenizer_dir), max_model_len=4096,
                                                  lora_modules=lora))
            for rid, lora in (("s1", ("sql",)), ("s2", ()))}
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"{rid}={sim.url}" for rid, sim in sims.items()]},
        "feed": {"url": "memory://engine-routes"},
        "salt": {"secret_file": str(d / "salt.secret")},
        "auth": {"api_keys_file": str(d / "keys.yaml"),
                 "tenants": {"tenant-narrow": {"models": ["sql"]}, "tenant-slow": {"max_rps": 0.01}}},
    }, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    async with aiohttp.ClientSession() as s:
        yield g, s, sims
    await g.close()
    for sim in sims.values():
        await sim.close()


async def _call(s, url, path, body=None, key="key-a", method="POST", raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with s.request(method, url + path, data=data, headers=headers) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text.startswith("{") else text), r.headers.get("X-Warmroute-Replica")


def _assert_error(st, body, want_status, code):
    assert st == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body


async def test_tokenize_answers_as_the_replica_does_in_turn(env):
    g, s, sims = env
    cases = [{"model": MODEL, "prompt": "hello world, twice over"}, {**CHAT, "return_token_strs": True},
             {"prompt": "no model named: the base model's tokenizer"}]
    for body in cases:
        async with s.post(sims["s2"].url + "/tokenize", json=body) as r:
            assert r.status == 200
            direct = await r.json()
        served_by = set()
        for _ in range(4):
            st, got, rid = await _call(s, g.url, "/tokenize", body)
            assert st == 200, got
            assert got == direct
            served_by.add(rid)
        assert served_by == {"s1", "s2"}  # in turn: both replicas answered
    assert direct["count"] == len(direct["tokens"]) > 3


async def test_detokenize_round_trips_and_an_engine_refusal_is_shaped(env):
    g, s, _ = env
    st, got, _ = await _call(s, g.url, "/tokenize", {"model": MODEL, "prompt": "a round trip, ünïcödé"})
    assert st == 200, got
    st, back, _ = await _call(s, g.url, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert st == 200 and back["prompt"].endswith("a round trip, ünïcödé"), back
    st, body, _ = await _call(s, g.url, "/detokenize", {"model": MODEL, "tokens": "not ids"})
    _assert_error(st, body, 400, body["error"]["code"])  # the engine's 400, in OpenAI's shape
    assert "tokens" in body["error"]["message"]


async def test_an_adapter_is_tokenized_only_where_it_is_loaded(env):
    g, s, _ = env
    for key in ("key-a", "key-narrow"):  # tenant-narrow may use the adapter only
        for _ in range(3):
            st, got, rid = await _call(s, g.url, "/tokenize", {"model": "sql", "prompt": "select 1"}, key=key)
            assert st == 200 and rid == "s1", (got, rid)


@pytest.mark.parametrize("case,status,code", [
    ("no_key", 401, "missing_api_key"),
    ("wrong_key", 401, "invalid_api_key"),
    ("model_not_allowed", 403, None),
    ("unknown_model", 404, "model_not_found"),
    ("malformed_json", 400, "invalid_json"),
    ("model_wrong_type", 400, "invalid_type"),
    ("wrong_method", 405, "method_not_allowed"),
    ("rate_limited", 429, "rate_limit_exceeded"),
])
async def test_bad_requests_get_openai_errors_and_disturb_nothing(env, case, status, code):
    g, s, _ = env
    body, key, method, raw = {"model": MODEL, "prompt": "hi"}, "key-a", "POST", None
    if case == "no_key":
        key = None
    elif case == "wrong_key":
        key = "nope"
    elif case == "model_not_allowed":
        key = "key-narrow"
    elif case == "unknown_model":
        body = {"model": "gpt-9", "prompt": "hi"}
    elif case == "malformed_json":
        raw = b'{"prompt": '
    elif case == "model_wrong_type":
        body = {"model": 7, "prompt": "hi"}
    elif case == "wrong_method":
        method = "GET"
    elif case == "rate_limited":
        key = "key-slow"
        st, got, _ = await _call(s, g.url, "/tokenize", body, key=key)  # its burst of one
        assert st == 200, got
    st, got, _ = await _call(s, g.url, "/tokenize", body, key=key, method=method, raw=raw)
    _assert_error(st, got, status, code or got["error"]["code"])
    st, got, _ = await _call(s, g.url, "/tokenize", {"model": MODEL, "prompt": "still fine"})
    assert st == 200, got


async def test_unknown_route_names_the_served_ones(env):
    g, s, _ = env
    st, body, _ = await _call(s, g.url, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    _assert_error(st, body, 404, "unknown_route")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize"):
        assert path in body["error"]["message"]


async def test_counted_under_its_route(env):
    g, s, _ = env
    st, _, _ = await _call(s, g.url, "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]})
    assert st == 200
    async with s.get(g.admin_url + "/metrics") as r:
        text = await r.text()
    lines = [ln for ln in text.splitlines() if ln.startswith("warmroute_gateway_requests_total")
             and 'route="/detokenize"' in ln and 'status="200"' in ln]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1, lines


async def test_a_refusing_replica_is_ejected_and_the_next_answers(tok, tokenizer_dir, tmp_path):
    sim = await start_sim_server(SimConfig(model=MODEL, tokenizer=str(tokenizer_dir), max_model_len=4096))
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "model": {"name": MODEL},
        "membership": {"replicas": [f"dead=http://127.0.0.1:{_closed_port()}", f"live={sim.url}"]},
        "feed": {"url": "memory://engine-routes-dead"},
        "auth": {"enabled": False},
    }, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                st, got, rid = await _call(s, g.url, "/tokenize", {"prompt": "hello"}, key=None)
                assert st == 200 and rid == "live", (got, rid)
            assert not g.gateway.membership.available("dead")
            await sim.close()
            st, got, _ = await _call(s, g.url, "/tokenize", {"prompt": "hello"}, key=None)
            assert st in (502, 503) and got["error"]["code"] in ("upstream_unavailable", "no_replica_available"), got
    finally:
        await g.close()
        await sim.close()
