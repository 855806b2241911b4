"""Secrets and prompt text never leave the gateway or the agent: one run with authentication (API
keys and HS256 JWTs), a salt secret, a password-protected Redis feed, tracing to the console, the
access log on, and errors of every kind (bad key, bad and expired tokens, malformed bodies, an
unknown model, an engine that fails before and after the first byte, a Redis outage). Everything
the gateway and the agent emitted is captured (every log record at DEBUG, every console span,
/metrics of both, the admin views, every response body and header) and searched for the API keys,
the JWT secret and tokens, the salt secret, the derived salts, the Redis password, the tenants'
ids in clear and the prompts' text."""
from __future__ import annotations

import asyncio
import io
import logging
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import aiohttp
import jwt
import pytest
from aiohttp import web

from loadtests.processes import stop_processes
from gateway.config import config_from_dict
from gateway.server import start_gateway
from gateway.telemetry import JsonFormatter
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.conftest import free_port, serve_app

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.redis]

MODEL = "warmroute-sim"


class PasswordRedis:
    """redis-server with `requirepass`, stoppable and restartable on the same port."""

    def __init__(self, password: str) -> None:
        self.password = password
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="wr-redis-pw-")
        self.proc = None
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server not found: install it (apt-get install redis-server); .ci/run does")
        self.exe = exe

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--requirepass", self.password],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        pytest.fail("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], 5)
            self.proc = None


async def _flaky_engine():
    """An engine that answers 500 before the first byte, or cuts a stream after one event."""
    app = web.Application()

    async def chat(request):
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": {"message": "engine exploded", "type": "InternalServerError"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        request.transport.close()
        return resp

    async def health(request):
        return web.Response()

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return await serve_app(app, shutdown_timeout=0.1)


async def test_no_secret_or_prompt_in_anything_emitted(tok, tmp_path):
    api_key_a, api_key_b = "sk-" + secrets.token_hex(16), "sk-" + secrets.token_hex(16)
    wrong_key = "sk-" + secrets.token_hex(16)
    jwt_secret = "jwt-" + secrets.token_hex(24)
    salt_secret = "salt-" + secrets.token_hex(24)
    redis_password = "pw" + secrets.token_hex(12)
    tenant_a, tenant_b, tenant_c = "tenant-" + secrets.token_hex(4), "tenant-" + secrets.token_hex(4), "tenant-" + secrets.token_hex(4)
    marker = "PROMPTMARK" + secrets.token_hex(6)
    (tmp_path / "keys.yaml").write_text(f"{tenant_a}: [{api_key_a}]\n{tenant_b}: [{api_key_b}]\n")
    (tmp_path / "jwt.secret").write_text(jwt_secret)
    (tmp_path / "salt.secret").write_text(salt_secret)
    good_jwt = jwt.encode({"tenant": tenant_c, "sub": "user-" + marker[-6:], "exp": int(time.time()) + 600},
                          jwt_secret, algorithm="HS256")
    forged_jwt = jwt.encode({"tenant": tenant_c, "exp": int(time.time()) + 600}, "not-the-secret-" + jwt_secret[:8],
                            algorithm="HS256")
    expired_jwt = jwt.encode({"tenant": tenant_c, "exp": int(time.time()) - 60}, jwt_secret, algorithm="HS256")

    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    spans = io.StringIO()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=spans)))

    redis = PasswordRedis(redis_password)
    redis.start()
    pub, rep = free_port(), free_port()
    sim = await start_sim_server(SimConfig(model=MODEL, kv_events_endpoint=f"tcp://*:{pub}",
                                           replay_endpoint=f"tcp://127.0.0.1:{rep}"))
    agent = await start_agent(AgentConfig(replica_id="good", kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                                          replay_endpoint=f"tcp://127.0.0.1:{rep}", engine_url=sim.url,
                                          load_interval_s=0.2, admin_port=0), open_feed(redis.url))
    flaky_runner, flaky_url = await _flaky_engine()
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"good={sim.url}", f"flaky={flaky_url}"], "health_interval_s": 0.2,
                       "eject_base_s": 0.2, "eject_max_s": 0.5},
        "auth": {"enabled": True, "api_keys_file": str(tmp_path / "keys.yaml"),
                 "jwt": {"hs256_secret_file": str(tmp_path / "jwt.secret")}},
        "salt": {"secret_file": str(tmp_path / "salt.secret")},
        "feed": {"url": redis.url, "inflight_poll_s": 0.1},
        "policy": {"name": "round_robin"},
        "telemetry": {"access_log": True, "log_level": "DEBUG"},
        "proxy": {"max_attempts": 2}}, env={})
    g = await start_gateway(cfg, tokenizer=tok, tracer_provider=provider)
    bodies: list[str] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def post(path, *, key=None, data=None, json_body=None):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                if data is not None:
                    headers["Content-Type"] = "application/json"
                async with s.post(g.url + path, json=json_body, data=data, headers=headers) as r:
                    text = await r.text()
                    bodies.append(f"{r.status} {dict(r.headers)} {text}")
                    return r.status

            chat = lambda stream, n: {"model": MODEL, "stream": stream, "max_tokens": 3,  # noqa: E731
                                      "messages": [{"role": "user", "content": f"{marker} question {n} " * 20}]}
            statuses = []
            for i in range(6):  # round robin over good and flaky: retries, stream cut after the first byte
                statuses.append(await post("/v1/chat/completions", key=api_key_a, json_body=chat(i % 2 == 0, i)))
                statuses.append(await post("/v1/chat/completions", key=good_jwt, json_body=chat(True, 100 + i)))
            statuses.append(await post("/v1/completions", key=api_key_b,
                                       json_body={"model": MODEL, "prompt": f"{marker} completion", "max_tokens": 2}))
            statuses.append(await post("/v1/chat/completions", key=wrong_key, json_body=chat(False, 1)))
            statuses.append(await post("/v1/chat/completions", key=forged_jwt, json_body=chat(False, 2)))
            statuses.append(await post("/v1/chat/completions", key=expired_jwt, json_body=chat(False, 3)))
            statuses.append(await post("/v1/chat/completions", key=api_key_a,
                                       data=f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{marker}'))
            statuses.append(await post("/v1/chat/completions", key=api_key_a,
                                       json_body={"model": "no-such-model", "messages": [{"role": "user", "content": marker}]}))
            statuses.append(await post("/v1/chat/completions", key=api_key_a,
                                       json_body={"model": MODEL, "messages": [{"role": "user", "content": marker}],
                                                  "max_tokens": "many"}))
            statuses.append(await post("/v1/chat/completions", key=api_key_a,
                                       json_body={"model": MODEL, "messages": [{"role": "user", "content": marker * 4000}]}))
            assert {401, 400, 404, 200} <= set(statuses), statuses
            redis.stop()  # an outage: the gateway and the agent log it
            await asyncio.sleep(1.5)
            statuses.append(await post("/v1/chat/completions", key=api_key_b, json_body=chat(False, 7)))
            redis.start()
            await asyncio.sleep(1.5)
            for path in ("/metrics", "/debug/index", "/readyz"):
                async with s.get(g.admin_url + path) as r:
                    bodies.append(await r.text())
            async with s.post(g.admin_url + f"/debug/route?tenant={tenant_a}", json=chat(False, 9)) as r:
                bodies.append(await r.text())
            async with s.get(agent.admin_url + "/metrics") as r:
                bodies.append(await r.text())
            async with s.get(agent.admin_url + "/healthz") as r:
                bodies.append(await r.text())
    finally:
        await g.close()
        await agent.close()
        await agent.feed.close()
        await sim.close()
        await flaky_runner.cleanup()
        provider.shutdown()
        redis.stop()
        shutil.rmtree(redis.dir, ignore_errors=True)
        root.removeHandler(handler)
        root.setLevel(old_level)

    salts = [g.gateway.salter.salt_for(t, None) for t in (tenant_a, tenant_b, tenant_c)]
    needles = {"API key A": api_key_a, "API key B": api_key_b, "the refused key": wrong_key,
               "JWT secret": jwt_secret, "a JWT": good_jwt, "a forged JWT": forged_jwt, "an expired JWT": expired_jwt,
               "salt secret": salt_secret, "Redis password": redis_password, "prompt text": marker,
               "tenant A id": tenant_a, "tenant B id": tenant_b, "tenant C id": tenant_c,
               **{f"derived salt {i}": salt for i, salt in enumerate(salts)}}
    logs, span_text = captured.getvalue(), spans.getvalue()
    assert "unavailable" in logs and "request" in logs, "the run logged its errors and requests"
    assert '"name": "chat warmroute-sim"' in span_text, "spans were exported"
    haystacks = {"logs": logs, "spans": span_text, "responses and admin views": "\n".join(bodies)}
    found = [(what, where) for what, needle in needles.items() for where, hay in haystacks.items() if needle in hay]
    # The admin route explains a tenant named by the operator; only its hash may come back.
    assert not found, found
