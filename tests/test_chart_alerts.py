"""The chart's alerting rules (templates/prometheusrule.yaml) with Prometheus's own tool, promtool
(Debian's `prometheus` package; .ci/run installs it): `promtool check rules` accepts them;
`promtool test rules` shows each alert firing on the series it is for, after its `for`, with its
labels and its annotations as rendered, and silent on healthy series and on another namespace's;
and every metric the rules read is one a running gateway and agent expose, of the type the rule
reads it as."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.chart.live_metrics import declared, metric_types, metrics_read, running_system
from tests.chart.render import FULL_NAME, NAMESPACE as NS, ci_values, deep_merge, render

THRESHOLDS = {"errorRatio": 0.05, "ttftP99Seconds": 10, "shedRatio": 0.1, "agentLagSeconds": 5}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package (apt-get install prometheus; .ci/run does)")
    return path


@pytest.fixture(scope="module")
def rule():
    values = deep_merge(ci_values("full"), {"prometheusRule": THRESHOLDS})
    return render(values).get("PrometheusRule", FULL_NAME)


@pytest.fixture
def rules_file(rule, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def _alerts(rule) -> dict[str, dict]:
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_promtool_accepts_the_rules(rule, rules_file):
    out = subprocess.run([_promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts(rule))} rules found" in out.stdout
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"


def _s(name: str, values: str, **labels) -> dict:
    """One input series of a promtool test, in this release's namespace unless told."""
    labels = {"namespace": NS, **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _ttft(namespace: str, slow: bool) -> list[dict]:
    """TTFT histogram buckets growing 60 a minute, every observation in (10, 30] s or in (0, 1] s."""
    return [_s("warmroute_gateway_ttft_seconds_bucket", f"0+{0 if (slow and le in ('1', '10')) else 60}x40",
               namespace=namespace, replica="r0", le=le) for le in ("1", "10", "30", "+Inf")]


# alert -> (series where it fires, series where it does not, eval time, the alert's own labels,
# and a time before its `for` has passed, where it must not fire yet)
CASES = {
    "WarmrouteGatewayNotReady": (
        [_s("warmroute_gateway_ready", "0x20", pod="g0")],
        [_s("warmroute_gateway_ready", "1x20", pod="g0"), _s("warmroute_gateway_ready", "0x20", namespace="other", pod="g9")],
        "10m", {"pod": "g0"}, "4m"),
    "WarmrouteReplicaUnavailable": (  # every gateway sees r1 down
        [_s("warmroute_gateway_replica_up", "0x20", pod="g0", replica="r1"),
         _s("warmroute_gateway_replica_up", "0x20", pod="g1", replica="r1")],
        [_s("warmroute_gateway_replica_up", "0x20", pod="g0", replica="r1"),  # one gateway still reaches it
         _s("warmroute_gateway_replica_up", "1x20", pod="g1", replica="r1")],
        "10m", {"replica": "r1"}, "4m"),
    "WarmrouteErrorRatioHigh": (  # 10 of 110 a minute answered 502
        [_s("warmroute_gateway_requests_total", "0+100x30", route="chat", status="200", replica="r0"),
         _s("warmroute_gateway_requests_total", "0+10x30", route="chat", status="502", replica="r1")],
        [_s("warmroute_gateway_requests_total", "0+100x30", route="chat", status="200", replica="r0"),
         _s("warmroute_gateway_requests_total", "0+2x30", route="chat", status="502", replica="r1"),
         _s("warmroute_gateway_requests_total", "0+300x30", route="chat", status="429", replica=""),
         _s("warmroute_gateway_requests_total", "0+300x30", route="chat", status="499", replica="r0")],
        "15m", {}, "3m"),
    "WarmrouteTTFTHigh": (_ttft(NS, True), _ttft(NS, False) + _ttft("other", True), "25m", {}, "8m"),
    "WarmrouteShedding": (  # 20 of 100 a minute refused
        [_s("warmroute_gateway_requests_total", "0+100x40", route="chat", status="200", replica="r0"),
         _s("warmroute_gateway_flow_sheds_total", "0+20x40", tenant_hash="t1", priority="standard", reason="queue_full")],
        [_s("warmroute_gateway_requests_total", "0+100x40", route="chat", status="200", replica="r0"),
         _s("warmroute_gateway_flow_sheds_total", "0+5x40", tenant_hash="t1", priority="standard", reason="queue_full"),
         _s("warmroute_gateway_flow_sheds_total", "0+50x40", tenant_hash="t1", priority="standard", reason="client_gone")],
        "25m", {}, "8m"),
    "WarmrouteFeedDown": ([_s("warmroute_gateway_feed_up", "0x10", pod="g0")],
                          [_s("warmroute_gateway_feed_up", "1x10", pod="g0")], "5m", {"pod": "g0"}, "1m"),
    "WarmrouteIndexDistrusted": (  # one gateway of two distrusts r0
        [_s("warmroute_gateway_index_trusted", "1x30", pod="g0", replica="r0"),
         _s("warmroute_gateway_index_trusted", "0x30", pod="g1", replica="r0")],
        [_s("warmroute_gateway_index_trusted", "1x30", pod="g0", replica="r0"),
         _s("warmroute_gateway_index_trusted", "0x10 1x20", pod="g1", replica="r0")],  # trusted again after 10 m
        "20m", {"replica": "r0"}, "12m"),
    "WarmrouteTokenizerMismatch": ([_s("warmroute_gateway_tokenizer_mismatch", "0 1x5", pod="g0", replica="r0")],
                                   [_s("warmroute_gateway_tokenizer_mismatch", "0x5", pod="g0", replica="r0")],
                                   "3m", {"replica": "r0"}, None),
    "WarmrouteStoredResponsesNotShared": (  # one write refused a minute
        [_s("warmroute_gateway_stored_responses_total", "0+1x20", pod="g0", event="write_failed")],
        [_s("warmroute_gateway_stored_responses_total", "0+1x20", pod="g0", event="recorded"),
         _s("warmroute_gateway_stored_responses_total", "0x20", pod="g0", event="write_failed")],
        "15m", {}, "3m"),
    "WarmrouteAgentUnhealthy": ([_s("warmroute_agent_healthy", "0x10", pod="a0", replica="r0")],
                                [_s("warmroute_agent_healthy", "1x10", pod="a0", replica="r0")],
                                "8m", {"pod": "a0", "replica": "r0"}, "3m"),
    "WarmrouteAgentLagging": ([_s("warmroute_agent_lag_seconds", "8x10", pod="a0", replica="r0")],
                              [_s("warmroute_agent_lag_seconds", "1x10", pod="a0", replica="r0")],
                              "8m", {"pod": "a0", "replica": "r0"}, "3m"),
}


def test_every_alert_has_a_case(rule):
    assert set(CASES) == set(_alerts(rule))


def _unit_tests(rule) -> dict:
    tests = []
    for name, (firing, healthy, at, labels, early) in CASES.items():
        r = _alerts(rule)[name]
        want = {"exp_labels": {"namespace": NS, **r["labels"], **labels}, "exp_annotations": r["annotations"]}
        checks = [{"eval_time": at, "alertname": name, "exp_alerts": [want]}]
        if early is not None:
            checks.append({"eval_time": early, "alertname": name, "exp_alerts": []})  # pending, not firing
        tests.append({"name": f"{name} fires", "interval": "1m", "input_series": firing, "alert_rule_test": checks})
        tests.append({"name": f"{name} stays silent", "interval": "1m", "input_series": healthy,
                      "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}]})
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def test_each_alert_fires_on_its_series_and_not_on_healthy_ones(rule, rules_file):
    spec = rules_file.parent / "tests.yaml"
    spec.write_text(yaml.safe_dump(_unit_tests(rule), sort_keys=False))
    out = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=120,
                         cwd=rules_file.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_unit_tests_can_fail(rule, rules_file):
    """A healthy series where the alert should fire fails promtool's test (the harness is not vacuous)."""
    doc = _unit_tests(rule)
    doc["tests"][0]["input_series"] = CASES["WarmrouteGatewayNotReady"][1][:1]
    spec = rules_file.parent / "tests.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=120,
                         cwd=rules_file.parent)
    assert out.returncode != 0 and "WarmrouteGatewayNotReady" in out.stdout + out.stderr


# ---------------------------------------------------------------------- the metrics they read
async def test_every_metric_the_rules_read_is_exposed_with_that_type(rule, tok, tmp_path):
    async with running_system(tok, tmp_path) as live:
        await live.send(2)
        types = metric_types(await live.exposition())
    read = metrics_read(r["expr"] for r in _alerts(rule).values())
    assert len(read) >= 9, read
    for name in sorted(read):
        name_declared, kind = declared(name)
        assert types.get(name_declared) == kind, (name, types.get(name_declared))
