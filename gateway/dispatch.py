"""Dispatch stage: try the ranked replicas in order until one answers.

Rules:
- At most `proxy.max_attempts` replicas, best first. Before each try the request's work is
  counted on that replica (`RoutingState.dispatched`: in flight until its first token, its keys
  speculatively in the index), and that count ends in a `finally` around the try *and* the
  answer, so no failure path (refusal, timeout, cancellation, a bug) leaves it behind.
- A failure before the first byte (`proxy.UpstreamFailure`: refused, 5xx, no first event in
  `first_byte_timeout_s`) ejects the replica with backoff (`Membership.report_failure`) and the
  next one is tried: the client has seen nothing yet. When every try failed the client gets
  503 (nothing tried), 504 (the last one timed out) or 502, with `Retry-After`.
- The first answer goes to `answer(ctx, attempt, upstream_span)` (the front's relay), whose
  result (the HTTP status the client got) is returned.
- A replica that answers 404 for a LoRA adapter it listed (gateway.model: discovered, not
  configured) has unloaded it: the adapter leaves its listing (gateway.adapters.not_loaded) and
  the next ranked replica, which lists it, is tried; the last one's 404 goes to the client as it is.
- A body carrying flow control's vLLM priority that the replica refuses (400, rewrite.
  refuses_priority: an engine not run with `--scheduling-policy priority`) is sent again to the
  same replica without it, and that replica gets no priority for PRIORITY_RETRY_S (one warning):
  a misconfigured engine serves its requests in arrival order instead of failing them.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from gateway.adapters import not_loaded
from gateway.config import ProxyConfig
from gateway.context import RequestContext, Try
from gateway.errors import ApiError
from gateway.membership import Membership
from gateway.model import ModelInfo
from gateway.proxy import Attempt, UpstreamFailure, attempt
from gateway.rewrite import PRIORITY_RETRY_S, PriorityRefusals, refuses_priority, without_priority
from gateway.routing import RoutingState, predicted_matched_tokens, reported_cached_tokens
from gateway.telemetry import Metrics
from gateway.upstream import UpstreamPool
from policies.base import Candidate

__all__ = ["Dispatcher", "Answer", "start_try", "exhausted"]

log = logging.getLogger("warmroute.gateway")

Answer = Callable[[RequestContext, Attempt, object], Awaitable[int]]


class Dispatcher:
    def __init__(self, pool: UpstreamPool, membership: Membership, routing: RoutingState, metrics: Metrics,
                 proxy: ProxyConfig, model: ModelInfo | None = None) -> None:
        self.pool = pool
        self.model = model  # the adapters' listings (module rules); None: no adapter is dropped
        self.membership = membership
        self.routing = routing
        self.metrics = metrics
        self.proxy = proxy
        self.refusals = PriorityRefusals()  # replicas that refused flow control's priority lately

    async def run(self, ctx: RequestContext, answer: Answer) -> int:
        """Send `ctx.body` to the ranked replicas in turn (module rules); the client's status."""
        ranked = ctx.routing.decision.ranked[: self.proxy.max_attempts]
        last: UpstreamFailure | None = None
        for n, cand in enumerate(ranked):
            st = self.membership.get(cand.replica_id)
            if st is None:  # left the pool since the decision
                continue
            tr = self._start(ctx, n, cand)
            up_span = ctx.span.upstream(cand.replica_id, st.url + ctx.route, n)
            headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id,
                       "Accept-Encoding": "identity"}
            up_span.inject(headers, ctx.headers)
            try:
                try:
                    prio = ctx.engine_priority is not None and self.refusals.allows(cand.replica_id, time.monotonic())
                    body = ctx.body if prio or ctx.engine_priority is None else without_priority(ctx.payload)
                    at = await self._send(ctx, st.url, body, headers)
                    if prio and refuses_priority(at.status, at.body):
                        self._refused(cand.replica_id)
                        at = await self._send(ctx, st.url, without_priority(ctx.payload), headers)
                except UpstreamFailure as f:
                    last = f
                    self.failed(ctx, f, up_span, retrying=n + 1 < len(ranked))
                    continue
                except BaseException:
                    up_span.error("cancelled")
                    raise
                self.membership.report_success(cand.replica_id)
                if at.status == 404 and self._adapter_gone(ctx) and n + 1 < len(ranked):
                    up_span.error("adapter not loaded", 404)
                    self.metrics.child(self.metrics.retries, "adapter_not_loaded").inc()
                    continue
                return await answer(ctx, at, up_span)
            finally:
                tr.flight.finish()
                up_span.end()
        raise exhausted(last)

    def _send(self, ctx: RequestContext, url: str, body: bytes, headers: dict) -> Awaitable[Attempt]:
        return attempt(self.pool, url, ctx.route, body, headers, stream=ctx.request.stream,
                       client_wants_usage=ctx.request.client_wants_usage,
                       first_byte_timeout_s=self.proxy.first_byte_timeout_s)

    def _refused(self, rid: str) -> None:
        if self.refusals.refused(rid, time.monotonic()):
            log.warning("replica %s refuses request priorities (vLLM without --scheduling-policy priority): its "
                        "requests go without one for %.0f s", rid, PRIORITY_RETRY_S)

    def _adapter_gone(self, ctx: RequestContext) -> bool:
        """A 404 from the replica tried for the request's adapter, which it listed: dropped there
        (gateway.adapters)."""
        return self.model is not None and not_loaded(self.model, ctx.replica, ctx.lora)

    def _start(self, ctx: RequestContext, n: int, cand: Candidate) -> Try:
        return start_try(self.routing, ctx, n, cand)

    def failed(self, ctx: RequestContext, f: UpstreamFailure, up_span, *, retrying: bool) -> None:
        """`ctx.replica` failed before its first byte: eject it (with backoff), count, log, mark the span."""
        rid = ctx.replica
        backoff = self.membership.report_failure(rid, f.reason)
        m = self.metrics
        m.child(m.ejections, rid).inc()
        m.child(m.upstream_errors, rid, f.phase, f.reason).inc()
        log.warning("replica failed before first byte", extra={"fields": {
            "request_id": ctx.request_id, "replica": rid, "phase": f.phase, "reason": f.reason, "ejected_s": backoff}})
        up_span.error(f.reason, f.status)
        if retrying:
            m.child(m.retries, f.phase).inc()


def start_try(routing: RoutingState, ctx: RequestContext, n: int, cand: Candidate) -> Try:
    """Attempt `n` goes to `cand`: count its work there (until `ctx.attempt.flight.finish()`)."""
    view = ctx.routing.view_of(cand.replica_id)
    rv, req, prompt = ctx.routing.request, ctx.request, ctx.prompt
    predicted = predicted_matched_tokens(rv, view)
    last = None
    if ctx.last_keys is not None:  # a batch: its last prompt's blocks, held there or computed by an earlier prompt
        held = routing.held_blocks(cand.replica_id, ctx.last_keys)
        last = (len(prompt.last_ids), max(held, prompt.last_shared // rv.block_size))
    reported = None if prompt.cut else reported_cached_tokens(rv, predicted, choices=req.n, stream=req.stream, last=last,
                                                              reads_cache=req.reads_cache)  # cut: the rest is unknown
    uncached = max(0, prompt.total_tokens - predicted)
    flight = routing.dispatched(cand.replica_id, ctx.keys, uncached, req.max_tokens, view, lora=ctx.lora,
                                seqs=req.sequences)
    routing.linger(cand.replica_id, ctx.history_keys)  # a chat with media: its blocks past the first item
    ctx.attempt = Try(n, cand, view, reported, uncached, flight)
    ctx.replica = cand.replica_id
    return ctx.attempt


def exhausted(last: UpstreamFailure | None) -> ApiError:
    msg = "no replica could take the request"
    if last is None:
        return ApiError(503, msg, code="upstream_unavailable", headers={"Retry-After": "1"})
    msg += f" (last error: {last.reason})"
    status = 504 if last.phase == "first_byte" and last.reason == "timeout" else 502 if last.phase == "first_byte" else 503
    return ApiError(status, msg, code="upstream_unavailable", headers={"Retry-After": "1"})
