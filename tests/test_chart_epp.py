"""charts/warmroute in epp mode (epp.enabled): the Endpoint Picker instead of the HTTP gateway.

The documented epp value sets (ci/epp-deploy-values.yaml, ci/epp-attach-values.yaml) also lint
and validate against the Kubernetes API schemas of two versions in tests/test_chart.py. Here:
  - the rendered InferencePool validates against its CRD's OpenAPI schema
    (tests/fixtures/k8s/, `jsonschema`, unknown fields refused as kubernetes-validate's strict mode
    does; the CRD's two CEL rules checked by hand, and a new rule in the CRD fails the test);
  - the HTTPRoute is checked structurally: kubernetes-validate ships no Gateway API schemas (a
    test below asserts that, so it says when it starts to);
  - the objects fit together: the pool selects the engines the picker resolves, on the port it
    names them by; the pool names the picker's Service and port; the route sends exactly the
    paths the picker answers to the pool; the picker's pod is the gateway's pod but for the
    command, ports and probes (native grpc probes with the health service names); the rendered
    args parse with the picker's own flags; NetworkPolicy lets the Gateway's Envoy reach the
    picker's gRPC port and the engines, and the picker reach engines and Redis;
  - values that cannot work together fail naming what to set.
Running the rendered picker: tests/test_chart_run.py.
"""
from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

from gateway.engine_routes import ENGINE_ROUTES
from gateway.epp_cli import add_arguments as epp_arguments
from gateway.pipeline import ROUTES
from tests.chart.render import CHART_DIR, FULL_NAME, ci_values, deep_merge, render

CRD_PATH = Path(__file__).parent / "fixtures" / "k8s" / "inference.networking.k8s.io_inferencepools.yaml"
EPP = f"{FULL_NAME}-epp"
KUBE_VERSIONS = ("1.28.0", "1.35.0")
# The CRD's CEL rules (x-kubernetes-validations) and where they apply; checked in _cel_rules_hold.
KNOWN_CEL_RULES = {
    ("spec", "endpointPickerRef"): "self.kind != 'Service' || has(self.port)",
    ("spec", "targetPorts"): "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
}


def values_of(name: str) -> dict:
    return deep_merge(helm.Chart.load(str(CHART_DIR)).values, ci_values(name))


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused: an object schema that lists its properties and
    neither sets additionalProperties nor preserves unknown fields gets additionalProperties
    false (the API server would silently prune such fields; a chart must not render them)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def _crd_schema() -> dict:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


def _cel_rules(schema: dict, path=()) -> dict:
    found = {}
    for rule in schema.get("x-kubernetes-validations", []):
        found[path] = rule["rule"]
    for name, sub in schema.get("properties", {}).items():
        found.update(_cel_rules(sub, path + (name,)))
    return found


def validate_inference_pool(obj: dict) -> None:
    """Raise jsonschema.ValidationError (structure) or AssertionError (CEL rules, metadata)."""
    schema = _crd_schema()
    jsonschema.validate(obj, _strict(schema), cls=jsonschema.Draft7Validator)
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1" and obj["kind"] == "InferencePool"
    # CEL rules: jsonschema cannot run them; these are the CRD's, one by one.
    assert _cel_rules(schema) == KNOWN_CEL_RULES, "the CRD has new CEL rules: check them here"
    ref = obj["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required when kind is 'Service'"
    numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"
    # metadata is `type: object` in a CRD schema; the API server checks the name and labels.
    name = obj["metadata"]["name"]
    assert len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name)
    assert all(isinstance(v, str) for v in obj["metadata"].get("labels", {}).values())


def _pod(r, kind: str, name: str) -> dict:
    return r.get(kind, name)["spec"]["template"]


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ------------------------------------------------------------------------------ InferencePool


@pytest.mark.parametrize("name", ["epp-deploy", "epp-attach"])
def test_rendered_inference_pool_validates_against_its_crd_schema(name):
    validate_inference_pool(render(ci_values(name)).of_kind("InferencePool")[0])


@pytest.mark.parametrize("change, where", [
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSafe"), "failureMode"),
    (lambda p: p["spec"]["targetPorts"][0].update(number=70000), "number"),
    (lambda p: p["spec"].update(targetPorts=[]), "targetPorts"),
    (lambda p: p["spec"]["selector"].update(matchLabels={}), "matchLabels"),
    (lambda p: p["spec"]["endpointPickerRef"].update(portNumber=9002), "portNumber"),  # unknown field
    (lambda p: p["spec"].update(extensionRef={"name": "x"}), "extensionRef"),  # a v1alpha2 field
    (lambda p: p["spec"]["selector"]["matchLabels"].update(app="-bad-"), "-bad-"),
])
def test_the_crd_schema_check_is_not_vacuous(change, where):
    pool = copy.deepcopy(render(ci_values("epp-deploy")).of_kind("InferencePool")[0])
    change(pool)
    with pytest.raises(jsonschema.ValidationError) as exc:
        validate_inference_pool(pool)
    assert where in str(exc.value)


def test_the_crd_cel_rules_are_checked():
    pool = copy.deepcopy(render(ci_values("epp-deploy")).of_kind("InferencePool")[0])
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    with pytest.raises(AssertionError, match="unique"):
        validate_inference_pool(pool)
    pool = copy.deepcopy(render(ci_values("epp-deploy")).of_kind("InferencePool")[0])
    del pool["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(AssertionError, match="port is required"):
        validate_inference_pool(pool)


def test_kubernetes_validate_has_no_gateway_api_or_inference_schemas():
    """Why the HTTPRoute is checked structurally and the InferencePool by its CRD: if this fails,
    kubernetes-validate learned them, and test_chart.py should stop skipping them."""
    r = render(ci_values("epp-deploy"))
    for kind in ("HTTPRoute", "InferencePool"):
        for ver in KUBE_VERSIONS:
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(r.of_kind(kind)[0], ver, strict=True)


@pytest.mark.parametrize("name", ["epp-deploy", "epp-attach"])
def test_pool_selects_the_engines_the_picker_resolves_and_names_the_picker(name):
    values = values_of(name)
    r = render(values)
    pool = r.of_kind("InferencePool")[0]["spec"]
    cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    # The picker resolves a headless Service: its endpoint names are pod IP:dns_port, as the
    # Gateway's endpoints are pod IP:targetPort.
    assert [p["number"] for p in pool["targetPorts"]] == [cfg["membership"]["dns_port"]]
    if name == "epp-deploy":
        sts = r.get("StatefulSet", f"{FULL_NAME}-vllm")
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        headless = r.get("Service", f"{FULL_NAME}-vllm")
        assert _selects(pool["selector"]["matchLabels"], pod_labels)
        assert pool["selector"]["matchLabels"] == headless["spec"]["selector"]  # the same pods
        assert cfg["membership"]["dns_service"] == f"{FULL_NAME}-vllm.llm.svc.cluster.local"
        vllm = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
        assert pool["targetPorts"][0]["number"] == next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
        assert r.of_kind("InferencePool")[0]["metadata"]["name"] == FULL_NAME
    else:
        assert pool["selector"]["matchLabels"] == values["replicas"]["attach"]["podSelector"]["matchLabels"]
        assert cfg["membership"]["dns_service"] == values["replicas"]["attach"]["headlessService"]
        assert r.of_kind("InferencePool")[0]["metadata"]["name"] == "llama-pool"
    ref = pool["endpointPickerRef"]
    assert ref["failureMode"] == values["epp"]["failureMode"] and ref["kind"] == "Service"
    svc = r.get("Service", ref["name"])
    (grpc,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["port"] == values["epp"]["ports"]["grpc"] and grpc["appProtocol"] == "http2"
    picker = _pod(r, "Deployment", EPP)
    assert _selects(svc["spec"]["selector"], picker["metadata"]["labels"])
    container_ports = {p["name"]: p["containerPort"] for p in picker["spec"]["containers"][0]["ports"]}
    assert container_ports[grpc["targetPort"]] == values["epp"]["ports"]["grpc"]
    admin = next(p for p in svc["spec"]["ports"] if p["name"] == "admin")
    assert container_ports[admin["targetPort"]] == values["gateway"]["ports"]["admin"]


def test_failure_mode_defaults_to_fail_close():
    values = ci_values("epp-deploy")
    assert "failureMode" not in values["epp"]
    assert render(values).of_kind("InferencePool")[0]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


# ------------------------------------------------------------------------------ HTTPRoute


def test_http_route_sends_the_pickers_paths_to_the_pool():
    values = values_of("epp-deploy")
    r = render(values)
    route = r.get("HTTPRoute", FULL_NAME)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert set(spec) <= {"parentRefs", "hostnames", "rules"}
    assert spec["parentRefs"] == values["epp"]["httpRoute"]["parentRefs"]
    assert spec["hostnames"] == values["epp"]["httpRoute"]["hostnames"]
    (rule,) = spec["rules"]
    assert set(rule) <= {"matches", "backendRefs", "timeouts", "filters", "name"}
    pool = r.of_kind("InferencePool")[0]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    # Exactly the paths the picker answers (anything else it refuses with 404).
    assert all(set(m) == {"path"} and m["path"]["type"] == "Exact" for m in rule["matches"])
    assert {m["path"]["value"] for m in rule["matches"]} == set(ROUTES) | set(ENGINE_ROUTES)
    assert re.fullmatch(r"([0-9]{1,5}(h|m|s|ms)){1,4}", rule["timeouts"]["request"])  # Gateway API Duration
    # epp-attach renders none; NOTES shows one to write.
    r2 = render(ci_values("epp-attach"))
    assert not r2.of_kind("HTTPRoute")
    example = r2.notes.split("for example:")[1].split("Did the Gateway")[0]
    shown = yaml.safe_load(re.sub(r"^ {7}", "", example, flags=re.M))
    assert shown["spec"]["rules"][0]["backendRefs"][0]["name"] == "llama-pool"
    assert {m["path"]["value"] for m in shown["spec"]["rules"][0]["matches"]} == set(ROUTES) | set(ENGINE_ROUTES)


# ------------------------------------------------------------------------------ the picker's pod


def _without_mode(d: dict) -> dict:
    d = copy.deepcopy(d)
    d["metadata"]["labels"].pop("app.kubernetes.io/component")
    c = d["spec"]["containers"][0]
    for k in ("name", "args", "ports", "startupProbe", "readinessProbe", "livenessProbe"):
        c.pop(k)
    for t in d["spec"]["topologySpreadConstraints"]:
        t["labelSelector"]["matchLabels"].pop("app.kubernetes.io/component")
    return d


@pytest.mark.parametrize("name", ["epp-deploy", "epp-attach"])
def test_picker_pod_is_the_gateway_pod_but_for_command_ports_and_probes(name):
    values = ci_values(name)
    over = {"epp": {"enabled": False}}
    if values["auth"].get("enabled") is False or "trustedTenantHeader" in values["epp"]:
        over["epp"]["failureMode"] = "FailClose"
    epp_r, gw_r = render(values), render(deep_merge(values, over))
    epp_pod, gw_pod = _pod(epp_r, "Deployment", EPP), _pod(gw_r, "Deployment", FULL_NAME)
    # Same secrets, feed, tracing env, volumes, security contexts, termination, topology spread,
    # init containers, resources and annotations (the config checksum differs: no API port).
    epp_cmp, gw_cmp = _without_mode(epp_pod), _without_mode(gw_pod)
    epp_cmp["metadata"]["annotations"].pop("checksum/config")
    gw_cmp["metadata"]["annotations"].pop("checksum/config")
    assert epp_cmp == gw_cmp
    c = epp_pod["spec"]["containers"][0]
    assert c["name"] == "epp" and epp_pod["metadata"]["labels"]["app.kubernetes.io/component"] == "epp"
    assert all(t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "epp"
               for t in epp_pod["spec"]["topologySpreadConstraints"])
    # Native grpc probes on the health port (a number: Kubernetes takes no port name there).
    v = values_of(name)
    health = v["epp"]["ports"]["grpcHealth"]
    assert {k: (c[k]["grpc"]["port"], c[k]["grpc"]["service"]) for k in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "startupProbe": (health, "liveness"), "readinessProbe": (health, "readiness"), "livenessProbe": (health, "liveness")}
    assert all(set(c[k]) - {"periodSeconds", "failureThreshold", "timeoutSeconds"} == {"grpc"}
               for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc-ext-proc": v["epp"]["ports"]["grpc"], "grpc-health": health, "admin": v["gateway"]["ports"]["admin"]}
    assert epp_pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["admin"])
    # The args are the picker's own flags, with the config file the ConfigMap mounts.
    p = argparse.ArgumentParser(prog="warmroute epp")
    epp_arguments(p)
    assert c["args"][0] == "epp"
    a = p.parse_args(c["args"][1:])
    assert (a.grpc_port, a.grpc_health_port) == (v["epp"]["ports"]["grpc"], health)
    assert a.trusted_tenant_header == (v["epp"]["trustedTenantHeader"] or None)
    assert a.transport == v["epp"].get("transport", "h2")
    assert any(m["mountPath"] == str(Path(a.config).parent) for m in c["volumeMounts"])
    # No HTTP gateway alongside.
    assert FULL_NAME not in {d["metadata"]["name"] for d in epp_r.of_kind("Deployment")}
    assert not [s for s in epp_r.of_kind("Service") if s["metadata"]["name"] in (FULL_NAME, f"{FULL_NAME}-admin")]


def test_pdb_hpa_and_monitors_target_the_picker():
    r = render(ci_values("epp-attach"))
    picker = r.get("Deployment", EPP)
    hpa, pdb = r.get("HorizontalPodAutoscaler", EPP), r.get("PodDisruptionBudget", EPP)
    assert hpa["spec"]["scaleTargetRef"]["name"] == EPP and "replicas" not in picker["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == picker["spec"]["selector"]["matchLabels"]
    r = render(ci_values("epp-deploy"))
    sm = r.get("ServiceMonitor", FULL_NAME)
    svc = r.get("Service", EPP)
    assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert not _selects(sm["spec"]["selector"]["matchLabels"], r.get("Service", f"{FULL_NAME}-vllm")["metadata"]["labels"])


# ------------------------------------------------------------------------------ NetworkPolicy


def _admits(rule: dict, labels: dict) -> bool:
    return any("podSelector" in f and "namespaceSelector" not in f and _selects(f["podSelector"].get("matchLabels", {}), labels)
               for f in rule.get("from", []))


@pytest.mark.parametrize("name", ["epp-deploy", "epp-attach"])
def test_network_policies_let_the_gateway_reach_picker_and_engines(name):
    values = values_of(name)
    r = render(values)
    peers = values["epp"]["gatewayFrom"]
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    assert f"{FULL_NAME}-gateway" not in policies
    picker_labels = _pod(r, "Deployment", EPP)["metadata"]["labels"]
    epp = policies[f"{FULL_NAME}-epp"]
    assert _selects(epp["podSelector"]["matchLabels"], picker_labels)
    grpc_rules = [x for x in epp["ingress"] if {"port": "grpc-ext-proc", "protocol": "TCP"} in x["ports"]]
    assert [x["from"] for x in grpc_rules] == [peers]  # the Gateway's Envoy only
    admin_rules = [x for x in epp["ingress"] if {"port": "admin", "protocol": "TCP"} in x["ports"]]
    (check,) = r.of_kind("Pod")  # `helm test`'s: admitted to the admin port beside the scrapers
    assert admin_rules and all(x["from"][:-1] in (values["networkPolicy"]["metricsFrom"], [{"podSelector": {}}])
                               and list(x["from"][-1]) == ["podSelector"]
                               and _selects(x["from"][-1]["podSelector"]["matchLabels"], check["metadata"]["labels"])
                               for x in admin_rules)
    if name == "epp-deploy":
        vllm_pod = _pod(r, "StatefulSet", f"{FULL_NAME}-vllm")["metadata"]["labels"]
        vllm = policies[f"{FULL_NAME}-vllm"]
        assert _selects(vllm["podSelector"]["matchLabels"], vllm_pod)
        api, *scrapers = [x for x in vllm["ingress"] if {"port": "http", "protocol": "TCP"} in x["ports"]]
        assert [x["from"] for x in scrapers] == [values["networkPolicy"]["metricsFrom"]]  # vLLM's /metrics
        assert _admits(api, picker_labels)  # /health and /v1/models
        assert all(p in api["from"] for p in peers)  # the requests, from Envoy
        redis_from = policies[f"{FULL_NAME}-redis"]["ingress"][0]
        assert _admits(redis_from, picker_labels) and _admits(redis_from, vllm_pod)  # picker and agents
    else:
        att = policies[f"{FULL_NAME}-attached-replicas"]
        assert att["podSelector"] == values["replicas"]["attach"]["podSelector"]
        assert _admits(att["ingress"][0], picker_labels) and all(p in att["ingress"][0]["from"] for p in peers)
        assert _admits(policies[f"{FULL_NAME}-redis"]["ingress"][0], picker_labels)


# ------------------------------------------------------------------------------ refusals


BASE = ci_values("epp-deploy")


@pytest.mark.parametrize("over, says", [
    ({"epp": {"failureMode": "FailOpen"}}, "epp.failureMode: FailOpen with the picker authenticating"),
    ({"epp": {"gatewayFrom": []}}, "epp.gatewayFrom: name the pods of the Gateway in front"),
    ({"epp": {"httpRoute": {"parentRefs": []}}}, "epp.httpRoute.parentRefs"),
    ({"epp": {"ports": {"grpcHealth": 9002}}}, "epp.ports: grpc, grpcHealth and gateway.ports.admin"),
    ({"epp": {"ports": {"grpc": 8081}}}, "epp.ports: grpc, grpcHealth and gateway.ports.admin"),
    ({"replicas": {"mode": "attach", "attach": {"endpoints": [
        {"id": "vllm-0", "url": "http://vllm-0.vllm.llm.svc:8000", "kvEventsEndpoint": "tcp://vllm-0.vllm.llm.svc:5557"}]}},
      "gateway": {"tokenizer": {"source": "builtin"}}}, "url http://vllm-0.vllm.llm.svc:8000 must name the pod by IP"),
    ({"replicas": {"mode": "attach", "attach": {"port": 8000, "endpoints": [
        {"id": "vllm-0", "url": "http://10.0.0.7:8001", "kvEventsEndpoint": "tcp://10.0.0.7:5557"}]}},
      "gateway": {"tokenizer": {"source": "builtin"}}}, "must use port replicas.attach.port (8000)"),
    ({"replicas": {"mode": "attach", "attach": {"headlessService": "vllm.llm.svc"}},
      "gateway": {"tokenizer": {"source": "builtin"}}}, "epp.inferencePool.matchLabels"),
    ({"auth": {"apiKeys": {"existingSecret": ""}}, "epp": {"trustedTenantHeader": "x-tenant-id"}},
     "with epp.trustedTenantHeader"),
])
def test_epp_values_that_cannot_work_fail_saying_what_to_set(over, says):
    with pytest.raises(helm.HelmError) as exc:
        render(deep_merge(BASE, over))
    assert says in str(exc.value), str(exc.value)


def test_listed_attach_endpoints_by_pod_ip_render_with_an_agent_each():
    values = deep_merge(BASE, {"replicas": {"mode": "attach", "attach": {
        "port": 8000, "podSelector": {"matchLabels": {"app": "vllm"}},
        "endpoints": [{"id": "vllm-0", "url": "http://10.0.0.7:8000", "kvEventsEndpoint": "tcp://10.0.0.7:5557"}]}},
        "gateway": {"tokenizer": {"source": "builtin"}}})
    r = render(values)
    cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    assert cfg["membership"]["replicas"] == [{"id": "vllm-0", "url": "http://10.0.0.7:8000"}]
    assert r.get("Deployment", f"{FULL_NAME}-agent-vllm-0")
    assert r.of_kind("InferencePool")[0]["spec"]["selector"]["matchLabels"] == {"app": "vllm"}


def test_the_readme_epp_install_command_renders():
    import shlex

    readme = (CHART_DIR.parents[1] / "README.md").read_text()
    section = readme.split("**Endpoint Picker mode**")[1]
    command = section.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[:3] == ["helm", "install", "wr"] and argv[3] == "charts/warmroute"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    r = render(helm.parse_set_string(",".join(sets)))
    assert r.get("Deployment", EPP) and r.get("HTTPRoute", FULL_NAME) and r.of_kind("InferencePool")
    assert r.get("NetworkPolicy", EPP)["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "gateway-system"}
