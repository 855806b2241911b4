"""The gateway service on uvloop; wires auth, salt, tokenizer, keys, index, load, membership,
policy, proxy and telemetry into the request path (DESIGN.md "One request, end to end").

The API port is served by `gateway.http_front` (httptools) and proxied requests go out through
`gateway.upstream` (both lean HTTP/1.1, for the per-request CPU budget); the admin port, health
probes and model discovery use aiohttp.

This module owns the I/O and the order of steps; every decision is made by a pure module:
`auth` (who, which model, limits), `salt` (the cache salt), `routing` (replica views and the
explanation), `policies` (the ranking), `membership` (health and ejection), `load` (in-flight
work), `proxy.SseRelay` (what bytes the client gets). Background tasks (feed sync, in-flight
counter flush/poll, health probes, DNS, key-file reload, model discovery) are started in
`Gateway.start()` and cancelled in `Gateway.close()`, never by constructors.

Public API: `start_gateway(cfg, *, feed=None, tracer_provider=None) -> RunningGateway` (.url,
.admin_url, .gateway, `await close()`), and `main_from_args(args) -> int` for the CLI
(`--workers N` runs N worker processes sharing the ports through SO_REUSEPORT; SIGTERM drains).
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway.auth import (ApiKeyStore, Authenticator, Identity, JwtVerifier, TenantLimiter, TenantPolicy,
                          load_api_keys_file, load_jwks_file, parse_key_entry)
from gateway.config import ConfigError, GatewayConfig, apply_args, check_files, load_config
from gateway.errors import ApiError, sse_error_event
from gateway.http_front import FrontRequest, FrontResponse, FrontServer, send_error as _send_error, start_front
from gateway.load import LoadTracker
from gateway.membership import Membership, MembershipRunner
from gateway.proxy import Attempt, UpstreamFailure, attempt, make_session, usage_numbers
from gateway.upstream import UpstreamError, UpstreamPool
from gateway.routing import build_views, explain, predicted_matched_tokens
from gateway.salt import NO_AUTH_DEFAULT_SECRET, SaltDeriver, load_salt_secret
from gateway.telemetry import Metrics, StateCollector, build_tracer_provider, setup_logging

__all__ = ["Gateway", "RunningGateway", "start_gateway", "main_from_args", "build_authenticator"]

log = logging.getLogger("warmroute.gateway")
access_log = logging.getLogger("warmroute.gateway.access")

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_JSON = "application/json"
_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def build_authenticator(cfg: GatewayConfig) -> Authenticator:
    a = cfg.auth
    policies = {
        t: TenantPolicy(frozenset(tc.models) if tc.models is not None else None, tc.max_concurrent_reqs, tc.max_rps)
        for t, tc in a.tenants.items()
    }
    if not a.enabled:
        return Authenticator(enabled=False, policies=policies)
    tenants: dict[str, list[bytes]] = {}
    for t, keys in a.api_keys.items():
        tenants.setdefault(t, []).extend(parse_key_entry(k, allow_plain=False, where=f"auth.api_keys.{t}") for k in keys)
    if a.api_keys_file:
        for t, ds in load_api_keys_file(a.api_keys_file).items():
            tenants.setdefault(t, []).extend(ds)
    verifier = None
    j = a.jwt
    if j.enabled():
        hs = None
        if j.hs256_secret_file:
            hs = Path(j.hs256_secret_file).read_bytes().rstrip(b"\r\n")
        elif j.hs256_secret_env:
            v = os.environ.get(j.hs256_secret_env)
            if not v:
                raise ConfigError(f"auth.jwt.hs256_secret_env: environment variable {j.hs256_secret_env} is not set")
            hs = v.encode()
        pem = Path(j.rs256_public_key_file).read_bytes() if j.rs256_public_key_file else None
        jwks = load_jwks_file(j.jwks_file) if j.jwks_file else None
        verifier = JwtVerifier(hs256_secret=hs, rs256_public_key_pem=pem, jwks=jwks, issuer=j.issuer, audience=j.audience,
                               tenant_claim=j.tenant_claim, user_claim=j.user_claim, leeway_s=j.leeway_s)
    return Authenticator(enabled=True, keys=ApiKeyStore(tenants), jwt_verifier=verifier, policies=policies)


class Gateway:
    """All state of one gateway process; see the module header."""

    def __init__(self, cfg: GatewayConfig, *, feed=None, tracer_provider=None, tokenizer=None,
                 registry=None, reuse_port: bool = False) -> None:
        self.cfg = cfg
        self._feed = feed  # a replica_agent.feed Feed, or None: opened from cfg.feed.url
        self._own_feed = feed is None
        self._tokenizer = tokenizer
        self._own_tokenizer = tokenizer is None
        self.reuse_port = reuse_port
        self.auth = build_authenticator(cfg)
        secret = load_salt_secret(cfg.salt.secret_file)
        if secret is None:
            if cfg.auth.enabled:
                raise ConfigError("salt.secret_file: a salt secret is required when authentication is on "
                                  "(--salt-secret-file FILE or WARMROUTE_SALT_SECRET)")
            secret = NO_AUTH_DEFAULT_SECRET
        self.salter = SaltDeriver(secret, cfg.salt.scope)
        self.limiter = TenantLimiter(self.auth.policies)
        self.metrics = Metrics(registry)
        self.metrics.registry.register(StateCollector(self.state_for_metrics))
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("warmroute.gateway") if tracer_provider is not None else None
        self.membership = Membership(eject_base_s=cfg.membership.eject_base_s, eject_max_s=cfg.membership.eject_max_s,
                                     probe_timeouts_to_down=cfg.membership.health_timeouts_to_down)
        if cfg.membership.replicas:
            self.membership.set_members({r.id: r.url for r in cfg.membership.replicas})
        self.load = LoadTracker()
        from policies.calibration import Calibrator
        from policies.registry import get_policy

        try:
            self.policy = get_policy(cfg.policy.name, **cfg.policy.params)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"policy.params: {exc}") from None
        self.calibrator = Calibrator(prior_prefill_s_per_token=cfg.policy.prior_prefill_s_per_token,
                                     prior_decode_step_s=cfg.policy.prior_decode_step_s)
        self.rng = random.Random(cfg.policy.seed)
        from gateway.index import KVIndex

        self.index = KVIndex(max_entries=cfg.feed.index_max_entries, stale_after_s=cfg.feed.stale_after_s)
        self.model_name: str | None = cfg.model.name
        self.max_model_len: int | None = cfg.model.max_model_len
        self.keychain = None
        self._served: set[str] = set()
        self.session: aiohttp.ClientSession | None = None  # probes and model discovery
        self.pool: UpstreamPool | None = None  # proxied requests (the hot path)
        self._front: FrontServer | None = None  # the API port
        self._tasks: list[asyncio.Task] = []
        self._runners: list[web.AppRunner] = []
        self._req_ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        self.feed_ok = False
        self.draining = False
        self.active_handlers = 0
        self.url = ""
        self.admin_url = ""
        self._keys_mtime = 0.0
        self._propagator = None
        if self.tracer is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    # ------------------------------------------------------------------ lifecycle
    def _set_model(self, name: str, max_model_len: int | None) -> None:
        from hashing.keys import KeyChain

        self.model_name = name
        self.keychain = KeyChain(name, self.cfg.model.block_size)
        self._served = {name, *self.cfg.model.aliases}
        if self.max_model_len is None and max_model_len:
            self.max_model_len = int(max_model_len)

    @property
    def tokenizer(self):
        return self._tokenizer

    async def start(self) -> None:
        cfg = self.cfg
        self.session = make_session(cfg.proxy.pool_limit, cfg.proxy.connect_timeout_s)
        self.pool = UpstreamPool(connect_timeout_s=cfg.proxy.connect_timeout_s, max_idle_per_host=cfg.proxy.pool_limit)
        # Admin first: /healthz answers while the tokenizer loads.
        admin = web.Application()
        admin.router.add_get("/metrics", self.h_metrics)
        admin.router.add_get("/healthz", self.h_healthz)
        admin.router.add_get("/readyz", self.h_readyz)
        admin.router.add_post("/debug/route", self.h_debug_route)
        admin.router.add_get("/debug/index", self.h_debug_index)
        admin.router.add_get("/debug/replicas", self.h_debug_index)
        admin_runner = web.AppRunner(admin, access_log=None, handler_cancellation=True)
        await admin_runner.setup()
        self._runners.append(admin_runner)
        site = web.TCPSite(admin_runner, cfg.server.host, cfg.server.admin_port, reuse_port=self.reuse_port or None)
        await site.start()
        self.admin_url = f"http://{_host_for_url(cfg.server.host)}:{_bound_port(site)}"

        if self._tokenizer is None:
            from gateway.tokenization import TokenizerService

            loop = asyncio.get_running_loop()
            self._tokenizer = await loop.run_in_executor(
                None, lambda: TokenizerService(cfg.model.tokenizer_dir, max_workers=cfg.model.tokenizer_workers))
        if self.max_model_len is None and cfg.model.name is not None:
            pass  # discovered from replicas below, else the tokenizer's limit
        if self.model_name is not None:
            self._set_model(self.model_name, None)

        # Feed and index sync.
        if not cfg.feed.load_only:
            if self._feed is None:
                from replica_agent.feed import open_feed

                self._feed = open_feed(cfg.feed.url)
            from gateway.index_sync import IndexSync

            # Follow exactly the pool's replicas (an agent's --replica-id must equal the gateway's id).
            self.index_sync = IndexSync(self._feed, self.index, replicas=self.membership.ids())
            self._tasks.append(asyncio.create_task(self._run_sync(), name="index-sync"))
            self._tasks.append(asyncio.create_task(self._inflight_loop(), name="inflight"))
        m = cfg.membership
        self.mrunner = MembershipRunner(
            self.membership, self.session, health_path=m.health_path, health_interval_s=m.health_interval_s,
            health_timeout_s=m.health_timeout_s, dns_service=m.dns_service, dns_port=m.dns_port,
            dns_refresh_s=m.dns_refresh_s, on_change=self._members_changed)
        if m.dns_service:
            await self.mrunner.resolve_once()
            self._tasks.append(asyncio.create_task(self.mrunner.dns_loop(), name="dns"))
        self._tasks.append(asyncio.create_task(self.mrunner.probe_loop(), name="probes"))
        if cfg.auth.enabled and cfg.auth.api_keys_file:
            self._keys_mtime = _mtime(cfg.auth.api_keys_file)
            self._tasks.append(asyncio.create_task(self._keys_reload_loop(), name="keys-reload"))
        if self.model_name is None or self.max_model_len is None:
            await self._discover_model(attempts=3)
            if self.model_name is None or self.max_model_len is None:
                self._tasks.append(asyncio.create_task(self._discover_loop(), name="discover"))

        # The API port last: bound once everything it needs exists.
        self._front, port = await start_front(self.h_api, cfg.server.host, cfg.server.port,
                                              max_body_bytes=cfg.server.max_body_bytes, reuse_port=self.reuse_port)
        self.url = f"http://{_host_for_url(cfg.server.host)}:{port}"

    async def close(self) -> None:
        self.draining = True
        # API port first: stops accepting, waits for in-flight responses up to shutdown_grace_s.
        if self._front is not None:
            await self._front.close(self.cfg.server.shutdown_grace_s)
            self._front = None
        for r in self._runners:
            await r.cleanup()
        self._runners.clear()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks.clear()
        if self._feed is not None and not self.cfg.feed.load_only:
            try:
                pending = self.load.take_pending()
                for rid, (r, t) in pending.items():
                    await self._feed.incr_inflight(rid, r, t)
            except Exception:  # noqa: BLE001
                pass
            if self._own_feed:
                try:
                    await self._feed.close()
                except Exception:  # noqa: BLE001
                    pass
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            await self.pool.close()
        if self._own_tokenizer and self._tokenizer is not None:
            self._tokenizer.close()

    async def _run_sync(self) -> None:
        backoff = 0.5
        while True:
            try:
                self.feed_ok = True
                await self.index_sync.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.feed_ok = False
                log.warning("index sync failed: %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(10.0, backoff * 2)

    async def _inflight_loop(self) -> None:
        """Flush our in-flight changes to the feed's shared counters and read everyone's, every
        `inflight_poll_s`; a zero increment every ~10 s keeps our counters' TTL alive while idle."""
        period = self.cfg.feed.inflight_poll_s
        last_beat = time.monotonic()
        while True:
            await asyncio.sleep(period)
            try:
                pending = self.load.take_pending()
                for rid, (r, t) in pending.items():
                    await self._feed.incr_inflight(rid, r, t)
                if time.monotonic() - last_beat > 10.0:
                    last_beat = time.monotonic()
                    for rid in self.membership.ids():
                        if rid not in pending:
                            await self._feed.incr_inflight(rid, 0, 0)
                shared = await self._feed.inflight()
                self.load.set_shared({rid: (v.reqs, v.prefill_tokens) for rid, v in shared.items()})
                self.feed_ok = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.feed_ok = False
                log.warning("in-flight counters unavailable: %s", exc)
                await asyncio.sleep(1.0)

    async def _keys_reload_loop(self) -> None:
        path = self.cfg.auth.api_keys_file
        while True:
            await asyncio.sleep(self.cfg.auth.api_keys_reload_s)
            mt = _mtime(path)
            if mt and mt != self._keys_mtime:
                try:
                    tenants: dict[str, list[bytes]] = {}
                    for t, keys in self.cfg.auth.api_keys.items():
                        tenants.setdefault(t, []).extend(parse_key_entry(k, allow_plain=False) for k in keys)
                    for t, ds in load_api_keys_file(path).items():
                        tenants.setdefault(t, []).extend(ds)
                    self.auth.replace_keys(ApiKeyStore(tenants))
                    self._keys_mtime = mt
                    log.info("api keys reloaded", extra={"fields": {"tenants": len(tenants)}})
                except Exception as exc:  # noqa: BLE001 - keep the old keys
                    log.error("api keys file invalid, keeping the previous keys: %s", exc)

    async def _discover_model(self, attempts: int = 1) -> None:
        for _ in range(attempts):
            for st in self.membership.all():
                try:
                    async with self.session.get(st.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status != 200:
                            continue
                        data = await r.json()
                    card = (data.get("data") or [{}])[0]
                    name = self.model_name or card.get("id")
                    mml = card.get("max_model_len")
                    if name:
                        self._set_model(name, mml if isinstance(mml, int) else None)
                        if self.max_model_len is not None:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                    continue
            if self.model_name is not None and self.max_model_len is not None:
                return
            await asyncio.sleep(0.3)
        if self.model_name is not None and self.max_model_len is None and self._tokenizer is not None:
            mml = self._tokenizer.model_max_length
            if 0 < mml < 10_000_000:
                self.max_model_len = mml

    async def _discover_loop(self) -> None:
        while self.model_name is None or self.max_model_len is None:
            await self._discover_model(attempts=1)
            await asyncio.sleep(2.0)

    def _members_changed(self, added: list[str], removed: list[str]) -> None:
        sync = getattr(self, "index_sync", None)
        for rid in added:
            if sync is not None:
                sync.follow(rid)
        for rid in removed:
            if sync is not None:
                sync.forget(rid)
            self.index.purge(rid)
            self.load.forget(rid)
            self.calibrator.forget(rid)
        if added or removed:
            log.info("replicas changed", extra={"fields": {"added": added, "removed": removed}})

    # ------------------------------------------------------------------ readiness & state
    def readiness(self) -> tuple[bool, list[str]]:
        why = []
        if self._tokenizer is None:
            why.append("tokenizer not loaded")
        if self.model_name is None:
            why.append("model name unknown (set model.name or make a replica answer /v1/models)")
        if self.max_model_len is None:
            why.append("max_model_len unknown")
        if not self.membership.ids():
            why.append("no replicas")
        elif not self.membership.any_available():
            why.append("no replica available")
        if not self.cfg.feed.load_only and not self.feed_ok:
            why.append("feed not usable")
        if self.draining:
            why.append("draining")
        return not why, why

    def state_for_metrics(self) -> dict:
        st = self.index.stats()
        now = self.membership.clock()
        reps = {}
        for s in self.membership.all():
            ld = self.load.get(s.replica_id)
            reps[s.replica_id] = {"available": s.available(now), "index_live": self.index.is_live(s.replica_id),
                                  "inflight_reqs": ld.inflight_reqs, "active_reqs": ld.active_reqs}
        rates = {rid: (self.calibrator.prefill_s_per_token(rid), self.calibrator.decode_step_s(rid))
                 for rid in self.membership.ids()}
        return {"index_entries": st.entries, "index_bytes": st.bytes_estimate, "index_evictions": st.evictions,
                "index_speculative": st.speculative_entries, "feed_lag": st.feed_lag_s_by_replica,
                "entries_by_replica": st.entries_by_replica, "rates": rates, "replicas": reps,
                "ready": self.readiness()[0]}

    # ------------------------------------------------------------------ admin handlers
    async def h_metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        reg = self.metrics.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and self.cfg.server.workers > 1:
            from prometheus_client import CollectorRegistry, multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            reg.register(StateCollector(self.state_for_metrics))
        body = generate_latest(reg)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def h_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pid": os.getpid()})

    async def h_readyz(self, request: web.Request) -> web.Response:
        ok, why = self.readiness()
        return web.json_response({"ready": ok, "reasons": why}, status=200 if ok else 503)

    async def h_debug_index(self, request: web.Request) -> web.Response:
        st = self.index.stats()
        now = self.membership.clock()
        reps = []
        for s in self.membership.all():
            ld = self.load.get(s.replica_id)
            rep = self.index.last_load(s.replica_id)
            reps.append({
                "replica_id": s.replica_id, "url": s.url, "available": s.available(now), "probe_ok": s.probe_ok,
                "failures": s.failures, "ejected_for_s": max(0.0, s.ejected_until - now), "last_error": s.last_error,
                "index_live": self.index.is_live(s.replica_id), "entries": st.entries_by_replica.get(s.replica_id, 0),
                "feed_lag_s": st.feed_lag_s_by_replica.get(s.replica_id),
                "load_report": None if rep is None else {"running_reqs": rep.running_reqs, "waiting_reqs": rep.waiting_reqs,
                                                         "kv_usage": rep.kv_usage},
                "inflight_reqs": ld.inflight_reqs, "inflight_tokens": ld.inflight_tokens, "active_reqs": ld.active_reqs,
                "others_inflight_reqs": ld.others_reqs,
                "prefill_s_per_token": self.calibrator.prefill_s_per_token(s.replica_id),
                "decode_step_s": self.calibrator.decode_step_s(s.replica_id),
            })
        return web.json_response({
            "model": self.model_name, "block_size": self.cfg.model.block_size, "policy": self.cfg.policy.name,
            "index": {"entries": st.entries, "bytes_estimate": st.bytes_estimate, "evictions": st.evictions,
                      "replicas": st.replicas, "live_replicas": st.live_replicas,
                      "speculative_entries": st.speculative_entries, "max_entries": self.cfg.feed.index_max_entries},
            "replicas": reps,
        })

    async def h_debug_route(self, request: web.Request) -> web.Response:
        """Explain where a request body would go, without sending it. Query: kind=chat|completions,
        tenant=ID (default: the no-auth tenant), user=ID."""
        try:
            raw = await request.read()
            payload = _parse_body(raw)
            kind = request.query.get("kind") or ("chat" if "messages" in payload else "completions")
            if kind not in ("chat", "completions"):
                raise ApiError(400, "kind must be chat or completions", param="kind")
            from gateway.auth import NO_AUTH_TENANT

            ident = Identity(request.query.get("tenant") or NO_AUTH_TENANT, request.query.get("user"), "debug")
            self._check_model(payload)
            salt = self.salter.salt_for(ident.tenant_id, ident.user_id)
            prep = await self._prepare(kind, payload, ident)
            keys = self.keychain.request_keys(prep.first_ids, salt=salt)
            rv, views, decision, decision_s = self._decide(prep, keys, ident)
            out = explain(rv, views, decision, decision_s)
            out["tenant_hash"] = ident.tenant_hash
            return web.json_response(out)
        except ApiError as e:
            return _error_response(e)

    # ------------------------------------------------------------------ API handlers
    async def h_api(self, request: FrontRequest, resp: FrontResponse) -> None:
        """The API port's one entry point (gateway.http_front calls it per request)."""
        kind = _ROUTES.get(request.path)
        if kind is not None:
            await self._handle(request, resp, kind, request.path)
        elif request.path == "/v1/models":
            await self.h_models(request, resp)
        else:
            await _send_error(resp, ApiError(404, f"unknown route {request.method} {request.path}", code="unknown_route"))

    async def h_models(self, request: FrontRequest, resp: FrontResponse) -> None:
        if request.method != "GET":
            return await _method_not_allowed(request, resp, "GET")
        try:
            ident = self.auth.authenticate(request.headers)
        except ApiError as e:
            return await _send_error(resp, e)
        names = sorted(self._served) if self.model_name else []
        pol = self.auth.policies.get(ident.tenant_id)
        if pol is not None and pol.models is not None:
            names = [n for n in names if n in pol.models]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "warmroute", "root": self.model_name,
                 "max_model_len": self.max_model_len} for n in names]
        await resp.send(200, {"Content-Type": _JSON}, _encode({"object": "list", "data": data}))

    def _check_model(self, payload: dict) -> str:
        model = payload.get("model")
        if model is None:
            raise ApiError(400, "missing required field 'model'", param="model", code="missing_required_parameter")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
        if self.model_name is None:
            raise ApiError(503, "the gateway does not know its model yet (no replica answered /v1/models)",
                           code="not_ready")
        if model not in self._served:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    async def _prepare(self, kind: str, payload: dict, ident: Identity) -> "_Prepared":
        tok = self._tokenizer
        from gateway.tokenization import TokenizationError

        t0 = time.perf_counter()
        # NOTE: a thread hop for a short input costs more than the encoding (and, with a busy loop,
        # the worker waits for the GIL up to a switch interval): short inputs tokenize inline.
        inline_max = self.cfg.model.inline_tokenize_max_chars
        stream = payload.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
        so = payload.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        max_tokens = payload.get("max_completion_tokens") if kind == "chat" else None
        if max_tokens is None:
            max_tokens = payload.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            raise ApiError(400, "'max_tokens' must be an integer", param="max_tokens", code="invalid_type")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, "'max_tokens' must be at least 1", param="max_tokens", code="invalid_value")
        try:
            if kind == "chat":
                messages = payload.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
                for i, m in enumerate(messages):
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                        raise ApiError(400, f"messages[{i}] must be an object with a string 'role'",
                                       param="messages", code="invalid_type")
                agp = payload.get("add_generation_prompt", True)
                cfm = payload.get("continue_final_message", False)
                ctk = payload.get("chat_template_kwargs")
                if not isinstance(agp, bool) or not isinstance(cfm, bool):
                    raise ApiError(400, "'add_generation_prompt'/'continue_final_message' must be booleans",
                                   param="add_generation_prompt", code="invalid_type")
                tools = payload.get("tools")
                if payload.get("tool_choice") == "none" and not (ctk or {}).get("include_tools_with_tool_choice_none"):
                    tools = None  # vLLM drops tools from the template when tool_choice is "none" (default)
                if _chat_chars(messages) <= inline_max and not tools:
                    ids = tok.encode_chat(messages, add_generation_prompt=agp, chat_template_kwargs=ctk,
                                          tools=tools, continue_final_message=cfm)
                else:
                    ids = await tok.encode_chat_async(messages, add_generation_prompt=agp, chat_template_kwargs=ctk,
                                                      tools=tools, continue_final_message=cfm)
                prompts = [ids]
            else:
                prompt = payload.get("prompt")
                if prompt is None:
                    raise ApiError(400, "missing required field 'prompt'", param="prompt", code="missing_required_parameter")
                if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
                    if not isinstance(prompt, str) or len(prompt) <= inline_max:
                        prompts = [tok.encode_prompt(prompt)]
                    else:
                        prompts = [await tok.encode_prompt_async(prompt)]
                elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
                    prompts = [await tok.encode_prompt_async(p) for p in prompt]
                else:
                    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those",
                                   param="prompt", code="invalid_type")
        except TokenizationError as exc:
            raise ApiError(400, f"invalid input: {exc}", param="messages" if kind == "chat" else "prompt",
                           code="invalid_prompt") from None
        n_tokens = max(len(p) for p in prompts)
        if n_tokens == 0:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
        mml = self.max_model_len
        if mml is not None:
            where = "messages" if kind == "chat" else "prompt"
            if n_tokens >= mml or (max_tokens is not None and n_tokens + max_tokens > mml):
                raise ApiError(400, f"This model's maximum context length is {mml} tokens. However, you requested "
                                    f"{n_tokens + (max_tokens or 0)} tokens ({n_tokens} in the {where}, "
                                    f"{max_tokens or 0} in the completion). Please reduce the length of the {where} "
                                    f"or completion.", param=where, code="context_length_exceeded")
        tokenize_s = time.perf_counter() - t0
        return _Prepared(kind, prompts[0], sum(len(p) for p in prompts), bool(stream), so, max_tokens or 0, tokenize_s)

    def _decide(self, prep: "_Prepared", keys, ident: Identity):
        from policies.base import RequestView

        t0 = time.perf_counter()
        rv = RequestView(prompt_tokens=len(prep.first_ids), block_size=self.cfg.model.block_size, keys=tuple(keys),
                         max_output_tokens=prep.max_tokens, tenant_hash=ident.tenant_hash if self.auth.enabled else "")
        ids = self.membership.ids()
        now = self.membership.clock()
        index = self.index
        matches = index.match(keys) if keys else {}
        cal = self.calibrator
        reports = {rid: index.last_load(rid) for rid in ids}
        mono = time.monotonic()
        views = build_views(
            ids,
            matches=matches,
            available={rid: self.membership.get(rid).available(now) for rid in ids},
            live={rid: index.is_live(rid) for rid in ids},
            reports=reports,
            loads={rid: self.load.get(rid) for rid in ids},
            rates={rid: (cal.prefill_s_per_token(rid), cal.decode_step_s(rid)) for rid in ids},
            cached_frac={rid: min(1.0, index.entries_of(rid) / rep.num_gpu_blocks)
                         for rid, rep in reports.items() if rep is not None and rep.num_gpu_blocks},
            routed_rps={rid: self.load.routed_rps(rid, mono) for rid in ids},
        )
        decision = self.policy.rank(rv, views, self.rng)
        return rv, views, decision, time.perf_counter() - t0

    async def _handle(self, request: FrontRequest, resp: FrontResponse, kind: str, route: str) -> None:
        t0 = time.perf_counter()
        if request.method != "POST":
            return await _method_not_allowed(request, resp, "POST")
        rid_req = request.headers.get("X-Request-Id")
        if not rid_req or len(rid_req) > 128 or not rid_req.isprintable():
            rid_req = f"wr-{self._id_prefix}-{next(self._req_ids)}"
        status = 500
        replica = "-"
        span = None
        ident: Identity | None = None
        limited = False
        self.active_handlers += 1
        try:
            try:
                ident = self.auth.authenticate(request.headers)
                payload = _parse_body(request.body)  # the front end already bounded its size (413)
                model = self._check_model(payload)
                self.auth.authorize_model(ident, model)
                limited = self.limiter.acquire(ident.tenant_id)
                if self.tracer is not None:
                    span = self._start_span(request, kind, model, ident, rid_req)
                prep = await self._prepare(kind, payload, ident)
                salt = self.salter.salt_for(ident.tenant_id, ident.user_id)
                keys = self.keychain.request_keys(prep.first_ids, salt=salt)
                rv, views, decision, decision_s = self._decide(prep, keys, ident)
                self.metrics.decision.observe(decision_s)
                self.metrics.tokenize.observe(prep.tokenize_s)
                if span is not None:
                    self._decision_span(span, rv, views, decision, decision_s)
                if not decision.ranked:
                    raise ApiError(503, "no replica available", code="no_replica_available", headers={"Retry-After": "1"})
                # Upstream body: the derived salt replaces the client's; canonical model; options we need.
                payload["cache_salt"] = salt
                payload["model"] = self.model_name
                client_usage = bool(prep.stream_options and prep.stream_options.get("include_usage"))
                if prep.stream and self.cfg.proxy.force_include_usage:
                    so = dict(prep.stream_options or {})
                    so["include_usage"] = True
                    payload["stream_options"] = so
                if self.cfg.proxy.kv_cache_report_mode:
                    xa = payload.get("vllm_xargs")
                    xa = dict(xa) if isinstance(xa, dict) else {}
                    xa["kv_cache_report_mode"] = self.cfg.proxy.kv_cache_report_mode
                    payload["vllm_xargs"] = xa
                body = _encode(payload)
                trail = ["-"]
                try:
                    status, replica = await self._proxy(request, resp, route, body, prep, rv, views, decision, keys,
                                                        client_usage, span, rid_req, t0, trail)
                except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                    status, replica = 499, trail[0]
                    raise
            except ApiError as e:
                status = e.status
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    span.set_attribute("error.type", e.code or str(status))
                await _send_error(resp, e, rid_req)
        except Exception as exc:  # noqa: BLE001 - never crash a connection on our own bug
            if isinstance(exc, (ConnectionResetError, asyncio.CancelledError)):
                raise
            log.exception("internal error", extra={"fields": {"request_id": rid_req}})
            status = 500
            if not resp.started:
                await _send_error(resp, ApiError(500, "internal error", code="internal_error"), rid_req)
            elif not resp.finished:  # mid-stream: say so, don't end the body as if it were whole
                try:
                    await resp.write(sse_error_event("gateway internal error", "internal_server_error", "internal_error"))
                    await resp.end()
                except ConnectionResetError:
                    pass
        finally:
            self.active_handlers -= 1
            if limited and ident is not None:
                self.limiter.release(ident.tenant_id)
            elapsed = time.perf_counter() - t0
            self.metrics.request_done(route, status, replica)
            self.metrics.child(self.metrics.e2e, route).observe(elapsed)
            if ident is not None and self.auth.enabled:
                self.metrics.child(self.metrics.tenant_requests, ident.tenant_hash).inc()
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                span.end()
            if self.cfg.telemetry.access_log:
                access_log.info("request", extra={"fields": {
                    "request_id": rid_req, "route": route, "status": status, "replica": replica,
                    "duration_s": round(elapsed, 6),
                    "tenant_hash": ident.tenant_hash if ident is not None else None}})

    # ------------------------------------------------------------------ proxying
    async def _proxy(self, request, resp, route, body, prep, rv, views, decision, keys, client_usage, span, rid_req, t0,
                     trail):
        cfg = self.cfg.proxy
        ranked = decision.ranked[: cfg.max_attempts]
        view_of = {v.replica_id: v for v in views}
        last_failure: UpstreamFailure | None = None
        for n, cand in enumerate(ranked):
            rid = cand.replica_id
            st = self.membership.get(rid)
            if st is None:
                continue
            view = view_of.get(rid)
            predicted = predicted_matched_tokens(rv, view)
            uncached = max(0, prep.total_tokens - predicted)
            flight = self.load.dispatch(rid, uncached, time.monotonic(), prep.max_tokens)
            trail[0] = rid
            if keys:
                self.index.insert_speculative(rid, keys, self.cfg.feed.speculative_ttl_s)
            headers = {"Content-Type": _JSON, "X-Request-Id": rid_req, "Accept-Encoding": "identity"}
            up_span = None
            if span is not None:
                up_span = self._upstream_span(span, rid, st.url + route, n)
                self._propagator.inject(headers, context=_ctx_of(up_span))
            else:
                tp = request.headers.get("traceparent")
                if tp:
                    headers["traceparent"] = tp
            try:
                at = await attempt(self.pool, st.url, route, body, headers, stream=prep.stream,
                                   client_wants_usage=client_usage, first_byte_timeout_s=cfg.first_byte_timeout_s)
            except UpstreamFailure as f:
                flight.finish()
                last_failure = f
                backoff = self.membership.report_failure(rid, f.reason)
                self.metrics.child(self.metrics.ejections, rid).inc()
                self.metrics.child(self.metrics.upstream_errors, rid, f.phase, f.reason).inc()
                log.warning("replica failed before first byte", extra={"fields": {
                    "request_id": rid_req, "replica": rid, "phase": f.phase, "reason": f.reason, "ejected_s": backoff}})
                if up_span is not None:
                    up_span.set_attribute("error.type", f.reason)
                    if f.status:
                        up_span.set_attribute("http.response.status_code", f.status)
                    up_span.end()
                if n + 1 < len(ranked):
                    self.metrics.child(self.metrics.retries, f.phase).inc()
                continue
            except BaseException:
                flight.finish()
                if up_span is not None:
                    up_span.set_attribute("error.type", "cancelled")
                    up_span.end()
                raise
            self.membership.report_success(rid)
            try:
                gone = await self._relay(resp, at, prep, rid, view, predicted, uncached, flight, span, up_span,
                                         t0, cand, rid_req)
            finally:
                flight.finish()
                if up_span is not None:
                    up_span.end()
            return (499 if gone else at.status), rid  # 499: client closed the request
        msg = "no replica could take the request"
        if last_failure is not None:
            msg += f" (last error: {last_failure.reason})"
        raise ApiError(503 if last_failure is None or last_failure.phase != "first_byte" else 504 if last_failure.reason == "timeout" else 502,
                       msg, code="upstream_unavailable", headers={"Retry-After": "1"})

    async def _relay(self, resp: FrontResponse, at: Attempt, prep, rid, view, predicted, uncached, flight, span, up_span,
                     t0, cand, rid_req) -> bool:
        """Send the attempt's answer to the client. Returns True when the client went away."""
        m = self.metrics
        hdrs = {"X-Request-Id": rid_req, "X-Warmroute-Replica": rid}
        if at.resp is None:
            # Whole body in hand (non-stream, or an engine error passed through).
            flight.first_token()
            if up_span is not None:
                up_span.set_attribute("warmroute.ttft_s", at.t_first - at.t_sent)
                up_span.set_attribute("http.response.status_code", at.status)
            if at.status == 200:
                # A non-streamed answer arrives whole: its time is not a TTFT, so no rate sample.
                self._learn(rid, None, uncached, cand, view, span, up_span, predicted, _usage_from_body(at.body), None)
            try:
                await resp.send(at.status, {**hdrs, "Content-Type": at.content_type}, at.body)
            except ConnectionResetError:
                return True
            return False
        relay = at.relay
        flight.first_token()
        ttft = at.t_first - t0
        m.child(m.ttft, rid).observe(ttft)
        if up_span is not None:
            up_span.set_attribute("warmroute.ttft_s", at.t_first - at.t_sent)
            up_span.set_attribute("http.response.status_code", at.status)
        hdrs["Content-Type"] = at.content_type
        hdrs["Cache-Control"] = "no-cache"
        upstream = at.resp
        # Idle timeout without a timer per chunk: one watchdog per stream, re-armed lazily from the
        # time of the last chunk; on expiry it ends the relay as an idle timeout.
        loop = asyncio.get_running_loop()
        idle = self.cfg.proxy.idle_timeout_s
        idle_expired = UpstreamError("io", "idle timeout")
        last = [loop.time()]

        def watchdog() -> None:
            remaining = last[0] + idle - loop.time()
            if remaining > 0:
                handle[0] = loop.call_later(remaining, watchdog)
            else:
                on_end(idle_expired)

        handle = [loop.call_later(idle, watchdog)]
        # `ended`: [DONE] went out together with the end of the chunked body (one send, not two);
        # the upstream is then only read to its end, so its connection goes back to the pool.
        ended = [relay.done]
        done: asyncio.Future = loop.create_future()

        # Chunks are relayed from the upstream connection's callback, not by this task: a task
        # wake-up per token event was most of the gateway's CPU on long streams.
        def on_data(chunk: bytes) -> None:
            last[0] = loop.time()
            try:
                out = relay.feed(chunk)
                if ended[0]:
                    return
                if relay.done:
                    ended[0] = True
                    resp.end_nowait(out)
                elif out:
                    resp.write_nowait(out)
            except Exception:  # noqa: BLE001 - a relay bug ends this stream, nothing else
                log.exception("relay failed", extra={"fields": {"request_id": rid_req}})
                on_end(UpstreamError("io", "relay error"))

        def on_end(err: UpstreamError | None) -> None:
            if not done.done():
                done.set_result(err)

        try:
            # Headers and the first event(s) in one send (and the end of the body, if it came too).
            await resp.start(200, hdrs, at.body, end=ended[0])
            resp.on_flow(upstream.pause_reading, upstream.resume_reading)
            upstream.pipe(on_data, on_end)
            err = await done
            if err is idle_expired:
                upstream.close()  # stop the engine's request, and the pipe: nothing more from it
            if err is not None:
                m.child(m.upstream_errors, rid, "stream", err.reason).inc()
                if span is not None:
                    span.set_attribute("error.type", err.reason)
                if not ended[0]:
                    await resp.write(sse_error_event(f"upstream replica sent nothing for {idle:g}s" if err is idle_expired
                                                     else f"upstream replica failed mid-stream ({err.reason})"))
            elif not ended[0]:
                tail = relay.tail()
                if tail:
                    await resp.write(tail)
                m.child(m.upstream_errors, rid, "stream", "truncated").inc()
                await resp.write(sse_error_event("upstream stream ended without [DONE]"))
            handle[0].cancel()
            await resp.end()
        except ConnectionResetError:
            # Client went away: closing the upstream response aborts the engine's request.
            upstream.close()
            return True
        except asyncio.CancelledError:
            upstream.close()
            raise
        finally:
            handle[0].cancel()
            resp.on_flow(None, None)
            if not upstream.closed:
                upstream.release()
        decode = None
        if relay.content_events >= 3 and relay.t_last_event > relay.t_first_event:
            decode = (relay.t_last_event - relay.t_first_event) / (relay.content_events - 1)
        self._learn(rid, at.t_first - at.t_sent, uncached, cand, view, span, up_span, predicted, relay.usage, decode)
        return False

    def _learn(self, rid, ttft_up_s, uncached, cand, view, span, up_span, predicted, usage, decode_s) -> None:
        """Feed calibration, the policy hook, metrics and span attributes from one finished request.
        `ttft_up_s`: upstream send -> first event of a stream (None for non-streamed answers)."""
        pt, ct, cached = usage_numbers(usage)
        terms = cand.terms
        queued = float(terms.get("backlog_tokens", 0.0)) if terms else 0.0
        actual_uncached = (pt - cached) if (pt is not None and cached is not None) else uncached
        if ttft_up_s is not None:
            self.calibrator.observe_ttft(rid, ttft_up_s, actual_uncached, queued, view.running_reqs if view else 0)
            self.policy.observe(rid, ttft_up_s, actual_uncached)
        if decode_s is not None:
            self.calibrator.observe_token_interval(rid, decode_s)
        m = self.metrics
        if pt is not None:
            m.child(m.prompt_tokens, rid).inc(pt)
        if ct is not None:
            m.child(m.output_tokens, rid).inc(ct)
        agree = None
        if cached is not None:
            agree = m.cache_outcome(rid, predicted, cached)
        if span is not None:
            if pt is not None:
                span.set_attribute("gen_ai.usage.input_tokens", pt)
            if ct is not None:
                span.set_attribute("gen_ai.usage.output_tokens", ct)
            span.set_attribute("warmroute.predicted_cached_tokens", predicted)
            if cached is not None:
                span.set_attribute("warmroute.engine_cached_tokens", cached)
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached)
                span.set_attribute("warmroute.index_accuracy", agree)

    # ------------------------------------------------------------------ tracing helpers
    def _start_span(self, request, kind, model, ident, rid_req):
        from opentelemetry.trace import SpanKind

        ctx = self._propagator.extract(request.headers)
        op = "chat" if kind == "chat" else "text_completion"
        return self.tracer.start_span(f"{op} {model}", context=ctx, kind=SpanKind.SERVER, attributes={
            "gen_ai.operation.name": op,
            "gen_ai.request.model": model,
            "gen_ai.provider.name": "vllm",
            "http.request.method": "POST",
            "url.path": request.path,
            "warmroute.request_id": rid_req,
            "warmroute.tenant_hash": ident.tenant_hash,
        })

    def _decision_span(self, span, rv, views, decision, decision_s) -> None:
        d = self.tracer.start_span("warmroute.route", context=_ctx_of(span), attributes={
            "warmroute.policy": decision.policy,
            "warmroute.winner": decision.winner or "",
            "warmroute.decision_s": decision_s,
            "warmroute.prompt_tokens": rv.prompt_tokens,
            "warmroute.full_blocks": len(rv.keys),
            "warmroute.candidates": len(decision.ranked),
        })
        ranked = {c.replica_id: (i, c) for i, c in enumerate(decision.ranked)}
        for v in views:
            attrs: dict[str, Any] = {"warmroute.replica_id": v.replica_id, "warmroute.healthy": v.healthy,
                                     "warmroute.matched_blocks_gpu": v.matched_blocks_gpu,
                                     "warmroute.matched_blocks_cpu": v.matched_blocks_cpu,
                                     "warmroute.index_live": v.index_live}
            rc = ranked.get(v.replica_id)
            if rc is not None:
                attrs["warmroute.rank"] = rc[0]
                attrs["warmroute.score"] = rc[1].score
                for k, val in rc[1].terms.items():
                    if isinstance(val, (int, float)):
                        attrs[f"warmroute.term.{k}"] = val
            d.add_event("warmroute.candidate", attrs)
        span.set_attribute("warmroute.replica_id", decision.winner or "")
        d.end()

    def _upstream_span(self, span, rid, url, attempt_no):
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span("warmroute.upstream", context=_ctx_of(span), kind=SpanKind.CLIENT, attributes={
            "warmroute.replica_id": rid, "url.full": url, "http.request.method": "POST", "warmroute.attempt": attempt_no})


@dataclass(slots=True)
class _Prepared:
    kind: str  # "chat" | "completions"
    first_ids: list  # token ids of the (first) prompt: the one routed on
    total_tokens: int  # all prompts' tokens (a batch of completions prompts counts them all)
    stream: bool
    stream_options: dict | None
    max_tokens: int  # 0: not given
    tokenize_s: float


def _ctx_of(span):
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)


def _chat_chars(messages: list) -> int:
    """A cheap upper-bound-ish size of a chat's text (string contents and text parts)."""
    n = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict):
                    t = part.get("text")
                    n += len(t) if isinstance(t, str) else 64
                else:
                    n += 64
        else:
            n += 64
    return n


def _parse_body(raw: bytes) -> dict:
    if not raw:
        raise ApiError(400, "empty request body: expected a JSON object", code="invalid_json")
    try:
        payload = _decode(raw)
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise ApiError(400, "request body is not valid UTF-8", code="invalid_encoding") from None
        raise ApiError(400, f"malformed JSON: {text}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return payload


def _usage_from_body(body: bytes):
    if b'"usage"' not in body:
        return None
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return None
    return obj.get("usage") if isinstance(obj, dict) else None


def _error_response(e: ApiError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, headers=e.response_headers())


async def _method_not_allowed(request: FrontRequest, resp: FrontResponse, allowed: str) -> None:
    e = ApiError(405, f"method {request.method} not allowed on {request.path} (use {allowed})",
                 code="method_not_allowed", headers={"Allow": allowed})
    await _send_error(resp, e)


def _bound_port(site: web.TCPSite) -> int:
    server = site._server  # noqa: SLF001 - aiohttp exposes no public accessor for the bound port
    return server.sockets[0].getsockname()[1]


def _host_for_url(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


# ---------------------------------------------------------------------- in-process API
@dataclass
class RunningGateway:
    gateway: Gateway
    url: str  # API base URL, e.g. http://127.0.0.1:PORT
    admin_url: str  # admin base URL

    async def close(self) -> None:
        await self.gateway.close()


async def start_gateway(cfg: GatewayConfig, *, feed=None, tracer_provider=None, tokenizer=None,
                        registry=None) -> RunningGateway:
    """Start a gateway on the running loop (embedded mode, tests). `feed`: a shared Feed object
    (e.g. the in-process one the agents publish to); `tracer_provider`: an OTel TracerProvider
    (None: from the OTEL_* environment, usually none); `tokenizer`: a shared TokenizerService."""
    check_files(cfg)
    if tracer_provider is None:
        tracer_provider = build_tracer_provider(cfg.telemetry.service_name)
    gw = Gateway(cfg, feed=feed, tracer_provider=tracer_provider, tokenizer=tokenizer, registry=registry)
    try:
        await gw.start()
    except BaseException:
        await gw.close()
        raise
    return RunningGateway(gw, gw.url, gw.admin_url)


# ---------------------------------------------------------------------- CLI
def _config_from_args(args) -> GatewayConfig:
    cfg = load_config(getattr(args, "config", None))
    return apply_args(cfg, args)


async def _serve(cfg: GatewayConfig, reuse_port: bool) -> int:
    tp = build_tracer_provider(cfg.telemetry.service_name)
    gw = Gateway(cfg, tracer_provider=tp, reuse_port=reuse_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await gw.start()
        # Everything loaded so far (tokenizer, templates, modules) lives as long as the process:
        # move it out of the collector's reach, or each full collection walks it all (65 ms
        # measured with the default tokenizer) and stalls every stream in flight.
        gc.freeze()
        log.info("gateway serving", extra={"fields": {"url": gw.url, "admin_url": gw.admin_url, "pid": os.getpid()}})
        await stop.wait()
        log.info("draining", extra={"fields": {"grace_s": cfg.server.shutdown_grace_s}})
    finally:
        await gw.close()
        if tp is not None:
            tp.shutdown()
    return 0


def _run_loop(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


def _worker_main(cfg_dict: dict, index: int) -> None:
    from gateway.config import config_from_dict

    cfg = config_from_dict(cfg_dict, env={})
    setup_logging(cfg.telemetry.log_level)
    sys.exit(_run_loop(_serve(cfg, reuse_port=True)))


def main_from_args(args) -> int:
    """`warmroute gateway`: 0 on clean exit, 2 on invalid configuration."""
    if getattr(args, "check_config", None):
        try:
            cfg = load_config(args.check_config)
            check_files(cfg)
            build_authenticator(cfg)
        except (ConfigError, ValueError, OSError) as exc:
            print(f"invalid config {args.check_config}: {exc}", file=sys.stderr)
            return 2
        print(f"config {args.check_config} is valid")
        return 0
    try:
        cfg = _config_from_args(args)
        check_files(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.telemetry.log_level)
    if cfg.server.workers <= 1:
        try:
            return _run_loop(_serve(cfg, reuse_port=False))
        except ConfigError as exc:
            print(f"invalid configuration: {exc}", file=sys.stderr)
            return 2
    return _supervise(cfg)


def _supervise(cfg: GatewayConfig) -> int:
    """Run cfg.server.workers processes on the same ports (SO_REUSEPORT); forward SIGTERM/SIGINT;
    metrics aggregate through prometheus-client's multiprocess directory."""
    import multiprocessing as mp
    import shutil
    import tempfile

    mdir = tempfile.mkdtemp(prefix="warmroute-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mdir
    ctx = mp.get_context("spawn")
    cfg_dict = cfg.to_dict()
    procs = [ctx.Process(target=_worker_main, args=(cfg_dict, i), name=f"warmroute-gw-{i}") for i in range(cfg.server.workers)]
    for p in procs:
        p.start()
    stopping = False

    def _forward(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    rc = 0
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(0.5)
                if not p.is_alive() and not stopping and p.exitcode not in (0, None):
                    log.error("worker exited", extra={"fields": {"worker": p.name, "exitcode": p.exitcode}})
                    rc = 1
                    _forward(signal.SIGTERM, None)
        return rc
    finally:
        shutil.rmtree(mdir, ignore_errors=True)
