"""Flow control's Helm values (charts/warmroute values.yaml `config.flow`, values.schema.json):
the defaults render into a gateway config the gateway accepts with flow control on; weights and
bounds given as values reach that config; bad ones are refused by the schema (real Helm) naming
the value, before any template runs."""
from __future__ import annotations

import helm_python as helm
import pytest
import yaml

from gateway.config import config_from_dict
from tests.chart.render import FULL_NAME, ci_values, deep_merge, render

BASE = ci_values("attach")


def _gateway_config(values: dict):
    raw = yaml.safe_load(render(values).configmap_data(FULL_NAME)["gateway.yaml"])
    return config_from_dict(raw, env={})


def test_default_values_turn_flow_control_on_with_equal_weights():
    cfg = _gateway_config(BASE)
    assert cfg.flow.enabled and cfg.flow.default_weight == 1.0 and cfg.flow.tenants == {}
    assert cfg.flow.priorities == ["interactive", "standard", "batch"]


def test_weights_classes_and_bounds_given_as_values_reach_the_gateway():
    flow = {"max_queue_wait_s": 5.0, "max_queue_reqs_per_tenant": 50, "max_num_seqs": 16,
            "tenants": {"acme": {"weight": 3.0, "allowed_priorities": ["interactive"]}}}
    cfg = _gateway_config(deep_merge(BASE, {"config": {"flow": flow}}))
    assert (cfg.flow.max_queue_wait_s, cfg.flow.max_queue_reqs_per_tenant, cfg.flow.max_num_seqs) == (5.0, 50, 16)
    assert cfg.flow.tenants["acme"].weight == 3.0 and cfg.flow.tenants["acme"].allowed_priorities == ["interactive"]
    assert _gateway_config(deep_merge(BASE, {"config": {"flow": {"enabled": False}}})).flow.enabled is False


@pytest.mark.parametrize("flow, names", [
    ({"max_queue_wait_s": 0}, ["/config/flow/max_queue_wait_s"]),
    ({"max_queue_reqs_per_tenant": -1}, ["/config/flow/max_queue_reqs_per_tenant", "minimum"]),
    ({"tenants": {"acme": {"weight": 0}}}, ["/config/flow/tenants/acme/weight"]),
    ({"tenants": {"acme": {"wieght": 2}}}, ["/config/flow/tenants/acme", "wieght"]),
    ({"priorities": []}, ["/config/flow/priorities"]),
    ({"enabeld": True}, ["/config/flow", "enabeld"]),
])
def test_bad_flow_values_are_refused_by_the_schema_naming_them(flow, names):
    with pytest.raises(helm.HelmError) as exc:
        render(deep_merge(BASE, {"config": {"flow": flow}}))
    msg = str(exc.value)
    assert "schema" in msg and all(n in msg for n in names), msg
