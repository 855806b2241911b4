"""Fixtures for tests against real vLLM (CPU build) replicas.

`vllm_replicas` starts 2 replicas of the tiny model once per pytest session (concurrently,
about 1.5 min on 2 cores) and stops them at the end. Tests that use it live in this folder (so they
share the one session fixture), are marked `@pytest.mark.vllm`, and raise their pytest-timeout
(the project default of 300 s covers fixture set-up too). Nothing is skipped: a missing vLLM venv,
or an engine that fails to start, fails the test with the reason (and the engine's log tail).
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

import pytest

from .launch import DEFAULT_MODEL_DIR, Replica, ReplicaStartError, VllmVenvMissing, ensure_model, start_replicas, stop_replicas, vllm_python

N_REPLICAS = int(os.environ.get("WARMROUTE_VLLM_REPLICAS", "2"))
SERVED_MODEL = "tiny"
# Sequence slots per engine: small, so that a few held requests make a real queue (requests
# waiting for a slot, test_routing_sticks_then_spills_under_queue). The gateway's cache_aware
# policy is told the same value (policy.params.max_num_seqs), as an operator would configure it.
MAX_NUM_SEQS = 8


@pytest.fixture(scope="session")
def vllm_python_path() -> Path:
    """The vLLM venv's python; fails (never skips) when setup_vllm.sh has not been run."""
    try:
        return vllm_python()
    except VllmVenvMissing as exc:
        msg = str(exc)
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python_path) -> Path:
    """The tiny random-weight Llama with the project's tokenizer (built once per machine)."""
    from gateway.default_tokenizer import default_tokenizer_dir

    return ensure_model(os.environ.get("WARMROUTE_VLLM_MODEL") or DEFAULT_MODEL_DIR, default_tokenizer_dir())


@pytest.fixture(scope="session")
def vllm_replicas(vllm_python_path, tiny_model_dir, tmp_path_factory) -> list[Replica]:
    """N_REPLICAS real vLLM replicas, started once per session; stopped at session end.

    A test may kill() and restart() one; it must leave it running (restart) when done."""
    log_dir = Path(os.environ.get("WARMROUTE_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm-logs"))
    reps, error = [], ""
    try:
        reps = start_replicas(N_REPLICAS, tiny_model_dir, served_model_name=SERVED_MODEL, log_dir=log_dir,
                              extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
                              extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})  # stored Responses (e2e)
    except ReplicaStartError as exc:
        error = str(exc)
    if error:
        pytest.fail(error, pytrace=False)
    atexit.register(stop_replicas, reps)  # if the session dies before teardown
    for r in reps:
        print(
            f"vLLM replica {r.name}: {r.url} pid {r.pid} started in {r.last_startup_s:.0f} s, "
            f"PSS {r.pss_bytes() / 2**20:.0f} MiB, log {r.log_path}"
        )
    try:
        yield reps
    finally:
        stop_replicas(reps)


# -- the warmroute system around the real replicas (test_vllm_e2e.py) ---------------------------
#
# One Redis server, one replica agent per real vLLM replica (connect mode: vLLM's PUB binds
# tcp://*:P; replay ROUTER; /metrics scraping) publishing to the Redis feed, and one gateway
# consuming it, all session-scoped so every e2e test shares them with the one vllm_replicas pair.
# Agents and gateway are asyncio services: they run on a private event loop in a daemon thread
# (`LoopThread`), tests stay synchronous (httpx) and reach into the services with `sys.call(coro)`.
# Start-up errors propagate: a fixture that cannot start fails the tests (never skips).

E2E_TENANTS = {"acme": "sk-e2e-acme-7f3a", "globex": "sk-e2e-globex-91c2"}


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run(coro)` waits for its result."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="warmroute-e2e-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args, timeout: float = 30.0):
        """Run a plain function on the loop thread (reads of service state without races)."""

        async def _wrap():
            return fn(*args)

        return self.run(_wrap(), timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


class WarmSystem:
    """Agents + gateway around the real replicas (see e2e_system)."""

    def __init__(self, replicas, model_dir: Path, redis_url: str, workdir: Path, lora_adapters=()) -> None:
        self.replicas = list(replicas)
        self.lora_adapters = list(lora_adapters)  # the engines' --lora-modules names (test_vllm_lora.py)
        self.by_id = {r.name: r for r in self.replicas}
        self.model_dir = Path(model_dir)
        self.redis_url = redis_url
        self.workdir = workdir
        self.loop = LoopThread()
        self.feed = None
        self.agents: dict = {}
        self.running = None  # RunningGateway
        self.exporter = None  # InMemorySpanExporter
        self.tracer_provider = None
        self.api_keys = dict(E2E_TENANTS)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.run(self._start(), timeout=180)

    async def _start(self) -> None:
        import hashlib
        import secrets

        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from gateway.config import GatewayConfig, ReplicaSpec
        from gateway.server import start_gateway
        from replica_agent.agent import AgentConfig, start_agent
        from replica_agent.feed import open_feed

        self.feed = open_feed(self.redis_url)
        for r in self.replicas:
            acfg = AgentConfig(replica_id=r.name, kv_events_endpoint=r.kv_events_endpoint, engine_url=r.url,
                               replay_endpoint=r.replay_endpoint, bind=False, topic=r.kv_topic,
                               model=r.served_model_name, block_size=r.block_size, load_interval_s=0.25)
            self.agents[r.name] = await start_agent(acfg, self.feed)
        secret_file = self.workdir / "salt-secret"
        secret_file.write_text(secrets.token_urlsafe(32))
        cfg = GatewayConfig()
        cfg.server.host, cfg.server.port, cfg.server.admin_port = "127.0.0.1", 0, 0
        cfg.model.name = self.replicas[0].served_model_name
        cfg.model.tokenizer_dir = str(self.model_dir)  # the model's own tokenizer, as the engine loads it
        cfg.model.block_size = self.replicas[0].block_size
        cfg.model.max_model_len = self.replicas[0].max_model_len
        cfg.model.lora_adapters = list(self.lora_adapters)
        cfg.membership.replicas = [ReplicaSpec(id=r.name, url=r.url) for r in self.replicas]
        cfg.membership.health_interval_s = 0.5
        # CPU engines on 2 shared cores answer /health late while saturated (the routing test
        # saturates one): a longer timeout, as an operator of such replicas would set.
        cfg.membership.health_timeout_s = 5.0
        # ... and accept connections late: in a preemption storm (16 long generations on 2 cores) a
        # connect took over the default 2 s and a request failed on both replicas (CI, 2026-12-01)
        cfg.proxy.connect_timeout_s = 10.0
        cfg.feed.url = self.redis_url  # the gateway opens its own Redis connection, as in production
        cfg.responses.store = True  # the replicas store Responses (vllm_replicas)
        cfg.policy.name = "cache_aware"
        cfg.policy.seed = 7
        cfg.policy.params = {"max_num_seqs": MAX_NUM_SEQS}  # the engines' --max-num-seqs (vllm_replicas)
        cfg.salt.secret_file = str(secret_file)
        cfg.auth.api_keys = {t: ["sha256:" + hashlib.sha256(k.encode()).hexdigest()] for t, k in self.api_keys.items()}
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.running = await start_gateway(cfg, tracer_provider=self.tracer_provider)
        await self._wait_ready()

    async def _wait_ready(self, timeout_s: float = 60.0) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        why = None
        while loop.time() < deadline:
            ok, why = self.gateway.readiness()
            live = all(self.gateway.index.is_live(r.name) for r in self.replicas)
            if ok and live:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"gateway around real vLLM not ready after {timeout_s:.0f} s: {why}; "
                           f"index live: {[self.gateway.index.is_live(r.name) for r in self.replicas]}")

    def close(self) -> None:
        try:
            self.loop.run(self._close(), timeout=60)
        finally:
            self.loop.stop()
            if self.tracer_provider is not None:
                self.tracer_provider.shutdown()

    async def _close(self) -> None:
        if self.running is not None:
            await self.running.close()
            self.running = None
        for a in self.agents.values():
            await a.close()
        self.agents.clear()
        if self.feed is not None:
            await self.feed.close()
            self.feed = None

    # -- accessors ---------------------------------------------------------------------------
    @property
    def gateway(self):
        return self.running.gateway

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def admin_url(self) -> str:
        return self.running.admin_url

    @property
    def model(self) -> str:
        return self.replicas[0].served_model_name

    def headers(self, tenant: str) -> dict:
        return {"Authorization": f"Bearer {self.api_keys[tenant]}"}

    def salt(self, tenant: str) -> str:
        return self.gateway.salter.salt_for(tenant, None)

    def call(self, fn, *args, timeout: float = 30.0):
        return self.loop.call(fn, *args, timeout=timeout)


@pytest.fixture(scope="session")
def e2e_redis():
    """A private redis-server for the whole session (the per-test `redis_server` is function-scoped)."""
    try:
        from tests.conftest import running_redis
    except ImportError:  # tests/ is not a package: its conftest is the top-level module "conftest"
        from conftest import running_redis

    with running_redis() as srv:
        yield srv


@pytest.fixture(scope="session")
def e2e_system(vllm_replicas, tiny_model_dir, e2e_redis, tmp_path_factory) -> WarmSystem:
    """Agents (one per real replica) + a gateway, over a Redis feed; started once per session.
    A start-up failure raises (the test errors with the reason); nothing is skipped."""
    sys_ = WarmSystem(vllm_replicas, tiny_model_dir, e2e_redis.url, tmp_path_factory.mktemp("warm-e2e"))
    try:
        sys_.start()
    except BaseException:
        sys_.close()
        raise
    try:
        yield sys_
    finally:
        sys_.close()
