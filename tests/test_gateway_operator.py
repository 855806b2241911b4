"""What an operator meets first with `warmroute gateway`: --check-config runs start-up's checks on
the config as flags and environment leave it; a port in use is one line, not a traceback; the
admin port answers JSON everywhere (its endpoint list, 404, 405) and explains a routing decision
for the tenant asked about; refused requests leave a log line; an engine's own 4xx reaches the
client in OpenAI's error shape; a dependency that fails every second is logged a few times, not
every second."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys

import aiohttp
import pytest
import pytest_asyncio

from replica_agent.feed import FailureLog
from gateway.auth import tenant_hash
from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")  # the async tests share the module's gateway

MODEL = "warmroute-sim"


def _gateway_cli(*args: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_check_config_is_what_start_up_checks(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("t0: [k1]\n")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"auth: {{api_keys_file: {keys}}}\nmembership: {{replicas: ['a=http://127.0.0.1:9']}}\n")
    env = {k: v for k, v in os.environ.items() if k != "WARMROUTE_SALT_SECRET"}
    # auth on without a salt secret: start-up refuses, so must the check
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", "--check-config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "salt.secret_file" in r.stderr, r.stderr
    # the environment gives the secret: valid
    r = _gateway_cli("--check-config", str(cfg), env={"WARMROUTE_SALT_SECRET": "s"})
    assert r.returncode == 0, r.stderr
    # a flag beside it is applied (and validated) as at start
    r = _gateway_cli("--check-config", str(cfg), "--port", "70000", env={"WARMROUTE_SALT_SECRET": "s"})
    assert r.returncode == 2 and "server.port" in r.stderr, r.stderr
    r = _gateway_cli("--check-config", str(cfg), "--no-auth", "--policy", "nonsense")
    assert r.returncode == 2 and "policy.name" in r.stderr and "cache_aware" in r.stderr, r.stderr
    # an environment override is checked too
    r = _gateway_cli("--check-config", str(cfg), "--no-auth", env={"WARMROUTE_PROXY__MAX_ATTEMPTS": "0"})
    assert r.returncode == 2 and "proxy.max_attempts" in r.stderr, r.stderr


def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _gateway_cli("--host", "127.0.0.1", "--port", "0", "--admin-port", str(port), "--no-auth",
                         "--replica", "a=http://127.0.0.1:9", "--load-only", "--model", MODEL, timeout=120)
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
    assert len(err) == 1 and "cannot listen" in err[0] and "in use" in err[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim():
    s = await start_sim_server(SimConfig(model=MODEL))
    yield s
    await s.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def authed(sim, tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("op")
    (d / "keys.yaml").write_text("tenant-a: [key-a]\ntenant-b: [key-b]\n")
    (d / "salt").write_text("operator-salt\n")
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"s={sim.url}"], "health_interval_s": 0.2},
        "auth": {"api_keys_file": str(d / "keys.yaml")}, "salt": {"secret_file": str(d / "salt")},
        "feed": {"url": "memory://operator"}, "model": {"name": MODEL},
        "policy": {"params": {"w_queue": 1.7}},
    }, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    yield g
    await g.close()


@MODULE_LOOP
async def test_admin_port_answers_json_everywhere(authed):
    async with aiohttp.ClientSession() as s:
        async with s.get(authed.admin_url + "/") as r:
            assert r.status == 200 and "POST /debug/route?kind=chat|completions|responses&tenant=ID" in (await r.json())["endpoints"]
        async with s.get(authed.admin_url + "/debug/route") as r:
            doc = await r.json()
            assert r.status == 405 and r.headers["Allow"] == "POST" and doc["error"]["code"] == "method_not_allowed"
        async with s.get(authed.admin_url + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_route"
        async with s.post(authed.admin_url + "/debug/route", data=b"{") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"


@MODULE_LOOP
async def test_debug_route_explains_for_the_tenant_asked_about(authed):
    doc = "the shared operator handbook, chapter one. " * 60
    body = {"model": MODEL, "messages": [{"role": "user", "content": doc}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(authed.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}) as r:
            assert r.status == 200
        async with s.post(authed.admin_url + "/debug/route", json=body) as r:  # whose request? refused, not guessed
            err = await r.json()
            assert r.status == 400 and err["error"]["param"] == "tenant", err
        matched = {}
        for how in ({"params": {"tenant": "tenant-a"}}, {"headers": {"Authorization": "Bearer key-a"}},
                    {"params": {"tenant": "tenant-b"}}):
            async with s.post(authed.admin_url + "/debug/route", json=body, **how) as r:
                out = await r.json()
                assert r.status == 200, out
                matched[str(how)] = max(v["matched_blocks_gpu"] for v in out["replicas"])
                assert out["policy_params"]["w_queue"] == 1.7  # the weights in force are shown
        a_q, a_h, b_q = matched.values()
        assert a_q > 0 and a_h == a_q  # tenant-a's prefix was just served: it matches, by query or by key
        assert b_q == 0  # tenant-b's salt differs: no match


@MODULE_LOOP
async def test_refused_requests_leave_a_log_line_without_the_key(authed, caplog):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with caplog.at_level(logging.INFO, logger="warmroute.gateway"):
        async with aiohttp.ClientSession() as s:
            async with s.post(authed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong-secret-key"}) as r:
                assert r.status == 401
    recs = [r for r in caplog.records if r.getMessage() == "request refused"]
    assert recs and recs[-1].fields["status"] == 401 and recs[-1].fields["error"] == "invalid_api_key"
    assert "wrong-secret-key" not in caplog.text


@MODULE_LOOP
async def test_engine_4xx_reaches_the_client_in_openai_shape(authed):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "top_k": "many"}  # the gateway leaves top_k to the engine
    async with aiohttp.ClientSession() as s:
        async with s.post(authed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}) as r:
            doc = await r.json()
            assert r.status == 400, doc
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    assert "top_k" in doc["error"]["message"] and doc["error"]["type"] == "invalid_request_error"


def test_feed_trouble_is_logged_when_it_starts_rarely_while_it_lasts_and_when_it_ends(caplog):
    t = [0.0]
    health = FailureLog(logging.getLogger("warmroute.gateway"), "feed (test)", every_s=30.0, clock=lambda: t[0])
    with caplog.at_level(logging.INFO, logger="warmroute.gateway"):
        for _ in range(60):  # a minute of failures, one a second
            health.failed(ConnectionError("redis down"))
            t[0] += 1.0
        health.ok()
    lines = [r.getMessage() for r in caplog.records if r.name == "warmroute.gateway"]
    assert len(lines) == 3 and "feed (test) failed: redis down" in lines[0]  # at 0 s, 30 s, then recovery
    assert "still failing for 30 s" in lines[1] and lines[2].startswith("feed (test) recovered")
    assert not health.failing


@MODULE_LOOP
async def test_tokens_are_counted_per_tenant_with_what_the_cache_served(authed):
    """warmroute_gateway_tenant_tokens_total{tenant_hash,kind}: each tenant's prompt, cached and
    completion tokens as the engine reported them; a document tenant A reads twice is cached for A
    the second time, and B's first read of it is not (its salt is its own)."""
    doc = " ".join(f"article {i} of the operators' handbook." for i in range(60))
    usage: dict[str, list[dict]] = {"tenant-a": [], "tenant-b": []}

    async def metric(s, tenant: str, kind: str) -> float:
        async with s.get(authed.admin_url + "/metrics") as r:
            text = await r.text()
        line = f'warmroute_gateway_tenant_tokens_total{{kind="{kind}",tenant_hash="{tenant_hash(tenant)}"}} '
        return sum(float(ln[len(line):]) for ln in text.splitlines() if ln.startswith(line))

    async with aiohttp.ClientSession() as s:
        before = {(t, k): await metric(s, t, k) for t in usage for k in ("prompt", "cached", "completion")}
        for tenant, key in (("tenant-a", "key-a"), ("tenant-a", "key-a"), ("tenant-b", "key-b")):
            async with s.post(authed.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "prompt": doc, "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
                usage[tenant].append((await r.json())["usage"])
            await asyncio.sleep(0.3)  # the engine's blocks reach the index before the next read
        for tenant, answers in usage.items():
            want = {"prompt": sum(u["prompt_tokens"] for u in answers),
                    "cached": sum(u["prompt_tokens_details"]["cached_tokens"] for u in answers),
                    "completion": sum(u["completion_tokens"] for u in answers)}
            got = {k: await metric(s, tenant, k) - before[(tenant, k)] for k in want}
            assert got == want, (tenant, got, want)
    assert usage["tenant-a"][1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["tenant-b"][0]["prompt_tokens_details"]["cached_tokens"] == 0
