"""values.schema.json: real Helm refuses bad values before rendering, each with a message naming
the value; its `config` part is exactly what tests/chart/schema_gen.py derives from
gateway/config.py and the policy registry (no drift between the chart and the gateway)."""
from __future__ import annotations

import json

import helm_python as helm
import pytest

from policies.registry import POLICY_NAMES
from tests.chart.render import ci_values, deep_merge, render
from tests.chart.schema_gen import SCHEMA_PATH, config_schema

BASE = ci_values("attach")  # a valid install; each case below changes one value


def _refusal(over: dict) -> str:
    with pytest.raises(helm.HelmError) as exc:
        render(deep_merge(BASE, over))
    msg = str(exc.value)
    assert "schema" in msg, msg  # refused by the schema, before any template ran
    return msg


def test_base_values_render():
    assert render(BASE).objects


@pytest.mark.parametrize("over, names", [
    # a negative weight
    ({"config": {"policy": {"params": {"w_queue": -1}}}}, ["/config/policy/params/w_queue", "minimum"]),
    # an unknown policy
    ({"config": {"policy": {"name": "cache_awre"}}}, ["/config/policy/name", "must be one of 'cache_aware'"]),
    # a weight the policy does not have
    ({"config": {"policy": {"params": {"w_cahce": 2.0}}}}, ["/config/policy", "w_cahce"]),
    # malformed URLs
    ({"replicas": {"attach": {"endpoints": [{"id": "vllm-0", "url": "vllm-0:8000", "kvEventsEndpoint": "tcp://vllm-0:5557"}]}}},
     ["/replicas/attach/endpoints/0/url", "vllm-0:8000"]),
    ({"replicas": {"attach": {"endpoints": [{"id": "vllm-0", "url": "http://vllm-0:8000", "kvEventsEndpoint": "vllm-0:5557"}]}}},
     ["/replicas/attach/endpoints/0/kvEventsEndpoint", "vllm-0:5557"]),
    ({"feed": {"externalUrl": "http://redis:6379"}}, ["/feed/externalUrl", "http://redis:6379"]),
    ({"tracing": {"otlpEndpoint": "otel-collector:4318"}}, ["/tracing/otlpEndpoint"]),
    # wrong types
    ({"gateway": {"replicaCount": "two"}}, ["/gateway/replicaCount", "string"]),
    ({"config": {"proxy": {"max_attempts": "3x"}}}, ["/config/proxy/max_attempts"]),
    ({"config": {"telemetry": {"access_log": "yes"}}}, ["/config/telemetry/access_log"]),
    # a malformed salt secret: too short to be one, or not a Secret name
    ({"salt": {"existingSecret": "", "value": "short"}}, ["/salt/value"]),
    ({"salt": {"existingSecret": "Bad_Name"}}, ["/salt/existingSecret", "Bad_Name"]),
    # a typo, and a config field the chart owns
    ({"config": {"proxy": {"max_attemps": 3}}}, ["/config/proxy", "max_attemps"]),
    ({"config": {"server": {"port": 9000}}}, ["/config/server", "port"]),
    # out of range / unknown choice
    ({"gateway": {"ports": {"http": 70000}}}, ["/gateway/ports/http", "maximum"]),
    ({"service": {"type": "Ingress"}}, ["/service/type", "must be one of"]),
    ({"tracing": {"samplerRatio": 1.5}}, ["/tracing/samplerRatio"]),
    ({"feed": {"redis": {"auth": {"password": "p@ss/word"}}}}, ["/feed/redis/auth/password"]),
    ({"replicas": {"mode": "both"}}, ["/replicas/mode", "must be one of 'deploy', 'attach'"]),
    # epp mode's values (refused whether or not epp.enabled)
    ({"epp": {"failureMode": "FailSafe"}}, ["/epp/failureMode", "must be one of 'FailOpen', 'FailClose'"]),
    ({"epp": {"failureMode": "failopen"}}, ["/epp/failureMode"]),
    ({"epp": {"ports": {"grpc": 70000}}}, ["/epp/ports/grpc", "maximum"]),
    ({"epp": {"ports": {"grpcHealth": 0}}}, ["/epp/ports/grpcHealth", "minimum"]),
    ({"epp": {"ports": {"grpc": "9002"}}}, ["/epp/ports/grpc", "string"]),
    ({"epp": {"trustedTenantHeader": "x tenant"}}, ["/epp/trustedTenantHeader", "x tenant"]),
    ({"epp": {"enabled": "yes"}}, ["/epp/enabled"]),
    ({"epp": {"failMode": "FailOpen"}}, ["/epp", "failMode"]),
    ({"epp": {"gatewayFrom": [{"namespaceSelecter": {}}]}}, ["/epp/gatewayFrom/0", "namespaceSelecter"]),
    ({"epp": {"inferencePool": {"name": "Llama_Pool"}}}, ["/epp/inferencePool/name", "Llama_Pool"]),
    ({"epp": {"inferencePool": {"matchLabels": {"app": 1}}}}, ["/epp/inferencePool/matchLabels/app"]),
    ({"epp": {"httpRoute": {"parentRefs": [{"namespace": "gw"}]}}}, ["/epp/httpRoute/parentRefs/0", "name"]),
    ({"epp": {"httpRoute": {"requestTimeout": "5 minutes"}}}, ["/epp/httpRoute/requestTimeout", "5 minutes"]),
    ({"epp": {"httpRoute": {"paths": ["v1/chat/completions"]}}}, ["/epp/httpRoute/paths/0"]),
    ({"epp": {"httpRoute": {"paths": []}}}, ["/epp/httpRoute/paths", "minItems"]),
])
def test_schema_refuses_bad_values_naming_them(over, names):
    msg = _refusal(over)
    for n in names:
        assert n in msg, f"{n!r} not in: {msg}"


def test_config_schema_is_derived_from_the_gateway_config():
    committed = json.loads(SCHEMA_PATH.read_text())["properties"]["config"]
    assert committed == config_schema(), "run: python -m tests.chart.schema_gen"
    assert committed["properties"]["policy"]["properties"]["name"]["enum"] == list(POLICY_NAMES)
    # The chart's own defaults pass the derived part (and so does every documented set: test_chart.py).
    assert "server" in committed["properties"] and "port" not in committed["properties"]["server"]["properties"]


def test_zero_switches_that_mean_off_pass():
    """0 is "off" for these (gateway/config.py), not a bad period."""
    render(deep_merge(BASE, {"config": {"flow": {"light_spill_s": 0, "headroom_reqs": 0, "engine_priority": True},
                                        "feed": {"media_history_ttl_s": 0}}}))


def test_every_policy_name_and_its_own_parameters_pass():
    for name in POLICY_NAMES:
        render(deep_merge(BASE, {"config": {"policy": {"name": name, "params": {}}}}))
    render(deep_merge(BASE, {"config": {"policy": {"name": "prefix_hash", "params": {"prefix_blocks": 8}}}}))
    msg = _refusal({"config": {"policy": {"name": "prefix_hash", "params": {"w_cache": 2.0}}}})
    assert "w_cache" in msg


def test_cache_plan_takes_its_own_and_cache_awares_parameters():
    """cache_plan (the chart's default) passes its keywords to an embedded cache_aware: the schema
    accepts both sets, with its flag as a boolean, and refuses a name neither has."""
    ok = {"hot_min": 0.3, "window_reqs": 100, "copy_in_background": False, "w_queue": 2.0, "balance_rel": 1.5}
    render(deep_merge(BASE, {"config": {"policy": {"name": "cache_plan", "params": ok}}}))
    assert "hot_mni" in _refusal({"config": {"policy": {"name": "cache_plan", "params": {"hot_mni": 0.3}}}})
    assert "copy_in_background" in _refusal({"config": {"policy": {"name": "cache_plan", "params": {"copy_in_background": 1}}}})
