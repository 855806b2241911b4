"""Trace stage: the request's OpenTelemetry spans, or no-op spans when tracing is off.

Rule: the pipeline always talks to a span object and never asks whether tracing is on; with no
tracer provider every span is `NO_SPAN`, whose methods do nothing (and which passes the client's
`traceparent` on to the engine unchanged, so a trace started upstream of the gateway continues).
With a provider, one SERVER span per request (`chat MODEL` / `text_completion MODEL`, continuing
the client's trace context), a `warmroute.route` child with one `warmroute.candidate` event per
replica (its inputs, rank, score and every score term), and a CLIENT span per upstream attempt
whose context is injected into the engine request. Attribute names follow the GenAI semantic
conventions where they exist (gen_ai.*); the rest are warmroute.*. Tenants appear hashed only.
"""
from __future__ import annotations

from typing import Any, Mapping

from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.context import COMPLETIONS, RequestContext, Routing
from gateway.learn import Lesson

__all__ = ["Tracing", "NoSpan", "NO_SPAN", "RequestSpan"]


class NoSpan:
    """Tracing off: every call is a no-op."""

    __slots__ = ()

    def set(self, key: str, value: Any) -> None:
        pass

    def error(self, reason: str, status: int | None = None) -> None:
        pass

    def decision(self, routing: Routing, extra: Mapping[str, Any] | None = None) -> None:
        pass

    def upstream(self, replica_id: str, url: str, attempt_no: int) -> "NoSpan":
        return self

    def inject(self, headers: dict[str, str], client_headers: Mapping[str, str]) -> None:
        tp = client_headers.get("traceparent")
        if tp:
            headers["traceparent"] = tp

    def outcome(self, lesson: Lesson, agreement: float | None) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN = NoSpan()


class RequestSpan:
    """One live OTel span (request or upstream attempt)."""

    __slots__ = ("_span", "_tracer", "_propagator")

    def __init__(self, span, tracer, propagator) -> None:
        self._span = span
        self._tracer = tracer
        self._propagator = propagator

    def set(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def error(self, reason: str, status: int | None = None) -> None:
        self._span.set_attribute("error.type", reason)
        if status:
            self._span.set_attribute("http.response.status_code", status)

    def decision(self, routing: Routing, extra: Mapping[str, Any] | None = None) -> None:
        d, rv = routing.decision, routing.request
        span = self._tracer.start_span("warmroute.route", context=set_span_in_context(self._span), attributes={
            "warmroute.policy": d.policy, "warmroute.winner": d.winner or "",
            "warmroute.decision_s": routing.decision_s, "warmroute.prompt_tokens": rv.prompt_tokens,
            "warmroute.full_blocks": len(rv.keys), "warmroute.candidates": len(d.ranked), **(extra or {})})
        ranked = {c.replica_id: (i, c) for i, c in enumerate(d.ranked)}
        for v in routing.views:
            attrs: dict[str, Any] = {"warmroute.replica_id": v.replica_id, "warmroute.healthy": v.healthy,
                                     "warmroute.matched_blocks_gpu": v.matched_blocks_gpu,
                                     "warmroute.matched_blocks_cpu": v.matched_blocks_cpu,
                                     "warmroute.index_live": v.index_live}
            rc = ranked.get(v.replica_id)
            if rc is not None:
                attrs["warmroute.rank"] = rc[0]
                attrs["warmroute.score"] = rc[1].score
                attrs.update({f"warmroute.term.{k}": val for k, val in rc[1].terms.items()
                              if isinstance(val, (int, float))})
            span.add_event("warmroute.candidate", attrs)
        self._span.set_attribute("warmroute.replica_id", d.winner or "")
        span.end()

    def upstream(self, replica_id: str, url: str, attempt_no: int) -> "RequestSpan":
        span = self._tracer.start_span("warmroute.upstream", context=set_span_in_context(self._span),
                                       kind=SpanKind.CLIENT, attributes={
                                           "warmroute.replica_id": replica_id, "url.full": url,
                                           "http.request.method": "POST", "warmroute.attempt": attempt_no})
        return RequestSpan(span, self._tracer, self._propagator)

    def inject(self, headers: dict[str, str], client_headers: Mapping[str, str]) -> None:
        self._propagator.inject(headers, context=set_span_in_context(self._span))

    def outcome(self, lesson: Lesson, agreement: float | None) -> None:
        s = self._span
        if lesson.prompt_tokens is not None:
            s.set_attribute("gen_ai.usage.input_tokens", lesson.prompt_tokens)
        if lesson.completion_tokens is not None:
            s.set_attribute("gen_ai.usage.output_tokens", lesson.completion_tokens)
        if lesson.predicted_cached_tokens is not None:
            s.set_attribute("warmroute.predicted_cached_tokens", lesson.predicted_cached_tokens)
        if lesson.cached_tokens is not None:
            s.set_attribute("warmroute.engine_cached_tokens", lesson.cached_tokens)
            s.set_attribute("gen_ai.usage.cache_read.input_tokens", lesson.cached_tokens)
        if agreement is not None:
            s.set_attribute("warmroute.index_accuracy", agreement)

    def end(self) -> None:
        self._span.end()


class Tracing:
    """Starts request spans from a TracerProvider (None: tracing off, every span is NO_SPAN)."""

    def __init__(self, tracer_provider=None) -> None:
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("warmroute.gateway") if tracer_provider is not None else None
        self._propagator = TraceContextTextMapPropagator()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request_span(self, ctx: RequestContext, model: str) -> NoSpan | RequestSpan:
        if self._tracer is None:
            return NO_SPAN
        op = "text_completion" if ctx.kind == COMPLETIONS else "chat"  # the Responses API is a chat
        span = self._tracer.start_span(f"{op} {model}", context=self._propagator.extract(ctx.headers),
                                       kind=SpanKind.SERVER, attributes={
                                           "gen_ai.operation.name": op, "gen_ai.request.model": model,
                                           "gen_ai.provider.name": "vllm", "http.request.method": "POST",
                                           "url.path": ctx.route, "warmroute.request_id": ctx.request_id,
                                           "warmroute.tenant_hash": ctx.identity.tenant_hash if ctx.identity else ""})
        return RequestSpan(span, self._tracer, self._propagator)
