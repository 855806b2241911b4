"""Metrics, tracing and logs of the gateway.

Metrics: prometheus-client with the gateway's own CollectorRegistry (never the global one), names
`warmroute_gateway_*` with units in the name (`_seconds`, `_tokens`, `_bytes`, `_total`). Values
that already live elsewhere (index size and memory, feed lag, calibrated rates, replica health,
in-flight work) are read at scrape time by `StateCollector` instead of being mirrored per request.
With several worker processes the registry is aggregated through prometheus-client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before the workers start).

Tracing: OpenTelemetry SDK. `build_tracer_provider()` returns None (no tracing, no per-request
cost) unless OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set or
OTEL_TRACES_EXPORTER names "otlp"/"console"; then a BatchSpanProcessor with the OTLP/HTTP exporter
configured by the standard OTEL_* variables. Attribute names follow the GenAI semantic
conventions where they exist (gen_ai.*); the rest are `warmroute.*`.

Logs: one JSON object per line; at most one line per request at INFO and only when
`telemetry.access_log` is on. Secrets and prompts are never logged; tenants appear as
`tenant_hash` (first 16 hex of sha256). In metrics a tenant's label is its tenant_hash for the
first `telemetry.max_tenant_labels` tenants a process sees and "other" for the rest
(`TenantLabels`): with JWT tenants that come and go, a label per tenant ever seen would grow the
scrape and Prometheus' series without bound.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

__all__ = ["LabelCache", "Metrics", "TenantLabels", "StateCollector", "build_tracer_provider", "setup_logging",
           "JsonFormatter"]

_LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class TenantLabels:
    """A tenant's metric label (module header): its hash while fewer than `limit` tenants have a
    label of their own, then "other"; a tenant keeps the label it was first given."""

    OTHER = "other"

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._own: set[str] = set()

    def __call__(self, tenant_hash: str) -> str:
        if tenant_hash in self._own:
            return tenant_hash
        if len(self._own) < self.limit:
            self._own.add(tenant_hash)
            return tenant_hash
        return self.OTHER


class LabelCache:
    """Labelled children of prometheus metrics, each made once: on the hot path a dict lookup
    instead of `labels()` (a lock and the metric's own lookup)."""

    def __init__(self) -> None:
        self._children: dict[tuple, Any] = {}

    def child(self, metric, *labels):
        key = (id(metric),) + labels
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c


class Metrics(LabelCache):
    """Per-request instruments; label children are cached so the hot path is a dict lookup."""

    def __init__(self, registry: CollectorRegistry | None = None, max_tenant_labels: int = 1000) -> None:
        super().__init__()
        self.tenant_label = TenantLabels(max_tenant_labels)  # shared with flow control's metrics
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter("warmroute_gateway_requests", "Requests answered, by route, HTTP status and replica",
                                ["route", "status", "replica"], registry=r)
        self.tenant_requests = Counter("warmroute_gateway_tenant_requests", "Requests by hashed tenant id",
                                       ["tenant_hash"], registry=r)
        self.tenant_tokens = Counter("warmroute_gateway_tenant_tokens",
                                     "Tokens by hashed tenant id and kind (engine usage): prompt, cached (of the prompt, "
                                     "served from the engine's cache), completion", ["tenant_hash", "kind"], registry=r)
        self.decision = Histogram("warmroute_gateway_decision_seconds", "Routing decision time (keys to ranking)",
                                  buckets=_LAT_BUCKETS, registry=r)
        self.tokenize = Histogram("warmroute_gateway_tokenize_seconds", "Tokenization time per request",
                                  buckets=_LAT_BUCKETS + (0.25, 1.0), registry=r)
        self.ttft = Histogram("warmroute_gateway_ttft_seconds", "Time to first streamed event, from request arrival",
                              ["replica"], buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("warmroute_gateway_request_duration_seconds", "End-to-end request duration",
                             ["route"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("warmroute_gateway_prompt_tokens", "Prompt tokens (gateway tokenization)",
                                     ["replica"], registry=r)
        self.predicted_cached = Counter("warmroute_gateway_predicted_cached_tokens",
                                        "Prompt tokens the index predicted cached on the chosen replica", ["replica"], registry=r)
        self.engine_cached = Counter("warmroute_gateway_engine_cached_tokens",
                                     "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
                                     ["replica"], registry=r)
        self.prediction_error = Histogram("warmroute_gateway_cached_tokens_prediction_error_tokens",
                                          "|engine-reported cached tokens - predicted matched tokens| per request",
                                          ["replica"], buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=r)
        self.accuracy = Gauge("warmroute_gateway_index_accuracy_ratio",
                              "Moving mean of min(predicted, reported)/max(predicted, reported) cached tokens",
                              ["replica"], registry=r, multiprocess_mode="mostrecent")
        self.media_item_tokens = Gauge("warmroute_gateway_media_item_tokens",
                                       "Tokens a media item takes in the engines' prompts as their answers said "
                                       "(moving mean; the prior until the first answer with media): the load estimate's",
                                       registry=r, multiprocess_mode="mostrecent")
        self.retries = Counter("warmroute_gateway_retries", "Attempts on a next-ranked replica before the first byte",
                               ["reason"], registry=r)
        self.upstream_errors = Counter("warmroute_gateway_upstream_errors", "Upstream failures",
                                       ["replica", "phase", "reason"], registry=r)
        self.ejections = Counter("warmroute_gateway_ejections", "Passive ejections of a replica", ["replica"], registry=r)
        self.refreshes = Counter("warmroute_gateway_keepalive_refreshes",
                                 "Keep-alive refreshes of kept prefixes sent to a replica, by outcome (ok: every block "
                                 "a hit; partial: the engine computed more than one block of it; error)",
                                 ["replica", "outcome"], registry=r)
        self.tokenize_checks = Counter("warmroute_gateway_tokenize_checks",
                                       "Sampled checks of the gateway's token ids against a replica's /tokenize, "
                                       "by result (match, mismatch, error)", ["replica", "result"], registry=r)
        self.refresh_computed = Counter("warmroute_gateway_keepalive_computed_tokens",
                                        "Prompt tokens keep-alive refreshes made the engine compute (prompt - cached, "
                                        "engine usage): the refreshes' prefill cost", ["replica"], registry=r)
        self.output_tokens = Counter("warmroute_gateway_output_tokens", "Completion tokens (engine usage)", ["replica"], registry=r)
        self.stored_responses = Counter("warmroute_gateway_stored_responses",
                                        "Stored Responses' records (gateway.stored_responses), by event: recorded, "
                                        "followed, answer_fetched, not_found, history_lost, write_failed, feed_unreachable, "
                                        "engine_lost (a replica's 404 for one it stored)",
                                        ["event"], registry=r)
        self._acc: dict[str, float] = {}

    def request_done(self, route: str, status: int, replica: str) -> None:
        key = ("r", route, status, replica)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self.requests.labels(route, str(status), replica)
        c.inc()

    def record_lesson(self, lesson) -> float | None:
        """Count one answer's tokens (a gateway.learn.Lesson); the index agreement, when the
        engine reported cached tokens."""
        rid = lesson.replica_id
        if lesson.prompt_tokens is not None:
            self.child(self.prompt_tokens, rid).inc(lesson.prompt_tokens)
        if lesson.completion_tokens is not None:
            self.child(self.output_tokens, rid).inc(lesson.completion_tokens)
        if lesson.cached_tokens is None or lesson.predicted_cached_tokens is None:
            return None
        return self.cache_outcome(rid, lesson.predicted_cached_tokens, lesson.cached_tokens)

    def record_tenant_usage(self, tenant_hash: str, lesson) -> None:
        """One answer's engine usage on its tenant's counters (chargeback, and who the cache serves)."""
        label = self.tenant_label(tenant_hash)
        for kind, n in (("prompt", lesson.prompt_tokens), ("cached", lesson.cached_tokens),
                        ("completion", lesson.completion_tokens)):
            if n is not None:
                self.child(self.tenant_tokens, label, kind).inc(n)

    def cache_outcome(self, replica: str, predicted: int, reported: int) -> float:
        self.child(self.predicted_cached, replica).inc(predicted)
        self.child(self.engine_cached, replica).inc(reported)
        self.child(self.prediction_error, replica).observe(abs(reported - predicted))
        hi = max(predicted, reported)
        agree = 1.0 if hi == 0 else min(predicted, reported) / hi
        prev = self._acc.get(replica)
        val = agree if prev is None else prev + 0.05 * (agree - prev)
        self._acc[replica] = val
        self.child(self.accuracy, replica).set(val)
        return agree


class StateCollector:
    """Scrape-time gauges read from the gateway's live state (index, feed, calibration, replicas)."""

    def __init__(self, state_fn: Callable[[], dict]) -> None:
        self.state_fn = state_fn

    def describe(self):
        return []

    # (family, name, help, state key) of the unlabelled index figures
    _SCALARS = (
        (GaugeMetricFamily, "warmroute_gateway_index_entries", "KV index entries (key, replica, medium)", "index_entries"),
        (GaugeMetricFamily, "warmroute_gateway_index_bytes", "Estimated KV index memory", "index_bytes"),
        (CounterMetricFamily, "warmroute_gateway_index_evictions", "Index entries evicted by the budget", "index_evictions"),
        (GaugeMetricFamily, "warmroute_gateway_index_speculative_entries", "Speculative (key, replica) entries",
         "index_speculative"),
        (GaugeMetricFamily, "warmroute_gateway_background_responses_held",
         "Background responses answered and still running, their holds kept (gateway.background_holds)", "background_held"),
    )

    def collect(self):
        s = self.state_fn()
        for family, name, help_, key in self._SCALARS:
            f = family(name, help_)
            f.add_metric([], s.get(key, 0))
            yield f
        lag = GaugeMetricFamily("warmroute_gateway_feed_lag_seconds", "Publish-to-apply lag of each replica's feed", labels=["replica"])
        for rid, v in s.get("feed_lag", {}).items():
            lag.add_metric([rid], v)
        yield lag
        ent = GaugeMetricFamily("warmroute_gateway_index_replica_entries", "Index entries per replica", labels=["replica"])
        for rid, v in s.get("entries_by_replica", {}).items():
            ent.add_metric([rid], v)
        yield ent
        pre = GaugeMetricFamily("warmroute_gateway_prefill_seconds_per_token", "Calibrated prefill seconds per uncached token", labels=["replica"])
        dec = GaugeMetricFamily("warmroute_gateway_decode_step_seconds", "Calibrated decode step seconds", labels=["replica"])
        for rid, (p, d) in s.get("rates", {}).items():
            pre.add_metric([rid], p)
            dec.add_metric([rid], d)
        yield pre
        yield dec
        up = GaugeMetricFamily("warmroute_gateway_replica_up", "1 when the replica is available (probe ok, not ejected)", labels=["replica"])
        live = GaugeMetricFamily("warmroute_gateway_replica_index_live", "1 when the replica's feed is current", labels=["replica"])
        inf = GaugeMetricFamily("warmroute_gateway_inflight_requests", "Requests without a first token yet (this gateway)", labels=["replica"])
        act = GaugeMetricFamily("warmroute_gateway_active_requests", "Requests streaming (this gateway)", labels=["replica"])
        for rid, r in s.get("replicas", {}).items():
            up.add_metric([rid], 1.0 if r["available"] else 0.0)
            live.add_metric([rid], 1.0 if r["index_live"] else 0.0)
            inf.add_metric([rid], r["inflight_reqs"])
            act.add_metric([rid], r["active_reqs"])
        yield up
        yield live
        yield inf
        yield act
        rd = GaugeMetricFamily("warmroute_gateway_ready", "1 when /readyz answers 200")
        rd.add_metric([], 1.0 if s.get("ready") else 0.0)
        yield rd
        yield from _feed_and_trust(s)
        drift = GaugeMetricFamily("warmroute_gateway_tokenizer_mismatch", "1 while the replica's last tokenizer check "
                                  "(its /tokenize) found other token ids than the gateway's", labels=["replica"])
        for rid in s.get("replicas", {}):
            drift.add_metric([rid], 1.0 if rid in s.get("tokenizer_mismatch", ()) else 0.0)
        yield drift


def _feed_and_trust(s: dict):
    """The feed's reachability and each replica's index trust (gateway.index_health)."""
    up = GaugeMetricFamily("warmroute_gateway_feed_up", "1 while the feed (Redis) answers the gateway's polls")
    up.add_metric([], 1.0 if s.get("feed_up", True) else 0.0)
    yield up
    err = CounterMetricFamily("warmroute_gateway_feed_errors", "Failed feed calls (index sync and in-flight exchange)")
    err.add_metric([], s.get("feed_errors", 0))
    yield err
    trusted = GaugeMetricFamily("warmroute_gateway_index_trusted",
                                "1 while the replica's index predictions agree with its engine (else routed by load only)",
                                labels=["replica"])
    agree = GaugeMetricFamily("warmroute_gateway_index_agreement_window_ratio",
                              "Mean predicted/engine cached-token agreement over the replica's last requests",
                              labels=["replica"])
    for rid, r in s.get("replicas", {}).items():
        trusted.add_metric([rid], 1.0 if r.get("index_trusted", True) else 0.0)
        if r.get("index_agreement") is not None:
            agree.add_metric([rid], r["index_agreement"])
    yield trusted
    yield agree
    dis = CounterMetricFamily("warmroute_gateway_index_distrusted", "Times a replica's index became distrusted",
                              labels=["replica"])
    for rid, n in s.get("index_distrusted", {}).items():
        dis.add_metric([rid], n)
    yield dis


def build_tracer_provider(service_name: str = "warmroute-gateway", env: dict | None = None):
    """A TracerProvider exporting by OTLP/HTTP when the OTEL_* environment asks for it, else None."""
    env = os.environ if env is None else env
    exporters = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if "none" in exporters:
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and not exporters:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {"service.name": env.get("OTEL_SERVICE_NAME", service_name)}
    provider = TracerProvider(resource=Resource.create(attrs))
    if "console" in exporters:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if endpoint or "otlp" in exporters:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_warmroute", False):
            root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    h._warmroute = True  # type: ignore[attr-defined]
    root.addHandler(h)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def now_s() -> float:
    return time.perf_counter()
