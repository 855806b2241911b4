"""An embedded warmroute system in one process: N simulated vLLM replicas, one sidecar agent per
replica publishing to a feed, and a gateway consuming it (or `gateways` of them, each with its own
feed connection, index and in-flight counts, trading through the feed as gateway pods do; a load
spreads its requests over `urls`). Used by `warmroute demo`, `warmroute bench` (self-contained
mode), the benchmarks and end-to-end tests.

Wiring, as in a real deployment: each sim's ZMQ PUB connects to its agent's bound SUB on
127.0.0.1 (vLLM's rule for a non-wildcard endpoint), the replay socket is the sim's ROUTER, the
agent scrapes the sim's `/metrics`, and the gateway reaches the sims over HTTP. The feed is the
in-process one by default (`memory://<unique name>`) or Redis when `feed_url` says so.
"""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from loadtests.ports import free_port

__all__ = ["SystemSpec", "EmbeddedSystem", "api_key_for"]


def api_key_for(tenant: str) -> str:
    """The bench's API key of a tenant (deterministic, test-only credentials)."""
    return f"sk-bench-{tenant}"


@dataclass
class SystemSpec:
    replicas: int = 3
    policy: str = "cache_aware"
    policy_params: dict = field(default_factory=dict)
    model: str = "warmroute-sim"
    block_size: int = 16
    num_blocks: int | None = 256  # per replica KV capacity (blocks)
    time_profile: str = "wallclock"  # "wallclock" (slowed ~20x for this machine) or "gpu"
    max_num_seqs: int = 64
    tenants: tuple[str, ...] = ("t0",)
    auth: bool = True
    feed_url: str | None = None  # None: a private in-process feed
    agent_load_interval_s: float = 0.25
    lora_modules: tuple[str, ...] = ()  # LoRA adapters every sim serves (found by the gateway in /v1/models)
    max_loras: int = 1  # adapters one sim batch may run
    lora_metrics: bool = True  # the sims export their LoRA slots (vllm:lora_requests_info)
    gateways: int = 1  # gateway instances on the same feed (the first is `gateway`; all in `gateways`)
    media_tokens: int | None = None  # multi-modal sims, each media item this many tokens past its digest (None: text only)
    media_history_ttl_s: float | None = None  # the gateways' feed.media_history_ttl_s (None: its default)


class EmbeddedSystem:
    """`async with EmbeddedSystem(spec) as sys:` -> sys.url (gateway), sys.sims, sys.api_keys."""

    def __init__(self, spec: SystemSpec) -> None:
        self.spec = spec
        self.sims: list = []
        self.agents: list = []
        self.gateway = None
        self.gateways: list = []
        self.feed = None
        self._tmp = tempfile.TemporaryDirectory(prefix="warmroute-embedded-")
        self.api_keys = {t: api_key_for(t) for t in spec.tenants}

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def urls(self) -> list[str]:
        """Every gateway's API URL (one per `SystemSpec.gateways`)."""
        return [g.url for g in self.gateways]

    @property
    def admin_url(self) -> str:
        return self.gateway.admin_url

    async def __aenter__(self) -> "EmbeddedSystem":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        from gateway.config import GatewayConfig, ReplicaSpec
        from gateway.server import start_gateway
        from loadtests.sim.scheduler import TimeModel
        from loadtests.sim.server import SimConfig, start_sim_server
        from replica_agent.agent import AgentConfig, start_agent
        from replica_agent.feed import open_feed

        spec = self.spec
        self.feed = open_feed(spec.feed_url or f"memory://embedded-{uuid.uuid4().hex[:8]}")
        tm = TimeModel.wallclock() if spec.time_profile == "wallclock" else TimeModel()
        ids = [f"r{i}" for i in range(spec.replicas)]
        endpoints = {rid: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for rid in ids}
        sims = {}
        for rid in ids:
            ev, rp = endpoints[rid]
            cfg = SimConfig(model=spec.model, block_size=spec.block_size, num_blocks=spec.num_blocks,
                            max_num_seqs=spec.max_num_seqs, time=replace(tm), kv_events_endpoint=ev,
                            max_model_len=min(32768, spec.num_blocks * spec.block_size) if spec.num_blocks else 32768,
                            replay_endpoint=rp, engine_label=rid, lora_modules=tuple(spec.lora_modules),
                            max_loras=spec.max_loras, lora_metrics=spec.lora_metrics,
                            multimodal=spec.media_tokens is not None, media_tokens=spec.media_tokens or 0)
            sims[rid] = await start_sim_server(cfg)
            self.sims.append(sims[rid])
        for rid in ids:
            ev, rp = endpoints[rid]
            acfg = AgentConfig(replica_id=rid, kv_events_endpoint=ev, engine_url=sims[rid].url, replay_endpoint=rp,
                               bind=True, model=spec.model, block_size=spec.block_size,
                               load_interval_s=spec.agent_load_interval_s)
            self.agents.append(await start_agent(acfg, self.feed))
        secret_file = Path(self._tmp.name) / "salt-secret"
        secret_file.write_text(secrets.token_urlsafe(32))
        cfg = GatewayConfig()
        cfg.server.host, cfg.server.port, cfg.server.admin_port = "127.0.0.1", 0, 0
        cfg.model.name, cfg.model.block_size = spec.model, spec.block_size
        cfg.membership.replicas = [ReplicaSpec(id=rid, url=sims[rid].url) for rid in ids]
        cfg.membership.health_interval_s = 0.5
        cfg.feed.url = self.feed.url if hasattr(self.feed, "url") else (spec.feed_url or "memory://")
        cfg.policy.name, cfg.policy.params = spec.policy, dict(spec.policy_params)
        if spec.time_profile == "wallclock":
            cfg.policy.prior_prefill_s_per_token = tm.prefill_s_per_token
            cfg.policy.prior_decode_step_s = tm.step_overhead_s
        cfg.salt.secret_file = str(secret_file)
        if spec.media_history_ttl_s is not None:
            cfg.feed.media_history_ttl_s = spec.media_history_ttl_s
        if spec.auth:
            cfg.auth.api_keys = {t: ["sha256:" + hashlib.sha256(k.encode()).hexdigest()] for t, k in self.api_keys.items()}
        else:
            cfg.auth.enabled = False
        self.gateway = await start_gateway(cfg, feed=self.feed)
        self.gateways.append(self.gateway)
        for _ in range(spec.gateways - 1):  # each opens its own connection to the feed: its own owner there
            self.gateways.append(await start_gateway(cfg))
        for g in self.gateways:
            await self._wait_ready(g.admin_url)

    async def _wait_ready(self, admin_url: str, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last = ""
        async with aiohttp.ClientSession() as s:
            while loop.time() < deadline:
                try:
                    async with s.get(admin_url + "/readyz") as r:
                        last = await r.text()
                        if r.status == 200:
                            return
                except aiohttp.ClientError as exc:
                    last = str(exc)
                await asyncio.sleep(0.1)
        raise RuntimeError(f"embedded gateway not ready after {timeout_s}s: {last[:300]}")

    def sim_stats(self) -> dict[str, dict]:
        return {s.server.cfg.engine_label: s.server.stats() for s in self.sims}

    async def close(self) -> None:
        """Stop everything; a component that does not stop within `CLOSE_TIMEOUT_S` is reported
        (with the stacks of the tasks still running) and left behind rather than hanging the run."""
        steps = [(f"gateway {i}", g.close()) for i, g in enumerate(self.gateways)]
        steps += [(f"agent {i}", a.close()) for i, a in enumerate(self.agents)]
        steps += [(f"sim {i}", s.close()) for i, s in enumerate(self.sims)]
        if self.feed is not None and hasattr(self.feed, "close"):
            res = self.feed.close()
            if asyncio.iscoroutine(res):
                steps.append(("feed", res))
        self.gateway, self.feed = None, None
        self.gateways.clear()
        self.agents.clear()
        self.sims.clear()
        for name, coro in steps:
            try:
                await asyncio.wait_for(coro, CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                _report_hang(name)
        self._tmp.cleanup()


CLOSE_TIMEOUT_S = 20.0


def _report_hang(name: str) -> None:
    import sys

    print(f"warning: embedded {name} did not close within {CLOSE_TIMEOUT_S:.0f} s; tasks still running:", file=sys.stderr)
    for t in asyncio.all_tasks():
        if t is asyncio.current_task():
            continue
        frames = [f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}:{f.f_code.co_name}" for f in t.get_stack(limit=6)]
        print(f"  {t.get_name()}: {' <- '.join(frames)}", file=sys.stderr)
