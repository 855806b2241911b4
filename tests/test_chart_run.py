"""Running what the chart renders: the rendered Redis, agent and gateway containers run as local
processes (tests/chart/podrun.py does what the kubelet would: env with valueFrom resolved from the
rendered Secrets and ConfigMaps, mounted files under a temporary root, the image's entrypoint
replaced by the local install), with `warmroute sim` replicas at the addresses the rendered
objects name. Then: every probe in the rendered specs passes; a chat request with a key from the
rendered Secret is served warm on its repeat; the weights set in values are the ones the admin
port's routing explanation scores with; the rendered OTEL_* env exports the request's spans; no
secret shows in any log; every process stops promptly on SIGTERM. And one bad value in the
rendered config (which the schema cannot see: a cross-field rule) stops the gateway at start with
the field named.
In epp mode the rendered picker (`warmroute epp`) runs the same way beside a sim replica, its
agent and the rendered Redis: its native gRPC probes (startup, readiness, liveness) pass on the
rendered health port, its admin probes (/healthz, /readyz) on the rendered admin port, the
Service's ext_proc port answers one request as Envoy would send it (the pick names the replica as
the InferencePool's endpoints are, pod IP:targetPort; the cache salt is the derived one, the
client's credentials are removed), and it stops promptly on SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from loadtests.processes import stop_processes
from loadtests.runner import wait_http
from tests.chart.podrun import LocalContainer, local_entrypoint
from tests.chart.render import NAMESPACE, Rendered, deep_merge, render
from tests.conftest import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

FULL = "wr-warmroute"
MODEL = "sim-model"
API_KEY = "sk-run-test-key-t0-4b1d"
SALT = "run-test-salt-0123456789abcdef0123456789"
REDIS_PASSWORD = "run-test-redis-pw-77"
W_CACHE, W_QUEUE = 3.0, 0.5


class OtlpReceiver:
    """A minimal OTLP/HTTP trace endpoint: records the bodies POSTed to /v1/traces."""

    def __init__(self) -> None:
        bodies = self.bodies = []

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                bodies.append((self.path, self.headers.get("Content-Type"), self.rfile.read(n)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_values(ports: dict, otlp_port: int, **over) -> dict:
    values = {
        "salt": {"value": SALT},
        "auth": {"apiKeys": {"tenants": {"t0": [API_KEY]}}},
        "gateway": {"workers": 1, "ports": {"http": ports["http"], "admin": ports["admin"]},
                    "tokenizer": {"source": "builtin"}},
        # the Services' ports as the containers' (no kube-proxy here: a Service name reaches the pod's port)
        "service": {"port": ports["http"], "adminPort": ports["admin"]},
        "replicas": {"mode": "attach", "attach": {"endpoints": [
            {"id": f"r{i}", "url": f"http://127.0.0.1:{ports[f'sim{i}']}",
             "kvEventsEndpoint": f"tcp://127.0.0.1:{ports[f'ev{i}']}",
             "replayEndpoint": f"tcp://127.0.0.1:{ports[f'rp{i}']}"} for i in (1, 2)]}},
        "agent": {"adminPort": ports["agent1"]},
        "feed": {"redis": {"enabled": True, "port": ports["redis"],
                           "auth": {"enabled": True, "password": REDIS_PASSWORD}}},
        "tracing": {"otlpEndpoint": f"http://127.0.0.1:{otlp_port}", "samplerRatio": 1.0,
                    "extraEnv": {"OTEL_BSP_SCHEDULE_DELAY": "200"}},
        # cache_aware named (the chart's default is cache_plan): its score is the formula checked below
        "config": {"model": {"name": MODEL}, "policy": {"name": "cache_aware", "params": {"w_cache": W_CACHE, "w_queue": W_QUEUE}},
                   "membership": {"health_interval_s": 0.5}},
    }
    return deep_merge(values, over)


def _warmroute_image(r: Rendered) -> str:
    """The warmroute image: what the router (gateway or picker) container runs."""
    router = next(w for w in r.of_kind("Deployment") if w["metadata"]["name"] in (FULL, f"{FULL}-epp"))
    return router["spec"]["template"]["spec"]["containers"][0]["image"]


def _container(r: Rendered, kind: str, name: str, container: str, root: Path) -> LocalContainer:
    return LocalContainer(r, r.get(kind, name), container, root, warmroute_image=_warmroute_image(r), namespace=NAMESPACE)


def _helm_test(r: Rendered, root: Path, rc_expected: int = 0) -> str:
    """Run the rendered `helm test` Pod to its end; its log."""
    pod = next(p for p in r.of_kind("Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test")
    check = LocalContainer(r, pod, "check", root, warmroute_image=_warmroute_image(r), namespace=NAMESPACE)
    rc = check.start().wait(120)
    assert rc == rc_expected, check.log()
    return check.log()


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1].split("/")[0])


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _start_sim(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)


def test_rendered_system_runs_serves_warm_and_explains_its_weights(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found: install it (apt-get install redis-server); .ci/run does")
    ports = {k: free_port() for k in ("http", "admin", "redis", "agent1", "agent2",
                                      "sim1", "ev1", "rp1", "sim2", "ev2", "rp2")}
    otlp = OtlpReceiver()
    values = run_values(ports, otlp.port)
    r = render(values)
    # Each agent is its own pod (own network namespace) in a cluster, so both use agent.adminPort;
    # here they share one host, so the second agent comes from a render with another port, and
    # nothing else in its Deployment may differ.
    r_alt = render(deep_merge(values, {"agent": {"adminPort": ports["agent2"]}}))
    d2, d2_alt = r.get("Deployment", f"{FULL}-agent-r2"), r_alt.get("Deployment", f"{FULL}-agent-r2")
    assert json.dumps(d2_alt).replace(str(ports["agent2"]), str(ports["agent1"])) == json.dumps(d2)

    redis = _container(r, "StatefulSet", f"{FULL}-redis", "redis", tmp_path)
    agents = [_container(r, "Deployment", f"{FULL}-agent-r1", "agent", tmp_path),
              _container(r_alt, "Deployment", f"{FULL}-agent-r2", "agent", tmp_path)]
    gateway = _container(r, "Deployment", FULL, "gateway", tmp_path)
    gw_config = yaml.safe_load(r.configmap_data(FULL)["gateway.yaml"])
    sims: list[subprocess.Popen] = []
    running: list[LocalContainer] = []
    try:
        # Simulated replicas where the rendered config and agents say the replicas are.
        urls = {rep["id"]: rep["url"] for rep in gw_config["membership"]["replicas"]}
        assert set(urls) == {"r1", "r2"}
        for agent in agents:
            argv = agent.argv()
            rid = _arg(argv, "--replica-id")
            assert _arg(argv, "--engine-url") == urls[rid]
            sims.append(_start_sim([local_entrypoint()[0], "sim", "--host", "127.0.0.1", "--port", str(_port_of(urls[rid])),
                                    "--model", _arg(argv, "--model"), "--block-size", _arg(argv, "--block-size"),
                                    "--kv-events-endpoint", f"tcp://*:{_port_of(_arg(argv, '--kv-events-endpoint'))}",
                                    "--replay-endpoint", _arg(argv, "--replay-endpoint")], tmp_path / f"sim-{rid}.log"))
        redis.start()
        running.append(redis)
        for probe in ("readinessProbe", "livenessProbe"):
            redis.wait_probe(probe, 20)  # exec: redis-cli ping with the password from the rendered Secret
        for url in urls.values():
            wait_http(url + "/health", 60)
        for agent in agents:
            agent.start()
            running.append(agent)
        gateway.start()
        running.append(gateway)
        for agent in agents:
            for probe in ("startupProbe", "livenessProbe"):
                agent.wait_probe(probe, 60)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = gateway.wait_probe(probe, 90)
            assert p.url.startswith(f"http://127.0.0.1:{ports['admin']}/")

        # A key from the rendered Secret (what a client would be given).
        keys = yaml.safe_load(r.secret_data(f"{FULL}-api-keys")["keys.yaml"])
        key = keys["t0"][0]
        api = f"http://127.0.0.1:{gateway.port('http')}"
        admin = f"http://127.0.0.1:{gateway.port('admin')}"
        system = " ".join(f"Clause {i}: the tenant's data stays in the tenant's region." for i in range(60))
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Summarise clause 7."}]}
        auth = {"Authorization": f"Bearer {key}"}
        status, first = _post(api + "/v1/chat/completions", body, auth)
        assert status == 200, first
        status, denied = _post(api + "/v1/chat/completions", body, {"Authorization": "Bearer sk-not-a-key"})
        assert status == 401 and denied["error"]["type"], denied

        # The agent's events reach the gateway's index through the rendered Redis.
        deadline = time.monotonic() + 20
        while True:
            status, why = _post(admin + "/debug/route?tenant=t0", body)
            assert status == 200, why
            won = next(v for v in why["replicas"] if v["replica_id"] == why["winner"])
            if won["matched_blocks_gpu"] > 0:
                break
            assert time.monotonic() < deadline, f"the index never learned the first request's blocks: {why}"
            time.sleep(0.2)
        status, second = _post(api + "/v1/chat/completions", body, auth)
        assert status == 200, second
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, second["usage"]
        assert cached >= won["matched_blocks_gpu"] * gw_config["model"]["block_size"] - gw_config["model"]["block_size"]

        # The weights from values are what the explanation scores with (and not the defaults).
        t = won["terms"]
        assert t["cache_benefit_s"] > 0
        for v in why["replicas"]:
            tv = v["terms"]
            expect = (W_CACHE * tv["cache_benefit_s"] - W_QUEUE * tv["queue_penalty_s"] - 1.0 * tv["evict_penalty_s"]
                      - 0.0 * tv["kv_penalty_s"] - tv["balance_penalty_s"])
            assert v["score"] == pytest.approx(expect, abs=1e-9), (v["replica_id"], tv)
        default_score = (2.0 * t["cache_benefit_s"] - 1.0 * t["queue_penalty_s"] - 1.0 * t["evict_penalty_s"]
                         - t["balance_penalty_s"])
        assert won["score"] != pytest.approx(default_score, abs=1e-9)

        # The rendered OTEL_* env exports this gateway's spans (service name from values).
        deadline = time.monotonic() + 15
        while not any(b"warmroute-gateway" in b for path, _, b in otlp.bodies if path == "/v1/traces"):
            assert time.monotonic() < deadline, f"no spans exported to the OTLP endpoint: {otlp.bodies[:2]}"
            time.sleep(0.2)
        assert all(ct == "application/x-protobuf" for _, ct, _ in otlp.bodies)

        # `helm test`: the rendered check Pod passes against this release (no key given: the API
        # must refuse an unauthenticated listing).
        log = _helm_test(r, tmp_path / "check-1")
        assert log.count("ok   ") == 2 and "auth enforced" in log, log
    finally:
        stop_s = {}
        for c in reversed(running):
            stop_s[c.spec["name"] + ("" if c.spec["name"] != "agent" else c.pod_name)] = c.stop(15)
        stop_processes(sims, 15)
        otlp.close()
    assert all(s < 10 for s in stop_s.values()), stop_s
    logs = "\n".join(c.log() for c in running)
    for secret in (SALT, API_KEY, REDIS_PASSWORD):
        assert secret not in logs, "a secret appears in a process log"


def test_a_bad_rendered_value_stops_the_gateway_at_start_naming_it(tmp_path):
    ports = {k: free_port() for k in ("http", "admin", "redis", "agent1", "sim1", "ev1", "rp1", "sim2", "ev2", "rp2")}
    # The schema takes each value alone; the gateway checks that the ejection cap is not below its base.
    values = run_values(ports, free_port(), config={"membership": {"eject_base_s": 2.0, "eject_max_s": 0.5}})
    r = render(values)
    gateway = _container(r, "Deployment", FULL, "gateway", tmp_path)
    proc = gateway.start()
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        gateway.stop()
        pytest.fail(f"the gateway started with membership.eject_max_s < eject_base_s:\n{gateway.log()}")
    assert rc == 2, gateway.log()
    assert "membership.eject_max_s" in gateway.log(), gateway.log()


def epp_values(ports: dict) -> dict:
    """epp mode over one replica listed by IP (no cluster DNS here; in a cluster: a headless Service)."""
    return {
        "salt": {"value": SALT},
        "auth": {"apiKeys": {"tenants": {"t0": [API_KEY]}}},
        "gateway": {"ports": {"admin": ports["admin"]}, "tokenizer": {"source": "builtin"}},
        "service": {"adminPort": ports["admin"]},  # the Service's port as the container's (no kube-proxy here)
        "replicas": {"mode": "attach", "attach": {"port": ports["sim1"], "podSelector": {"matchLabels": {"app": "vllm"}},
                                                  "endpoints": [
            {"id": "r1", "url": f"http://127.0.0.1:{ports['sim1']}", "kvEventsEndpoint": f"tcp://127.0.0.1:{ports['ev1']}",
             "replayEndpoint": f"tcp://127.0.0.1:{ports['rp1']}"}]}},
        "agent": {"adminPort": ports["agent1"]},
        "feed": {"redis": {"enabled": True, "port": ports["redis"], "auth": {"enabled": True, "password": REDIS_PASSWORD}}},
        "epp": {"enabled": True, "ports": {"grpc": ports["grpc"], "grpcHealth": ports["health"]},
                "gatewayFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}]},
        "config": {"model": {"name": MODEL}, "membership": {"health_interval_s": 0.5},
                   "server": {"shutdown_grace_s": 5}},
    }


async def _ext_proc_pick(port: int, key: str, body: dict) -> tuple[dict, str, dict]:
    """One request as Envoy's ext_proc filter sends it (headers, then the body in one chunk,
    full-duplex streamed): returns the header mutation, the envoy.lb metadata pick, the new body."""
    import grpc
    from gateway.epp.extproc import DESTINATION_HEADER, FULL_DUPLEX_STREAMED, LB_NAMESPACE
    from gateway.epp.server import METHOD
    from gateway.epp.wire import ext_proc_pb2 as pb

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(METHOD, request_serializer=pb.ProcessingRequest.SerializeToString,
                                response_deserializer=pb.ProcessingResponse.FromString)()
        hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in (
            (":path", "/v1/chat/completions"), (":method", "POST"), (":authority", "llm.example.com"),
            ("content-type", "application/json"), ("authorization", f"Bearer {key}"))])
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm))
        first.protocol_config.request_body_mode = FULL_DUPLEX_STREAMED
        first.protocol_config.response_body_mode = FULL_DUPLEX_STREAMED
        await call.write(first)
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)))
        h = await asyncio.wait_for(call.read(), 30)
        common = h.request_headers.response
        mutation = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
        mutation["-removed"] = list(common.header_mutation.remove_headers)
        lb = h.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value
        sent = (await asyncio.wait_for(call.read(), 30)).request_body.response.body_mutation.streamed_response.body
        await call.done_writing()
        call.cancel()
        return mutation, lb, json.loads(sent)


def test_rendered_picker_runs_and_answers_its_probes_and_envoy(tmp_path):
    from gateway.epp.extproc import DESTINATION_HEADER
    from gateway.epp.server import EXT_PROC_SERVICE

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found: install it (apt-get install redis-server); .ci/run does")
    ports = {k: free_port() for k in ("grpc", "health", "admin", "redis", "agent1", "sim1", "ev1", "rp1")}
    r = render(epp_values(ports))
    picker_dep = r.get("Deployment", f"{FULL}-epp")
    assert not [d for d in r.of_kind("Deployment") if d["metadata"]["name"] == FULL]  # no HTTP gateway in epp mode
    pool = r.get("InferencePool", FULL)
    svc = r.get("Service", f"{FULL}-epp")
    redis = _container(r, "StatefulSet", f"{FULL}-redis", "redis", tmp_path)
    agent = _container(r, "Deployment", f"{FULL}-agent-r1", "agent", tmp_path)
    picker = _container(r, "Deployment", f"{FULL}-epp", "epp", tmp_path)
    assert picker.argv()[1] == "epp"
    cfg = yaml.safe_load(r.configmap_data(FULL)["gateway.yaml"])
    running: list[LocalContainer] = []
    argv = agent.argv()
    sim = _start_sim([local_entrypoint()[0], "sim", "--host", "127.0.0.1", "--port", str(ports["sim1"]),
                      "--model", _arg(argv, "--model"), "--block-size", _arg(argv, "--block-size"),
                      "--kv-events-endpoint", f"tcp://*:{_port_of(_arg(argv, '--kv-events-endpoint'))}",
                      "--replay-endpoint", _arg(argv, "--replay-endpoint")], tmp_path / "sim.log")
    try:
        redis.start()
        running.append(redis)
        redis.wait_probe("readinessProbe", 20)
        wait_http(cfg["membership"]["replicas"][0]["url"] + "/health", 60)
        agent.start()
        running.append(agent)
        picker.start()
        running.append(picker)
        # The kubelet's view: the native grpc probes on the rendered health port, with their services.
        for kind, service in (("startupProbe", "liveness"), ("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
            p = picker.wait_probe(kind, 90)
            assert (p.kind, p.url, p.service) == ("grpc", f"127.0.0.1:{ports['health']}", service)
        # The admin port's probes answer on the rendered admin container port.
        admin = f"http://127.0.0.1:{picker.port('admin')}"
        assert picker.port("admin") == ports["admin"]
        for path in ("/healthz", "/readyz"):
            wait_http(admin + path, 10)
        # The Service's ext_proc port (the InferencePool's endpointPickerRef) is where ext_proc answers.
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc-ext-proc")
        assert grpc_port["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"] == ports["grpc"]
        target = picker.port(grpc_port["targetPort"])
        from tests.chart.podrun import _grpc_health
        assert _grpc_health(f"127.0.0.1:{target}", EXT_PROC_SERVICE) == (True, "SERVING")
        key = yaml.safe_load(r.secret_data(f"{FULL}-api-keys")["keys.yaml"])["t0"][0]
        body = {"model": MODEL, "max_tokens": 4, "cache_salt": "client-chosen-salt",
                "messages": [{"role": "user", "content": "Which replica am I sent to?"}]}
        mutation, lb, sent = asyncio.run(_ext_proc_pick(target, key, body))
        # Named as the Gateway names the pool's endpoints: pod IP : the InferencePool's target port.
        expected = f"127.0.0.1:{pool['spec']['targetPorts'][0]['number']}"
        assert mutation[DESTINATION_HEADER] == lb == expected, (mutation, lb)
        assert sent["cache_salt"] and sent["cache_salt"] != "client-chosen-salt" and SALT not in json.dumps(sent)
        assert "authorization" in mutation["-removed"]
        assert agent.check(agent.probe("livenessProbe"))[0]
        log = _helm_test(r, tmp_path / "check")  # `helm test` in epp mode: the picker's readiness only
        assert log.startswith("ok   ready") and log.count("ok   ") == 1, log
    finally:
        stop_s = {c.spec["name"]: c.stop(15) for c in reversed(running)}
        stop_processes([sim], 15)
    assert stop_s["epp"] < 10, stop_s
    assert picker_dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 5 + 5  # preStop + drain
    logs = "\n".join(c.log() for c in running)
    for secret in (SALT, API_KEY, REDIS_PASSWORD):
        assert secret not in logs, "a secret appears in a process log"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
