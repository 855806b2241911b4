"""Render the chart with real Helm (helm-python-sdk: Helm's Go library, no binary) and read the
result as Kubernetes objects. Used by tests/test_chart_*.py.

`render(values)` returns the objects of every rendered manifest (NOTES.txt aside) in a
`Rendered`, with look-ups by kind and name; Helm errors propagate as helm_python.HelmError with
Helm's own message (schema violations, the templates' `fail` messages).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "warmroute"
CI_VALUES = CHART_DIR / "ci"
RELEASE = "wr"
NAMESPACE = "llm"


def ci_values(name: str) -> dict:
    """One of the documented value sets under charts/warmroute/ci/ (name without -values.yaml)."""
    return yaml.safe_load((CI_VALUES / f"{name}-values.yaml").read_text()) or {}


def documented_value_sets() -> list[str]:
    return sorted(p.name[: -len("-values.yaml")] for p in CI_VALUES.glob("*-values.yaml"))


@dataclass
class Rendered:
    objects: list[dict]
    notes: str

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        raise KeyError(f"no {kind} {name!r} rendered (have: {[(o['kind'], o['metadata']['name']) for o in self.objects]})")

    def secret_data(self, name: str) -> dict[str, bytes]:
        sec = self.get("Secret", name)
        out = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
        out.update({k: v.encode() for k, v in (sec.get("stringData") or {}).items()})
        return out

    def configmap_data(self, name: str) -> dict[str, bytes]:
        cm = self.get("ConfigMap", name)
        out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        return out

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")]


_chart: helm.Chart | None = None


def chart() -> helm.Chart:
    global _chart
    if _chart is None:
        _chart = helm.Chart.load(str(CHART_DIR))
    return _chart


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    manifests = chart().render(values or {}, name=name, namespace=namespace, is_install=True)
    objects: list[dict] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return Rendered(objects, notes)


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


FULL_NAME = f"{RELEASE}-warmroute"
