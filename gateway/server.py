"""The gateway service's lifecycle: what one gateway process owns, in what order it starts and stops.

Start: the admin port first (so /healthz answers while the tokenizer loads), the tokenizer, the
feed and its index consumer, health probes and DNS discovery, API-key reloads, model discovery and
the replicas' LoRA adapters, the tokenizer check, then the request pipeline (gateway.pipeline) and
last the API port (gateway.http_front), once everything it needs exists. Close: the API port first (stop accepting, finish in-flight requests
up to `shutdown_grace_s`), then the admin port, the background loops, a last flush of our
in-flight counters, the feed, the connection pools and the tokenizer.

The parts: `assemble` builds what needs no network (auth, salt, policy); `routing.RoutingState`
holds the index, load and rates; `membership` the replicas' health; `background` the loops;
`admin` the admin port. Public API: `start_gateway(cfg, *, feed=None, tracer_provider=None,
tokenizer=None, registry=None) -> RunningGateway` (.url, .admin_url, .gateway, `await close()`)
for embedded use and tests; the CLI is gateway.serve.
"""
from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from functools import partial

import aiohttp
import msgspec
from aiohttp import web

from gateway.adapters import AdapterLookup
from gateway.admin import build_admin_app
from gateway.assemble import build_authenticator, build_policy, build_salter
from gateway.auth import TenantLimiter
from gateway.background import (discover_model, flush_inflight, keep_alive_check_s, refresh_adapters, run_adapter_discovery,
                                run_index_sync, run_inflight_exchange, run_keep_alive, run_keys_reload,
                                run_model_discovery, run_share_exchange, trouble)
from gateway.config import GatewayConfig, check_files
from gateway.dispatch import Dispatcher
from gateway.engine_routes import ENGINE_ROUTES, EngineRoutes
from gateway.errors import ApiError
from gateway.flow import FlowControl
from gateway.http_front import FrontRequest, FrontResponse, FrontServer, send_error, start_front
from gateway.index import KVIndex
from gateway.index_sync import IndexSync
from gateway.keepalive import KeepAlive, Retainer
from gateway.load import ROUTED_TAU_S, LoadTracker
from gateway.membership import Membership, MembershipRunner
from gateway.model import ModelInfo
from gateway.pipeline import ROUTES, Pipeline
from gateway.proxy import make_session
from gateway.response_routes import CANCEL_ROUTE, GET_ROUTE, PREFIX, ResponseRoutes
from gateway.routing import RoutingState
from gateway.state import describe, readiness, state_for_metrics
from gateway.stored_responses import StoredResponses, fetcher
from gateway.telemetry import Metrics, StateCollector, build_tracer_provider
from gateway.tokenization import TokenizerService
from gateway.tokenize_check import TokenizeChecker
from gateway.tracing import Tracing
from gateway.upstream import UpstreamPool
from policies.calibration import Calibrator
from replica_agent.feed import Feed, fair_share_board, open_feed, stored_turn_board

__all__ = ["Gateway", "RunningGateway", "start_gateway"]

log = logging.getLogger("warmroute.gateway")


class Gateway:
    """All state of one gateway process; see the module header."""

    def __init__(self, cfg: GatewayConfig, *, feed: Feed | None = None, tracer_provider=None,
                 tokenizer: TokenizerService | None = None, registry=None, reuse_port: bool = False,
                 api_port: bool = True) -> None:
        self.cfg = cfg
        self.api_port = api_port  # serve the OpenAI API (False: the Envoy picker is the front)
        self.reuse_port = reuse_port  # share the ports with sibling workers (SO_REUSEPORT)
        self.feed = feed  # a Feed, or None: opened from cfg.feed.url at start
        self._own_feed = feed is None
        self.tokenizer = tokenizer  # None: loaded at start
        self._own_tokenizer = tokenizer is None
        self.auth = build_authenticator(cfg)
        self.salter = build_salter(cfg)
        self.policy = build_policy(cfg)
        self.limiter = TenantLimiter(self.auth.policies)
        self.metrics = Metrics(registry, max_tenant_labels=cfg.telemetry.max_tenant_labels)
        self.metrics.registry.register(StateCollector(self.state_for_metrics))
        self.tracing = Tracing(tracer_provider)
        m = cfg.membership
        self.membership = Membership(eject_base_s=m.eject_base_s, eject_max_s=m.eject_max_s,
                                     probe_timeouts_to_down=m.health_timeouts_to_down)
        if m.replicas:
            self.membership.set_members({r.id: r.url for r in m.replicas})
        self.routing = RoutingState(
            KVIndex(max_entries=cfg.feed.index_max_entries, stale_after_s=cfg.feed.stale_after_s),
            LoadTracker(routed_tau_s=getattr(self.policy, "routed_tau_s", ROUTED_TAU_S)),
            Calibrator(prior_prefill_s_per_token=cfg.policy.prior_prefill_s_per_token,
                       prior_decode_step_s=cfg.policy.prior_decode_step_s),
            speculative_ttl_s=cfg.feed.speculative_ttl_s, media_history_ttl_s=cfg.feed.media_history_ttl_s)
        self.model = ModelInfo(cfg.model.name, cfg.model.aliases, cfg.model.block_size, cfg.model.max_model_len,
                               cfg.model.lora_adapters)
        self.flow = FlowControl(cfg, routing=self.routing, membership=self.membership, limiter=self.limiter,
                                slots=cfg.flow.max_num_seqs or int(getattr(self.policy, "max_num_seqs", 256)),
                                registry=self.metrics.registry, tenant_label=self.metrics.tenant_label)
        self.share_health = trouble("feed (flow control's fair shares)")
        self.feed_health = trouble("feed (index sync)")
        self.board_health = trouble("feed (shared in-flight counters)")
        self.index_sync: IndexSync | None = None
        k = cfg.keep_alive
        # keep-alive of the plan's long roots (gateway.keepalive)
        # refreshes of a root another gateway refreshes wait one check and two exchanges longer, and
        # 50 ms to spare (gateway.keepalive): by then its refresh has counted here as a use
        defer_s = keep_alive_check_s(k.idle_s) + 2 * cfg.feed.inflight_poll_s + 0.05
        self.retainer = (Retainer(KeepAlive.from_config(k, cfg.model.block_size, defer_s=defer_s), rank=random.random())
                         if k.enabled else None)
        if k.enabled and cfg.policy.name != "cache_plan":  # not an error: flags may set the policy after the file
            log.warning("keep_alive is enabled but only cache_plan plans roots to keep; with policy %s nothing is kept",
                        cfg.policy.name)
        self.session: aiohttp.ClientSession | None = None  # probes and model discovery
        self.pool: UpstreamPool | None = None  # proxied requests (the hot path)
        self.pipeline: Pipeline | None = None  # the request path, once everything it needs exists
        self.engine_routes: EngineRoutes | None = None  # /tokenize and /detokenize (gateway.engine_routes), likewise
        self.response_routes: ResponseRoutes | None = None  # a stored response by id (gateway.response_routes), likewise
        self.tokenize_checker: TokenizeChecker | None = None  # sampled /tokenize checks (gateway.tokenize_check)
        self.mrunner: MembershipRunner | None = None
        self._front: FrontServer | None = None  # the API port
        self._admin: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self.draining = False
        self.url = ""
        self.admin_url = ""

    # convenience views of the routing state (admin, metrics, tests)
    @property
    def index(self) -> KVIndex:
        return self.routing.index

    @property
    def load(self) -> LoadTracker:
        return self.routing.load

    @property
    def calibrator(self) -> Calibrator:
        return self.routing.calibrator

    @property
    def keychain(self):
        return self.model.keychain

    # ------------------------------------------------------------------ lifecycle
    def _load_tokenizer(self) -> TokenizerService:
        cfg = self.cfg.model
        tok = TokenizerService(cfg.tokenizer_dir, max_workers=cfg.tokenizer_workers, chat_template=cfg.chat_template,
                               chat_template_content_format=cfg.chat_template_content_format,
                               default_chat_template_kwargs=cfg.default_chat_template_kwargs,
                               interleave_mm_strings=cfg.interleave_mm_strings)
        tok.warm_up()  # the first request would compile the chat template (off the loop here)
        return tok

    async def start(self) -> None:
        cfg = self.cfg
        self.session = make_session(cfg.proxy.pool_limit, cfg.proxy.connect_timeout_s)
        self.pool = UpstreamPool(connect_timeout_s=cfg.proxy.connect_timeout_s, max_idle_per_host=cfg.proxy.pool_limit)
        await self._start_admin()
        if self.tokenizer is None:
            self.tokenizer = await asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        if not cfg.feed.load_only:
            self._start_feed()
        await self._start_membership()
        if cfg.auth.enabled and cfg.auth.api_keys_file:
            self._spawn(run_keys_reload(self.auth, cfg.auth), "keys-reload")
        if not self.model.known or self.model.max_model_len is None:
            fallback = self.tokenizer.model_max_length
            await discover_model(self.session, self.membership, self.model, attempts=3, fallback_max_model_len=fallback)
            if not self.model.known or self.model.max_model_len is None:
                self._spawn(run_model_discovery(self.session, self.membership, self.model, fallback), "discover")
        if cfg.model.lora_discovery_s > 0:
            await refresh_adapters(self.session, self.membership, self.model)
            self._spawn(run_adapter_discovery(self.session, self.membership, self.model, cfg.model.lora_discovery_s),
                        "lora-discovery")
        self.tokenize_checker = TokenizeChecker(cfg.model.tokenize_check_s, self.session, self.metrics)
        dispatcher = Dispatcher(self.pool, self.membership, self.routing, self.metrics, cfg.proxy, self.model)
        self.pipeline = Pipeline(
            cfg, auth=self.auth, limiter=self.limiter, salter=self.salter, model=self.model, tokenizer=self.tokenizer,
            routing=self.routing, membership=self.membership, policy=self.policy, dispatcher=dispatcher,
            metrics=self.metrics, tracing=self.tracing, flow=self.flow, retainer=self.retainer,
            tokenize_checker=self.tokenize_checker, adapter_lookup=self._adapter_lookup(), stored=self._stored())
        self.engine_routes = EngineRoutes(self.pipeline, dispatcher)
        self.response_routes = ResponseRoutes(self.pipeline, dispatcher)
        if self.retainer is not None:
            self._spawn(run_keep_alive(self.retainer, cfg.keep_alive, session=self.session, membership=self.membership,
                                       index=self.index, model=self.model, metrics=self.metrics,
                                       health=trouble("replicas (keep-alive refreshes)"), routing=self.routing), "keep-alive")
        if cfg.flow.enabled:
            self._spawn(self.flow.run(), "flow")
        if self.api_port:
            self._front, port = await start_front(self.h_api, cfg.server.host, cfg.server.port,
                                                  max_body_bytes=cfg.server.max_body_bytes, reuse_port=self.reuse_port)
            self.url = f"http://{_host_for_url(cfg.server.host)}:{port}"

    def _stored(self) -> StoredResponses | None:
        """Stored Responses' records (gateway.stored_responses), when the engines store responses."""
        r = self.cfg.responses
        if not r.store:
            return None
        board = None if self.cfg.feed.load_only else stored_turn_board(self.feed, ttl_s=r.ttl_s)
        return StoredResponses(board, fetcher(self.session, self.membership, self.cfg.proxy.first_byte_timeout_s),
                               max_turns=r.max_turns, metrics=self.metrics)

    def _adapter_lookup(self) -> AdapterLookup | None:
        """Names not served looked up among the replicas' adapters (gateway.adapters), while discovery is on."""
        if self.cfg.model.lora_discovery_s <= 0:
            return None
        return AdapterLookup(self.model, partial(refresh_adapters, self.session, self.membership, self.model))

    async def _start_admin(self) -> None:
        runner = web.AppRunner(build_admin_app(self), access_log=None, handler_cancellation=True)
        await runner.setup()
        self._admin = runner
        site = web.TCPSite(runner, self.cfg.server.host, self.cfg.server.admin_port, reuse_port=self.reuse_port or None)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp has no public accessor
        self.admin_url = f"http://{_host_for_url(self.cfg.server.host)}:{port}"

    def _start_feed(self) -> None:
        if self.feed is None:
            self.feed = open_feed(self.cfg.feed.url, inflight_ttl_s=self.cfg.feed.inflight_ttl_s)
        # Follow exactly the pool's replicas (an agent's --replica-id must equal the gateway's id).
        self.index_sync = IndexSync(self.feed, self.routing.index, replicas=self.membership.ids(), health=self.feed_health)
        self.routing.freshen = self.index_sync.wake
        self._spawn(run_index_sync(self.index_sync, self.feed_health), "index-sync")
        self.routing.share_copies = True
        flow_on = self.cfg.flow.enabled
        self._spawn(run_inflight_exchange(self.feed, self.routing.load, self.board_health, self.cfg.feed.inflight_poll_s,
                                          routing=self.routing, policy=self.policy,
                                          busy=self.flow.contended if flow_on else None,
                                          busy_period_s=self.cfg.flow.busy_exchange_s, retainer=self.retainer), "inflight")
        if flow_on:
            self._spawn(run_share_exchange(self.flow, fair_share_board(self.feed), self.share_health,
                                           self.cfg.flow.share_interval_s, self.cfg.flow.busy_exchange_s), "flow-shares")

    async def _start_membership(self) -> None:
        m = self.cfg.membership
        self.mrunner = MembershipRunner(
            self.membership, self.session, health_path=m.health_path, health_interval_s=m.health_interval_s,
            health_timeout_s=m.health_timeout_s, dns_service=m.dns_service, dns_port=m.dns_port,
            dns_refresh_s=m.dns_refresh_s, on_change=self._members_changed)
        if m.dns_service:
            await self.mrunner.resolve_once()
            self._spawn(self.mrunner.dns_loop(), "dns")
        self._spawn(self.mrunner.probe_loop(), "probes")

    def _spawn(self, coro, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def close(self) -> None:
        self.draining = True
        self.flow.close()  # held requests get 503 now rather than the grace period's abort
        if self._front is not None:  # stops accepting; in-flight responses get shutdown_grace_s
            await self._front.close(self.cfg.server.shutdown_grace_s)
            self._front = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.tokenize_checker is not None:
            await self.tokenize_checker.close()
        if self.pipeline is not None and self.pipeline.stored is not None:
            await self.pipeline.holds.close()
            await self.pipeline.stored.close()
        if self.feed is not None and not self.cfg.feed.load_only:
            await self._close_feed()
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            await self.pool.close()
        if self._own_tokenizer and self.tokenizer is not None:
            self.tokenizer.close()

    async def _close_feed(self) -> None:
        try:
            await flush_inflight(self.feed, self.routing.load)
        except Exception:  # noqa: BLE001 - best effort: the counters' TTL ends them anyway
            pass
        if self._own_feed:
            try:
                await self.feed.close()
            except Exception:  # noqa: BLE001
                pass

    def _members_changed(self, added: list[str], removed: list[str]) -> None:
        for rid in added:
            if self.index_sync is not None:
                self.index_sync.follow(rid)
        for rid in removed:
            if self.index_sync is not None:
                self.index_sync.forget(rid)
            self.routing.forget(rid)
            self.model.forget_replica(rid)
            if self.tokenize_checker is not None:
                self.tokenize_checker.drift.forget(rid)
        if added or removed:
            log.info("replicas changed", extra={"fields": {"added": added, "removed": removed}})

    # ------------------------------------------------------------------ state (admin, metrics)
    @property
    def feed_ok(self) -> bool:
        return not self.feed_health.failing and not self.board_health.failing

    def readiness(self) -> tuple[bool, list[str]]:
        ok, why = readiness(self)
        note = self.flow.readiness_note()  # degraded but serving: said, without failing readiness
        return ok, why + [note] if note else why

    def state_for_metrics(self) -> dict:
        return state_for_metrics(self)

    def describe(self) -> dict:
        return describe(self)

    # ------------------------------------------------------------------ the API port
    async def h_api(self, request: FrontRequest, resp: FrontResponse) -> None:
        """The API port's one entry point (gateway.http_front calls it per request)."""
        if request.path in ROUTES:
            await self.pipeline.handle(request, resp)
        elif request.path == "/v1/models":
            await self.h_models(request, resp)
        elif request.path in ENGINE_ROUTES:
            await self.engine_routes.handle(request, resp)
        elif request.path.startswith(PREFIX):
            await self.response_routes.handle(request, resp)
        else:
            await send_error(resp, ApiError(404, f"unknown route {request.method} {request.path} (served: {API_PATHS})",
                                            code="unknown_route"))

    async def h_models(self, request: FrontRequest, resp: FrontResponse) -> None:
        if request.method != "GET":
            return await send_error(resp, ApiError(405, f"method {request.method} not allowed on {request.path} (use GET)",
                                                   code="method_not_allowed", headers={"Allow": "GET"}))
        try:
            ident = self.auth.authenticate(request.headers)
        except ApiError as e:
            return await send_error(resp, e)
        names = sorted(self.model.served)
        pol = self.auth.policies.get(ident.tenant_id)
        if pol is not None and pol.models is not None:
            names = [n for n in names if n in pol.models]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "warmroute", "root": self.model.name,
                 "parent": self.model.name if n in self.model.adapters else None,
                 "max_model_len": self.model.max_model_len} for n in names]
        await resp.send(200, {"Content-Type": "application/json"}, _encode({"object": "list", "data": data}))


API_PATHS = ", ".join([*ROUTES, GET_ROUTE, CANCEL_ROUTE, "/v1/models", *ENGINE_ROUTES])  # named in an unknown route's 404


def _host_for_url(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


_encode = msgspec.json.encode


# ---------------------------------------------------------------------- in-process API
@dataclass
class RunningGateway:
    gateway: Gateway
    url: str  # API base URL, e.g. http://127.0.0.1:PORT
    admin_url: str  # admin base URL

    async def close(self) -> None:
        await self.gateway.close()


async def start_gateway(cfg: GatewayConfig, *, feed: Feed | None = None, tracer_provider=None,
                        tokenizer: TokenizerService | None = None, registry=None) -> RunningGateway:
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
