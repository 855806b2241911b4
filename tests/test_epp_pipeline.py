"""warmroute's own picker (the gateway's request pipeline) behind a real Envoy, in front of
simulated replicas whose KV events reach the index through agents: the official `openai` SDK
streams through Envoy; a repeated document is served warm (engine-reported cached tokens) on the
replica that holds it; two tenants never share blocks; a client-sent salt never reaches the
engine; the client's API key is not forwarded; the usage chunk the picker asked for is stripped
when the client did not ask; a refused primary is retried by Envoy and reported failed; bad
requests get OpenAI-shaped errors; a stored response's follow-up goes to its replica, rendered
with its history; and `warmroute epp` runs as a process that stops on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.envoy import EnvoyOptions, EnvoyProcess, bootstrap, find_envoy
from gateway.epp.extproc import Outcome
from gateway.epp.picker import PipelinePicker, endpoint_of
from gateway.epp.server import EppServer
from gateway.server import Gateway
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.feed import open_feed
from tests.conftest import REPO, free_port, keyed_gateway_config, sims_with_agents

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL = "warmroute-sim"
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
DOC = " ".join(f"section {i} of the handbook that every tenant reads." for i in range(80))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tok, tmp_path_factory):
    find_envoy()
    feed = open_feed(f"memory://epp-{uuid.uuid4().hex[:6]}")
    async with sims_with_agents(2, feed, MODEL, responses_store=True) as sims:
        cfg = keyed_gateway_config(tmp_path_factory.mktemp("epp"), sims, KEYS)
        cfg.responses.store = True
        cfg.responses.background_poll_s = 0.05
        gw = Gateway(cfg, feed=feed, tokenizer=tok, api_port=False)
        await gw.start()
        epp = EppServer(PipelinePicker(gw), host="127.0.0.1", port=0)
        picker_port = await epp.start()
        await epp.set_ready(True)
        envoy = EnvoyProcess(bootstrap(EnvoyOptions(0, 0, ("127.0.0.1", picker_port),
                                                    [("127.0.0.1", s.port) for s in sims])), 0)
        await asyncio.to_thread(envoy.start)
        port = envoy.listen_port
        for _ in range(100):
            if all(gw.index.is_live(f"r{i}") for i in range(2)):
                break
            await asyncio.sleep(0.05)
        yield {"gw": gw, "sims": sims, "url": f"http://127.0.0.1:{port}/v1", "epp": epp}
        await asyncio.to_thread(envoy.stop)
        await epp.stop(1)
        await gw.close()


def _client(stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack["url"], api_key=key, max_retries=0, timeout=30)


async def _stream(client, content: str, *, usage: bool = True, **kw):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                  stream=True, max_tokens=4, **extra, **kw)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage_obj = next((c.usage.model_dump() for c in chunks if c.usage is not None), None)
    return text, usage_obj, chunks


async def _until_indexed(gw, n_blocks: int) -> None:
    for _ in range(100):
        if max(gw.index.stats().entries_by_replica.values() or [0]) >= n_blocks:
            return
        await asyncio.sleep(0.05)


async def test_repeat_is_warm_where_the_document_lives_and_tenants_never_share(stack):
    gw = stack["gw"]
    a, b = _client(stack, KEYS["tenant-a"]), _client(stack, KEYS["tenant-b"])
    doc = "warm: " + DOC
    _, u0, _ = await _stream(a, doc)
    assert u0["prompt_tokens_details"]["cached_tokens"] == 0
    await _until_indexed(gw, u0["prompt_tokens"] // 16)
    for _ in range(3):
        _, u, _ = await _stream(a, doc)
        assert u["prompt_tokens_details"]["cached_tokens"] == (u["prompt_tokens"] - 1) // 16 * 16
    _, ub, _ = await _stream(b, doc)  # same text, other tenant: other salt, nothing shared
    assert ub["prompt_tokens_details"]["cached_tokens"] == 0
    # a salt the client sends is replaced: tenant-b cannot reach tenant-a's blocks even with
    # tenant-a's own salt (a document only tenant-a has sent)
    doc2 = "only a: " + DOC
    await _stream(a, doc2)
    await _stream(a, doc2)
    _, uc, _ = await _stream(b, doc2, extra_body={"cache_salt": gw.salter.salt_for("tenant-a")})
    assert uc["prompt_tokens_details"]["cached_tokens"] == 0
    assert gw.metrics._acc and max(gw.metrics._acc.values()) > 0.9  # the picker learned: prediction == engine


async def test_usage_chunk_stripped_unless_asked_and_credentials_not_forwarded(stack):
    client = _client(stack, KEYS["tenant-a"])
    _, usage, chunks = await _stream(client, f"no usage please {uuid.uuid4().hex}", usage=False)
    assert usage is None and all(c.choices for c in chunks)  # the picker asked the engine for usage; the client didn't
    picker = PipelinePicker(stack["gw"])
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stream": true}' % MODEL.encode()
    pick = await picker.pick({":path": "/v1/chat/completions", ":method": "POST", "authorization": f"Bearer {KEYS['tenant-a']}"},
                             body, None)
    assert {"authorization", "x-api-key"} <= set(pick.remove_headers) and pick.strip_usage
    assert b'"include_usage":true' in pick.body and b"cache_salt" in pick.body
    assert pick.endpoints[0] in {endpoint_of(s.url) for s in stack["sims"]}
    picker.observe(pick.ctx, Outcome(
        pick.endpoints[0], 200, None, 0.01, None, 1, 10, False))
    assert stack["gw"].load.get(pick.ctx.replica).inflight_reqs == 0  # observe() ended its in-flight count


async def test_errors_are_openai_shaped_immediate_responses(stack):
    async with httpx.AsyncClient(timeout=10) as h:
        r = await h.post(stack["url"] + "/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = await h.post(stack["url"] + "/chat/completions", headers={"Authorization": f"Bearer {KEYS['tenant-a']}"},
                         json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await h.post(stack["url"] + "/chat/completions", headers={"Authorization": f"Bearer {KEYS['tenant-a']}"},
                         content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_endpoint_names():
    assert endpoint_of("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert endpoint_of("https://vllm-0.vllm:8443/base") == "vllm-0.vllm:8443"
    assert endpoint_of("http://[fd00::1]:8000") == "[fd00::1]:8000"


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


async def test_warmroute_epp_process_becomes_ready_and_stops_on_sigterm(tmp_path):
    sim = await start_sim_server(SimConfig(model=MODEL))
    grpc_port, health_port, admin = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "epp", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                             "--grpc-health-port", str(health_port), "--admin-port", str(admin), "--no-auth",
                             "--replica", f"r0={sim.url}", "--load-only"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = await asyncio.to_thread(_health, health_port, "readiness")
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            await asyncio.sleep(0.25)
        if status != health_pb2.HealthCheckResponse.SERVING:  # say why: the gateway's reasons and the process's log
            why = "admin port not answering"
            try:
                async with httpx.AsyncClient() as h:
                    why = (await h.get(f"http://127.0.0.1:{admin}/readyz", timeout=5)).text
            except httpx.HTTPError:
                pass
            if proc.poll() is None:
                proc.terminate()
            _, err = proc.communicate(timeout=20)
            pytest.fail(f"readiness {status} after 90 s; /readyz: {why}; exit {proc.returncode}; stderr: {err[-3000:]}")
        async with httpx.AsyncClient() as h:
            r = await h.get(f"http://127.0.0.1:{admin}/readyz")
            assert r.status_code == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await sim.close()


async def test_a_primary_envoy_retried_away_from_is_ejected(stack):
    gw = stack["gw"]
    picker = PipelinePicker(gw)
    body = b'{"model": "%s", "prompt": "retry me %s", "max_tokens": 1}' % (MODEL.encode(), uuid.uuid4().hex.encode())
    pick = await picker.pick({":path": "/v1/completions", ":method": "POST", "authorization": f"Bearer {KEYS['tenant-a']}"},
                             body, None)
    primary, fallback = pick.ctx.replica, pick.endpoints[1]
    assert len(pick.endpoints) == 2 and gw.membership.available(primary)
    picker.observe(pick.ctx, Outcome(fallback, 200, None, None, None, 0, 10, False))
    assert not gw.membership.available(primary) and pick.ctx.replica != primary
    gw.membership.get(primary).ejected_until = 0.0  # let the other tests use it again
    gw.membership.report_success(primary)


async def test_a_404_for_an_adapter_the_replica_listed_drops_it_there(stack):
    """Behind Envoy the client gets the engine's 404; the picker learns from it that the replica
    unloaded the adapter, and the next pick of it goes to the replica that still lists it."""
    gw = stack["gw"]
    picker = PipelinePicker(gw)
    for rid in ("r0", "r1"):
        gw.model.set_listed(rid, ["dyn-lora"])
    try:
        body = b'{"model": "dyn-lora", "prompt": "adapter %s", "max_tokens": 1}' % uuid.uuid4().hex.encode()
        headers = {":path": "/v1/completions", ":method": "POST", "authorization": f"Bearer {KEYS['tenant-a']}"}
        pick = await picker.pick(headers, body, None)
        gone = pick.ctx.replica
        picker.observe(pick.ctx, Outcome(pick.endpoints[0], 404, None, None, None, 0, 10, False))
        assert gw.model.replicas_for("dyn-lora") == {"r0", "r1"} - {gone}
        assert gw.membership.available(gone)  # an answer, not a failure
        again = await picker.pick(headers, body, None)
        assert again.ctx.replica != gone and len(again.endpoints) == 1
        picker.observe(again.ctx, Outcome(again.endpoints[0], 200, None, None, None, 0, 10, False))
    finally:
        for rid in ("r0", "r1"):
            gw.model.set_listed(rid, [])


async def test_the_engine_tokenizer_routes_pass_through_envoy(stack):
    """/tokenize and /detokenize through Envoy: admitted as the HTTP gateway admits them, answered by
    a replica untouched, in turn; a refused primary is ejected as a generation request's is."""
    base = stack["url"].removesuffix("/v1")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me, ünïcödé"}]}
    async with httpx.AsyncClient(timeout=10) as h:
        direct = (await h.post(stack["sims"][0].url + "/tokenize", json=body)).json()
        auth = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
        r = await h.post(base + "/tokenize", headers=auth, json=body)
        assert r.status_code == 200 and r.json() == direct, r.text
        r = await h.post(base + "/detokenize", headers=auth, json={"model": MODEL, "tokens": direct["tokens"]})
        assert r.status_code == 200 and "count me, ünïcödé" in r.json()["prompt"], r.text
        r = await h.post(base + "/tokenize", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = await h.post(base + "/v1/embeddings", headers=auth, json={"model": MODEL, "input": "hi"})
        assert r.status_code == 404 and "/tokenize" in r.json()["error"]["message"]
    gw = stack["gw"]
    picker = PipelinePicker(gw)
    headers = {":path": "/tokenize", ":method": "POST", "authorization": f"Bearer {KEYS['tenant-a']}"}
    raw = b'{"prompt": "hello"}'
    picks = [await picker.pick(headers, raw, None) for _ in range(2)]
    assert {p.ctx.replica for p in picks} == {"r0", "r1"} and all(p.body == raw and len(p.endpoints) == 2 for p in picks)
    picker.observe(picks[0].ctx, Outcome(picks[0].endpoints[0], 200, None, None, None, 0, 10, False))
    primary = picks[1].ctx.replica
    picker.observe(picks[1].ctx, Outcome(picks[1].endpoints[1], 200, None, None, None, 0, 10, False))
    assert not gw.membership.available(primary)
    gw.membership.get(primary).ejected_until = 0.0  # let the other tests use it again
    gw.membership.report_success(primary)


async def test_the_responses_api_streams_through_envoy_warm_where_it_lives(stack):
    """/v1/responses behind Envoy: the picker renders it as the engine does (a repeat is predicted
    exactly and served warm) and reads its usage and end from the stream's named events."""
    gw = stack["gw"]
    client = _client(stack, KEYS["tenant-a"])
    body = {"model": MODEL, "instructions": "responses via envoy " + DOC, "input": "Which section?",
            "max_output_tokens": 3}
    first = await client.responses.create(**body)
    await _until_indexed(gw, first.usage.input_tokens // 16)
    stream = await client.responses.create(**body, stream=True)
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    usage = events[-1].response.usage
    assert usage.input_tokens == first.usage.input_tokens
    assert usage.input_tokens_details.cached_tokens == (usage.input_tokens - 1) // 16 * 16
    async with httpx.AsyncClient(timeout=10) as h:
        text = (await h.get(gw.admin_url + "/metrics")).text
    assert 'route="/v1/responses",status="200"' in text
    assert any(ln.startswith("warmroute_gateway_index_accuracy_ratio") and ln.endswith(" 1.0") for ln in text.splitlines())


async def test_a_follow_up_goes_to_its_stored_responses_replica_rendered_with_its_history(stack):
    """`previous_response_id` behind Envoy: the picker recorded the first response on its replica,
    picks that replica only for the follow-up, and renders the stored history (the answer, which
    the picker does not read, asked of that replica), so the follow-up is predicted exactly; the
    response fetched and cancelled by id there; another tenant told it does not exist."""
    gw = stack["gw"]
    client = _client(stack, KEYS["tenant-a"])
    instructions = "stored via envoy " + DOC
    first = await client.responses.create(model=MODEL, instructions=instructions, input="Which section first?",
                                          max_output_tokens=3)
    await _until_indexed(gw, first.usage.input_tokens // 16)
    m = gw.metrics

    def counted() -> tuple[float, float, float, float]:
        return (m.stored_responses.labels("answer_fetched")._value.get(),
                sum(m.predicted_cached.labels(f"r{i}")._value.get() for i in range(2)),
                sum(m.engine_cached.labels(f"r{i}")._value.get() for i in range(2)),
                sum(m.requests.labels("/v1/responses", "200", f"r{i}")._value.get() for i in range(2)))

    before = counted()
    for _ in range(2):
        follow = await client.responses.create(model=MODEL, instructions=instructions, previous_response_id=first.id,
                                               input="And then?", max_output_tokens=3)
        assert follow.usage.input_tokens > first.usage.input_tokens
        assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    for _ in range(100):  # the picker learns once Envoy reports the answer's end
        fetched, predicted, engine, done = (b - a for a, b in zip(before, counted()))
        if done == 2:
            break
        await asyncio.sleep(0.05)
    assert fetched == 1  # asked of its replica once, then kept
    assert predicted == engine > 0  # the follow-ups predicted exactly: their history rendered as the engine did
    other = _client(stack, KEYS["tenant-b"])
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(model=MODEL, previous_response_id=first.id, input="Mine now?", max_output_tokens=2)
    # by id, through Envoy, to the replica that holds it (the other one would answer 404)
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    with pytest.raises(openai.BadRequestError, match="synchronous"):  # the engine's own answer: not a background one
        await client.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(first.id)
    async with httpx.AsyncClient(timeout=10) as h:
        r = await h.delete(stack["url"] + f"/responses/{first.id}", headers={"Authorization": f"Bearer {KEYS['tenant-a']}"})
    assert r.status_code == 405 and r.headers["allow"] == "GET"


async def test_a_background_response_behind_envoy_is_held_until_its_engine_ends_it(stack):
    """A background response through Envoy is answered `queued` at once and runs on: the picker
    (which reads no answer) keeps its replica's in-flight count until the engine says it is done,
    then records its answer, so a follow-up needs not ask the replica for it."""
    gw = stack["gw"]
    client = _client(stack, KEYS["tenant-a"])
    m = gw.metrics
    fetched = m.stored_responses.labels("answer_fetched")._value.get()
    queued = await client.responses.create(model=MODEL, input="In the background: " + DOC, max_output_tokens=40,
                                           background=True)
    assert queued.status == "queued"
    for _ in range(100):  # Envoy reports the (queued) answer's end to the picker
        if len(gw.pipeline.holds) == 1:
            break
        await asyncio.sleep(0.01)
    assert len(gw.pipeline.holds) == 1 and sum(gw.routing.load.get(f"r{i}").active_reqs for i in range(2)) == 1
    for _ in range(300):
        if not len(gw.pipeline.holds):
            break
        await asyncio.sleep(0.02)
    assert len(gw.pipeline.holds) == 0 and sum(gw.routing.load.get(f"r{i}").active_reqs for i in range(2)) == 0
    done = await client.responses.retrieve(queued.id)
    assert done.status == "completed" and done.usage.output_tokens == 40
    follow = await client.responses.create(model=MODEL, previous_response_id=queued.id, input="Shorter?", max_output_tokens=2)
    assert follow.usage.input_tokens > done.usage.input_tokens + 40
    assert m.stored_responses.labels("answer_fetched")._value.get() == fetched  # the watch recorded the answer
