"""The chart's Grafana dashboard and alerting rules against a real Prometheus: the dashboard file is
what tests/chart/dashboard_gen.py writes and the chart ships it unchanged in a ConfigMap for
Grafana's sidecar; with Prometheus scraping a running gateway and agent (traffic flowing), every
panel's query is valid PromQL and the ones the traffic feeds return data, and the chart's rules
load and evaluate without error and raise nothing on this healthy system."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import yaml

from tests.chart.dashboard_gen import DASHBOARD_PATH, render as render_dashboard
from tests.chart.live_metrics import declared, metric_types, metrics_read, running_prometheus, running_system
from tests.chart.render import FULL_NAME, NAMESPACE, ci_values, render

DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
QUERIES = {t["expr"]: p["title"] for p in DASHBOARD["panels"] if p["type"] != "row" for t in p["targets"]}
# Panels the test's traffic cannot feed: no retries, nothing held or refused by flow control, no
# stored responses (its gateway is not told the engines store any).
QUIET = {"Retries before the first byte, by reason", "Requests held", "Refused, by reason", "Time held, p99",
         "Stored responses' records, by event"}


def test_the_dashboard_file_is_the_generated_one():
    assert DASHBOARD_PATH.read_text() == render_dashboard(), "run: python -m tests.chart.dashboard_gen"


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar():
    r = render(ci_values("full"))
    cm = r.get("ConfigMap", f"{FULL_NAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["warmroute.json"]) == DASHBOARD
    assert not [o for o in render(ci_values("default")).objects if o["metadata"]["name"] == f"{FULL_NAME}-dashboard"]


async def _query(http: httpx.AsyncClient, base: str, expr: str) -> list:
    doc = (await http.get(base + "/api/v1/query", params={"query": expr})).json()
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


def _concrete(expr: str) -> str:
    """A panel's query as Grafana sends it here: this namespace, a 30 s rate window."""
    return expr.replace("$namespace", NAMESPACE).replace("$__rate_interval", "30s")


async def _traffic(live) -> None:
    while True:
        await live.send(4)
        await asyncio.sleep(0.2)


async def _scraped(http: httpx.AsyncClient, base: str, samples: int, timeout_s: float = 60.0) -> None:
    """Until Prometheus has `samples` successful scrapes of each target (its first come ~5 s after
    start). The processes it scrapes run on this event loop, so every wait here is async."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await _query(http, base, "sum by (job) (sum_over_time(up[1m]))")
        if len(got) == 2 and all(float(r["value"][1]) >= samples for r in got):
            return
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.5)


async def test_every_panel_and_rule_works_on_a_real_prometheus(tmp_path, tok):
    rules = tmp_path / "rules.yaml"
    spec = render(ci_values("full")).get("PrometheusRule", FULL_NAME)["spec"]
    rules.write_text(yaml.safe_dump(spec))
    n_alerts = sum(len(g["rules"]) for g in spec["groups"])
    async with running_system(tok, tmp_path) as live:
        types = metric_types(await live.exposition())
        for name in sorted(metrics_read(QUERIES)):
            name_declared, kind = declared(name)
            assert types.get(name_declared) == kind, (name, types.get(name_declared))
        traffic = asyncio.create_task(_traffic(live))
        try:
            with running_prometheus(tmp_path, {"gateway": live.gateway_admin, "agent": live.agent_admin}, [rules]) as base:
                async with httpx.AsyncClient(timeout=10) as http:
                    await _scraped(http, base, samples=3)
                    empty = [title for expr, title in QUERIES.items() if not await _query(http, base, _concrete(expr))]
                    groups = (await http.get(base + "/api/v1/rules")).json()["data"]["groups"]
        finally:
            traffic.cancel()
            await asyncio.gather(traffic, return_exceptions=True)
    assert set(empty) <= QUIET, empty
    evaluated = {r["name"]: (r["health"], r.get("lastError", ""), r["state"]) for g in groups for r in g["rules"]}
    assert len(evaluated) == n_alerts >= 10 and all(h == ("ok", "", "inactive") for h in evaluated.values()), evaluated
