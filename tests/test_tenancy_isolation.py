"""Tenants never share KV blocks: a client-chosen `cache_salt` (of any type, or another tenant's
derived salt) never reaches the engine (nor a client's vLLM `priority`: a place of its choosing in
the engine's queue), and tenants A and B sending the same long prompt share no
block, neither in the engines (engine-reported cached tokens) nor in the gateway's index."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.conftest import free_port, serve_app

pytestmark = pytest.mark.asyncio

MODEL = "warmroute-sim"
SECRET = "tenancy-test-salt-secret"
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
DOC = " ".join(f"Clause {i}: the shared contract text that both tenants happen to send." for i in range(80))


@pytest.fixture
def keys_file(tmp_path):
    p = tmp_path / "keys.yaml"
    p.write_text("".join(f"{t}: [{k}]\n" for t, k in KEYS.items()))
    (tmp_path / "salt.secret").write_text(SECRET)
    return p


def _cfg(replicas, keys_file, **over):
    d = {"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
         "membership": {"replicas": replicas, "health_interval_s": 0.3},
         "auth": {"enabled": True, "api_keys_file": str(keys_file)},
         "salt": {"secret_file": str(keys_file.parent / "salt.secret")},
         "model": {"name": MODEL, "max_model_len": 8192}, "feed": {"load_only": True}}
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return config_from_dict(d, env={})


async def test_client_cache_salt_never_reaches_the_engine(tok, keys_file):
    got: list[dict] = []

    async def chat(request):
        got.append(await request.json())
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    async def health(request):
        return web.Response()

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions"):
        app.router.add_post(path, chat)
    app.router.add_get("/health", health)
    runner, url = await serve_app(app)
    g = await start_gateway(_cfg([f"r={url}"], keys_file), tokenizer=tok)
    salt_a = g.gateway.salter.salt_for("tenant-a")
    salt_b = g.gateway.salter.salt_for("tenant-b")
    assert salt_a != salt_b
    client_salts = [salt_a, salt_b, "mine", "", "a" * 5000, "bad/salt@", 7, None, True, ["x"], {"s": "x"}]
    try:
        async with aiohttp.ClientSession() as s:
            for key, want in (("key-a", salt_a), ("key-b", salt_b)):
                for cs in client_salts:
                    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/v1/completions", {"prompt": "hi"})):
                        n = len(got)
                        raw = {"model": MODEL, **body, "cache_salt": cs, "priority": -1}
                        async with s.post(g.url + path, json=raw, headers={"Authorization": f"Bearer {key}"}) as r:
                            assert r.status == 200, await r.text()
                        assert len(got) == n + 1 and got[-1]["cache_salt"] == want, (key, cs, got[-1].get("cache_salt"))
                        assert "priority" not in got[-1]  # nor a place in the engine's queue of its choosing
            # The same with the salt key spelled twice in the raw JSON (the last one would win in a parser).
            raw = f'{{"model": "{MODEL}", "prompt": "hi", "cache_salt": "{salt_a}", "cache_salt": "{salt_a}"}}'
            async with s.post(g.url + "/v1/completions", data=raw, headers={"Authorization": "Bearer key-b",
                                                                            "Content-Type": "application/json"}) as r:
                assert r.status == 200
        assert got[-1]["cache_salt"] == salt_b
        assert len(got) == 2 * len(client_salts) * 2 + 1
    finally:
        await g.close()
        await runner.cleanup()


@pytest.mark.slow
async def test_same_long_prompt_two_tenants_share_no_block(tok, keys_file):
    """One replica, so both tenants land on the same engine: B's first request for A's prompt finds
    nothing cached (even when B sends A's derived salt as its own), the engine then holds two copies
    of the prompt's blocks, and the index holds A's and B's keys, disjoint, both on that replica."""
    feed = open_feed("memory://tenancy")
    port = free_port()
    sim = await start_sim_server(SimConfig(model=MODEL, kv_events_endpoint=f"tcp://*:{port}"))
    agent = await start_agent(AgentConfig(replica_id="r", kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                          engine_url=sim.url, load_interval_s=0.2), feed)
    g = await start_gateway(_cfg([f"r={sim.url}"], keys_file,
                                 feed={"load_only": False, "url": "memory://tenancy", "speculative_ttl_s": 0.2}),
                            feed=feed, tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            async def send(key, *, salt=None):
                body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": DOC}]}
                if salt is not None:
                    body["cache_salt"] = salt
                async with s.post(g.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

            async def settled(n_blocks):
                for _ in range(200):
                    if gw.index.stats().entries_by_replica.get("r", 0) >= n_blocks:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # speculative entries gone: what is left came from the engine

            ids = tok.encode_chat([{"role": "user", "content": DOC}])
            keys = {t: gw.keychain.request_keys(ids, salt=gw.salter.salt_for(t)) for t in KEYS}
            n = len(keys["tenant-a"])
            assert n >= 40 and set(keys["tenant-a"]).isdisjoint(keys["tenant-b"])
            assert await send("key-a") == 0
            await settled(n)
            assert gw.index.match(keys["tenant-a"])["r"].gpu_blocks == n
            assert gw.index.match(keys["tenant-b"]) == {}, "B's keys match no block in the index"
            assert await send("key-a") == n * 16 - (16 if len(ids) % 16 == 0 else 0)  # A hits its own blocks
            blocks_after_a = sim.engine.pool.num_cached_blocks
            # B, same prompt, same engine, claiming A's derived salt: nothing cached.
            assert await send("key-b", salt=gw.salter.salt_for("tenant-a")) == 0
            await settled(2 * n)
            assert await send("key-b") > 0  # B's own copy now
            # The engine holds the prompt's blocks twice; the index holds both tenants' keys there.
            assert sim.engine.pool.num_cached_blocks >= blocks_after_a + n
            assert gw.index.match(keys["tenant-a"])["r"].gpu_blocks == n
            assert gw.index.match(keys["tenant-b"])["r"].gpu_blocks == n
            async with s.post(g.admin_url + "/debug/route?tenant=tenant-b",
                              json={"model": MODEL, "messages": [{"role": "user", "content": DOC}]}) as r:
                why = await r.json()
            assert why["replicas"][0]["matched_blocks_gpu"] == n
            assert why["tenant_hash"] != "tenant-b"
    finally:
        await g.close()
        await agent.close()
        await sim.close()
