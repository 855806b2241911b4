"""Shared pieces of the flow-control tests: a replica whose answers the test releases one by one
(so the pool's saturation is exact, not timed), a gateway config around it, and a client."""
from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import jwt
from aiohttp import web

from tests.conftest import serve_app

MODEL = "flow-model"
HS_SECRET = b"flow-hs256-secret-0123456789abcdef"


class HeldReplica:
    """A vLLM-shaped streaming replica: each request gets its first event at once, then waits
    until the test releases it (`release`), then ends with usage and [DONE]. `arrived` lists the
    label (last message's content) of each request in arrival order, `bodies` their bodies."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.bodies: list[dict] = []
        self.gates: list[asyncio.Event] = []
        self.health = 200
        self.auto = False  # answer whole at once (after `drain`)
        self.fcfs = False  # refuse a priority other than 0 as vLLM's default policy does (400)
        self.refused: list[str] = []  # labels of the requests refused for their priority
        self.runner = None
        self.url = ""

    async def start(self) -> "HeldReplica":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner, self.url = await serve_app(app, shutdown_timeout=1.0)
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fcfs and body.get("priority", 0) != 0:
            self.refused.append(body["messages"][-1]["content"])
            msg = f"Got priority {body['priority']} but Priority scheduling is not enabled."
            return web.json_response({"error": {"message": msg, "type": "BadRequestError", "param": None, "code": 400}},
                                     status=400)
        self.bodies.append(body)
        self.arrived.append(body["messages"][-1]["content"])
        gate = asyncio.Event()
        if self.auto:
            gate.set()
        self.gates.append(gate)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await gate.wait()
        usage = {"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def open_count(self) -> int:
        return sum(1 for g in self.gates if not g.is_set())

    def release(self, n: int = 1) -> None:
        for g in self.gates:
            if n == 0:
                break
            if not g.is_set():
                g.set()
                n -= 1

    def drain(self) -> None:
        """Release every open request and answer every later one at once."""
        self.auto = True
        self.release(len(self.gates))

    def hold_again(self) -> None:
        self.auto = False
        self.arrived.clear()
        self.gates.clear()

    async def close(self) -> None:
        self.drain()
        if self.runner is not None:
            await self.runner.cleanup()


def keys_file(path, tenants: dict) -> str:
    """A keys file: tenant -> plain key, or tenant -> (key, {weight/priority/allowed_priorities})."""
    lines = []
    for tenant, spec in tenants.items():
        key, extra = (spec, {}) if isinstance(spec, str) else spec
        entry = {"keys": [key], **extra}
        lines.append(f"{tenant}: {json.dumps(entry)}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def flow_config(tmp_path, replicas: dict[str, str], tenants: dict, flow: dict | None = None, **sections) -> dict:
    (tmp_path / "salt").write_text("flow-salt-secret\n")
    (tmp_path / "hs").write_bytes(HS_SECRET)
    cfg = {
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "model": {"name": MODEL, "max_model_len": 4096},
        "membership": {"replicas": [f"{rid}={url}" for rid, url in replicas.items()], "health_interval_s": 0.1,
                       "health_timeout_s": 0.5},
        "feed": {"load_only": True},
        "salt": {"secret_file": str(tmp_path / "salt")},
        "auth": {"api_keys_file": keys_file(tmp_path / "keys.yaml", tenants),
                 "jwt": {"hs256_secret_file": str(tmp_path / "hs")}},
        "flow": {"max_num_seqs": 2, "engine_queue_reqs": 0, **(flow or {})},  # saturated at exactly 2 per replica
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def token_for(tenant: str, **claims) -> str:
    import time

    return jwt.encode({"tenant": tenant, "exp": int(time.time()) + 600, **claims}, HS_SECRET, algorithm="HS256")


async def ask(session: aiohttp.ClientSession, url: str, key: str, label: str, headers: dict | None = None,
              timeout_s: float = 30.0, **fields) -> tuple[int, dict, bytes]:
    """One streamed chat request (`fields`: more of its body, e.g. n); (status, response headers, body)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": label}], "stream": True, "max_tokens": 4, **fields}
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with session.post(url + "/v1/chat/completions", json=body, headers=h,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, dict(r.headers), await r.read()


async def until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
