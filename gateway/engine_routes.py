"""The engine's tokenizer routes on the API port: `POST /tokenize` and `POST /detokenize`, answered
by one replica as vLLM answers them.

Clients of vLLM count a prompt's tokens with `/tokenize` (and turn ids back into text with
`/detokenize`); behind the gateway they keep doing so. Rules:
- Authenticated and limited as the generation routes are (401; 403 for a model the tenant may not
  use; 429 over its limits); `model` is optional, as vLLM's is (absent: the base model), and when
  given it is checked as theirs (gateway.parse: 400, 404, 503; an adapter loaded at run time is
  looked up first). The body goes to the engine untouched: it judges the other fields.
- One available replica answers, taken in turn among those that serve the model (an adapter's name:
  the replicas that list it). A failure before the answer (refused, 5xx, nothing within
  `proxy.first_byte_timeout_s`) ejects that replica as a generation request's failure does, and the
  next is tried, at most `proxy.max_attempts`; none left: 503, 502 or 504 (gateway.dispatch). The
  answer goes to the client as the engine gave it (an error re-shaped to OpenAI's: gateway.relay).
- Nothing is salted, keyed, predicted, traced or learnt, and flow control does not hold these
  requests: tokenizing caches nothing and takes no engine step. They are counted and logged as the
  generation routes are (the `route` label is their path).
"""
from __future__ import annotations

import itertools
from typing import Collection

from gateway.auth import Identity
from gateway.dispatch import Dispatcher, exhausted
from gateway.errors import ApiError
from gateway.http_front import FrontRequest, FrontResponse, send_error
from gateway.membership import ReplicaState
from gateway.proxy import UpstreamFailure, attempt
from gateway.relay import send_whole
from gateway.tracing import NO_SPAN

__all__ = ["ENGINE_ROUTES", "EngineRoutes"]

ENGINE_ROUTES = ("/tokenize", "/detokenize")


class EngineRoutes:
    """Serves ENGINE_ROUTES with the pipeline's admission, counting and logging (module rules)."""

    def __init__(self, pipeline, dispatcher: Dispatcher) -> None:
        self.pipeline = pipeline  # gateway.pipeline.Pipeline (its serve wrapper, admission and finish)
        self.dispatcher = dispatcher  # its pool, membership, proxy settings and failure reports
        self._turn = itertools.count()

    async def handle(self, request: FrontRequest, resp: FrontResponse) -> None:
        if request.method != "POST":
            return await send_error(resp, ApiError(405, f"method {request.method} not allowed on {request.path} (use POST)",
                                                   code="method_not_allowed", headers={"Allow": "POST"}))
        await self.pipeline.serve(request, resp, self._answer)

    async def _answer(self, ctx, raw_body: bytes, resp: FrontResponse) -> int:
        d = self.dispatcher
        ready = self.ready(await self.admit(ctx, raw_body))
        last: UpstreamFailure | None = None
        for n, st in enumerate(ready):
            ctx.replica = st.replica_id
            headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id, "Accept-Encoding": "identity"}
            try:
                at = await attempt(d.pool, st.url, ctx.route, raw_body, headers, stream=False, client_wants_usage=False,
                                   first_byte_timeout_s=d.proxy.first_byte_timeout_s)
            except UpstreamFailure as f:
                last = f
                d.failed(ctx, f, NO_SPAN, retrying=n + 1 < len(ready))
                continue
            d.membership.report_success(st.replica_id)
            r = await send_whole(resp, at, {"X-Request-Id": ctx.request_id, "X-Warmroute-Replica": st.replica_id})
            return 499 if r.client_gone else at.status
        raise exhausted(last)

    async def admit(self, ctx, raw_body: bytes, *, identity: Identity | None = None) -> frozenset[str] | None:
        """Who asks (`identity`: already established by a trusted front), for which model, within the
        tenant's limits; the replicas that serve that model (None: all)."""
        p = self.pipeline
        model = await p.authorize(ctx, raw_body, identity=identity, model_optional=True)
        return p.model.replicas_for(p.model.lora_of(model))

    def ready(self, serving: Collection[str] | None) -> list[ReplicaState]:
        """The replicas to try, in order: the available ones in `serving` (None: any), starting
        from the next in turn, at most `proxy.max_attempts`; none: 503."""
        d = self.dispatcher
        now = d.membership.clock()
        ready = [st for st in d.membership.all() if st.available(now) and (serving is None or st.replica_id in serving)]
        if not ready:
            raise ApiError(503, "no replica available", code="no_replica_available", headers={"Retry-After": "1"})
        start = next(self._turn)
        return [ready[(start + n) % len(ready)] for n in range(min(len(ready), d.proxy.max_attempts))]
