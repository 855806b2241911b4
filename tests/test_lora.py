"""LoRA adapters (gateway.model): names, keys and configuration on plain data; through a gateway in
front of a replica that records what it is sent, a request for an adapter goes upstream under the
adapter's name with the derived salt, is keyed apart from the base model's (the index matches a
document routed for the adapter only for the adapter), and `/v1/models` lists the adapters with
their parent; adapters listed by a replica's `/v1/models` are discovered with the model. Real vLLM
serving adapters: tests/real_vllm/test_vllm_lora.py."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.auth import NO_AUTH_TENANT
from gateway.config import config_from_dict
from gateway.config_rules import ConfigError
from gateway.model import ModelInfo
from gateway.server import start_gateway
from hashing.keys import KeyChain
from tests.conftest import serve_app

MODEL = "base-model"


def test_model_info_serves_adapters_under_their_own_names():
    m = ModelInfo(MODEL, ["alias"], 16, 4096, ["sql-lora"])
    assert m.served == {MODEL, "alias", "sql-lora"}
    assert (m.lora_of("sql-lora"), m.lora_of(MODEL), m.lora_of("alias")) == ("sql-lora", None, None)
    assert m.replicas_for(None) is None and m.replicas_for("sql-lora") is None  # configured: every replica
    m.set_listed("a", ["chat-lora", MODEL, "alias", "", None, "sql-lora"])  # the model and its aliases are not adapters
    m.set_listed("b", ["chat-lora", "dyn-lora"])
    assert m.adapters == {"sql-lora", "chat-lora", "dyn-lora"}
    assert m.served == {MODEL, "alias", "sql-lora", "chat-lora", "dyn-lora"}
    assert m.replicas_for("chat-lora") == {"a", "b"} and m.replicas_for("dyn-lora") == {"b"}
    assert m.replicas_for("sql-lora") is None  # listed by a, but configured: every replica
    m.set_listed("b", ["chat-lora"])  # b unloaded dyn-lora: no replica serves it any more
    assert "dyn-lora" not in m.served and m.lora_of("dyn-lora") is None
    m.forget_replica("a")
    assert m.replicas_for("chat-lora") == {"b"}
    m.forget_replica("b")
    assert m.served == {MODEL, "alias", "sql-lora"} and m.listed == {}
    late = ModelInfo(None, [], 16, None, ["a"])
    assert late.served == frozenset() and late.lora_of("a") == "a"  # nothing is served before the model is known
    late.set(MODEL, 4096)
    assert late.served == {MODEL, "a"}


def test_adapter_keys_differ_from_the_base_models_on_every_block():
    chain = KeyChain(MODEL, 16)
    ids = list(range(100, 164))  # four blocks
    base = chain.request_keys(ids, salt="s")
    a = chain.request_keys(ids, salt="s", lora="sql-lora")
    b = chain.request_keys(ids, salt="s", lora="chat-lora")
    assert len(base) == len(a) == len(b) == 4
    assert not (set(base) & set(a)) and not (set(a) & set(b)) and not (set(base) & set(b))
    assert a == chain.request_keys(ids, salt="s", lora="sql-lora")  # deterministic


def test_config_rules():
    assert config_from_dict({}, env={}).model.lora_adapters == []
    cfg = config_from_dict({"model": {"name": MODEL, "lora_adapters": ["sql-lora", "chat-lora"]}}, env={})
    assert cfg.model.lora_adapters == ["sql-lora", "chat-lora"] and cfg.model.lora_discovery_s == 30.0
    with pytest.raises(ConfigError, match="model.lora_discovery_s"):
        config_from_dict({"model": {"lora_discovery_s": -1}}, env={})
    for bad, why in (([MODEL], "model's name or an alias"), (["alias"], "model's name or an alias"),
                     (["x", "x"], "model's name or an alias"), ([""], "non-empty")):
        with pytest.raises(ConfigError, match=why):
            config_from_dict({"model": {"name": MODEL, "aliases": ["alias"], "lora_adapters": bad}}, env={})


async def _recording_replica(models: list[dict] | None = None, seen: list | None = None, name: str = "r",
                             strict: bool = False):
    """A replica that answers completions (JSON, usage) and records each body it was sent (with
    `name` and the status it answered, in `seen`); its /v1/models answers `models` as the list
    stands at each call. `strict`: a model it does not list is answered 404, as vLLM does."""
    seen = [] if seen is None else seen

    async def completions(request):
        body = await request.json()
        if strict and body["model"] not in {m["id"] for m in models or ()}:
            seen.append({**body, "replica": name, "status": 404})
            return web.json_response({"error": {"message": f"The model `{body['model']}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        seen.append({**body, "replica": name, "status": 200})
        return web.json_response({"model": body["model"], "choices": [{"text": "ok", "index": 0}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async def list_models(request):
        return web.json_response({"object": "list", "data": models if models is not None else []})

    async def ok(request):
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", ok)
    app.router.add_post("/tokenize", ok)  # not a tokenizer: the drift check counts errors, nothing else
    runner, url = await serve_app(app, shutdown_timeout=0.1)
    return runner, url, seen


async def _statuses(s: aiohttp.ClientSession, url: str, model: str, prompts: list[str]) -> list[int]:
    """The status of a completion for `model` of each prompt, sent one after another."""
    out = []
    for prompt in prompts:
        async with s.post(url + "/v1/completions", json={"model": model, "prompt": prompt}) as r:
            out.append(r.status)
    return out


def _two_replicas(url_a: str, url_b: str, feed: str, seed: int, discovery_s: float):
    """A gateway's config for replicas a and b, adapters discovered every `discovery_s`."""
    return config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                             "membership": {"replicas": [f"a={url_a}", f"b={url_b}"], "health_interval_s": 0.5},
                             "auth": {"enabled": False}, "feed": {"url": f"memory://{feed}"}, "policy": {"seed": seed},
                             "model": {"name": MODEL, "max_model_len": 4096, "lora_discovery_s": discovery_s}}, env={})


def _cfg(url: str, **model) -> dict:
    return config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                             "membership": {"replicas": [f"r={url}"], "health_interval_s": 0.5},
                             "auth": {"enabled": False}, "feed": {"url": "memory://lora", "speculative_ttl_s": 60},
                             "model": model}, env={})


async def test_an_adapter_goes_upstream_under_its_name_and_is_keyed_apart(tok):
    runner, url, seen = await _recording_replica()
    g = await start_gateway(_cfg(url, name=MODEL, aliases=["alias"], lora_adapters=["sql-lora"], max_model_len=4096),
                            tokenizer=tok)
    doc = " ".join(f"section {i} of the shared contract." for i in range(80))
    try:
        async with aiohttp.ClientSession() as s:
            async def send(model):
                async with s.post(g.url + "/v1/completions", json={"model": model, "prompt": doc, "max_tokens": 1,
                                                                   "cache_salt": "client-chosen"}) as r:
                    assert r.status == 200, await r.text()

            gw = g.gateway
            ids = tok.encode_prompt(doc)

            def matched(model):  # leading blocks of the document the index holds on r, for `model`'s keys
                keys = gw.keychain.request_keys(ids, salt=gw.salter.salt_for(NO_AUTH_TENANT, None), lora=gw.model.lora_of(model))
                m = gw.routing.index.match(keys).get("r")
                return m.gpu_blocks if m is not None else 0

            await send("sql-lora")
            # Its keys are in the index (speculatively, for 60 s): the document is warm for the
            # adapter and cold for the base model, whose blocks the engine keeps apart.
            assert matched("sql-lora") == len(ids) // 16 and matched(MODEL) == 0
            await send("alias")
            await send(MODEL)
            assert matched(MODEL) == matched("sql-lora") == len(ids) // 16
            assert [b["model"] for b in seen] == ["sql-lora", MODEL, MODEL]  # an alias resolves, an adapter does not
            assert len({b["cache_salt"] for b in seen}) == 1 and seen[0]["cache_salt"] != "client-chosen"
            async with s.post(g.url + "/v1/completions", json={"model": "other-lora", "prompt": "x"}) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            async with s.get(g.url + "/v1/models") as r:
                listed = {m["id"]: m["parent"] for m in (await r.json())["data"]}
            assert listed == {MODEL: None, "alias": None, "sql-lora": MODEL}
    finally:
        await g.close()
        await runner.cleanup()


async def test_adapters_listed_by_a_replica_are_discovered(tok):
    models = [{"id": MODEL, "object": "model", "parent": None, "max_model_len": 4096},
              {"id": "sql-lora", "object": "model", "parent": MODEL, "max_model_len": None},
              {"id": "stray", "object": "model", "parent": "another-model"},
              "not a card"]
    runner, url, seen = await _recording_replica(models)
    g = await start_gateway(_cfg(url), tokenizer=tok)
    try:
        assert g.gateway.model.name == MODEL and g.gateway.model.adapters == {"sql-lora"}
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/completions", json={"model": "sql-lora", "prompt": "hello"}) as r:
                assert r.status == 200, await r.text()
            async with s.post(g.url + "/v1/completions", json={"model": "stray", "prompt": "hello"}) as r:
                assert r.status == 404
        assert [b["model"] for b in seen] == ["sql-lora"]
    finally:
        await g.close()
        await runner.cleanup()


async def test_an_adapter_loaded_on_some_replicas_goes_only_there(tok):
    """Adapters loaded at run time (vLLM /v1/load_lora_adapter) show in the replica's /v1/models:
    found every `lora_discovery_s`, served while a replica lists them, sent only to those."""
    seen: list[dict] = []
    listing_a = [{"id": MODEL, "object": "model", "parent": None}]
    listing_b = [{"id": MODEL, "object": "model", "parent": None}, {"id": "dyn-lora", "object": "model", "parent": MODEL}]
    ra, url_a, _ = await _recording_replica(listing_a, seen, "a")
    rb, url_b, _ = await _recording_replica(listing_b, seen, "b")
    g = await start_gateway(_two_replicas(url_a, url_b, "lora-dyn", 7, 0.1), tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            async def send(model: str, n: int) -> list[int]:
                return await _statuses(s, g.url, model, [f"question {i}?" for i in range(n)])

            async def until(pred) -> None:
                for _ in range(100):
                    if pred():
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("discovery did not catch up")

            assert gw.model.replicas_for("dyn-lora") == {"b"}  # known before the first request (start-up round)
            assert await send("dyn-lora", 6) == [200] * 6
            assert await send(MODEL, 6) == [200] * 6
            assert {b["replica"] for b in seen if b["model"] == "dyn-lora"} == {"b"}
            assert "a" in {b["replica"] for b in seen if b["model"] == MODEL}  # the base model is not held to b
            # b unloads it and a loads it: after the next round, requests for it go to a.
            del listing_b[1:]
            listing_a.append({"id": "dyn-lora", "object": "model", "parent": MODEL})
            await until(lambda: gw.model.replicas_for("dyn-lora") == {"a"})
            seen.clear()
            assert await send("dyn-lora", 4) == [200] * 4
            assert {b["replica"] for b in seen} == {"a"}
            async with s.get(g.admin_url + "/debug/index") as r:
                assert (await r.json())["lora_adapters"] == {"configured": [], "listed": {"a": ["dyn-lora"], "b": []}}
            # Nobody lists it any more: not served.
            del listing_a[1:]
            await until(lambda: "dyn-lora" not in gw.model.served)
            assert await send("dyn-lora", 1) == [404]
    finally:
        await g.close()
        await ra.cleanup()
        await rb.cleanup()


def test_lora_slots_in_the_views():
    """A replica's LoRA slots as the policy sees them: the engine's last report, plus this
    gateway's requests sent there since: generating ones hold their adapter's slot, those without
    a first token want one (unless their adapter holds one)."""
    from gateway.load import LoadTracker
    from gateway.routing import build_views
    from replica_agent.feed.records import LoadReport

    load = LoadTracker()
    reports = {"a": LoadReport(1, 0, 0.1, 0, 0, 100, 16, 0.0, 2, ("x",), ("w",)), "b": LoadReport(0, 0, 0.0, 0, 0, 100, 16, 0.0)}

    def views():
        vs = build_views(["a", "b"], matches={}, available={"a": True, "b": True}, live={}, reports=reports,
                         loads=load.snapshot(), rates={"a": (1e-4, 0.02), "b": (1e-4, 0.02)})
        return {v.replica_id: (v.max_lora, v.lora_running, v.lora_waiting) for v in vs}

    assert views() == {"a": (2, ("x",), ("w",)), "b": (0, (), ())}
    f1, f2 = load.dispatch("a", 10, lora="y"), load.dispatch("a", 10, lora="y")
    load.dispatch("b", 10, lora="y")  # b reports no LoRA slots: nothing to weigh there
    fx = load.dispatch("a", 10, lora="x")  # x already runs there: not waiting
    base = load.dispatch("a", 10)
    assert views() == {"a": (2, ("x",), ("w", "y")), "b": (0, (), ())}
    f1.first_token()  # y generates: it holds a slot
    assert views()["a"] == (2, ("x", "y"), ("w",))
    f1.finish()
    base.finish()
    fx.finish()
    assert views()["a"] == (2, ("x",), ("w", "y"))  # f2 still has no first token
    f2.finish()
    f2.finish()  # idempotent
    assert views()["a"] == (2, ("x",), ("w",))
    late = load.dispatch("a", 10, lora="z")
    load.forget("a")  # the replica left the pool with a request open
    late.first_token()
    late.finish()
    ld = load.get("a")
    assert ld is None or not (ld.inflight_loras or ld.active_loras)


async def test_other_gateways_adapters_reach_the_views():
    """Two gateway processes on one feed: each publishes its requests' adapters per replica with
    its exchange (gateway.background's call), and the other's views count them as its own
    (generating: holding a slot; no first token: wanting one) until that gateway's next exchange
    says they ended; a gateway never reads its own back."""
    import uuid

    from gateway.load import LoadTracker
    from gateway.routing import build_views
    from replica_agent.feed import open_feed
    from replica_agent.feed.records import LoadReport

    url = f"memory://lora-share-{uuid.uuid4().hex[:8]}"
    feeds, loads = [open_feed(url), open_feed(url)], [LoadTracker(), LoadTracker()]
    reports = {"a": LoadReport(1, 0, 0.1, 0, 0, 100, 16, 0.0, 2, ("x",), ())}

    async def exchange(i: int) -> None:
        got = await feeds[i].exchange_inflight(loads[i].take_pending(), loads[i].gauges(0.0), loads[i].adapters())
        loads[i].set_shared({rid: (v.reqs, v.prefill_tokens, v.open_reqs, v.routed_rps, v.size_weight, v.size_tokens,
                                   v.lora_running, v.lora_wanting) for rid, v in got.items()})

    def slots(i: int) -> tuple:
        (v,) = build_views(["a"], matches={}, available={"a": True}, live={}, reports=reports,
                           loads=loads[i].snapshot(), rates={"a": (1e-4, 0.02)})
        return v.max_lora, v.lora_running, v.lora_waiting

    y = loads[0].dispatch("a", 10, lora="y")
    z = loads[0].dispatch("a", 10, lora="z")
    await exchange(0)
    assert slots(1) == (2, ("x",), ())  # not exchanged yet: the engine's report only
    await exchange(1)
    assert slots(1) == (2, ("x",), ("y", "z"))
    y.first_token()
    await exchange(0)
    await exchange(1)
    assert slots(1) == (2, ("x", "y"), ("z",))
    assert loads[0].get("a").others_lora_running == ()  # its own are not read back as another's
    y.finish()
    z.finish()
    await exchange(0)
    await exchange(1)
    assert slots(1) == (2, ("x",), ())
    for f in feeds:
        await f.close()


async def test_an_adapter_goes_where_it_runs_or_a_slot_is_free(tok):
    """Two replicas with one LoRA slot each (as their agents report vllm:lora_requests_info): a
    request for an adapter goes to the one running it, or with its slot free, not to the one whose
    slot another adapter holds (it would wait there for that adapter's requests to finish); the
    base model is not held to either."""
    from replica_agent.feed import open_feed
    from replica_agent.feed.records import FeedEvent, LoadReport

    seen: list[dict] = []
    ra, url_a, _ = await _recording_replica(None, seen, "a")
    rb, url_b, _ = await _recording_replica(None, seen, "b")
    cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                            "membership": {"replicas": [f"a={url_a}", f"b={url_b}"], "health_interval_s": 0.5},
                            "auth": {"enabled": False}, "feed": {"url": "memory://lora-slots"}, "policy": {"seed": 3},
                            "model": {"name": MODEL, "max_model_len": 4096, "lora_adapters": ["sql-lora", "chat-lora"]}},
                           env={})
    g = await start_gateway(cfg, tokenizer=tok)
    gw = g.gateway
    feed = open_feed("memory://lora-slots")

    async def report(slots: dict[str, tuple[str, ...]]) -> None:  # what each replica's agent publishes
        for rid, running in slots.items():
            await feed.publish(rid, [FeedEvent("", 0, "load", load=LoadReport(1, 0, 0.1, 0, 0, 1000, 16, 0.0, 1, running, ()))])
        for _ in range(100):
            if all((r := gw.routing.index.last_load(rid)) is not None and r.lora_running == running
                   for rid, running in slots.items()):
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the reports did not reach the index")

    try:
        async with aiohttp.ClientSession() as s:
            async def send(model: str, n: int) -> set[str]:
                seen.clear()
                for i in range(n):
                    async with s.post(g.url + "/v1/completions", json={"model": model, "prompt": f"question {i}?",
                                                                       "max_tokens": 64}) as r:
                        assert r.status == 200, await r.text()
                return {b["replica"] for b in seen}

            await report({"a": ("chat-lora",), "b": ()})
            assert await send("sql-lora", 6) == {"b"}  # a's one slot is chat-lora's; b's is free
            await report({"a": ("chat-lora",), "b": ("sql-lora",)})
            assert await send("sql-lora", 6) == {"b"} and await send("chat-lora", 6) == {"a"}
            await report({"a": ("sql-lora",), "b": ("chat-lora",)})
            assert await send("sql-lora", 6) == {"a"} and await send("chat-lora", 6) == {"b"}
            assert await send(MODEL, 8) == {"a", "b"}  # the base model takes no LoRA slot
            async with s.get(g.admin_url + "/debug/index") as r:  # what an operator sees
                reps = {x["replica_id"]: x for x in (await r.json())["replicas"]}
            assert reps["a"]["load_report"]["lora_running"] == ["sql-lora"] and reps["a"]["load_report"]["max_lora"] == 1
            assert reps["a"]["lora_reqs"] == {"inflight": {}, "active": {}}  # every request answered
            assert reps["a"]["others_loras"] == {"running": [], "wanting": []}  # no other gateway
    finally:
        await feed.close()
        await g.close()
        await ra.cleanup()
        await rb.cleanup()


async def test_adapter_lookup_is_one_look_at_a_time_and_at_most_one_a_second():
    """A name not served is looked up once for every request waiting on it, and a look that ended
    under MIN_INTERVAL_S ago is not repeated (made-up names cannot flood the replicas)."""
    from gateway.adapters import MIN_INTERVAL_S, AdapterLookup

    m = ModelInfo(MODEL, [], 16, 4096)
    now = [100.0]
    listing: list[str] = []
    gate = asyncio.Event()

    async def refresh():
        await gate.wait()
        m.set_listed("r", listing)

    look = AdapterLookup(m, refresh, clock=lambda: now[0])
    listing.append("late")
    waiters = [asyncio.ensure_future(look.find(n)) for n in ("late", "late", "stray")]
    await asyncio.sleep(0)
    assert look.looks == 1 and not any(w.done() for w in waiters)
    gate.set()
    assert await asyncio.gather(*waiters) == [True, True, False] and look.looks == 1
    assert await look.find("late") and look.looks == 1  # served now: no look
    listing.append("later")
    now[0] += MIN_INTERVAL_S / 2
    assert not await look.find("later") and look.looks == 1  # too soon after the last look
    now[0] += MIN_INTERVAL_S
    assert await look.find("later") and look.looks == 2

    async def broken():
        raise RuntimeError("a bug in the refresh")

    now[0] += MIN_INTERVAL_S
    assert not await AdapterLookup(m, broken, clock=lambda: now[0]).find("other")  # refused, not raised


DOC = " ".join(f"word{i}" for i in range(200))  # a document of many blocks


async def test_an_adapter_loaded_after_the_last_round_is_served_at_once_and_an_unloaded_one_falls_back(tok):
    """An adapter a replica loads between discovery rounds is served from its first request (the
    gateway looks before it refuses); a replica that unloads one answers 404 and the request goes
    to another that lists it, the client sees 200; a made-up name is still refused (404)."""
    seen: list[dict] = []
    listing_a = [{"id": MODEL, "object": "model", "parent": None}]
    listing_b = [{"id": MODEL, "object": "model", "parent": None}]
    ra, url_a, _ = await _recording_replica(listing_a, seen, "a", strict=True)
    rb, url_b, _ = await _recording_replica(listing_b, seen, "b", strict=True)
    g = await start_gateway(_two_replicas(url_a, url_b, "lora-late", 5, 3600), tokenizer=tok)
    gw = g.gateway
    try:
        async with aiohttp.ClientSession() as s:
            async def send(model: str, n: int) -> list[int]:
                return await _statuses(s, g.url, model, [DOC] * n)

            assert "late-lora" not in gw.model.served
            for listing in (listing_a, listing_b):
                listing.append({"id": "late-lora", "object": "model", "parent": MODEL})
            assert await send("late-lora", 1) == [200]  # no discovery round for an hour: looked up
            assert gw.model.replicas_for("late-lora") == {"a", "b"}
            assert await send("made-up", 1) == [404]
            # The replica that served it unloads it (the gateway still has it listed there); the same
            # document again prefers that replica (its speculative entry), which answers 404.
            first = seen[-1]["replica"]
            other = {"a": "b", "b": "a"}[first]
            del {"a": listing_a, "b": listing_b}[first][1:]
            seen.clear()
            assert await send("late-lora", 6) == [200] * 6
            assert [b["replica"] for b in seen if b["status"] == 404] == [first]  # tried there once, then not
            assert {b["replica"] for b in seen if b["status"] == 200} == {other}
            assert gw.model.replicas_for("late-lora") == {other}
    finally:
        await g.close()
        await ra.cleanup()
        await rb.cleanup()
