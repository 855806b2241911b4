"""The gateway end to end over real HTTP: the official `openai` SDK through the gateway to simulated
replicas (loadtests.sim), the salt contract at the engine, retry before the first byte, client
disconnects, the decision trace, /metrics, and the debug routes."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.config import config_from_dict
from gateway.routing import SHARE_MIN_NEW_BLOCKS
from gateway.salt import derive_salt
from gateway.server import start_gateway
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from tests.conftest import serve_app, serve_chat, sims_with_agents
from tests.fault_harness import metrics_text
from tests.flow_helpers import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = "test-salt-secret-e2e"
KEYS = {"tenant-a": ["key-a-1", "key-a-2"], "tenant-b": ["key-b"]}
MODEL = "warmroute-sim"
LONG_DOC = " ".join(f"paragraph {i} of the shared document about routing." for i in range(60))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.yaml"
    p.write_text("".join(f"{t}: [{', '.join(ks)}]\n" for t, ks in KEYS.items()))
    return str(p)


def _cfg(replicas, keys_file=None, **over):
    d = {
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": replicas, "health_interval_s": 0.2, "eject_base_s": 5.0},
        "auth": {"enabled": keys_file is not None, "api_keys_file": keys_file},
        "feed": {"url": "memory://e2e"},
    }
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return config_from_dict(d, env={})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims():
    a = await start_sim_server(SimConfig(model=MODEL))
    b = await start_sim_server(SimConfig(model=MODEL))
    yield a, b
    await a.close()
    await b.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(sims, tok, keys_file, monkeypatch_module):
    monkeypatch_module.setenv("WARMROUTE_SALT_SECRET", SECRET)
    g = await start_gateway(_cfg([f"a={sims[0].url}", f"b={sims[1].url}"], keys_file), tokenizer=tok)
    yield g
    await g.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


async def test_openai_sdk_streams_chat_and_completions(gw):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="key-a-1", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello " * 20}], max_tokens=8, stream=True)
        chunks = [c async for c in stream]
        text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert text.strip(), "streamed chat produced no text"
        # The gateway asked for usage upstream for itself; the client did not, so it sees none.
        assert all(c.usage is None for c in chunks)

        stream = await client.completions.create(model=MODEL, prompt="Once upon a time " * 10, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens > 0

        full = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert full.choices[0].message.content and full.usage.completion_tokens == 4
    finally:
        await client.close()


async def _chat(session, url, key, content, salt=None, stream=False):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if salt is not None:
        body["cache_salt"] = salt
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["usage"], r.headers["X-Warmroute-Replica"]
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:])["usage"] or usage
        return usage, r.headers["X-Warmroute-Replica"]


async def test_engine_sees_derived_salt_not_clients(tok, keys_file, monkeypatch_module):
    """One real sim behind the gateway: the client's cache_salt has no effect, the tenant's does."""
    monkeypatch_module.setenv("WARMROUTE_SALT_SECRET", SECRET)
    sim = await start_sim_server(SimConfig(model=MODEL))
    g = await start_gateway(_cfg([f"only={sim.url}"], keys_file), tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            doc = "salt check: " + LONG_DOC
            u1, _ = await _chat(s, g.url, "key-a-1", doc, salt="client-salt-x")
            assert u1["prompt_tokens_details"]["cached_tokens"] == 0
            # Same tenant, another key and another client salt: the engine still hits (same derived salt).
            u2, _ = await _chat(s, g.url, "key-a-2", doc, salt="client-salt-y")
            assert u2["prompt_tokens_details"]["cached_tokens"] >= (u2["prompt_tokens"] // 16 - 1) * 16 > 0
            # Another tenant sending tenant A's exact request (even its client salt) gets nothing cached.
            u3, _ = await _chat(s, g.url, "key-b", doc, salt="client-salt-x")
            assert u3["prompt_tokens_details"]["cached_tokens"] == 0
            # A client salt that vLLM would reject (contains '/') is irrelevant: it is replaced.
            u4, _ = await _chat(s, g.url, "key-b", doc, salt="bad/salt@", stream=True)
            assert u4["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        await g.close()
        await sim.close()


class Recorder:
    """A tiny upstream that records request bodies and headers and answers like vLLM (non-stream)."""

    def __init__(self, status: int = 200):
        self.status = status
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.runner = None
        self.url = ""

    async def start(self):
        app = web.Application()

        async def chat(request):
            self.bodies.append(await request.json())
            self.headers.append(dict(request.headers))
            if self.status != 200:
                return web.json_response({"error": {"message": "boom"}}, status=self.status)
            return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                                                "prompt_tokens_details": {"cached_tokens": 0}}})

        async def health(request):
            return web.Response(status=200)

        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        self.runner, self.url = await serve_app(app)
        return self

    async def close(self):
        await self.runner.cleanup()


async def test_exact_salt_and_trace_with_every_candidate(tok, keys_file, monkeypatch_module):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch_module.setenv("WARMROUTE_SALT_SECRET", SECRET)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    r1, r2 = await Recorder().start(), await Recorder().start()
    g = await start_gateway(_cfg([f"r1={r1.url}", f"r2={r2.url}"], keys_file, model={"name": MODEL, "max_model_len": 4096}),
                            tokenizer=tok, tracer_provider=provider)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_DOC}], "cache_salt": "mine"}
            async with s.post(g.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-b"}) as r:
                assert r.status == 200
        got = (r1.bodies + r2.bodies)
        assert len(got) == 1
        assert got[0]["cache_salt"] == derive_salt(SECRET.encode(), "tenant-b")
        assert len(got[0]["cache_salt"]) == 43
        hdrs = (r1.headers + r2.headers)[0]
        assert "Authorization" not in hdrs, "the client's credential must not reach the engine"
        spans = {sp.name: sp for sp in exporter.get_finished_spans()}
        server = spans[f"chat {MODEL}"]
        route = spans["warmroute.route"]
        upstream = spans["warmroute.upstream"]
        assert server.attributes["gen_ai.operation.name"] == "chat"
        assert server.attributes["gen_ai.request.model"] == MODEL
        assert server.attributes["gen_ai.usage.input_tokens"] == 10
        assert server.attributes["warmroute.tenant_hash"] != "tenant-b"
        assert route.parent.span_id == server.context.span_id
        cands = [e for e in route.events if e.name == "warmroute.candidate"]
        assert sorted(e.attributes["warmroute.replica_id"] for e in cands) == ["r1", "r2"]
        for e in cands:
            assert "warmroute.score" in e.attributes and "warmroute.term.cache_benefit_s" in e.attributes
            assert "warmroute.term.queue_penalty_s" in e.attributes and "warmroute.matched_blocks_gpu" in e.attributes
        assert route.attributes["warmroute.winner"] in ("r1", "r2") and route.attributes["warmroute.decision_s"] > 0
        assert "warmroute.ttft_s" in upstream.attributes
        # W3C traceparent forwarded: the engine's request belongs to the same trace, parented by the upstream span.
        tp = hdrs["traceparent"].split("-")
        assert int(tp[1], 16) == server.context.trace_id and int(tp[2], 16) == upstream.context.span_id
    finally:
        await g.close()
        await r1.close()
        await r2.close()


def _dead_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


async def test_retry_before_first_byte(sims, tok):
    """A refused connection and a 503 are retried on the next-ranked replica; the client sees 200."""
    failing = await Recorder(status=503).start()
    dying = await Recorder().start()  # passes the first health probe, then goes away
    g = await start_gateway(_cfg([f"dead={dying.url}", f"err={failing.url}", f"ok={sims[0].url}"],
                                 policy={"name": "round_robin"}, proxy={"max_attempts": 3},
                                 membership={"health_interval_s": 30.0}), tokenizer=tok)
    await asyncio.sleep(0.2)
    assert g.gateway.membership.get("dead").probe_ok is True
    await dying.close()
    try:
        async with aiohttp.ClientSession() as s:
            for stream in (False, True) * 3:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 3, "stream": stream}
                async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Warmroute-Replica"] == "ok"
                    data = await r.read()
                    assert (b"[DONE]" in data) if stream else (b'"choices"' in data)
            async with s.get(g.admin_url + "/metrics") as r:
                text = await r.text()
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families(text)}
        retries = sum(smp.value for smp in fams["warmroute_gateway_retries"].samples if smp.name.endswith("_total"))
        assert retries >= 2
        ejected = {smp.labels["replica"] for smp in fams["warmroute_gateway_ejections"].samples if smp.name.endswith("_total")}
        assert {"dead", "err"} <= ejected
        assert failing.bodies, "the 503 replica was tried"
        st = g.gateway.membership.get("dead")
        assert st.failures >= 1 and st.last_error == "connection refused"
    finally:
        await g.close()
        await failing.close()


async def test_all_replicas_down_is_503(tok):
    g = await start_gateway(_cfg([f"dead={'http://127.0.0.1:%d' % _dead_port()}"], model={"name": MODEL, "max_model_len": 4096},
                                 membership={"health_interval_s": 0.05}), tokenizer=tok)
    try:
        await asyncio.sleep(0.3)  # the probe marks it down
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                assert r.status == 503
                err = (await r.json())["error"]
                assert err["code"] == "no_replica_available" and err["type"]
            async with s.get(g.admin_url + "/readyz") as r:
                assert r.status == 503 and "no replica available" in (await r.json())["reasons"]
    finally:
        await g.close()


async def test_client_disconnect_cancels_upstream(tok):
    slow = SimConfig(model=MODEL, time=TimeModel(step_overhead_s=0.02, prefill_s_per_token=1e-5, decode_s_per_seq=1e-4))
    sim = await start_sim_server(slow)
    g = await start_gateway(_cfg([f"s={sim.url}"]), tokenizer=tok)
    try:
        before = sim.server.num_aborted_total
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "stream": True}
            r = await s.post(g.url + "/v1/completions", json=body)
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            r.close()  # the client goes away mid-stream
        for _ in range(100):
            if sim.server.num_aborted_total > before:
                break
            await asyncio.sleep(0.05)
        assert sim.server.num_aborted_total == before + 1
        assert sim.engine.num_running == 0
        for _ in range(50):
            if g.gateway.load.get("s").active_reqs == 0:
                break
            await asyncio.sleep(0.02)
        assert g.gateway.load.get("s").active_reqs == 0 and g.gateway.load.get("s").inflight_reqs == 0
        async with aiohttp.ClientSession() as s:
            async with s.get(g.admin_url + "/metrics") as r:
                text = await r.text()
        assert 'warmroute_gateway_requests_total{replica="s",route="/v1/completions",status="499"} 1.0' in text, \
            [ln for ln in text.splitlines() if ln.startswith("warmroute_gateway_requests_total")]
    finally:
        await g.close()
        await sim.close()


async def test_metrics_debug_and_health(gw):
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s:
        for _ in range(3):  # two replicas: at least two of three land on the same one and hit its cache
            await _chat(s, gw.url, "key-b", "metrics " + LONG_DOC)
        async with s.get(gw.admin_url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        async with s.post(gw.admin_url + "/debug/route?tenant=tenant-b",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "metrics " + LONG_DOC}]}) as r:
            assert r.status == 200
            why = await r.json()
        async with s.get(gw.admin_url + "/debug/index") as r:
            idx = await r.json()
        async with s.get(gw.admin_url + "/healthz") as r:
            assert r.status == 200
        async with s.get(gw.admin_url + "/readyz") as r:
            assert r.status == 200, await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("warmroute_gateway_requests", "warmroute_gateway_decision_seconds", "warmroute_gateway_ttft_seconds",
                 "warmroute_gateway_request_duration_seconds", "warmroute_gateway_engine_cached_tokens",
                 "warmroute_gateway_predicted_cached_tokens", "warmroute_gateway_index_accuracy_ratio",
                 "warmroute_gateway_index_entries", "warmroute_gateway_index_bytes", "warmroute_gateway_prefill_seconds_per_token",
                 "warmroute_gateway_replica_up", "warmroute_gateway_retries", "warmroute_gateway_ejections"):
        assert name in fams, name
    ok = [smp for smp in fams["warmroute_gateway_requests"].samples
          if smp.name.endswith("_total") and smp.labels["status"] == "200" and smp.labels["route"] == "/v1/chat/completions"]
    assert sum(smp.value for smp in ok) >= 2
    # The second identical request hit the engine's cache; the engine's count is what the metric holds.
    cached = sum(smp.value for smp in fams["warmroute_gateway_engine_cached_tokens"].samples if smp.name.endswith("_total"))
    assert cached > 0
    # Tenants appear hashed, never in clear.
    assert "tenant-b" not in text and "tenant-a" not in text
    assert why["winner"] in ("a", "b") and {r["replica_id"] for r in why["replicas"]} == {"a", "b"}
    for rep in why["replicas"]:
        assert rep["terms"] is not None and "cache_benefit_s" in rep["terms"] and rep["score"] is not None
    assert why["request"]["full_blocks"] > 0
    assert {r["replica_id"] for r in idx["replicas"]} == {"a", "b"}
    assert idx["index"]["max_entries"] > 0


async def test_keepalive_connection_has_no_nagle_delay(gw):
    """TCP_NODELAY on accepted sockets: back-to-back streamed requests on one keep-alive connection stay fast."""
    import time

    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as s:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True}
            async with s.post(gw.url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-a-1"}) as r:
                await r.content.readline()
                times.append(time.perf_counter() - t)
                await r.read()
    # Nagle + delayed ACK would add ~40 ms from the second request on.
    assert sorted(times[1:])[len(times[1:]) // 2] < 0.035, times


async def test_dns_membership_and_purge_on_leave(sims, tok):
    """Headless-Service style membership: A records of a name (here `localhost`) become replicas
    "IP:port"; a replica that leaves is purged from the index."""
    port = sims[0].port
    g = await start_gateway(_cfg([], membership={"dns_service": "localhost", "dns_port": port, "dns_refresh_s": 0.2}),
                            tokenizer=tok)
    try:
        rid = f"127.0.0.1:{port}"
        assert g.gateway.membership.ids() == [rid]
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": LONG_DOC, "max_tokens": 2}
            async with s.post(g.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["X-Warmroute-Replica"] == rid
        keys = g.gateway.keychain.request_keys(tok.encode_prompt(LONG_DOC), salt=g.gateway.salter.salt_for("default"))
        assert rid in g.gateway.index.match(keys)  # the speculative entry of the chosen replica
        # The Service's endpoints change (pod replaced): the old replica leaves and is purged.
        g.gateway.mrunner.dns_port = sims[1].port
        new = f"127.0.0.1:{sims[1].port}"
        for _ in range(50):
            await asyncio.sleep(0.1)
            if g.gateway.membership.ids() == [new]:
                break
        assert g.gateway.membership.ids() == [new]
        assert rid not in g.gateway.index.match(keys)
    finally:
        await g.close()


async def test_access_log_is_one_json_line_without_secrets_or_prompts(sims, tok, keys_file, monkeypatch_module, caplog):
    import logging

    from gateway.telemetry import JsonFormatter

    monkeypatch_module.setenv("WARMROUTE_SALT_SECRET", SECRET)
    g = await start_gateway(_cfg([f"a={sims[0].url}"], keys_file, telemetry={"access_log": True}), tokenizer=tok)
    try:
        with caplog.at_level(logging.INFO, logger="warmroute.gateway.access"):
            async with aiohttp.ClientSession() as s:
                await _chat(s, g.url, "key-a-1", "SECRET-PROMPT-TEXT " + LONG_DOC)
        recs = [r for r in caplog.records if r.name == "warmroute.gateway.access"]
        assert len(recs) == 1
        line = JsonFormatter().format(recs[0])
        obj = json.loads(line)
        assert obj["status"] == 200 and obj["replica"] == "a" and obj["route"] == "/v1/chat/completions"
        assert obj["tenant_hash"] == __import__("gateway.auth", fromlist=["x"]).tenant_hash("tenant-a")
        for secret in ("SECRET-PROMPT-TEXT", "key-a-1", "tenant-a", SECRET):
            assert secret not in line
    finally:
        await g.close()


class BrokenStream:
    """An upstream whose streams send one event, then stall (`mode="stall"`) or drop the connection."""

    def __init__(self, mode: str):
        self.mode = mode
        self.runner = None
        self.url = ""

    async def start(self):
        app = web.Application()

        async def chat(request):
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
            if self.mode == "stall":
                await asyncio.sleep(30)
            else:
                await asyncio.sleep(0.05)
                request.transport.close()
            return resp

        async def health(request):
            return web.Response()

        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        self.runner, self.url = await serve_app(app, shutdown_timeout=0.1)
        return self

    async def close(self):
        await self.runner.cleanup()


@pytest.mark.parametrize("mode", ["stall", "drop"])
async def test_failure_after_first_byte_ends_stream_with_error_event(tok, mode):
    up = await BrokenStream(mode).start()
    g = await start_gateway(_cfg([f"u={up.url}"], model={"name": MODEL, "max_model_len": 4096},
                                 proxy={"idle_timeout_s": 0.4}), tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                data = await asyncio.wait_for(r.read(), 10)
        events = [e for e in data.split(b"\n\n") if e]
        assert events[0].startswith(b'data: {"choices"')
        err = json.loads(events[-2][6:])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "upstream_failed"
        assert events[-1] == b"data: [DONE]"
        if mode == "stall":
            assert "nothing for 0.4s" in err["message"]
    finally:
        await g.close()
        await up.close()


@pytest.mark.redis
async def test_gateways_share_inflight_load_through_redis(tok, redis_server):
    """Two gateways on one Redis feed: work one sends a replica shows in the other's view of it."""
    release = asyncio.Event()

    async def hold(body):
        await release.wait()  # no first byte until released: the request stays "in flight"

    runner, url = await serve_chat(hold)
    over = {"model": {"name": MODEL, "max_model_len": 4096}, "feed": {"url": redis_server.url, "inflight_poll_s": 0.05}}
    g1 = await start_gateway(_cfg([f"r={url}"], **over), tokenizer=tok)
    g2 = await start_gateway(_cfg([f"r={url}"], **over), tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_DOC}]}
            pending = asyncio.create_task(s.post(g1.url + "/v1/chat/completions", json=body))
            seen = None
            for _ in range(100):
                await asyncio.sleep(0.05)
                ld = g2.gateway.load.get("r")
                if ld.others_reqs:
                    seen = (ld.others_reqs, ld.others_tokens)
                    break
            assert seen is not None and seen[0] == 1 and seen[1] > 100, seen
            # g2's routing view of the replica includes g1's in-flight request, and g1's dispatch
            # gauges: its routed rate and the request's uncached size (g2 has sent nothing there)
            views = g2.gateway.routing.views(["r"], [], {"r": True})
            assert views[0].inflight_reqs == 1
            assert views[0].routed_rps > 0 and views[0].mean_uncached_prefill_tokens == pytest.approx(seen[1], rel=0.01)
            assert g2.gateway.load.routed_rps("r", time.monotonic()) == 0.0
            async with s.get(g2.admin_url + "/debug/index") as r:  # and an operator sees both
                rep = next(x for x in (await r.json())["replicas"] if x["replica_id"] == "r")
            assert rep["routed_rps"] == 0.0 and rep["pool_routed_rps"] > 0
            assert rep["pool_mean_uncached_tokens"] == pytest.approx(seen[1], rel=0.01)
            # and g1's copy in progress (the document is new to r): g2, which routed nothing, holds
            # its blocks speculatively on r until the engine's events would say so
            for _ in range(40):
                if g2.gateway.routing.index.stats().speculative_entries:
                    break
                await asyncio.sleep(0.05)
            assert g2.gateway.routing.index.stats().speculative_entries >= SHARE_MIN_NEW_BLOCKS
            assert g2.gateway.readiness() == (True, []), g2.gateway.readiness()  # the exchange counts as healthy
            release.set()
            r = await pending
            assert r.status == 200
            r.release()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if g2.gateway.load.get("r").others_reqs == 0:
                    break
            assert g2.gateway.load.get("r").others_reqs == 0
    finally:
        await g1.close()
        await g2.close()
        await runner.cleanup()


@pytest.mark.redis
async def test_gateways_share_the_plans_placements_through_redis(tok, redis_server):
    """Two cache_plan gateways on one Redis feed: a planned request through one counts in the
    other's plan (its root and the replica it went to), so each plan measures the whole stream."""
    from replica_agent.feed import open_feed
    from replica_agent.feed.records import FeedEvent, LoadReport

    runner, url = await serve_chat()
    over = {"model": {"name": MODEL, "max_model_len": 4096}, "feed": {"url": redis_server.url, "inflight_poll_s": 0.05},
            "policy": {"name": "cache_plan"}}
    g1 = await start_gateway(_cfg([f"r={url}", f"q={url}"], **over), tokenizer=tok)
    g2 = await start_gateway(_cfg([f"r={url}", f"q={url}"], **over), tokenizer=tok)
    try:
        p1, p2 = g1.gateway.policy, g2.gateway.policy
        # the replicas' feeds are live (a load report each, as an agent sends): their matches count
        feed = open_feed(redis_server.url)
        for rid in ("r", "q"):
            await feed.publish(rid, [FeedEvent("", 0, "load", load=LoadReport(0, 0, 0.0, 0, 0, 0, 16, 0.0))])
        await feed.close()
        for _ in range(100):
            if all(g.gateway.routing.index.is_live(rid) for g in (g1, g2) for rid in ("r", "q")):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            for question in ("first?", "second?", "third?"):  # the first is new (unplanned); the others extend it
                body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_DOC + " " + question}]}
                async with s.post(g1.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
        assert p1._now == 2 and len(p1._groups) == 1
        for _ in range(100):
            if p2._now >= 2:
                break
            await asyncio.sleep(0.05)
        assert p2._now == 2 and set(p2._groups) == set(p1._groups)  # g2 routed nothing, yet plans the same root
        assert {r: p2.load_share(r) for r in ("r", "q")} == pytest.approx({r: p1.load_share(r) for r in ("r", "q")})
        assert p1._now == 2  # and its own records never came back to g1
        async with aiohttp.ClientSession() as s:  # what an operator sees of the trade
            for g, want in ((g1, {"sent": 2, "applied": 0, "skipped": 0}), (g2, {"sent": 0, "applied": 2, "skipped": 0})):
                async with s.get(g.admin_url + "/debug/index") as r:
                    assert (await r.json())["placements"] == want
    finally:
        await g1.close()
        await g2.close()
        await runner.cleanup()


async def test_embedded_agents_feed_drive_cache_aware_routing(tok):
    """Sims publish KV events, agents translate them into the in-process feed, the gateway's index
    follows it: repeats of a document go to the replica holding it, and the engine's cached tokens
    equal the index's prediction (accuracy 1.0)."""
    from replica_agent.feed import open_feed

    feed = open_feed("memory://e2e-agents")
    async with sims_with_agents(2, feed, MODEL) as sims_:
        g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims_)]), feed=feed, tokenizer=tok)
        try:
            for _ in range(100):
                if all(g.gateway.index.is_live(f"r{i}") for i in range(2)):
                    break
                await asyncio.sleep(0.05)
            assert all(g.gateway.index.is_live(f"r{i}") for i in range(2))
            doc = "embedded: " + LONG_DOC
            async with aiohttp.ClientSession() as s:
                u0, first = await _chat(s, g.url, "-", doc, stream=True)
                for _ in range(100):  # the engine's BlockStored events reach the index
                    if g.gateway.index.stats().entries_by_replica.get(first, 0) >= u0["prompt_tokens"] // 16:
                        break
                    await asyncio.sleep(0.05)
                for _ in range(3):
                    u, rid = await _chat(s, g.url, "-", doc, stream=True)
                    assert rid == first
                    assert u["prompt_tokens_details"]["cached_tokens"] == (u["prompt_tokens"] - 1) // 16 * 16
            async with aiohttp.ClientSession() as s:
                async with s.get(g.admin_url + "/metrics") as r:
                    text = await r.text()
            assert f'warmroute_gateway_index_accuracy_ratio{{replica="{first}"}} 1.0' in text
            assert f'warmroute_gateway_replica_index_live{{replica="{first}"}} 1.0' in text
        finally:
            await g.close()


async def test_a_chat_with_images_is_routed_by_the_text_before_them(tok):
    """Multi-modal simulated replicas (an image is a placeholder keyed by its content, first in its
    message, as vLLM places and keys it): the gateway keys the text before a request's first image,
    so a question about a new image with a system prompt one replica holds goes there and finds
    that prompt cached; it predicts nothing for it (the rest is the engine's processor's), so the
    index accuracy counts no image request. Before, the gateway refused every image with 400. The
    tokens it routes on (the decision span's `warmroute.prompt_tokens`, the load it brings) are its
    ids, the text after the image and what the answers said an image takes: a question about an
    image counts the engine's prompt to a token or two (the sims' placeholders name a digest of each
    image, of varying length), where the ids and one token, as before, fall short by the text and
    the image."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from replica_agent.feed import open_feed

    feed = open_feed("memory://e2e-media")
    system = "system prompt of the image desk: " + LONG_DOC
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with sims_with_agents(2, feed, MODEL, multimodal=True) as sims_:
        g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims_)], model={"tokenize_check_s": 0.001}),
                                feed=feed, tokenizer=tok, tracer_provider=provider)
        try:
            await until(lambda: all(g.gateway.index.is_live(f"r{i}") for i in range(2)), timeout_s=5.0)
            async with aiohttp.ClientSession() as s:
                async def ask(content):
                    body = {"model": MODEL, "max_tokens": 2, "messages": [
                        {"role": "system", "content": system}, {"role": "user", "content": content}]}
                    async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        out = (await r.json())["usage"], r.headers["X-Warmroute-Replica"]
                    await until(lambda: not g.gateway.tokenize_checker._tasks, timeout_s=5.0)  # its tokenizer check done
                    return out

                u0, home = await ask("a text question first")
                await until(lambda: g.gateway.index.stats().entries_by_replica.get(home, 0) >= u0["prompt_tokens"] // 16,
                            timeout_s=5.0)
                # the tokens before the user's content: what an image request shares with the first
                rendered = tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": "\u2603"}])
                shared = len(tok.encode_prompt(rendered[:rendered.index("\u2603")], add_special_tokens=False))
                before = _accuracy_lines(await metrics_text(s, g.admin_url))
                assert len(before) == 4, before  # predicted and engine-reported: _total and _created
                for i in range(3):
                    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,IMAGE{i}"}}
                    u, rid = await ask([{"type": "text", "text": "what is in it?"}, image])
                    assert rid == home, (i, rid, home)
                    assert u["prompt_tokens_details"]["cached_tokens"] == shared // 16 * 16 > 0, (u, shared)
                exporter.clear()
                u, _ = await ask([{"type": "text", "text": "and what colour is it?"}, image])  # the last image again
                routed = [sp for sp in exporter.get_finished_spans() if sp.name == "warmroute.route"]
                assert len(routed) == 1 and abs(routed[0].attributes["warmroute.prompt_tokens"] - u["prompt_tokens"]) <= 2, u
                assert u["prompt_tokens"] - (shared + 1) > 20, (u, shared)  # what it routed on before
                learned = g.gateway.pipeline.media_tokens.per_item
                assert 0 < learned < 100 and f"warmroute_gateway_media_item_tokens {learned}" in await metrics_text(s, g.admin_url)
                # the Responses API's input_image the same way
                body = {"model": MODEL, "max_output_tokens": 2, "instructions": system, "store": False,
                        "input": [{"role": "user", "content": [{"type": "input_text", "text": "and this one?"},
                                                               {"type": "input_image", "image_url": "data:image/png;base64,X"}]}]}
                async with s.post(g.url + "/v1/responses", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Warmroute-Replica"] == home
                    assert (await r.json())["usage"]["input_tokens_details"]["cached_tokens"] == shared // 16 * 16
                assert _accuracy_lines(await metrics_text(s, g.admin_url)) == before
                # each was checked against the replica's /tokenize (the engine's ids, its placeholders in,
                # begin with the gateway's): the text request, the four images and the Responses one, all matching
                await until(lambda: not g.gateway.tokenize_checker._tasks, timeout_s=5.0)
                lines = [ln for ln in (await metrics_text(s, g.admin_url)).splitlines()
                         if ln.startswith(f'warmroute_gateway_tokenize_checks_total{{replica="{home}"')]
                assert lines == [f'warmroute_gateway_tokenize_checks_total{{replica="{home}",result="match"}} 6.0'], lines
        finally:
            await g.close()


async def test_a_conversation_about_an_image_goes_back_to_the_replica_that_holds_it(tok):
    """The engine keys the blocks past a chat's first image with the image's hash, which no event
    gives the gateway; the keys that stand for them (hashing.history_keys) count on the replica a
    turn went to (feed.media_history_ttl_s), so each conversation's next turn goes back there and
    finds its image and history cached, where before every replica matched it alike (a system
    prompt shorter than a block: nothing) and load alone chose."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from replica_agent.feed import open_feed

    feed = open_feed("memory://e2e-media-history")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with sims_with_agents(2, feed, MODEL, multimodal=True) as sims_:
        g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims_)]), feed=feed, tokenizer=tok,
                                tracer_provider=provider)
        try:
            await until(lambda: all(g.gateway.index.is_live(f"r{i}") for i in range(2)), timeout_s=5.0)
            async with aiohttp.ClientSession() as s:
                async def ask(messages):
                    usage, rid, matched, route = await _chat_routed(s, g.url, exporter, messages)
                    assert route.attributes["warmroute.history_blocks"] > len(LONG_DOC) // 64  # its keys past the image
                    return usage, rid, matched

                firsts = []
                for c in range(4):
                    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,CONVERSATION{c}"}}
                    turn = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": f"conversation {c}: " + LONG_DOC}, image]}]
                    usage, rid, matched = await ask(turn)
                    assert set(matched.values()) == {0}, matched  # nothing anywhere yet
                    firsts.append((turn, rid))
                for c, (turn, home) in enumerate(firsts):
                    usage, rid, matched = await ask(turn + [{"role": "assistant", "content": "A picture."},
                                                            {"role": "user", "content": "What else?"}])
                    assert rid == home and matched[home] > 0 == sum(m for r, m in matched.items() if r != home), (c, matched)
                    assert usage["prompt_tokens_details"]["cached_tokens"] > len(LONG_DOC) // 8, (c, usage)  # its image and history
        finally:
            await g.close()


async def test_a_popular_image_draws_a_new_conversation_to_the_replica_that_holds_it(tok):
    """The engine keys an image's blocks by the image and the text before it, so a new conversation
    that sends an image another one sent after the same text finds those blocks cached where that
    one went; the gateway's keys for a chat's first item stand for them alike in every conversation
    (hashing.history_keys), so it goes there. Before, a chat's first message with media was one
    unit, its question in every key: nothing matched, and load chose."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from replica_agent.feed import open_feed

    feed = open_feed("memory://e2e-media-popular")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with sims_with_agents(2, feed, MODEL, multimodal=True, media_tokens=320) as sims_:
        g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims_)]), feed=feed, tokenizer=tok,
                                tracer_provider=provider)
        try:
            await until(lambda: all(g.gateway.index.is_live(f"r{i}") for i in range(2)), timeout_s=5.0)
            async with aiohttp.ClientSession() as s:
                async def ask(question, image):
                    usage, rid, matched, _ = await _chat_routed(s, g.url, exporter, [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": question}, image]}])
                    return usage, rid, matched

                for i in range(4):
                    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,POPULAR{i}"}}
                    usage, home, matched = await ask(f"who took photograph {i}?", image)
                    assert set(matched.values()) == {0}, matched  # its first sender: nothing anywhere yet
                    assert usage["prompt_tokens_details"]["cached_tokens"] < 64, usage
                    usage, rid, matched = await ask(f"another user asks where photograph {i} was taken, and when", image)
                    assert rid == home and matched[home] > 0 == sum(m for r, m in matched.items() if r != home), (i, matched)
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= 320, (i, usage)  # the image's blocks
        finally:
            await g.close()


async def _chat_routed(session, url: str, exporter, messages: list) -> tuple[dict, str, dict, object]:
    """A 2-token chat through the gateway: its usage, the replica that served it, each candidate's
    matched GPU blocks from its decision span, and that span."""
    exporter.clear()
    body = {"model": MODEL, "max_tokens": 2, "messages": messages}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        usage, rid = (await r.json())["usage"], r.headers["X-Warmroute-Replica"]
    route = next(sp for sp in exporter.get_finished_spans() if sp.name == "warmroute.route")
    return usage, rid, {e.attributes["warmroute.replica_id"]: e.attributes["warmroute.matched_blocks_gpu"]
                        for e in route.events if e.name == "warmroute.candidate"}, route


def _accuracy_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(("warmroute_gateway_predicted_cached_tokens",
                                                              "warmroute_gateway_engine_cached_tokens"))]


async def test_n_choices_and_batches_are_predicted_as_the_engine_reports_them(tok):
    """`n` = 4 and completions batches through the gateway to simulated replicas that run them as
    vLLM does (child requests): what each answer reports cached (`n`: the last child's whole, every
    full block even cold, the first child's streamed; a batch: its last prompt's) is what the
    gateway predicted, so the index accuracy stays 1.0; and while `n` = 4 runs, the replica's
    in-flight count holds all four sequences."""
    from replica_agent.feed import open_feed

    feed = open_feed("memory://e2e-n")
    async with sims_with_agents(2, feed, MODEL) as sims_:
        g = await start_gateway(_cfg([f"r{i}={s.url}" for i, s in enumerate(sims_)]), feed=feed, tokenizer=tok)
        try:
            await until(lambda: all(g.gateway.index.is_live(f"r{i}") for i in range(2)), timeout_s=5.0)
            async with aiohttp.ClientSession() as s:
                for stream in (False, True, False):
                    body = {"model": MODEL, "prompt": f"four choices, stream={stream}: " + LONG_DOC, "max_tokens": 40, "n": 4,
                            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
                    task = asyncio.create_task(s.post(g.url + "/v1/completions", json=body))
                    loads = g.gateway.routing.load
                    await until(lambda: sum(ld.inflight_reqs + ld.active_reqs for ld in loads.snapshot().values()) == 4,
                                timeout_s=5.0)
                    async with await task as r:
                        assert r.status == 200
                        text = await r.text()
                        rid = r.headers["X-Warmroute-Replica"]
                    usage = (json.loads([ln for ln in text.splitlines() if ln.startswith("data: {")][-1][6:]) if stream
                             else json.loads(text))["usage"]
                    assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if stream else (usage["prompt_tokens"] - 1) // 16 * 16)
                served = {rid}
                # completions batches answered whole report their last prompt's cached tokens
                a = "batch a: " + LONG_DOC

                async def complete(prompt) -> tuple[dict, str]:
                    async with s.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["usage"], r.headers["X-Warmroute-Replica"]

                ua, home = await complete(a)
                await until(lambda: g.gateway.index.stats().entries_by_replica.get(home, 0) >= ua["prompt_tokens"] // 16,
                            timeout_s=5.0)
                cached = []
                for prompt in ([a, "batch b: " + LONG_DOC.replace("routing", "placement")], ["batch c: " + LONG_DOC[:400], a]):
                    u, r_id = await complete(prompt)
                    served.add(r_id)
                    cached.append(u["prompt_tokens_details"]["cached_tokens"])
                assert cached[0] == 0 and (cached[1] > 0) == (r_id == home), (cached, r_id, home)
                metrics = await metrics_text(s, g.admin_url)
            for r_id in served | {home}:
                assert f'warmroute_gateway_index_accuracy_ratio{{replica="{r_id}"}} 1.0' in metrics, _accuracy_lines(metrics)
        finally:
            await g.close()
