"""The Endpoint Picker's decisions: the gateway's request pipeline (gateway.pipeline) behind Envoy.

`pick()` runs the same stages as the HTTP gateway up to the rewrite (authenticate, or take the
tenant from a trusted header; parse; tokenize; salt; keys; decide; the engine's body) and
answers Envoy with the ranked replicas as `ip:port` (primary first, then the fallbacks Envoy
tries on a connect failure, at most `proxy.max_attempts`) and the rewritten body; the request's
work is counted on the primary from then on. An error the pipeline answers (401, 400, 404, 429,
503 ...) becomes an ImmediateResponse in OpenAI's error shape. The client's credentials are
removed from what Envoy forwards to the engine.
The engine's tokenizer routes (`/tokenize`, `/detokenize`: gateway.engine_routes) are admitted the
same way and sent untouched to the replicas that serve the model, in turn. A Responses request
the engines store (`responses.store`) is recorded on its primary before Envoy sends it on
(gateway.stored_responses; its answer, which the picker does not read, is asked of that replica
when a follow-up needs it), and a follow-up goes to its previous response's replica only, as do
the routes naming a stored response (`GET /v1/responses/{id}`, cancel: gateway.response_routes,
admitted the same way and sent untouched).
`observe()` gets what the response path saw: the replica that answered (when Envoy retried,
the primary is reported failed, as the HTTP gateway's dispatch would), its status, usage, time
to first event and decode interval, and whether the stream ended early; it ends the in-flight
count, learns (rates, the policy's hook, the index-accuracy check) and finishes the request
(metrics, span, logs).
Replicas are named by their URL's `host:port`, which is what Envoy's endpoints are: use pod IPs
(`--dns-service` with a headless Service, or static URLs with IPs).
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from gateway.adapters import not_loaded
from gateway.auth import Identity
from gateway.dispatch import start_try
from gateway.engine_routes import ENGINE_ROUTES
from gateway.epp.extproc import Outcome, Pick, Reject
from gateway.errors import ApiError
from gateway.pipeline import ROUTES, outcome_of
from gateway.response_routes import method_of, route_of
from gateway.server import API_PATHS, Gateway

__all__ = ["PipelinePicker", "endpoint_of"]

log = logging.getLogger("warmroute.epp")

_CLIENT_CREDENTIALS = ("authorization", "x-api-key")


def endpoint_of(url: str) -> str:
    """`host:port` of a replica URL (the name Envoy gives the endpoint)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PipelinePicker:
    """`gateway.epp.server.Picker` over a started `Gateway` (module header)."""

    def __init__(self, gw: Gateway, *, trusted_tenant_header: str | None = None) -> None:
        self.gw = gw
        self.trusted_tenant_header = trusted_tenant_header.lower() if trusted_tenant_header else None

    def _endpoints(self) -> dict[str, str]:
        """replica id -> endpoint."""
        return {st.replica_id: endpoint_of(st.url) for st in self.gw.membership.all()}

    async def pick(self, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None) -> Pick | Reject:
        pipeline = self.gw.pipeline
        if pipeline is None:
            return Reject.from_api_error(ApiError(503, "the picker is still starting", code="not_ready"))
        path = headers.get(":path", "").partition("?")[0]
        stored = route_of(path)  # (route template, response id) of a stored response's route
        if path not in ROUTES and path not in ENGINE_ROUTES and stored is None:
            return Reject.from_api_error(ApiError(404, f"unknown route {path} (served: {API_PATHS})", code="unknown_route"))
        route, want = (path, "POST") if stored is None else (stored[0], method_of(stored[0]))
        if headers.get(":method", "POST") != want:
            return Reject.from_api_error(ApiError(405, f"method {headers.get(':method')} not allowed on {route} (use {want})",
                                                  code="method_not_allowed", headers={"Allow": want}))
        endpoints = self._endpoints()
        only = None if subset is None else {rid for rid, ep in endpoints.items() if ep in set(subset)}
        ctx = pipeline.new_context(route, headers)
        try:
            if stored is not None:  # to the replica that holds it (gateway.response_routes)
                st = await self.gw.response_routes.holder(ctx, stored[1], identity=self._trusted_identity(headers))
                return Pick(body=body, endpoints=[endpoints[st.replica_id]], ctx=ctx, remove_headers=_CLIENT_CREDENTIALS)
            if path in ENGINE_ROUTES:
                return await self._pick_for_engine_route(ctx, body, only, endpoints)
            await pipeline.prepare(ctx, body, identity=self._trusted_identity(headers), only=only)
        except ApiError as e:
            ctx.status, ctx.error = e.status, e.code or ""
            ctx.span.error(e.code or str(e.status), e.status)
            pipeline.finish(ctx)
            return Reject.from_api_error(e)
        except BaseException:
            pipeline.finish(ctx)
            raise
        ranked = ctx.routing.decision.ranked[: self.gw.cfg.proxy.max_attempts]
        start_try(self.gw.routing, ctx, 0, ranked[0])
        if ctx.response_id is not None:  # a response the engine stores: recorded before Envoy sends it on
            await pipeline.record_response(ctx, ranked[0].replica_id)
        return Pick(body=ctx.body, endpoints=[endpoints[c.replica_id] for c in ranked if c.replica_id in endpoints],
                    ctx=ctx, remove_headers=_CLIENT_CREDENTIALS, strip_usage=not ctx.request.client_wants_usage)

    async def _pick_for_engine_route(self, ctx, body: bytes, only: set[str] | None, endpoints: dict[str, str]) -> Pick:
        """/tokenize and /detokenize (gateway.engine_routes): admitted as the HTTP gateway admits
        them, sent untouched to the available replicas that serve the model, in turn."""
        engine = self.gw.engine_routes
        serving = await engine.admit(ctx, body, identity=self._trusted_identity(ctx.headers))
        if only is not None:
            serving = only if serving is None else only & serving
        ready = engine.ready(serving)
        ctx.replica = ready[0].replica_id
        return Pick(body=body, endpoints=[endpoints[st.replica_id] for st in ready if st.replica_id in endpoints],
                    ctx=ctx, remove_headers=_CLIENT_CREDENTIALS, strip_usage=False)

    def _trusted_identity(self, headers: Mapping[str, str]) -> Identity | None:
        if self.trusted_tenant_header is None:
            return None
        tenant = headers.get(self.trusted_tenant_header)
        if not tenant:
            raise ApiError(401, f"missing the tenant header set by the gateway in front ({self.trusted_tenant_header})",
                           code="missing_tenant")
        return Identity(tenant, None, "trusted-header")

    def observe(self, ctx, outcome: Outcome) -> None:
        gw, tr = self.gw, ctx.attempt
        served = self._served(ctx, outcome, ctx.replica if tr is None else tr.replica_id)
        if tr is None:  # an engine route: nothing in flight, nothing to learn
            return gw.pipeline.finish(ctx)
        if ctx.response_id is not None and served != tr.replica_id:  # Envoy retried: stored there instead
            gw.pipeline.stored.moved(ctx.response_id, served)
        tr.flight.first_token()
        if ctx.request.background and ctx.response_id is not None and ctx.status == 200:
            gw.pipeline.hold_background(ctx, served)  # the picker reads no answer: the watch asks whether it is final
        tr.flight.finish()
        if ctx.status == 404:  # an adapter the replica listed and has unloaded since (gateway.adapters)
            not_loaded(gw.model, served, ctx.lora)
        m = gw.metrics
        if outcome.ttft_s is not None:
            m.child(m.ttft, served).observe(outcome.ttft_s)
        if outcome.ended_early:
            m.child(m.upstream_errors, served, "stream", "ended early").inc()
            ctx.span.error("ended early")
        elif ctx.status == 200 and served == tr.replica_id:
            gw.pipeline.learn(ctx, outcome_of(tr, ttft_s=outcome.ttft_s, usage=outcome.usage,
                                              decode_step_s=outcome.decode_s, choices=ctx.request.n))
        gw.pipeline.finish(ctx)

    def _served(self, ctx, outcome: Outcome, primary: str) -> str:
        """The replica that answered, and the request's status; a primary Envoy retried away from
        refused the connection: reported failed, as the HTTP gateway's dispatch would."""
        gw = self.gw
        served = self._replica_of(outcome.served_endpoint) or primary
        if served != primary:
            gw.membership.report_failure(primary, "connect failed (retried by the proxy)")
            gw.metrics.child(gw.metrics.retries, "connect").inc()
        ctx.replica = served
        ctx.status = outcome.status or 502
        return served

    def _replica_of(self, endpoint: str | None) -> str | None:
        if not endpoint:
            return None
        for rid, ep in self._endpoints().items():
            if ep == endpoint:
                return rid
        return None
