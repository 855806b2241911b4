"""The admin port (aiohttp): metrics, probes and the debug views. Keep it cluster-internal.

    GET  /            this list, as JSON
    GET  /metrics     Prometheus text (every worker's, aggregated, with --workers N)
    GET  /healthz     liveness: 200 {"status": "ok"} while the process serves
    GET  /readyz      readiness: 200 when the gateway can route, else 503 with the reasons; "degraded"
                      lists what makes routing worse without stopping it (gateway.state)
    GET  /debug/index the index and every replica's state (health, load, feed lag, rates)
    POST /debug/route where a request body would go, and why, without sending it: every replica's
                      inputs, rank, score and score terms. Query: kind=chat|completions|responses
                      (default: from the body), tenant=ID (whose salt; or send the tenant's own
                      `Authorization` header; with authentication on, one of the two is required)
Every error is JSON in OpenAI's shape (unknown path 404, wrong method 405 with `Allow`).
"""
from __future__ import annotations

import os

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

from gateway.auth import NO_AUTH_TENANT, Identity
from gateway.context import RequestContext
from gateway.errors import ApiError
from gateway.parse import check_model, parse_body
from gateway.pipeline import ROUTES
from gateway.routing import explain
from gateway.state import degraded
from gateway.telemetry import StateCollector
from gateway.tracing import NO_SPAN

__all__ = ["build_admin_app", "ENDPOINTS"]

ENDPOINTS = {
    "GET /": "this list",
    "GET /metrics": "Prometheus metrics",
    "GET /healthz": "liveness (200 while the process serves)",
    "GET /readyz": "readiness (200 when the gateway can route; else 503 with reasons)",
    "GET /debug/index": "the KV index and every replica's health, load, feed lag and rates",
    "POST /debug/route?kind=chat|completions|responses&tenant=ID": "explain where a request body would go, without sending it",
}
_ROUTE_OF_KIND = {kind: path for path, kind in ROUTES.items()}  # chat, completions, responses


def build_admin_app(gw) -> web.Application:
    """The admin app over a `gateway.server.Gateway`."""
    async def index(request: web.Request) -> web.Response:
        return web.json_response({"endpoints": ENDPOINTS})

    async def metrics(request: web.Request) -> web.Response:
        return _metrics(gw)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pid": os.getpid()})

    async def readyz(request: web.Request) -> web.Response:
        ok, why = gw.readiness()
        return web.json_response({"ready": ok, "reasons": why, "degraded": degraded(gw)}, status=200 if ok else 503)

    async def debug_index(request: web.Request) -> web.Response:
        return web.json_response(gw.describe())

    async def debug_route(request: web.Request) -> web.Response:
        return await _debug_route(gw, request)

    app = web.Application(middlewares=[_json_errors])
    for path, handler in (("/", index), ("/metrics", metrics), ("/healthz", healthz), ("/readyz", readyz),
                          ("/debug/index", debug_index), ("/debug/replicas", debug_index)):
        app.router.add_get(path, handler)
    app.router.add_post("/debug/route", debug_route)
    return app


@web.middleware
async def _json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(ApiError(405, f"method {request.method} not allowed on {request.path} (use {allowed})",
                               code="method_not_allowed", headers={"Allow": allowed}))
    except web.HTTPNotFound:
        return _error(ApiError(404, f"unknown admin path {request.path} (GET / lists them)", code="unknown_route"))


def _error(e: ApiError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, headers=e.response_headers())


def _metrics(gw) -> web.Response:
    reg = gw.metrics.registry
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and gw.cfg.server.workers > 1:
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        reg.register(StateCollector(gw.state_for_metrics))
    return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _debug_route(gw, request: web.Request) -> web.Response:
    pipeline = gw.pipeline
    if pipeline is None:
        raise ApiError(503, "the gateway is still starting", code="not_ready")
    payload = parse_body(await request.read())
    kind = request.query.get("kind") or ("chat" if "messages" in payload else "responses" if "input" in payload
                                         else "completions")
    if kind not in _ROUTE_OF_KIND:
        raise ApiError(400, "kind must be chat, completions or responses", param="kind")
    check_model(payload, gw.model.served, gw.model.known)
    ident = _debug_identity(gw, request)
    ctx = RequestContext("debug", _ROUTE_OF_KIND[kind], kind, request.headers, 0.0, identity=ident,
                         payload=payload, span=NO_SPAN)
    await pipeline.plan(ctx)
    r = ctx.routing
    out = explain(r.request, r.views, r.decision, r.decision_s)
    out["tenant_hash"] = ident.tenant_hash
    out["policy_params"] = _policy_params(pipeline.policy)
    return web.json_response(out)


def _debug_identity(gw, request: web.Request) -> Identity:
    tenant = request.query.get("tenant")
    if tenant:
        return Identity(tenant, request.query.get("user"), "debug")
    if not gw.auth.enabled:
        return Identity(NO_AUTH_TENANT, None, "none")
    if request.headers.get("Authorization") or request.headers.get("X-Api-Key"):
        return gw.auth.authenticate(request.headers)
    raise ApiError(400, "authentication is on: say whose request this is with ?tenant=ID (or send that "
                        "tenant's Authorization header); the salt, and so the cache match, depend on it",
                   param="tenant", code="missing_tenant")


def _policy_params(policy) -> dict:
    params = getattr(policy, "params", None)
    return params() if callable(params) else {}
