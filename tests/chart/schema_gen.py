"""The `config` part of charts/warmroute/values.schema.json, derived from gateway/config.py.

Rule: the chart's `config:` values are the gateway's config file, so their schema is the config
dataclasses' fields with their types, less the fields the chart sets itself (CHART_OWNED), plus
the few bounds and enums listed here (policy names and parameters come from the policy registry).
Every object refuses unknown keys, so a typo fails `helm install` naming the key. The gateway
still validates everything at start (cross-field rules the schema cannot express).

`python -m tests.chart.schema_gen` rewrites that part of the schema file in place;
tests/test_chart_schema.py fails when the file and this derivation differ.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from policies.registry import POLICIES, POLICY_NAMES, policy_params

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "charts" / "warmroute" / "values.schema.json"

# Set by the chart's templates from other values (ports, replicas, feed, credential files...).
CHART_OWNED = {
    "server": {"host", "port", "admin_port", "workers"},
    "model": {"tokenizer_dir"},
    "membership": {"replicas", "dns_service", "dns_port"},
    "feed": {"url"},
    "auth": {"enabled", "api_keys_file", "api_keys"},
    "auth.jwt": {"hs256_secret_file", "hs256_secret_env", "rs256_public_key_file", "jwks_file"},
    "salt": {"secret_file"},
    "telemetry": {"service_name"},
}

# Bounds worth refusing at install time (the gateway checks them again, and more).
BOUNDS: dict[str, dict[str, Any]] = {
    "model.block_size": {"minimum": 1},
    "model.max_model_len": {"minimum": 1},
    "model.tokenizer_workers": {"minimum": 1},
    "model.tokenize_check_s": {"minimum": 0},
    "model.lora_discovery_s": {"minimum": 0},
    "proxy.max_attempts": {"minimum": 1},
    "proxy.pool_limit": {"minimum": 1},
    "membership.health_timeouts_to_down": {"minimum": 1},
    "feed.index_max_entries": {"minimum": 1},
    "feed.media_history_ttl_s": {"minimum": 0},
    "server.max_body_bytes": {"minimum": 1024},
    "server.shutdown_grace_s": {"minimum": 0},
    "auth.jwt.leeway_s": {"minimum": 0},
    "telemetry.max_tenant_labels": {"minimum": 0},
    "auth.api_keys_reload_s": {"exclusiveMinimum": 0},
    "salt.scope": {"enum": ["tenant", "user"]},
    "telemetry.log_level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
    "policy.name": {"enum": list(POLICY_NAMES)},
    "flow.max_num_seqs": {"minimum": 1},
    "flow.engine_queue_reqs": {"minimum": 0},
    "flow.headroom_reqs": {"minimum": 0},
    "flow.light_spill_s": {"minimum": 0},
    "flow.max_queue_reqs_per_tenant": {"minimum": 0},
    "flow.default_weight": {"exclusiveMinimum": 0},
    "flow.priorities": {"minItems": 1, "uniqueItems": True},
    "flow.tenants.*.weight": {"exclusiveMinimum": 0},
}
# Timeouts and periods (`*_s` fields of these sections) must be positive.
POSITIVE_S_SECTIONS = {"membership", "feed", "proxy", "policy", "flow"}


def _type_schema(tp: Any, path: str) -> dict:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        sub = _type_schema(inner[0], path)
        if type(None) in args:
            t = sub.get("type")
            if isinstance(t, str):
                sub = dict(sub, type=[t, "null"])
            elif t is None:
                sub = {"anyOf": [sub, {"type": "null"}]}
        return sub
    if dataclasses.is_dataclass(tp):
        return _dataclass_schema(tp, path)
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], f"{path}[]")}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], f"{path}.*")}
    return {}


def _dataclass_schema(cls: type, path: str) -> dict:
    hints = typing.get_type_hints(cls)
    owned = CHART_OWNED.get(path, set())
    section = path.split(".")[0]
    props = {}
    for f in dataclasses.fields(cls):
        if f.name in owned:
            continue
        fpath = f"{path}.{f.name}" if path else f.name
        sub = _type_schema(hints[f.name], fpath)
        if section in POSITIVE_S_SECTIONS and f.name.endswith("_s") and "." not in path:
            sub = dict(sub, exclusiveMinimum=0)
        bound = BOUNDS.get(fpath, {})
        if "minimum" in bound:  # e.g. 0 switches it off: not forced positive
            sub.pop("exclusiveMinimum", None)
        sub.update(bound)
        props[f.name] = sub
    if path == "policy":
        props["params"] = {"type": "object", "description": "the policy's weights (policies/<name>.py)"}
    return {"type": "object", "additionalProperties": False, "properties": props}


def _policy_params_rules() -> list[dict]:
    """Per policy: its parameter names (its constructor's, and those of the policy it passes its
    keywords to: `PARAMS_FROM`), non-negative numbers, or booleans where the constructor says so."""
    rules = []
    for name, cls in POLICIES.items():
        if (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
                and getattr(cls, "PARAMS_FROM", None) is None):
            continue  # takes any keyword: nothing to check here
        params = policy_params(name)
        then: dict = {
            "propertyNames": {"enum": list(params)},
            "additionalProperties": {"type": "number", "minimum": 0},
        }
        flags = {p: {"type": "boolean"} for p, (tp, _) in params.items() if tp is bool}
        if flags:
            then["properties"] = flags
        rules.append({"if": {"properties": {"name": {"const": name}}}, "then": {"properties": {"params": then}}})
    return rules


def config_schema() -> dict:
    schema = _dataclass_schema(GatewayConfig, "")
    # numbers >= 0, or a policy's flag (each policy's rule below says which)
    schema["properties"]["policy"]["properties"]["params"]["additionalProperties"] = {"type": ["number", "boolean"], "minimum": 0}
    schema["properties"]["policy"]["allOf"] = _policy_params_rules()
    schema["description"] = "the gateway's config file (gateway/config.py field names); generated by tests/chart/schema_gen.py"
    return schema


def main() -> int:
    doc = json.loads(SCHEMA_PATH.read_text())
    doc["properties"]["config"] = config_schema()
    SCHEMA_PATH.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote the config part of {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
