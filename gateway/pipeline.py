"""The request pipeline: one request's stages, in order, over one `RequestContext`.

    admit      authenticate (gateway.auth), parse the body and check the model (gateway.parse; a
               name not served is looked up among the replicas' adapters first: gateway.adapters),
               tenant limits, start the trace span (gateway.tracing)
    plan       validate the request (gateway.parse; a Responses follow-up gets its stored history and
               its previous response's replica: gateway.stored_responses), tokenize (gateway.encode), derive the salt
               (gateway.salt), block keys (hashing.keys; a LoRA adapter's carry its name, and only
               the replicas that have it may be picked: gateway.model; a chat with media, the keys
               standing for its blocks past the first item: hashing.history_keys), decide (gateway.routing)
    flow       go on while a replica has room, else wait in the fair queue and decide again at
               release (gateway.flow); then the policy records the placement (`placed`: once per
               request, whatever ranked it before)
    rewrite    the engine's body (gateway.rewrite; a response the engine stores gets its id)
    dispatch   the ranked retry loop (gateway.dispatch)
    relay      the answer to the client (gateway.relay; a stored response's record is written
               before its first byte goes out, its answer added once whole)
    learn      rates, policy hook, index accuracy (gateway.learn); now and then the replica's own
               tokenization of the request, checked in the background (gateway.tokenize_check)
    finish     metrics, span end, logs, limiter release (a background response's slot, grant and
               in-flight count are kept until its engine ends it: gateway.background_holds)

Both fronts run these stages and no copy of them: the HTTP port calls `handle()`; the Envoy
picker calls `admit`/`plan`/`rewrite` through `prepare()`, lets Envoy proxy, and calls `learn()`
and `finish()` from the response it observes. Every error the gateway answers itself is an
`ApiError` in OpenAI's shape; a bug in a stage answers 500 (or ends a started stream with an error
event) and loses nothing else.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from functools import partial
from typing import Awaitable, Callable, Collection, Mapping

from gateway.adapters import AdapterLookup
from gateway.auth import Authenticator, Identity, TenantLimiter
from gateway.background_holds import BackgroundHolds
from gateway.chat_messages import history_units
from gateway.config import GatewayConfig
from gateway.context import RESPONSES, Outcome, RequestContext, Try
from gateway.dispatch import Dispatcher
from gateway.encode import MediaTokens, tokenize
from gateway.errors import ApiError, sse_error_event
from gateway.flow import FlowControl
from gateway.http_front import FrontRequest, FrontResponse, send_error
from gateway.keepalive import Retainer, planned_root
from gateway.learn import learn
from gateway.membership import Membership
from gateway.model import ModelInfo
from gateway.parse import check_model, parse_body, parse_request
from gateway.proxy import Attempt
from gateway.relay import relay, send_whole
from gateway.rewrite import upstream_body
from gateway.routing import RoutingState, queued_prefill_tokens
from gateway.responses_api import kept_messages, turn_messages, with_history
from gateway.salt import SaltDeriver
from gateway.stored_responses import StoredResponses, Turn, final_output, lost_response, not_found
from gateway.telemetry import Metrics
from gateway.tokenization import TokenizerService
from gateway.tokenize_check import TokenizeChecker
from gateway.tracing import NO_SPAN, Tracing
from hashing.history_keys import history_keys
from policies.base import Policy, RequestView

__all__ = ["Pipeline", "ROUTES", "outcome_of"]

log = logging.getLogger("warmroute.gateway")
access_log = logging.getLogger("warmroute.gateway.access")

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}  # path -> kind
Answer = Callable[[RequestContext, bytes, FrontResponse], Awaitable[int]]  # serves a request; the client's status


class Pipeline:
    """The stages of the module header, with what they need."""

    def __init__(self, cfg: GatewayConfig, *, auth: Authenticator, limiter: TenantLimiter, salter: SaltDeriver,
                 model: ModelInfo, tokenizer: TokenizerService, routing: RoutingState, membership: Membership,
                 policy: Policy, dispatcher: Dispatcher, metrics: Metrics, tracing: Tracing, flow: FlowControl,
                 retainer: Retainer | None = None, tokenize_checker: TokenizeChecker | None = None,
                 adapter_lookup: AdapterLookup | None = None, stored: StoredResponses | None = None) -> None:
        self.cfg = cfg
        self.auth = auth
        self.limiter = limiter
        self.salter = salter
        self.model = model
        self.tokenizer = tokenizer
        self.media_tokens = MediaTokens()  # a media item's tokens, learned from the answers (gateway.encode)
        self.routing = routing
        self.membership = membership
        self.policy = policy
        self.rng = random.Random(cfg.policy.seed)  # the policy's tie-breaks
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.tracing = tracing
        self.flow = flow
        self.retainer = retainer  # keep-alive of the plan's long roots (gateway.keepalive); None: off
        self.tokenize_checker = tokenize_checker  # sampled /tokenize checks (gateway.tokenize_check); None: none
        self.adapter_lookup = adapter_lookup  # names not served looked up (gateway.adapters); None: discovery off
        self.stored = stored  # stored Responses (gateway.stored_responses); None: the engines store none
        rc = cfg.responses
        self.holds = None if stored is None else BackgroundHolds(  # background responses still running
            stored.fetch, poll_s=rc.background_poll_s, max_s=rc.background_max_s, answered=stored.answered, count=stored.count)
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()

    # ------------------------------------------------------------------ the HTTP front
    async def handle(self, request: FrontRequest, resp: FrontResponse) -> None:
        """A chat or completions request on the API port, answered on `resp`."""
        if request.method != "POST":
            return await send_error(resp, ApiError(405, f"method {request.method} not allowed on {request.path} (use POST)",
                                                   code="method_not_allowed", headers={"Allow": "POST"}))
        await self.serve(request, resp, self._generate)

    async def serve(self, request: FrontRequest, resp: FrontResponse, answer: Answer, *, route: str | None = None) -> None:
        """`answer(ctx, body, resp)`, which returns the client's status, over a new context: an
        ApiError answered in OpenAI's shape, a client gone counted 499, a bug answered 500, and
        `finish` whatever happened (the generation routes, gateway.engine_routes and
        gateway.response_routes). `route`: the path's template, counted in its stead."""
        ctx = self.new_context(route or request.path, request.headers)
        try:
            await self._serve(ctx, request.body, resp, answer)
        finally:
            self.finish(ctx)

    async def _generate(self, ctx: RequestContext, body: bytes, resp: FrontResponse) -> int:
        await self.prepare(ctx, body)
        return await self.dispatcher.run(ctx, partial(self._answer, resp))

    async def _serve(self, ctx: RequestContext, body: bytes, resp: FrontResponse, answer: Answer) -> None:
        try:
            try:
                ctx.status = await answer(ctx, body, resp)
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                ctx.status = 499
                raise
            except ApiError as e:
                ctx.status, ctx.error = e.status, e.code or ""
                ctx.span.error(e.code or str(e.status), e.status)
                await send_error(resp, e, ctx.request_id)
        except Exception as exc:  # noqa: BLE001 - never crash a connection on our own bug
            if isinstance(exc, ConnectionResetError):
                raise
            log.exception("internal error", extra={"fields": {"request_id": ctx.request_id}})
            ctx.status = 500
            await _internal_error(resp, ctx.request_id, responses=ctx.kind == RESPONSES)

    async def _answer(self, resp: FrontResponse, ctx: RequestContext, at: Attempt, up_span) -> int:
        """Relay stage for the HTTP front: send the attempt's answer, then learn from it."""
        tr = ctx.attempt
        tr.flight.first_token()
        self.flow.first_token()
        up_span.set("warmroute.ttft_s", at.t_first - at.t_sent)
        up_span.set("http.response.status_code", at.status)
        headers = {"X-Request-Id": ctx.request_id, "X-Warmroute-Replica": tr.replica_id}
        if ctx.response_id is not None and at.status == 200:
            await self.record_response(ctx, tr.replica_id)
        elif at.status == 404 and ctx.request.previous_response_id is not None and lost_response(at.body):
            self.stored.engine_lost(tr.replica_id, time.monotonic())
        r = None
        try:
            if at.resp is None:
                r = await send_whole(resp, at, headers)
                ttft_s = None  # a whole answer's time is not a time to first token
            else:
                m = self.metrics
                m.child(m.ttft, tr.replica_id).observe(at.t_first - ctx.t0)
                r = await relay(resp, at, headers, idle_timeout_s=self.cfg.proxy.idle_timeout_s, request_id=ctx.request_id)
                if r.error is not None:
                    m.child(m.upstream_errors, tr.replica_id, "stream", r.error).inc()
                    ctx.span.error(r.error)
                ttft_s = at.t_first - at.t_sent
        finally:  # the client may have left mid-stream: a background response runs on all the same
            if ctx.request.background and ctx.response_id is not None and at.status == 200 and \
                    final_output(None if r is None else r.final) is None:
                self.hold_background(ctx)
        if ctx.response_id is not None and r.final is not None:
            self.stored.answered(ctx.response_id, r.final)
        if r.client_gone:
            return 499  # the client closed the request
        if at.status == 200:
            self.learn(ctx, outcome_of(tr, ttft_s=ttft_s, usage=r.usage, decode_step_s=r.decode_step_s, choices=ctx.request.n))
        return at.status

    # ------------------------------------------------------------------ the stages
    def new_context(self, route: str, headers: Mapping[str, str]) -> RequestContext:
        rid = headers.get("X-Request-Id")
        if not rid or len(rid) > 128 or not rid.isprintable():
            rid = f"wr-{self._id_prefix}-{next(self._ids)}"
        return RequestContext(rid, route, ROUTES.get(route) or route.strip("/"), headers, time.perf_counter(), span=NO_SPAN)

    async def prepare(self, ctx: RequestContext, raw_body: bytes, *, identity: Identity | None = None,
                      only: Collection[str] | None = None) -> None:
        """admit, plan, flow and rewrite: afterwards `ctx.body` goes to `ctx.routing`'s ranked replicas.
        `identity`: already established by a trusted front (skips authentication); `only`: the
        replicas that may be picked (None: all)."""
        await self.admit(ctx, raw_body, identity=identity)
        await self.plan(ctx, only=only)
        self.metrics.tokenize.observe(ctx.prompt.tokenize_s)
        if ctx.routing.decision.ranked:  # may wait, and then decide again (late binding)
            await self.flow.hold(ctx, partial(self.decide, only=ctx.only))
        routing = ctx.routing
        self.metrics.decision.observe(routing.decision_s)
        extra = ctx.flow.span_attrs() if ctx.flow is not None and self.tracing.enabled else None
        if ctx.history_keys:  # a chat with media: its keys past the first item (hashing.history_keys)
            extra = {**(extra or {}), "warmroute.history_blocks": len(ctx.history_keys)}
        ctx.span.decision(routing, extra)
        if not routing.decision.ranked:
            raise ApiError(503, "no replica available", code="no_replica_available", headers={"Retry-After": "1"})
        self.routing.placed(self.policy, routing.request, routing.decision)  # once, as sent (rank may have run twice)
        p = self.cfg.proxy
        prio = (0 if ctx.flow.light else 1) if self.cfg.flow.engine_priority and ctx.flow is not None else None
        ctx.engine_priority = prio
        if self.stored is not None and ctx.kind == RESPONSES and ctx.payload.get("store", True) is not False:
            ctx.response_id = self.stored.new_id()
        ctx.body = upstream_body(ctx.payload, ctx.request, salt=ctx.salt, model_name=ctx.lora or self.model.name,
                                 force_include_usage=p.force_include_usage, kv_cache_report_mode=p.kv_cache_report_mode,
                                 engine_priority=prio, response_id=ctx.response_id)

    async def admit(self, ctx: RequestContext, raw_body: bytes, *, identity: Identity | None = None) -> None:
        """Who asks, for which model, within the tenant's limits; the trace span starts here."""
        model = await self.authorize(ctx, raw_body, identity=identity)
        ctx.span = self.tracing.request_span(ctx, model)

    async def authorize(self, ctx: RequestContext, raw_body: bytes, *, identity: Identity | None = None,
                        model_optional: bool = False) -> str:
        """Who asks (`identity`: already established by a trusted front), for which model (absent and
        `model_optional`: the base model, as vLLM's /tokenize takes it), within the tenant's limits."""
        ctx.identity = identity if identity is not None else self.auth.authenticate(ctx.headers)
        ctx.payload = parse_body(raw_body)  # the front already bounded its size (413)
        if model_optional and "model" not in ctx.payload:
            model = self.model.name
            if model is None:
                raise ApiError(503, "the gateway does not know its model yet (no replica answered /v1/models)",
                               code="not_ready")
        else:
            model = await self._served_model(ctx.payload)
        self.auth.authorize_model(ctx.identity, model)
        ctx.limited = int(self.limiter.acquire(ctx.identity.tenant_id))
        return model

    async def _served_model(self, payload: dict) -> str:
        """The requested model, if served (gateway.parse.check_model; else an adapter looked up)."""
        try:
            return check_model(payload, self.model.served, self.model.known)
        except ApiError as e:  # an adapter loaded since the last discovery round is served at once
            if e.code != "model_not_found" or self.adapter_lookup is None:
                raise
            if not await self.adapter_lookup.find(payload["model"]):
                raise
            return payload["model"]

    async def plan(self, ctx: RequestContext, *, only: Collection[str] | None = None) -> None:
        """Validate, tokenize, salt, key and decide (`ctx.identity` and `ctx.payload` are set)."""
        ident: Identity = ctx.identity
        ctx.request = parse_request(ctx.kind, ctx.payload, ctx.payload["model"], stored_responses=self.stored is not None)
        if ctx.limited and ctx.request.sequences > 1:  # a slot per sequence the engine runs
            ctx.limited += self.limiter.widen(ident.tenant_id, ctx.request.sequences - 1)
        if ctx.request.previous_response_id is not None:
            only = await self._follow(ctx, only)
        self.routing.freshen()  # the index reads the engines' latest events while we tokenize
        ctx.prompt = await tokenize(self.tokenizer, ctx.request, inline_max_chars=self.cfg.model.inline_tokenize_max_chars,
                                    max_model_len=self.model.max_model_len, media=self.media_tokens)
        ctx.salt = self.salter.salt_for(ident.tenant_id, ident.user_id)
        ctx.lora = self.model.lora_of(ctx.request.model)
        serving = self.model.replicas_for(ctx.lora)  # an adapter some replicas load: only those
        if serving is not None:
            only = serving if only is None else serving & set(only)
        ctx.only = only
        ctx.keys = self.model.keychain.request_keys(ctx.prompt.first_ids, salt=ctx.salt, lora=ctx.lora)
        if ctx.prompt.last_ids is not None:
            ctx.last_keys = self.model.keychain.request_keys(ctx.prompt.last_ids, salt=ctx.salt, lora=ctx.lora)
        if ctx.prompt.media_items and ctx.request.reads_cache and self.routing.media_history_ttl_s > 0:
            chain, bs = self.model.keychain, self.model.block_size
            units = history_units(ctx.request.messages, in_part_order=self.tokenizer.media_in_part_order(ctx.request.tools))
            ctx.history_keys = tuple(history_keys(ctx.keys[-1] if ctx.keys else chain.root, ctx.prompt.first_ids[len(ctx.keys) * bs:],
                                                  units, bs, salt=ctx.salt, lora=ctx.lora))
        rv = RequestView(prompt_tokens=ctx.prompt.routed_tokens, block_size=self.model.block_size,
                         # an engine that reads no cached blocks for it: no replica holds any (routed by load)
                         keys=(*ctx.keys, *ctx.history_keys) if ctx.request.reads_cache else (), max_output_tokens=ctx.request.max_tokens,
                         tenant_hash=ident.tenant_hash if ident.identified else "", request_id=ctx.request_id,
                         lora=ctx.lora)
        self.decide(ctx, rv, only=only)

    async def _follow(self, ctx: RequestContext, only: Collection[str] | None) -> set[str]:
        """A Responses follow-up: its stored history put in, and its previous response's replica the
        only one it may go to (gateway.stored_responses)."""
        prev = ctx.request.previous_response_id
        holder, history = await self.stored.history(prev, ctx.identity.tenant_hash)
        if self.membership.get(holder) is None:
            raise not_found(prev, "previous_response_id", why="the replica that stored it has left the pool")
        ctx.request = with_history(ctx.request, ctx.payload, history)
        return {holder} if only is None or holder in only else set()

    async def record_response(self, ctx: RequestContext, replica_id: str) -> None:
        """The record of the response `replica_id` stores for `ctx` (gateway.stored_responses)."""
        said = kept_messages(turn_messages(ctx.payload.get("input")))
        await self.stored.record(ctx.response_id, Turn(replica_id, ctx.identity.tenant_hash,
                                                       ctx.request.previous_response_id, said))

    def decide(self, ctx: RequestContext, rv: RequestView | None = None, *, only: Collection[str] | None = None) -> None:
        """Rank the replicas for the request (`rv`, else the one decided before: flow control's
        late binding) as the index, load and health stand now; `only`: the replicas that may be
        picked (None: all)."""
        now = self.membership.clock()
        available = {st.replica_id: st.available(now) for st in self.membership.all()
                     if only is None or st.replica_id in only}
        ctx.routing = self.routing.decide(rv or ctx.routing.request, available, self.policy, self.rng)

    def learn(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Learn stage: rates, the policy's hook, metrics and span attributes of one answer."""
        lesson = learn(outcome, self.routing.calibrator, self.policy)
        if self.media_tokens.observe(ctx.prompt, lesson.prompt_tokens):
            self.metrics.media_item_tokens.set(self.media_tokens.per_item)
        agreement = self.metrics.record_lesson(lesson)
        ident = ctx.identity
        if ident is not None and ident.identified:
            self.metrics.record_tenant_usage(ident.tenant_hash, lesson)
        if lesson.cached_tokens is not None and lesson.predicted_cached_tokens is not None:  # the index check (gateway.index_health)
            self.routing.checked(lesson.replica_id, lesson.predicted_cached_tokens, lesson.cached_tokens, lesson.queued_s)
        ctx.span.outcome(lesson, agreement)
        if self.retainer is not None:
            self._keep(ctx, lesson.replica_id)
        if self.tokenize_checker is not None:
            st = self.membership.get(lesson.replica_id)
            if st is not None:
                self.tokenize_checker.after_answer(lesson.replica_id, st.url, ctx.request, ctx.payload,
                                                   ctx.lora or self.model.name, ctx.prompt.first_ids, prefix=ctx.prompt.cut)

    def _keep(self, ctx: RequestContext, replica_id: str) -> None:
        """The served replica keeps the request's planned root (gateway.keepalive), with the token
        ids, salt and LoRA adapter a refresh needs (copied only when the root is new there)."""
        cand = next((c for c in ctx.routing.decision.ranked if c.replica_id == replica_id), None)
        if cand is None:
            return
        root = planned_root(cand.terms)
        ids, salt, lora, n = ctx.prompt.first_ids, ctx.salt, ctx.lora, root * self.model.block_size
        if 0 < n < len(ids):
            self.retainer.used(replica_id, ctx.keys, root, time.monotonic(), lambda: (tuple(ids[: n + 1]), salt, lora))

    def hold_background(self, ctx: RequestContext, holder: str | None = None) -> None:
        """A background response not yet final: its tenant's slot, flow control's grant and its
        replica's in-flight count stay held until its engine (`holder`, else the replica it was sent
        to) says it ended (gateway.background_holds)."""
        tr = ctx.attempt
        flight, ticket, tenant, slots = tr.flight.handed_over(), ctx.flow, ctx.identity.tenant_id, ctx.limited
        ctx.flow, ctx.limited = None, 0  # the request's own end releases none of them now

        def release() -> None:
            flight.finish()
            self.flow.release(ticket)
            if slots:
                self.limiter.release(tenant, slots)
        self.holds.watch(holder or tr.replica_id, ctx.response_id, release)

    def finish(self, ctx: RequestContext) -> None:
        """Release the tenant's slot; count, trace and log the request (whatever happened)."""
        ident = ctx.identity
        self.flow.finished(ctx)
        if ctx.limited:
            self.limiter.release(ident.tenant_id, ctx.limited)
        elapsed = time.perf_counter() - ctx.t0
        m = self.metrics
        m.request_done(ctx.route, ctx.status, ctx.replica)
        m.child(m.e2e, ctx.route).observe(elapsed)
        if ident is not None and ident.identified:
            m.child(m.tenant_requests, m.tenant_label(ident.tenant_hash)).inc()
        ctx.span.set("http.response.status_code", ctx.status)
        ctx.span.end()
        fields = {"request_id": ctx.request_id, "route": ctx.route, "status": ctx.status, "replica": ctx.replica,
                  "duration_s": round(elapsed, 6), "tenant_hash": ident.tenant_hash if ident is not None else None}
        if self.cfg.telemetry.access_log:
            access_log.info("request", extra={"fields": fields})
        elif ctx.status in (401, 403, 429):  # refusals are worth a line even with the access log off
            log.info("request refused", extra={"fields": {**fields, "error": ctx.error}})


def outcome_of(tr: Try, *, ttft_s: float | None, usage, decode_step_s: float | None, choices: int = 1) -> Outcome:
    """What the learner needs of an answered attempt (its prediction and the queue it saw); with
    `choices` (n) > 1 a stream carries n events a decode step, so its intervals are no step time."""
    return Outcome(tr.replica_id, ttft_s, tr.predicted_cached_tokens, tr.uncached_tokens,
                   queued_prefill_tokens(tr.view), tr.view.running_reqs if tr.view is not None else 0, usage,
                   decode_step_s if choices == 1 else None)


async def _internal_error(resp: FrontResponse, request_id: str, *, responses: bool = False) -> None:
    if not resp.started:
        await send_error(resp, ApiError(500, "internal error", code="internal_error"), request_id)
    elif not resp.finished:  # mid-stream: say so, don't end the body as if it were whole
        try:
            await resp.write(sse_error_event("gateway internal error", "internal_server_error", "internal_error",
                                             responses=responses))
            await resp.end()
        except ConnectionResetError:
            pass
