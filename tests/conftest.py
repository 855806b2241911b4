"""Shared fixtures. Tests mark what they need (redis, vllm, slow); nothing skips silently:
a missing redis-server or vLLM makes the test fail with the reason."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from loadtests.ports import free_port  # noqa: F401  (tests import it from here)
from loadtests.processes import stop_processes
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
FIXTURE_EVENTS = FIXTURES / "vllm-0.32-cpu-kv-events.json"


async def serve_app(app, *, ssl_context=None, shutdown_timeout: float = 60.0):
    """Serve an aiohttp app on a free 127.0.0.1 port: (runner, base URL); `await runner.cleanup()`."""
    from aiohttp import web

    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    scheme = "https" if ssl_context is not None else "http"
    return runner, f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"


async def serve_chat(before=None):
    """A minimal replica on a free port: `/health` answers 200 and `/v1/chat/completions` a JSON
    completion with usage, after awaiting `before(body)` when given (the parsed request body: hold
    the first byte, pick by content). (runner, base URL); `await runner.cleanup()`."""
    from aiohttp import web

    async def chat(request):
        body = await request.json()
        if before is not None:
            await before(body)
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async def health(request):
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return await serve_app(app, shutdown_timeout=0.1)


@contextlib.asynccontextmanager
async def sims_with_agents(n: int, feed, model: str, **sim):
    """`n` simulated replicas `r0`.. publishing KV events over ZMQ, each with its agent writing to
    `feed` (a replica_agent.feed); all closed on leaving. `sim`: more SimConfig fields."""
    sims, agents = [], []
    try:
        for i in range(n):
            port = free_port()
            sims.append(await start_sim_server(SimConfig(model=model, kv_events_endpoint=f"tcp://*:{port}", **sim)))
            agents.append(await start_agent(AgentConfig(replica_id=f"r{i}", kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                                                         engine_url=sims[-1].url, load_interval_s=0.2), feed))
        yield sims
    finally:
        for a in agents:
            await a.close()
        for s in sims:
            await s.close()


@contextlib.asynccontextmanager
async def gateway_before_engine(tok, routes: dict, model: str, **config):
    """A gateway (no auth) in front of one fake engine `u` serving `routes` ("METHOD /path" ->
    aiohttp handler; `/health` is added), with `config` sections merged into its config."""
    from aiohttp import web

    from gateway.config import config_from_dict
    from gateway.server import start_gateway

    async def health(request):
        return web.Response()

    app = web.Application()
    for route, handler in routes.items():
        method, path = route.split(" ", 1)
        app.router.add_route(method, path, handler)
    app.router.add_get("/health", health)
    runner, url = await serve_app(app, shutdown_timeout=0.1)
    cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                            "membership": {"replicas": [f"u={url}"]}, "auth": {"enabled": False},
                            "model": {"name": model, "max_model_len": 4096}, "feed": {"url": "memory://fake"},
                            **config}, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    try:
        yield g
    finally:
        await g.close()
        await runner.cleanup()


def keyed_gateway_config(d: Path, sims, keys: dict[str, str]):
    """A gateway config in front of `sims` (replicas `r0`..), with API keys (tenant -> key) and a salt
    secret written under `d`; its feed is the caller's (`memory://unused` here)."""
    from gateway.config import config_from_dict

    (d / "keys.yaml").write_text("".join(f"{t}: [{k}]\n" for t, k in keys.items()))
    (d / "salt").write_text(f"salt-secret-{d.name}\n")
    return config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "membership": {"replicas": [f"r{i}={s.url}" for i, s in enumerate(sims)], "health_interval_s": 0.2},
        "auth": {"api_keys_file": str(d / "keys.yaml")}, "salt": {"secret_file": str(d / "salt")},
        "feed": {"url": "memory://unused"},
    }, env={})


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The built-in Qwen/ChatML tokenizer directory (built offline on first use)."""
    from gateway.default_tokenizer import default_tokenizer_dir

    return default_tokenizer_dir()


@pytest.fixture(scope="session")
def tok(tokenizer_dir):
    """One gateway TokenizerService on the built-in tokenizer, shared by the tests that start gateways."""
    from gateway.tokenization import TokenizerService

    svc = TokenizerService(tokenizer_dir)
    yield svc
    svc.close()


@pytest.fixture(scope="session")
def vllm_fixture() -> dict:
    """Traffic captured from a real vLLM 0.32 CPU build (tests/fixtures/README.md)."""
    import json

    if not FIXTURE_EVENTS.exists():
        pytest.fail(f"captured vLLM fixture missing at {FIXTURE_EVENTS} (it is part of the repository)")
    return json.loads(FIXTURE_EVENTS.read_text())


class RedisServer:
    """A private redis-server on a free port; can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server not found: install it (apt-get install redis-server); .ci/run does")
        self.exe = exe
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="wr-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], 5)
            self.proc = None


@contextlib.contextmanager
def running_redis():
    """A private redis-server for the `with` block; stopped and its directory removed after."""
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


@pytest.fixture
def redis_server():
    """A fresh private redis-server per test (real Redis, not a mock)."""
    with running_redis() as srv:
        yield srv
