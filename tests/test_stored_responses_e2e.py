"""Stored Responses through the gateway, end to end (gateway.stored_responses, gateway.response_routes):
simulated replicas that store responses as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1, agents
publishing their KV events, two gateways sharing one feed. A conversation carried on with
`previous_response_id` stays on the replica that holds it, through either gateway, and each turn
is tokenized and predicted as the engine renders it (its stored history first); a stored response
is fetched and cancelled by id on its replica; no tenant reaches another's; what cannot be served
is answered clearly."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.config import config_from_dict
from gateway.server import start_gateway
from replica_agent.feed import open_feed
from tests.conftest import gateway_before_engine, keyed_gateway_config, sims_with_agents
from tests.fault_harness import metric_sum, metrics_text

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "warmroute-sim"
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
DOC = " ".join(f"clause {i} of the lease the tenant signed." for i in range(60))


def _config(d, sims):
    raw = keyed_gateway_config(d, sims, KEYS).to_dict()
    raw["responses"] = {"store": True}
    raw["feed"] = {"url": "memory://stored-e2e"}
    return config_from_dict(raw, env={})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tok, tmp_path_factory):
    feed = open_feed("memory://stored-e2e")
    async with sims_with_agents(2, feed, MODEL, responses_store=True) as sims:
        d = tmp_path_factory.mktemp("stored")
        gws = [await start_gateway(_config(d, sims), feed=feed, tokenizer=tok) for _ in range(2)]
        for _ in range(100):
            if all(gws[0].gateway.index.is_live(f"r{i}") for i in range(2)):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            yield gws, s, sims
        for g in gws:
            await g.close()


def _auth(tenant: str = "tenant-a") -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def _respond(s, g, body: dict, *, tenant: str = "tenant-a", stream: bool = False) -> tuple[dict, str]:
    """(the response object, replica) of one response through gateway `g`."""
    async with s.post(g.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 3, "stream": stream, **body},
                      headers=_auth(tenant)) as r:
        assert r.status == 200, await r.text()
        if stream:
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
            assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
            return events[-1]["response"], r.headers["X-Warmroute-Replica"]
        return await r.json(), r.headers["X-Warmroute-Replica"]


async def _routed(s, g, body: dict, tenant: str = "tenant-a") -> dict:
    """The gateway's decision for `body` (POST /debug/route), not sent."""
    async with s.post(g.admin_url + "/debug/route", params={"tenant": tenant, "kind": "responses"},
                      json={"model": MODEL, **body}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _until_known(s, g, body: dict, blocks: int) -> dict:
    """The decision for `body` once its one candidate's index holds `blocks` of its prefix (the
    engine's KV events of the turn before)."""
    for _ in range(100):
        d = await _routed(s, g, body)
        [view] = d["replicas"]  # a follow-up may go to one replica only
        if view["matched_blocks_gpu"] >= blocks:
            return d
        await asyncio.sleep(0.05)
    raise AssertionError(f"the index never held {blocks} blocks of the history: {d}")


async def _metrics(s, g) -> str:
    return await metrics_text(s, g.admin_url)


async def test_a_conversation_stays_on_its_replica_and_is_predicted_as_the_engine_renders_it(stack):
    (ga, gb), s, _ = stack
    instructions = "You read leases; answer briefly."
    first, home = await _respond(s, ga, {"instructions": instructions, "input": DOC + " Who signed?"})
    assert first["id"].startswith("resp_") and first["output"][0]["content"][0]["text"]
    prev, turns = first, []
    for n, (g, stream) in enumerate([(ga, True), (gb, False), (gb, True), (ga, False)]):  # through either gateway
        body = {"instructions": instructions, "previous_response_id": prev["id"],
                "input": [{"role": "user", "content": f"And clause {n}?"}]}
        # the turn before is a prefix of this one: wait for its blocks in the index
        routed = (await _until_known(s, g, body, prev["usage"]["input_tokens"] // 16))["request"]["prompt_tokens"]
        before = await _metrics(s, g)
        resp, where = await _respond(s, g, body, stream=stream)
        assert where == home, (n, where, home)  # only its replica holds the history
        usage = resp["usage"]
        assert usage["input_tokens"] == routed, n  # the gateway rendered the stored history as the engine did
        after = await _metrics(s, g)
        predicted = metric_sum(after, "warmroute_gateway_predicted_cached_tokens_total") - \
            metric_sum(before, "warmroute_gateway_predicted_cached_tokens_total")
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert cached > 0 and predicted == cached, (n, predicted, cached)
        turns.append(usage["input_tokens"])
        prev = resp
    assert turns == sorted(turns) and len(set(turns)) == len(turns)  # each turn's history longer
    followed = metric_sum(await _metrics(s, ga), "warmroute_gateway_stored_responses_total", event="followed") + \
        metric_sum(await _metrics(s, gb), "warmroute_gateway_stored_responses_total", event="followed")
    assert followed >= 4


async def test_background_responses_are_polled_followed_replayed_and_cancelled_on_their_replica(stack):
    """A background response (the engine answers `queued` and runs on): polled and replayed through
    either gateway from its replica; a follow-up, whose gateway never saw the answer, asks the
    replica for it and renders the history as the engine does; a running one cancelled by id."""
    (ga, gb), s, sims = stack
    queued, home = await _respond(s, ga, {"input": "Summarise in the background. " + DOC, "background": True})
    assert queued["status"] == "queued" and queued["output"] == []
    for _ in range(200):  # asked of the engine itself: no gateway sees the answer
        async with s.get(sims[int(home[1:])].url + f"/v1/responses/{queued['id']}") as r:
            done = await r.json()
        if done["status"] == "completed":
            break
        await asyncio.sleep(0.02)
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"]
    body = {"previous_response_id": queued["id"], "input": "And in one line?"}
    fetched = metric_sum(await _metrics(s, gb), "warmroute_gateway_stored_responses_total", event="answer_fetched")
    routed = (await _until_known(s, gb, body, done["usage"]["input_tokens"] // 16))["request"]["prompt_tokens"]
    before = await _metrics(s, gb)
    resp, where = await _respond(s, gb, body)
    after = await _metrics(s, gb)
    assert where == home and resp["usage"]["input_tokens"] == routed  # the answer fetched, rendered as the engine did
    assert metric_sum(after, "warmroute_gateway_stored_responses_total", event="answer_fetched") > fetched
    predicted = metric_sum(after, "warmroute_gateway_predicted_cached_tokens_total") - \
        metric_sum(before, "warmroute_gateway_predicted_cached_tokens_total")
    assert predicted == resp["usage"]["input_tokens_details"]["cached_tokens"] > 0
    async with s.get(ga.url + f"/v1/responses/{queued['id']}", headers=_auth()) as r:
        assert r.status == 200 and r.headers["X-Warmroute-Replica"] == home and await r.json() == done

    async with s.post(ga.url + "/v1/responses", headers=_auth(), json={"model": MODEL, "input": "Stream it. " + DOC,
                                                                       "max_output_tokens": 3, "background": True, "stream": True}) as r:
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        home = r.headers["X-Warmroute-Replica"]
    rid = events[-1]["response"]["id"]
    async with s.get(gb.url + f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "1"}, headers=_auth()) as r:
        assert r.status == 200 and r.headers["X-Warmroute-Replica"] == home
        assert [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")] == events[2:]

    long, home = await _respond(s, ga, {"input": "Take your time.", "max_output_tokens": 2000, "background": True})
    sim = sims[int(home[1:])]  # replicas r0, r1
    for _ in range(200):
        if sim.engine.num_running:
            break
        await asyncio.sleep(0.01)
    async with s.post(gb.url + f"/v1/responses/{long['id']}/cancel", headers=_auth()) as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled" and r.headers["X-Warmroute-Replica"] == home
    assert sim.engine.num_running == 0


async def test_a_background_response_holds_its_tenants_slot_until_it_ends(stack, tok, tmp_path):
    """A tenant allowed 2 requests at once: two background responses still running (one whose
    streamed client left at its first event) keep both slots and their replica's in-flight count
    after their clients have their answers, so a third request is 429; a cancellation, seen at the
    next poll, frees one (were the holds to end with the answers, the tenant could start any number)."""
    (_, _), s, sims = stack
    raw = _config(tmp_path, sims).to_dict()
    raw["auth"]["tenants"] = {"tenant-a": {"max_concurrent_reqs": 2}}
    raw["responses"]["background_poll_s"] = 0.05
    raw["feed"] = {"url": "memory://stored-e2e-holds"}
    g = await start_gateway(config_from_dict(raw, env={}), tokenizer=tok)
    gw = g.gateway
    long = {"model": MODEL, "input": "Take your time.", "max_output_tokens": 4000, "background": True}
    try:
        a, home = await _respond(s, g, long)
        async with s.post(g.url + "/v1/responses", headers=_auth(), json={**long, "stream": True}) as r:
            assert r.status == 200 and (await r.content.readline()).startswith(b"event: response.created")
            b_home = r.headers["X-Warmroute-Replica"]
        await asyncio.sleep(0.2)  # several polls: both still running
        assert len(gw.pipeline.holds) == 2
        assert sum(gw.routing.load.get(f"r{i}").active_reqs for i in range(2)) == 2
        assert metric_sum(await _metrics(s, g), "warmroute_gateway_background_responses_held") == 2
        async with s.post(g.url + "/v1/responses", headers=_auth(), json={"model": MODEL, "input": "hi"}) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "concurrency_limit_exceeded"
        async with s.post(g.url + f"/v1/responses/{a['id']}/cancel", headers=_auth()) as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
        for _ in range(100):
            if len(gw.pipeline.holds) == 1:
                break
            await asyncio.sleep(0.02)
        assert len(gw.pipeline.holds) == 1 and gw.routing.load.get(home).active_reqs == (1 if home == b_home else 0)
        resp, _ = await _respond(s, g, {"input": "hi"})  # a slot again
        assert resp["status"] == "completed"
        assert metric_sum(await _metrics(s, g), "warmroute_gateway_stored_responses_total", event="background_held") == 2
    finally:
        await g.close()  # releases the streamed one's hold
    assert len(gw.pipeline.holds) == 0
    for sim in sims:  # leave the engines idle for the next test
        for rid in list(sim.server.stored.background):
            async with s.post(sim.url + f"/v1/responses/{rid}/cancel") as r:
                pass


async def test_a_stored_response_is_fetched_and_cancelled_on_its_replica(stack):
    (ga, gb), s, _ = stack
    resp, home = await _respond(s, ga, {"input": "Fetch me later. " + DOC})
    for g in (ga, gb):
        async with s.get(g.url + f"/v1/responses/{resp['id']}", headers=_auth()) as r:
            assert r.status == 200 and r.headers["X-Warmroute-Replica"] == home
            got = await r.json()
        assert got["id"] == resp["id"] and got["output"] == resp["output"]
        async with s.post(g.url + f"/v1/responses/{resp['id']}/cancel", headers=_auth()) as r:
            err = (await r.json())["error"]  # the engine's own answer: not a background response
            assert r.status == 400 and "synchronous" in err["message"] and r.headers["X-Warmroute-Replica"] == home
    text = await _metrics(s, ga)
    assert 'route="/v1/responses/{id}",status="200"' in text and resp["id"] not in text  # the template, never the id


async def test_no_tenant_reaches_another_tenants_response(stack):
    (ga, gb), s, _ = stack
    resp, _ = await _respond(s, ga, {"input": "tenant a's secret plan: " + DOC, "request_id": "resp_chosen"})
    assert resp["id"] != "resp_chosen"  # the gateway names stored responses, never the client
    for g in (ga, gb):
        async with s.post(g.url + "/v1/responses", headers=_auth("tenant-b"),
                          json={"model": MODEL, "input": "go on", "previous_response_id": resp["id"]}) as r:
            err = (await r.json())["error"]
            assert r.status == 404 and err["code"] == "response_not_found" and err["param"] == "previous_response_id"
        async with s.get(g.url + f"/v1/responses/{resp['id']}", headers=_auth("tenant-b")) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
        async with s.get(g.url + f"/v1/responses/{resp['id']}") as r:
            assert r.status == 401
    u, _ = await _respond(s, gb, {"input": "go on", "previous_response_id": resp["id"]})  # its owner still can
    assert u["usage"]["input_tokens_details"]["cached_tokens"] > 0


async def test_what_cannot_be_served_is_answered_clearly(stack):
    (ga, _), s, sims = stack
    async with s.post(ga.url + "/v1/responses", headers=_auth(),
                      json={"model": MODEL, "input": "hi", "previous_response_id": "resp_never"}) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
    unstored, _ = await _respond(s, ga, {"input": "keep nothing", "store": False})
    async with s.post(ga.url + "/v1/responses", headers=_auth(),
                      json={"model": MODEL, "input": "hi", "previous_response_id": unstored["id"]}) as r:
        assert r.status == 404  # `store: false`: nothing recorded
    async with s.delete(ga.url + "/v1/responses/resp_x", headers=_auth()) as r:
        assert r.status == 405 and r.headers["Allow"] == "GET"
    async with s.get(ga.url + "/v1/responses/resp_x/more", headers=_auth()) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_route"
    resp, home = await _respond(s, ga, {"input": "on a replica about to go: " + DOC})
    gw = ga.gateway
    gw.membership.report_failure(home, "test: ejected")  # unavailable for a while
    async with s.post(ga.url + "/v1/responses", headers=_auth(),
                      json={"model": MODEL, "input": "hi", "previous_response_id": resp["id"]}) as r:
        assert r.status == 503 and r.headers["Retry-After"]
    async with s.get(ga.url + f"/v1/responses/{resp['id']}", headers=_auth()) as r:
        assert r.status == 503
    gw.membership.report_success(home)


async def test_a_gateway_not_told_of_the_store_refuses_clearly(stack, tok, tmp_path):
    (ga, _), s, sims = stack
    resp, _ = await _respond(s, ga, {"input": "stored"})
    cfg = keyed_gateway_config(tmp_path, sims, KEYS)
    g = await start_gateway(cfg, feed=open_feed("memory://stored-e2e-off"), tokenizer=tok)
    try:
        async with s.post(g.url + "/v1/responses", headers=_auth(),
                          json={"model": MODEL, "input": "hi", "previous_response_id": resp["id"]}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "unsupported_parameter" and "responses.store" in err["message"]
        async with s.get(g.url + f"/v1/responses/{resp['id']}", headers=_auth()) as r:
            assert r.status == 404 and "store" in (await r.json())["error"]["message"]
    finally:
        await g.close()


async def test_a_replay_that_waits_past_its_last_event_is_504_and_no_ejection(tok):
    """vLLM's replay of a background response (`GET ...?stream=true&starting_after=N`) past its last
    event waits for more, forever: the client gets 504 after `proxy.first_byte_timeout_s`, and the
    replica, which is fine, stays in the pool."""
    async def create(request):
        body = await request.json()
        return web.json_response({"id": body["request_id"], "object": "response", "status": "completed", "output": [],
                                  "usage": {"input_tokens": 3, "output_tokens": 1,
                                            "input_tokens_details": {"cached_tokens": 0}}})

    async def replay(request):
        await asyncio.sleep(30)
        return web.Response()

    routes = {"POST /v1/responses": create, "GET /v1/responses/{rid}": replay}
    async with gateway_before_engine(tok, routes, MODEL, feed={"url": "memory://stored-replay"},
                                     proxy={"first_byte_timeout_s": 0.5}, responses={"store": True}) as g:
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/responses", json={"model": MODEL, "input": "hi"}) as r:
                assert r.status == 200
                rid = (await r.json())["id"]
            async with s.get(g.url + f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "9"}) as r:
                assert r.status == 504 and (await r.json())["error"]["code"] == "upstream_unavailable"
        assert g.gateway.membership.available("u")


async def test_engines_that_store_nothing_are_named_in_a_warning(tok, tmp_path, caplog):
    """A gateway told the engines store responses in front of one that does not (run without
    VLLM_ENABLE_RESPONSES_API_STORE=1): the engine's own 404 reaches the client, each is counted,
    and one warning names the replica and the variable."""
    feed = open_feed("memory://stored-e2e-engine-lost")
    async with sims_with_agents(1, feed, MODEL) as sims:
        g = await start_gateway(_config(tmp_path, sims), feed=feed, tokenizer=tok)
        try:
            async with aiohttp.ClientSession() as s:
                first, home = await _respond(s, g, {"input": "remember me"})
                with caplog.at_level("WARNING", logger="warmroute.gateway.stored_responses"):
                    async with s.post(g.url + "/v1/responses", headers=_auth(),
                                      json={"model": MODEL, "input": "go on", "previous_response_id": first["id"]}) as r:
                        assert r.status == 404 and "not found" in (await r.json())["error"]["message"]
                    async with s.get(g.url + f"/v1/responses/{first['id']}", headers=_auth()) as r:
                        assert r.status == 404 and r.headers["X-Warmroute-Replica"] == home
            assert g.gateway.metrics.stored_responses.labels("engine_lost")._value.get() == 2
            [rec] = [r for r in caplog.records if r.name == "warmroute.gateway.stored_responses"]
            assert home in rec.getMessage() and "VLLM_ENABLE_RESPONSES_API_STORE=1" in rec.getMessage()
        finally:
            await g.close()
