"""The routes that name a stored response, answered by the replica that holds it
(gateway.stored_responses): `GET /v1/responses/{id}` (the response; `?stream=true`, with
`starting_after`, replays a background response's events as vLLM does) and
`POST /v1/responses/{id}/cancel` (a background response).

Rules:
- Authenticated (401) and held to the tenant's request rate (429), not to its concurrent
  requests: asking after or cancelling a response adds no work to an engine, and a tenant whose
  background responses hold all its slots (gateway.background_holds) can still do both.
  The response must be one the tenant stored through a gateway of this pool: anything else, a
  replica that has left the pool, or a gateway not told the engines store responses
  (`responses.store`) is 404 `response_not_found`, as vLLM answers an id it does not hold.
- The request goes to the holder only, its query string and body as the client sent them; the
  holder unavailable: 503; refused, or answering 5xx, it is ejected as after a generation
  request's failure (502); no answer within `proxy.first_byte_timeout_s`: 504, and not ejected
  (vLLM's replay of a background response asked for events past its last one waits for more). The answer goes to the client as the engine gave it (an error
  re-shaped to OpenAI's), streamed when it is a stream; a whole response read on its way is
  the record's answer when the record has none yet.
- Counted and logged as the other routes are, under the route templates `/v1/responses/{id}`
  and `/v1/responses/{id}/cancel` (never the id itself); nothing is keyed, predicted or learnt,
  and flow control does not hold them: a stored response takes no new engine step.
"""
from __future__ import annotations

import time

from gateway.auth import Identity
from gateway.dispatch import Dispatcher, exhausted
from gateway.errors import ApiError
from gateway.http_front import FrontRequest, FrontResponse, send_error
from gateway.membership import ReplicaState
from gateway.proxy import UpstreamFailure, attempt
from gateway.relay import relay, send_whole
from gateway.stored_responses import lost_response, not_found
from gateway.tracing import NO_SPAN

__all__ = ["PREFIX", "GET_ROUTE", "CANCEL_ROUTE", "ResponseRoutes", "route_of", "method_of"]

PREFIX = "/v1/responses/"
GET_ROUTE = "/v1/responses/{id}"
CANCEL_ROUTE = "/v1/responses/{id}/cancel"


def route_of(path: str) -> tuple[str, str] | None:
    """(route template, response id) of a path under PREFIX; None: not one of these routes."""
    rest = path[len(PREFIX):] if path.startswith(PREFIX) else ""
    rid, _, tail = rest.partition("/")
    if not rid or tail not in ("", "cancel") or (tail and not rest.endswith("/cancel")):
        return None
    return (CANCEL_ROUTE if tail else GET_ROUTE), rid


def method_of(route: str) -> str:
    return "POST" if route == CANCEL_ROUTE else "GET"


class ResponseRoutes:
    """Serves GET_ROUTE and CANCEL_ROUTE (module rules)."""

    def __init__(self, pipeline, dispatcher: Dispatcher) -> None:
        self.pipeline = pipeline  # gateway.pipeline.Pipeline (authentication, limits, the records, finish)
        self.dispatcher = dispatcher  # its pool, membership, proxy settings and failure reports

    async def handle(self, request: FrontRequest, resp: FrontResponse) -> None:
        found = route_of(request.path)
        if found is None:
            return await send_error(resp, ApiError(404, f"unknown route {request.method} {request.path}",
                                                   code="unknown_route"))
        route, rid = found
        want = method_of(route)
        if request.method != want:
            return await send_error(resp, ApiError(405, f"method {request.method} not allowed on {route} (use {want})",
                                                   code="method_not_allowed", headers={"Allow": want}))

        async def answer(ctx, body: bytes, client: FrontResponse) -> int:
            return await self._answer(ctx, rid, request, client)
        await self.pipeline.serve(request, resp, answer, route=route)

    async def holder(self, ctx, rid: str, *, identity: Identity | None = None) -> ReplicaState:
        """Who asks (`identity`: already established by a trusted front), within the tenant's
        limits, and the available replica that holds their response `rid` (module rules)."""
        p, d = self.pipeline, self.dispatcher
        ctx.identity = identity if identity is not None else p.auth.authenticate(ctx.headers)
        # polling or cancelling adds no work: a tenant whose background responses hold all its slots
        # (gateway.background_holds) can still ask after them, at its request rate
        ctx.limited = int(p.limiter.acquire(ctx.identity.tenant_id, slot=False))
        if p.stored is None:
            raise not_found(rid, "response_id", why="this gateway was not told the engines store responses")
        turn = await p.stored.holder(rid, ctx.identity.tenant_hash, param="response_id")
        st = d.membership.get(turn.replica_id)
        if st is None:
            raise not_found(rid, "response_id", why="the replica that stored it has left the pool")
        ctx.replica = st.replica_id
        if not st.available(d.membership.clock()):
            raise ApiError(503, "the replica holding this response is unavailable", code="no_replica_available",
                           headers={"Retry-After": "1"})
        return st

    async def _answer(self, ctx, rid: str, request: FrontRequest, client: FrontResponse) -> int:
        p, d = self.pipeline, self.dispatcher
        st = await self.holder(ctx, rid)
        path = request.path + (f"?{request.query_string}" if request.query_string else "")
        headers = {"X-Request-Id": ctx.request_id, "Accept-Encoding": "identity"}
        if request.method == "POST":
            headers["Content-Type"] = "application/json"
        try:
            at = await attempt(d.pool, st.url, path, request.body, headers, stream=True, client_wants_usage=True,
                               first_byte_timeout_s=d.proxy.first_byte_timeout_s, method=request.method)
        except UpstreamFailure as f:
            if f.phase == "connect" or f.status is not None:  # the replica's failure: ejected
                d.failed(ctx, f, NO_SPAN, retrying=False)
            else:  # nothing yet: vLLM's replay of a background response waits for events past the last one
                d.metrics.child(d.metrics.upstream_errors, st.replica_id, f.phase, f.reason).inc()
            raise exhausted(f) from None
        d.membership.report_success(st.replica_id)
        if at.status == 404 and lost_response(at.body):
            p.stored.engine_lost(st.replica_id, time.monotonic())
        out = {"X-Request-Id": ctx.request_id, "X-Warmroute-Replica": st.replica_id}
        if at.resp is None:
            r = await send_whole(client, at, out)
        else:
            r = await relay(client, at, out, idle_timeout_s=p.cfg.proxy.idle_timeout_s, request_id=ctx.request_id)
        if r.final is not None and r.final.get("id") == rid:
            p.stored.answered(rid, r.final)
        return 499 if r.client_gone else at.status
