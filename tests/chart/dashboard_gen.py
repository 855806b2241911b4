"""The chart's Grafana dashboard, charts/warmroute/dashboards/warmroute.json, from the panel list below.

Rule: one row per concern (traffic, cache, replicas, flow control, feed and agents, the gateway's
own work), each panel one or a few PromQL queries over the `warmroute_*` series of the namespace
chosen in the `namespace` variable (`$ns` below). The chart ships the file as a ConfigMap labelled
for Grafana's dashboard sidecar (`grafanaDashboard.enabled`). `python -m tests.chart.dashboard_gen`
rewrites the file; tests/test_chart_dashboard.py fails when the file and this list differ, and runs
every query against a real Prometheus scraping a running gateway and agent.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "charts" / "warmroute" / "dashboards" / "warmroute.json"

NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"


def _q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


def _pct(metric: str, q: float, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{by}) (rate({metric}_bucket{{{NS}}}[{RATE}])))"


# (row, [(panel title, unit, [(expr, legend)])])
ROWS = [
    ("Traffic", [
        ("Requests by status", "reqps",
         [(f"sum by (status) (rate(warmroute_gateway_requests_total{{{NS}}}[{RATE}]))", "{{status}}")]),
        ("Time to first token", "s",
         [(_pct("warmroute_gateway_ttft_seconds", 0.5), "p50"), (_pct("warmroute_gateway_ttft_seconds", 0.99), "p99")]),
        ("Request duration", "s",
         [(_pct("warmroute_gateway_request_duration_seconds", 0.5), "p50"),
          (_pct("warmroute_gateway_request_duration_seconds", 0.99), "p99")]),
    ]),
    ("Cache", [
        ("Prompt tokens served from cache (engine)", "percentunit",
         [(f"sum(rate(warmroute_gateway_engine_cached_tokens_total{{{NS}}}[{RATE}])) / "
           f"sum(rate(warmroute_gateway_prompt_tokens_total{{{NS}}}[{RATE}]))", "hit ratio")]),
        ("Cached tokens: predicted and reported", "short",
         [(f"sum(rate(warmroute_gateway_predicted_cached_tokens_total{{{NS}}}[{RATE}]))", "predicted"),
          (f"sum(rate(warmroute_gateway_engine_cached_tokens_total{{{NS}}}[{RATE}]))", "engine")]),
        ("Index agreement by replica", "percentunit",
         [(f"min by (replica) (warmroute_gateway_index_accuracy_ratio{{{NS}}})", "{{replica}}")]),
        ("Index trusted by replica (0: routed by load only)", "short",
         [(f"min by (replica) (warmroute_gateway_index_trusted{{{NS}}})", "{{replica}}")]),
    ]),
    ("Tenants", [
        ("Requests by tenant", "reqps",
         [(f"sum by (tenant_hash) (rate(warmroute_gateway_tenant_requests_total{{{NS}}}[{RATE}]))", "{{tenant_hash}}")]),
        ("Prompt tokens by tenant", "short",
         [(f"sum by (tenant_hash) (rate(warmroute_gateway_tenant_tokens_total{{{NS},kind=\"prompt\"}}[{RATE}]))",
           "{{tenant_hash}}")]),
        ("Prompt tokens served from cache, by tenant", "percentunit",
         [(f"sum by (tenant_hash) (rate(warmroute_gateway_tenant_tokens_total{{{NS},kind=\"cached\"}}[{RATE}])) / "
           f"sum by (tenant_hash) (rate(warmroute_gateway_tenant_tokens_total{{{NS},kind=\"prompt\"}}[{RATE}]))",
           "{{tenant_hash}}")]),
    ]),
    ("Replicas", [
        ("Replica available (any gateway)", "short",
         [(f"max by (replica) (warmroute_gateway_replica_up{{{NS}}})", "{{replica}}")]),
        ("Requests by replica", "reqps",
         [(f"sum by (replica) (rate(warmroute_gateway_requests_total{{{NS}}}[{RATE}]))", "{{replica}}")]),
        ("Waiting for a first token, by replica", "short",
         [(f"sum by (replica) (warmroute_gateway_inflight_requests{{{NS}}})", "{{replica}}")]),
        ("Streaming, by replica", "short",
         [(f"sum by (replica) (warmroute_gateway_active_requests{{{NS}}})", "{{replica}}")]),
        ("Retries before the first byte, by reason", "reqps",
         [(f"sum by (reason) (rate(warmroute_gateway_retries_total{{{NS}}}[{RATE}]))", "{{reason}}")]),
    ]),
    ("Flow control", [
        ("Requests held", "short", [(f"sum(warmroute_gateway_flow_queued_requests{{{NS}}})", "held")]),
        ("Refused, by reason", "reqps",
         [(f"sum by (reason) (rate(warmroute_gateway_flow_sheds_total{{{NS}}}[{RATE}]))", "{{reason}}")]),
        ("Time held, p99", "s", [(_pct("warmroute_gateway_flow_queue_wait_seconds", 0.99), "p99")]),
    ]),
    ("Feed and agents", [
        ("Feed reachable (1: by every gateway)", "short", [(f"min(warmroute_gateway_feed_up{{{NS}}})", "feed")]),
        ("Feed lag by replica", "s", [(f"max by (replica) (warmroute_gateway_feed_lag_seconds{{{NS}}})", "{{replica}}")]),
        ("Agent event lag", "s", [(f"max by (replica) (warmroute_agent_lag_seconds{{{NS}}})", "{{replica}}")]),
        ("Agent healthy", "short", [(f"min by (replica) (warmroute_agent_healthy{{{NS}}})", "{{replica}}")]),
        ("Index entries", "short", [(f"sum(warmroute_gateway_index_entries{{{NS}}})", "entries")]),
        ("Stored responses' records, by event", "ops",
         [(f"sum by (event) (rate(warmroute_gateway_stored_responses_total{{{NS}}}[{RATE}]))", "{{event}}")]),
    ]),
    ("Gateway", [
        ("Routing decision and tokenization, p99", "s",
         [(_pct("warmroute_gateway_decision_seconds", 0.99), "decision"),
          (_pct("warmroute_gateway_tokenize_seconds", 0.99), "tokenize")]),
    ]),
]


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row, row_panels in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": pid, "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + j), "datasource": {"type": "prometheus", "uid": "${datasource}"}, **_q(e, leg)}
                            for j, (e, leg) in enumerate(queries)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "title": "warmroute", "uid": "warmroute", "editable": True, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["warmroute", "llm"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "namespace", "type": "query", "label": "Namespace", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(warmroute_gateway_ready, namespace)", "refId": "ns"},
             "definition": "label_values(warmroute_gateway_ready, namespace)", "refresh": 2, "includeAll": False, "multi": True},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(render())
    print(f"wrote {DASHBOARD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
