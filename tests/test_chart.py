"""charts/warmroute with real Helm (helm-python-sdk bundles Helm's Go library): it lints, and
every object it renders for the default install and for each documented value set
(charts/warmroute/ci/*-values.yaml) validates against the Kubernetes API schemas of two
Kubernetes versions (kubernetes-validate, strict: unknown fields refused). The rendered objects
fit together: the gateway config is one the gateway accepts, the engines get the flags the agents
and the gateway rely on, selectors select what they mean to, and the image the Dockerfile builds
is what the containers expect. Running the rendered containers: tests/test_chart_run.py."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate as kv
import pytest
import yaml

from gateway.config import config_from_dict
from policies.registry import get_policy
from tests.chart.render import CHART_DIR, FULL_NAME, ci_values, deep_merge, documented_value_sets, render

KUBE_VERSIONS = ("1.28.0", "1.35.0")  # the oldest still in common use and a recent one
REPO = CHART_DIR.parents[1]
VALUE_SETS = documented_value_sets()
# Custom resources kubernetes-validate has no schema for: Prometheus Operator's (checked structurally
# below; the PrometheusRule's rules by promtool: tests/test_chart_alerts.py) and, in epp mode, the
# InferencePool (its CRD's schema) and HTTPRoute (structurally): tests/test_chart_epp.py.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}


def test_documented_value_sets_cover_the_modes():
    assert {"default", "attach", "attach-headless", "deploy-redis", "full", "epp-deploy", "epp-attach"} <= set(VALUE_SETS)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lints_each_value_set_strictly_on_two_kubernetes_versions(name):
    for ver in KUBE_VERSIONS:
        report = helm.lint(str(CHART_DIR), ci_values(name), strict=True, kube_version=f"v{ver}", namespace="llm")
        assert report["errors"] == [], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates_against_kubernetes_schemas(name):
    r = render(ci_values(name))
    kinds = {o["kind"] for o in r.objects}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    for ver in KUBE_VERSIONS:
        for obj in r.objects:
            if obj["kind"] in CRD_KINDS:
                continue
            kv.validate(obj, ver, strict=True)  # raises ValidationError naming the field


def test_the_validator_is_not_vacuous():
    obj = copy.deepcopy(render(ci_values("default")).get("Deployment", FULL_NAME))
    obj["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eighty"
    with pytest.raises(kv.ValidationError):
        kv.validate(obj, KUBE_VERSIONS[0], strict=True)
    obj = copy.deepcopy(render(ci_values("default")).get("Deployment", FULL_NAME))
    obj["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(obj, KUBE_VERSIONS[1], strict=True)


def test_default_install_without_a_salt_secret_fails_saying_how_to_give_one():
    with pytest.raises(helm.HelmError) as exc:
        render({})
    msg = str(exc.value)
    assert "salt" in msg and "salt.existingSecret" in msg and "kubectl create secret generic" in msg, msg
    assert "salt.value" in msg
    # and the same install with the Secret named renders
    render({"salt": {"existingSecret": "warmroute-salt"}, "auth": {"apiKeys": {"existingSecret": "k"}}})


@pytest.mark.parametrize("over, says", [
    ({"auth": {"apiKeys": {"existingSecret": ""}}}, "auth.enabled: give credentials"),
    ({"feed": {"redis": {"enabled": False}}}, "feed.externalUrl"),
    ({"feed": {"redis": {"auth": {"enabled": True}}}}, "feed.redis.auth.existingSecret"),
    ({"replicas": {"mode": "attach"}, "gateway": {"tokenizer": {"source": "builtin"}}}, "replicas.attach.endpoints"),
    ({"replicas": {"mode": "attach", "attach": {"headlessService": "vllm.llm.svc"}}}, "gateway.tokenizer.hubModel"),
    ({"replicas": {"deploy": {"servedModelName": "a"}}, "config": {"model": {"name": "b"}}}, "servedModelName"),
])
def test_incomplete_values_fail_saying_what_to_set(over, says):
    with pytest.raises(helm.HelmError) as exc:
        render(deep_merge(ci_values("default"), over))
    assert says in str(exc.value), str(exc.value)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_gateway_config_is_one_the_gateway_accepts(name):
    r = render(ci_values(name))
    raw = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    cfg = config_from_dict(raw, env={})  # raises ConfigError naming the field
    values = deep_merge(helm.Chart.load(str(CHART_DIR)).values, ci_values(name))
    if values["epp"]["enabled"]:  # the picker: no API port, one process; its gRPC ports are flags
        assert "port" not in raw["server"] and "workers" not in raw["server"]
    else:
        assert cfg.server.port == values["gateway"]["ports"]["http"] and cfg.server.workers == values["gateway"]["workers"]
    assert cfg.server.admin_port == values["gateway"]["ports"]["admin"]
    assert cfg.salt.secret_file == "/etc/warmroute/salt/secret"
    dep = r.get("Deployment", router_name(values))["spec"]["template"]["spec"]
    gw = dep["containers"][0]
    mounts = {m["mountPath"] for m in gw["volumeMounts"]}
    for path in (cfg.salt.secret_file, cfg.auth.api_keys_file, cfg.auth.jwt.jwks_file, cfg.auth.jwt.hs256_secret_file,
                 cfg.model.tokenizer_dir):
        if path:  # every file the config names sits in a mounted volume
            assert any(path.startswith(m + "/") or path == m for m in mounts), (path, mounts)
    assert gw["args"][-1].startswith("/etc/warmroute/config/") and any(m == "/etc/warmroute/config" for m in mounts)


def router_name(values: dict) -> str:
    """The Deployment that reads the config: the gateway, or in epp mode the picker."""
    return f"{FULL_NAME}-epp" if values.get("epp", {}).get("enabled") else FULL_NAME


def test_gateway_pod_is_hardened_drains_and_spreads():
    r = render(ci_values("full"))
    values = deep_merge(helm.Chart.load(str(CHART_DIR)).values, ci_values("full"))
    dep = r.get("Deployment", FULL_NAME)
    pod = dep["spec"]["template"]["spec"]
    gw = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    sc = gw["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/tmp" for m in gw["volumeMounts"])  # the one writable place
    grace = values["config"]["server"]["shutdown_grace_s"]
    sleep_s = int(gw["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + grace
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gw[probe]["httpGet"]["port"] == "admin"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz" and gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    keys = {t["topologyKey"] for t in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(t["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"] for t in pod["topologySpreadConstraints"])
    assert gw["resources"] == values["gateway"]["resources"]
    # HPA on: the Deployment leaves the replica count to it; PDB and HPA target these pods.
    assert "replicas" not in dep["spec"]
    hpa, pdb = r.get("HorizontalPodAutoscaler", FULL_NAME), r.get("PodDisruptionBudget", FULL_NAME)
    assert hpa["spec"]["scaleTargetRef"]["name"] == FULL_NAME and hpa["spec"]["minReplicas"] == 3
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # The API Service is the LoadBalancer; /debug stays on a ClusterIP Service.
    assert r.get("Service", FULL_NAME)["spec"]["type"] == "LoadBalancer"
    assert [p["targetPort"] for p in r.get("Service", FULL_NAME)["spec"]["ports"]] == ["http"]
    assert r.get("Service", f"{FULL_NAME}-admin")["spec"]["type"] == "ClusterIP"


def test_tracing_values_become_the_standard_otel_variables():
    values = ci_values("full")
    env = {e["name"]: e.get("value") for e in render(values).get("Deployment", FULL_NAME)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == values["tracing"]["otlpEndpoint"]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and float(env["OTEL_TRACES_SAMPLER_ARG"]) == 0.25
    assert env["OTEL_SERVICE_NAME"] == "warmroute-gateway" and env["OTEL_BSP_SCHEDULE_DELAY"] == "1000"
    off = {e["name"] for e in render(ci_values("default")).get("Deployment", FULL_NAME)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in off  # no endpoint: no exporter


def _args(container: dict) -> list[str]:
    return [str(a) for a in container.get("args", [])]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("name", ["default", "deploy-redis", "full"])
def test_deploy_mode_engines_and_their_agents_agree(name):
    r = render(ci_values(name))
    cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    sts = r.get("StatefulSet", f"{FULL_NAME}-vllm")
    pod = sts["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    va, aa = _args(vllm), _args(agent)
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in va
    assert int(_flag(va, "--block-size")) == cfg["model"]["block_size"] == int(_flag(aa, "--block-size"))
    events = json.loads(_flag(va, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # The engine binds, the agent in the same pod connects to the same ports over localhost.
    assert events["endpoint"] == "tcp://*:" + _flag(aa, "--kv-events-endpoint").rsplit(":", 1)[1]
    assert events["replay_endpoint"] == "tcp://*:" + _flag(aa, "--replay-endpoint").rsplit(":", 1)[1]
    assert _flag(aa, "--engine-url") == f"http://127.0.0.1:{_flag(va, '--port')}"
    # The names the gateway, the engine and the agent use for the model and the replica agree.
    assert _flag(va, "--served-model-name") == cfg["model"]["name"] == _flag(aa, "--model")
    assert _flag(aa, "--replica-id") == f"$(POD_IP):{cfg['membership']['dns_port']}"  # gateway's DNS ids: IP:port
    assert "status.podIP" == next(e for e in agent["env"] if e["name"] == "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"]
    svc = r.get("Service", f"{FULL_NAME}-vllm")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert cfg["membership"]["dns_service"].startswith(f"{FULL_NAME}-vllm.llm.svc.")
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    # The agent and the gateway read the same feed.
    gw_env = {e["name"]: e for e in r.get("Deployment", FULL_NAME)["spec"]["template"]["spec"]["containers"][0]["env"]}
    ag_env = {e["name"]: e for e in agent["env"]}
    assert _flag(aa, "--feed") == "$(FEED_URL)" and gw_env["WARMROUTE_FEED__URL"]["value"] == "$(FEED_URL)"
    assert gw_env["FEED_URL"] == ag_env["FEED_URL"]


def test_engines_schedule_by_priority_exactly_when_the_gateway_sends_priorities():
    """vLLM refuses a request priority other than 0 unless it runs --scheduling-policy priority: the
    deployed engines get the flag when flow control or keep-alive sends priorities (keep-alive, on
    by default, does in deploy mode unless told not to), attach mode's notes ask for it, and
    nothing changes otherwise."""
    def rendered(over: dict, base: str = "default") -> tuple[list[str], dict]:
        r = render(deep_merge(ci_values(base), over))
        cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
        if base != "default":
            return [], cfg
        pod = r.get("StatefulSet", f"{FULL_NAME}-vllm")["spec"]["template"]["spec"]
        return _args(next(c for c in pod["containers"] if c["name"] == "vllm")), cfg

    va, cfg = rendered({})  # the chart's default: keep-alive on, its refreshes ahead of the queue
    assert _flag(va, "--scheduling-policy") == "priority" and va.count("--scheduling-policy") == 1
    ka = config_from_dict(cfg, env={}).keep_alive
    assert ka.enabled and ka.engine_priority and ka.max_waiting == 8 and ka.idle_s == 1.0
    for off in ({"config": {"keep_alive": {"enabled": False}}}, {"config": {"keep_alive": {"engine_priority": False}}}):
        va, cfg = rendered(off)
        assert "--scheduling-policy" not in va and not cfg["keep_alive"].get("engine_priority")
    va, cfg = rendered({"config": {"keep_alive": {"engine_priority": False, "max_waiting": 3}}})
    assert cfg["keep_alive"]["max_waiting"] == 3  # an operator's own value stands
    va, _ = rendered({"config": {"keep_alive": {"enabled": False}, "flow": {"engine_priority": True}}})
    assert _flag(va, "--scheduling-policy") == "priority"
    va, _ = rendered({"replicas": {"deploy": {"extraArgs": ["--scheduling-policy", "priority"]}}})
    assert va.count("--scheduling-policy") == 1  # an operator's own flag is not doubled
    # attach mode: the chart does not run the engines, so keep-alive's refreshes carry no priority
    # unless asked, and then NOTES asks for the engines' flag
    attach = ci_values("attach")
    _, cfg = rendered({}, "attach")
    assert cfg["keep_alive"]["enabled"] and not cfg["keep_alive"].get("engine_priority")
    assert "--scheduling-policy" not in render(attach).notes
    notes = render(deep_merge(attach, {"config": {"keep_alive": {"engine_priority": True}}})).notes
    assert "--scheduling-policy priority" in notes


def test_the_gateway_renders_chats_with_the_deployed_engines_chat_flags():
    """The chat-rendering flags an operator gives the deployed engines (replicas.deploy.extraArgs:
    --chat-template inline, --chat-template-content-format, --default-chat-template-kwargs,
    --interleave-mm-strings; "--flag value" or "--flag=value") reach the gateway's config.model, so
    its token ids stay the engines'; a template file the gateway cannot read, or a config.model
    value that says otherwise, fails the install saying what to set."""
    def model(args: list, over: dict | None = None) -> dict:
        values = deep_merge(ci_values("default"), {"replicas": {"deploy": {"extraArgs": args}}, **(over or {})})
        r = render(values)
        cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
        config_from_dict(cfg, env={})  # one the gateway accepts
        return cfg["model"]

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    m = model(["--max-model-len", "8192", "--chat-template", inline, "--chat-template-content-format=openai",
               "--default-chat-template-kwargs", '{"enable_thinking": false}', "--interleave-mm-strings"])
    assert (m["chat_template"], m["chat_template_content_format"], m["default_chat_template_kwargs"],
            m["interleave_mm_strings"]) == (inline, "openai", {"enable_thinking": False}, True)
    m = model(["--max-model-len", "8192"])
    assert not {"chat_template", "chat_template_content_format", "default_chat_template_kwargs",
                "interleave_mm_strings"} & m.keys()  # nothing given: the gateway's defaults, the engines'
    same = {"config": {"model": {"chat_template_content_format": "openai"}}}
    assert model(["--chat-template-content-format", "openai"], same)["chat_template_content_format"] == "openai"
    for args, over, says in (
            (["--chat-template", "/templates/tool_chat.jinja"], None, "set config.model.chat_template"),
            (["--chat-template-content-format", "string"], same, "config.model.chat_template_content_format"),
            (["--default-chat-template-kwargs", "{not json"], None, "must be a JSON object")):
        with pytest.raises(helm.HelmError, match=re.escape(says)):
            model(args, over)
    own = {"config": {"model": {"chat_template": inline}}}  # a file on the engines, its text for the gateway
    assert model(["--chat-template", "/templates/tool_chat.jinja"], own)["chat_template"] == inline


def test_attach_notes_give_the_engines_the_chat_flags_config_model_states():
    """Attach mode: the chart does not run the engines, so its notes print the chat-rendering
    flags config.model gives the gateway, for the engines to run with; with none set, they say
    where to put the engines' own."""
    attach = ci_values("attach")
    notes = render(attach).notes
    assert "give the gateway the same in config.model" in notes and "--interleave-mm-strings\n" not in notes
    model = {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
             "chat_template_content_format": "openai", "default_chat_template_kwargs": {"enable_thinking": False},
             "interleave_mm_strings": True}
    notes = render(deep_merge(attach, {"config": {"model": model}})).notes
    assert "give the gateway the same" not in notes
    for flag in ("--chat-template <the template config.model.chat_template has>",
                 "--chat-template-content-format openai",
                 "--default-chat-template-kwargs '{\"enable_thinking\":false}'", "--interleave-mm-strings"):
        assert flag in notes, flag
    notes = render(deep_merge(attach, {"config": {"model": {"interleave_mm_strings": True}}})).notes
    assert "--interleave-mm-strings" in notes and "--chat-template" not in notes


def test_engines_store_responses_exactly_when_the_gateway_serves_them():
    """config.responses.store: the deployed engines get VLLM_ENABLE_RESPONSES_API_STORE=1 (vLLM
    stores nothing without it), attach mode's notes ask for it, and nothing changes otherwise."""
    def engine_env(over: dict) -> dict:
        r = render(deep_merge(ci_values("default"), over))
        pod = r.get("StatefulSet", f"{FULL_NAME}-vllm")["spec"]["template"]["spec"]
        cfg = config_from_dict(yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"]), env={})
        return {e["name"]: e.get("value") for e in next(c for c in pod["containers"] if c["name"] == "vllm")["env"]}, cfg

    env, cfg = engine_env({})
    assert "VLLM_ENABLE_RESPONSES_API_STORE" not in env and not cfg.responses.store
    env, cfg = engine_env({"config": {"responses": {"store": True}}})
    assert env["VLLM_ENABLE_RESPONSES_API_STORE"] == "1" and cfg.responses.store
    attach = ci_values("attach")
    assert "VLLM_ENABLE_RESPONSES_API_STORE" not in render(attach).notes
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in render(deep_merge(attach, {"config": {"responses": {"store": True}}})).notes


def test_attach_mode_adds_one_agent_per_listed_replica():
    values = ci_values("attach")
    r = render(values)
    cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    endpoints = values["replicas"]["attach"]["endpoints"]
    assert cfg["membership"]["replicas"] == [{"id": e["id"], "url": e["url"]} for e in endpoints]
    assert not r.of_kind("StatefulSet")  # no engines, no Redis (external)
    agents = [d for d in r.of_kind("Deployment") if d["metadata"]["name"].startswith(f"{FULL_NAME}-agent-")]
    assert len(agents) == len(endpoints)
    for e, d in zip(endpoints, agents):
        a = _args(d["spec"]["template"]["spec"]["containers"][0])
        assert (_flag(a, "--replica-id"), _flag(a, "--engine-url"), _flag(a, "--kv-events-endpoint"), _flag(a, "--replay-endpoint")) == \
            (e["id"], e["url"], e["kvEventsEndpoint"], e["replayEndpoint"])
        assert d["spec"]["strategy"]["type"] == "Recreate"  # never two agents for one replica
    feed = {e["name"]: e for e in agents[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert feed["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == values["feed"]["externalPasswordSecret"]
    assert feed["FEED_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis-master.infra.svc.cluster.local:6379/2"
    assert cfg["feed"]["url"] == values["feed"]["externalUrl"]  # no password in the ConfigMap
    assert "--enable-prompt-tokens-details" in r.notes and "--kv-events-config" in r.notes


def test_attach_by_headless_service_resolves_it_and_notes_print_the_sidecar():
    values = ci_values("attach-headless")
    r = render(values)
    cfg = yaml.safe_load(r.configmap_data(FULL_NAME)["gateway.yaml"])
    assert cfg["membership"]["dns_service"] == "vllm.llm.svc.cluster.local" and cfg["membership"]["dns_port"] == 8000
    assert cfg["model"]["tokenizer_dir"] == "/etc/warmroute/tokenizer/llama-3.1-8b-instruct"
    sidecar = yaml.safe_load(r.notes.split("add this agent sidecar to their pod template:")[1])
    assert sidecar[0]["args"][:3] == ["agent", "--replica-id", "$(POD_IP):8000"]
    env = {e["name"]: e for e in sidecar[0]["env"]}
    assert env["FEED_URL"]["value"] == f"redis://{FULL_NAME}-redis.llm.svc.cluster.local:6379/0"
    # Their agents may reach the built-in Redis (NetworkPolicy), and only the gateway and agents reach them.
    redis_from = r.get("NetworkPolicy", f"{FULL_NAME}-redis")["spec"]["ingress"][0]["from"]
    assert {"podSelector": values["replicas"]["attach"]["podSelector"]} in redis_from
    assert r.get("NetworkPolicy", f"{FULL_NAME}-attached-replicas")["spec"]["podSelector"] == values["replicas"]["attach"]["podSelector"]
    vols = {v["name"]: v for v in r.get("Deployment", FULL_NAME)["spec"]["template"]["spec"]["volumes"]}
    assert vols["tokenizer"]["persistentVolumeClaim"]["claimName"] == "models"


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def _pods(r) -> dict[str, dict]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in r.workloads()}


@pytest.mark.parametrize("name", ["default", "full", "attach"])
def test_network_policies_admit_only_the_gateway_to_replicas_and_feed(name):
    r = render(ci_values(name))
    pods = _pods(r)
    gw = pods[FULL_NAME]
    policies = {p["metadata"]["name"]: p for p in r.of_kind("NetworkPolicy")}
    for pol in policies.values():  # each policy selects some rendered pods (or the attached ones)
        sel = pol["spec"]["podSelector"].get("matchLabels", {})
        assert any(_selects(sel, l) for l in pods.values()) or pol["metadata"]["name"].endswith("attached-replicas"), pol
    if name in ("default", "full"):
        vllm = policies[f"{FULL_NAME}-vllm"]["spec"]["ingress"]
        api_rules = [rule for rule in vllm if {"port": "http", "protocol": "TCP"} in rule["ports"]]
        froms = [f for rule in api_rules for f in rule["from"]]
        if name == "default":  # no scraper named: the engines' API admits the gateway pods only
            assert len(froms) == 1 and _selects(froms[0]["podSelector"]["matchLabels"], gw)
    if name in ("default", "full"):
        redis = policies[f"{FULL_NAME}-redis"]["spec"]["ingress"][0]["from"]
        admitted = [n for n, labels in pods.items() if any(_selects(f["podSelector"]["matchLabels"], labels) for f in redis)]
        assert sorted(admitted) == sorted([FULL_NAME, f"{FULL_NAME}-vllm"])
    if name == "attach":
        att = policies[f"{FULL_NAME}-attached-replicas"]
        assert att["spec"]["podSelector"] == ci_values("attach")["replicas"]["attach"]["podSelector"]


def test_prometheus_monitors_select_the_admin_service_and_agent_pods():
    r = render(ci_values("full"))
    sm, pm = r.get("ServiceMonitor", FULL_NAME), r.get("PodMonitor", f"{FULL_NAME}-replicas")
    admin = r.get("Service", f"{FULL_NAME}-admin")
    assert _selects(sm["spec"]["selector"]["matchLabels"], admin["metadata"]["labels"])
    assert not _selects(sm["spec"]["selector"]["matchLabels"], r.get("Service", FULL_NAME)["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in admin["spec"]["ports"]}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    vllm = r.get("StatefulSet", f"{FULL_NAME}-vllm")["spec"]["template"]
    assert _selects(pm["spec"]["selector"]["matchLabels"], vllm["metadata"]["labels"])
    ports = {p["name"] for c in vllm["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports


def test_chart_created_secrets_hold_the_values_and_none_leaks_into_configmaps():
    values = ci_values("full")
    r = render(values)
    assert r.secret_data(f"{FULL_NAME}-salt")["secret"].decode() == values["salt"]["value"]
    assert yaml.safe_load(r.secret_data(f"{FULL_NAME}-api-keys")["keys.yaml"]) == values["auth"]["apiKeys"]["tenants"]
    assert r.secret_data(f"{FULL_NAME}-redis")["password"].decode() == values["feed"]["redis"]["auth"]["password"]
    assert set(r.secret_data(f"{FULL_NAME}-jwt")) == {"hs256.secret", "jwks.json"}
    text = json.dumps([o for o in r.objects if o["kind"] != "Secret"])
    for secret in (values["salt"]["value"], values["feed"]["redis"]["auth"]["password"], "sk-team-b-plain-key-for-tests"):
        assert secret not in text
    # Existing Secrets: the chart creates none.
    assert not render(ci_values("deploy-redis")).of_kind("Secret")


def test_values_yaml_documents_the_policys_own_default_weights():
    text = (CHART_DIR / "values.yaml").read_text()
    blocks = text.split("which are, for cache_aware:")[1].split("params: {}")[0].split("and for cache_plan itself:")
    for name, block in zip(("cache_aware", "cache_plan"), blocks, strict=True):
        documented = {m.group(1): float(m.group(2)) for m in re.finditer(r"#\s+(\w+): ([0-9.]+)", block)}
        defaults = get_policy(name).params()
        assert documented and all(defaults[k] == v for k, v in documented.items()), (name, documented, defaults)


@pytest.mark.parametrize("name", ["full", "epp-deploy"])
def test_dockerfile_builds_the_image_the_containers_expect(name):
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["warmroute"\]$', text, re.M)
    assert re.search(r"^RUN pip install \. ", text, re.M)  # the package, as the tests install it
    uid = int(re.search(r"^USER (\d+)", text, re.M).group(1))
    r = render(ci_values(name))
    image = f"{helm.Chart.load(str(CHART_DIR)).values['image']['repository']}:0.1.0"
    for w in r.workloads():
        for c in w["spec"]["template"]["spec"]["containers"] + w["spec"]["template"]["spec"].get("initContainers", []):
            if c["image"] != image:
                continue
            if "command" in c:  # the tokenizer fetcher runs the image's python with a library the package depends on
                assert c["command"][0] == "python"
                import huggingface_hub  # noqa: F401
            else:
                assert c["args"][0] in ("gateway", "agent", "epp")
            assert c["securityContext"].get("runAsUser", w["spec"]["template"]["spec"].get("securityContext", {}).get("runAsUser")) == uid
    assert helm.Chart.load(str(CHART_DIR)).metadata["appVersion"] in image


def test_chart_metadata():
    meta = helm.Chart.load(str(CHART_DIR)).metadata
    assert meta["name"] == "warmroute" and meta["apiVersion"] == "v2" and meta["kubeVersion"]
    assert Path(CHART_DIR / "values.schema.json").exists()


@pytest.mark.parametrize("name", ["default", "full", "epp-deploy"])
def test_the_helm_test_pod_calls_the_routers_services_and_the_network_policy_admits_it(name):
    """`helm test`'s Pod runs `warmroute check` against the router's admin Service (and, for the
    HTTP gateway, its API Service) on their rendered ports, and the router's NetworkPolicy admits
    it on both even when only named peers may call the API or scrape the admin port."""
    r = render(ci_values(name))
    (pod,) = r.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    args = pod["spec"]["containers"][0]["args"]
    assert args[0] == "check"
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]} for s in r.of_kind("Service")}
    targets = [args[args.index(flag) + 1] for flag in ("--admin-url", "--url") if flag in args]
    assert len(targets) == (1 if name.startswith("epp") else 2)
    for url in targets:
        host, port = url.removeprefix("http://").split(":")
        assert int(port) in services[host], (url, services)
    router = next(p for p in r.of_kind("NetworkPolicy") if p["metadata"]["name"] in (FULL_NAME + "-gateway", FULL_NAME + "-epp"))
    labels = pod["metadata"]["labels"]
    for port in ("admin",) if name.startswith("epp") else ("http", "admin"):
        rules = [rule for rule in router["spec"]["ingress"] if {"port": port, "protocol": "TCP"} in rule["ports"]]
        assert rules and all("from" not in rule or any(_selects(f.get("podSelector", {}).get("matchLabels", {}), labels)
                                                        and "namespaceSelector" not in f for f in rule["from"])
                             for rule in rules), (port, rules)
