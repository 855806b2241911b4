"""The Helm chart's values render a gateway config that validates and builds its policy (helm is
not installed here, so the templates themselves are not rendered; the values are what operators edit)."""
from __future__ import annotations

from pathlib import Path

import yaml

from gateway.config import config_from_dict, validate
from policies.registry import get_policy

CHART = Path(__file__).resolve().parent.parent / "charts" / "warmroute"


def test_values_config_validates_and_policy_defaults_match():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    cfg = config_from_dict(values["config"])
    cfg.feed.url = values["feed"]["url"]
    validate(cfg)
    policy = get_policy(cfg.policy.name, **cfg.policy.params)
    defaults = get_policy(cfg.policy.name).params()
    # the chart documents the policy's own defaults: a drift here means one of them changed
    for k, v in cfg.policy.params.items():
        assert float(v) == float(defaults[k]), k
    assert policy.params() == defaults


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["name"] == "warmroute" and chart["apiVersion"] == "v2"
    for t in ("deployment.yaml", "service.yaml", "configmap.yaml"):
        assert (CHART / "templates" / t).exists()
