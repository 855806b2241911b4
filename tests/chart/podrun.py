"""Run a rendered container as a local process, doing what the kubelet would do with its spec.

Rule: nothing about the process is taken from the test; everything from the rendered objects.
  - env: `value`s, and `valueFrom` resolved from the rendered Secrets and ConfigMaps
    (secretKeyRef / configMapKeyRef) and the pod's fields (fieldRef: status.podIP is 127.0.0.1 here,
    metadata.name / metadata.namespace); `$(VAR)` references expanded in order as the kubelet
    does (a reference to an undefined variable stays as written, `$$` is a literal `$`);
  - command and args: `$(VAR)` expanded from that env; with no `command`, the image's entrypoint,
    which for the warmroute image is the local install's `warmroute` script (the Dockerfile's
    ENTRYPOINT; the install is the same `pip install` of this package);
  - volumes: each mounted ConfigMap, Secret (with `items`) and emptyDir is written under a
    temporary root, `<root>/<mountPath>`; the mount paths named in args, env values and the
    mounted files themselves are rewritten to point there (the one liberty taken: a process
    cannot see `/etc/warmroute/...` without a mount namespace);
  - cluster DNS: the rendered Services' host names (short and qualified) in URLs (after `//` or
    `@`) become 127.0.0.1, where every pod of the release runs here;
  - probes: httpGet `path` on the container port the probe names (named ports resolved from the
    container's ports) on 127.0.0.1; grpc probes as the kubelet's: the gRPC Health Checking
    Protocol's Check for `service` on that port number, passing only on SERVING; and exec probes
    run with the container's env.
The process env is the container's env over the image's (PATH to the local install, the prebuilt
tokenizer cache, no home directory). Volume kinds other than ConfigMap, Secret and
emptyDir raise: such a container cannot run here.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.chart.render import Rendered

POD_IP = "127.0.0.1"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables replaced, undefined ones kept, $$ -> $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, text)


def local_entrypoint() -> list[str]:
    """The image's ENTRYPOINT ["warmroute"], from the local install beside this interpreter."""
    exe = Path(sys.executable).with_name("warmroute")
    if not exe.exists():
        found = shutil.which("warmroute")
        if found is None:
            raise RuntimeError("the warmroute console script is not installed (pip install -e .)")
        exe = Path(found)
    return [str(exe)]


@dataclass
class Probe:
    kind: str  # "http", "grpc" or "exec"
    url: str = ""  # http: the URL; grpc: host:port
    argv: list[str] = field(default_factory=list)
    service: str = ""  # grpc: the health service asked for


class LocalContainer:
    def __init__(self, rendered: Rendered, workload: dict, container: str, root: Path, *, warmroute_image: str,
                 namespace: str, cluster_domain: str = "cluster.local") -> None:
        self.rendered = rendered
        self.workload = workload
        bare = workload["kind"] == "Pod"  # a bare Pod (`helm test`'s) rather than a workload's template
        self.pod = workload["spec"] if bare else workload["spec"]["template"]["spec"]
        self.spec = next(c for c in self.pod["containers"] if c["name"] == container)
        self.pod_name = workload["metadata"]["name"] + ("" if bare else "-0")
        self.root = root / self.pod_name / container
        self.warmroute_image = warmroute_image
        self.mounts = sorted(((m["mountPath"], m["name"]) for m in self.spec.get("volumeMounts", [])),
                             key=lambda t: -len(t[0]))
        self.namespace = namespace
        # Cluster DNS: every rendered Service name resolves to this host (all pods run here).
        self.hosts = sorted({f"{svc['metadata']['name']}{suffix}" for svc in rendered.of_kind("Service")
                             for suffix in ("", f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.{cluster_domain}")},
                            key=len, reverse=True)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "log.txt"
        self._materialize()
        self.env = self._resolve_env()

    # ---------------------------------------------------------------- paths
    def local_path(self, path: str) -> str:
        for mount, _ in self.mounts:
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(self.root / "fs") + path
        return path

    def rewrite(self, text: str) -> str:
        """Every mount path in `text` -> its directory under the root, and every Service host
        name -> 127.0.0.1 (each in one pass, longest first)."""
        if self.mounts:
            alt = "|".join(re.escape(m) for m, _ in self.mounts)
            text = re.sub(rf"(?<![\w/.])({alt})(?=/|\b|$)", lambda m: str(self.root / "fs") + m.group(1), text)
        if self.hosts:
            alt = "|".join(re.escape(h) for h in self.hosts)
            text = re.sub(rf"(?<=[/@])({alt})(?![\w.-])", POD_IP, text)
        return text

    # ---------------------------------------------------------------- volumes
    def _materialize(self) -> None:
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        for mount, name in self.mounts:
            vol = volumes[name]
            target = Path(str(self.root / "fs") + mount)
            target.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in vol:
                continue
            if "configMap" in vol:
                data, src = self.rendered.configmap_data(vol["configMap"]["name"]), vol["configMap"]
            elif "secret" in vol:
                data, src = self.rendered.secret_data(vol["secret"]["secretName"]), vol["secret"]
            else:
                raise RuntimeError(f"volume {name}: only configMap, secret and emptyDir volumes can run locally, got {sorted(vol)}")
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            for it in items:
                if it["key"] not in data:
                    raise KeyError(f"volume {name}: key {it['key']!r} not in the rendered object (has {sorted(data)})")
                out = target / it["path"]
                out.parent.mkdir(parents=True, exist_ok=True)
                try:
                    content = self.rewrite(data[it["key"]].decode()).encode()
                except UnicodeDecodeError:
                    content = data[it["key"]]
                out.write_bytes(content)
                out.chmod(it.get("mode", src.get("defaultMode", 0o644)))

    # ---------------------------------------------------------------- env
    def _field(self, path: str) -> str:
        fields = {"status.podIP": POD_IP, "metadata.name": self.pod_name,
                  "metadata.namespace": self.namespace,
                  "spec.nodeName": "local", "status.hostIP": POD_IP}
        if path not in fields:
            raise KeyError(f"fieldRef {path} is not emulated")
        return fields[path]

    def _resolve_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in self.spec.get("env", []) or []:
            if "value" in e:
                env[e["name"]] = self.rewrite(expand(str(e["value"]), env))
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    env[e["name"]] = self.rendered.secret_data(ref["name"])[ref["key"]].decode()
                elif "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    env[e["name"]] = self.rendered.configmap_data(ref["name"])[ref["key"]].decode()
                elif "fieldRef" in vf:
                    env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
                else:
                    raise KeyError(f"env {e['name']}: valueFrom {sorted(vf)} is not emulated")
            else:
                env[e["name"]] = ""
        return env

    # ---------------------------------------------------------------- process
    def argv(self) -> list[str]:
        args = [self.rewrite(expand(str(a), self.env)) for a in self.spec.get("args", [])]
        if self.spec.get("command"):
            return [self.rewrite(expand(str(a), self.env)) for a in self.spec["command"]] + args
        if self.spec["image"] != self.warmroute_image:
            raise RuntimeError(f"{self.spec['name']}: no command and image {self.spec['image']}: no local entrypoint for it")
        return local_entrypoint() + args

    def process_env(self) -> dict[str, str]:
        """The container's env over what the image provides: PATH to the install, the prebuilt
        tokenizer cache (the Dockerfile's WARMROUTE_CACHE_DIR, here the local one), and a HOME
        that does not exist (the image's user has none; nothing may need one)."""
        from gateway.default_tokenizer import _cache_root

        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        base = {"PATH": path, "HOME": "/nonexistent", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1", "WARMROUTE_CACHE_DIR": str(_cache_root())}
        return {**base, **self.env}

    def start(self) -> subprocess.Popen:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv(), env=self.process_env(), stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.spec.get("workingDir") and self.local_path(self.spec["workingDir"]) or None)
        log.close()
        return self.proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> float:
        """SIGTERM, then wait; returns the seconds it took (SIGKILL and raise past timeout_s)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{self.spec['name']} did not stop within {timeout_s} s of SIGTERM")
        return time.monotonic() - t0

    # ---------------------------------------------------------------- probes
    def port(self, ref) -> int:
        if isinstance(ref, int):
            return ref
        for p in self.spec.get("ports", []):
            if p.get("name") == ref:
                return int(p["containerPort"])
        raise KeyError(f"{self.spec['name']}: no container port named {ref!r}")

    def probe(self, kind: str) -> Probe | None:
        p = self.spec.get(kind)
        if not p:
            return None
        if "httpGet" in p:
            g = p["httpGet"]
            return Probe("http", url=f"http://{POD_IP}:{self.port(g['port'])}{g.get('path', '/')}")
        if "grpc" in p:
            g = p["grpc"]
            if not isinstance(g["port"], int):
                raise TypeError(f"{kind}: a grpc probe's port is a number (Kubernetes takes no name there), got {g['port']!r}")
            return Probe("grpc", url=f"{POD_IP}:{g['port']}", service=g.get("service", ""))
        if "exec" in p:
            return Probe("exec", argv=[self.rewrite(expand(a, self.env)) for a in p["exec"]["command"]])
        raise KeyError(f"{kind}: only httpGet, grpc and exec probes are emulated, got {sorted(p)}")

    def check(self, probe: Probe) -> tuple[bool, str]:
        if probe.kind == "http":
            try:
                with urllib.request.urlopen(probe.url, timeout=2) as r:
                    return r.status == 200, f"{r.status} {r.read(300)!r}"
            except urllib.error.HTTPError as e:
                return False, f"{e.code} {e.read(300)!r}"
            except OSError as e:
                return False, str(e)
        if probe.kind == "grpc":
            return _grpc_health(probe.url, probe.service)
        r = subprocess.run(probe.argv, env=self.process_env(), capture_output=True, timeout=5)
        return r.returncode == 0, (r.stdout + r.stderr).decode(errors="replace")[:300]

    def wait_probe(self, kind: str, timeout_s: float) -> Probe:
        probe = self.probe(kind)
        assert probe is not None, f"{self.spec['name']} has no {kind}"
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec['name']} exited {self.proc.returncode} while waiting for its {kind}:\n{self.log()[-3000:]}")
            ok, last = self.check(probe)
            if ok:
                return probe
            time.sleep(0.2)
        raise RuntimeError(f"{self.spec['name']} {kind} ({probe.url or probe.argv}) not passing after {timeout_s} s: {last}\n{self.log()[-3000:]}")


def _grpc_health(target: str, service: str) -> tuple[bool, str]:
    """The kubelet's grpc probe: grpc.health.v1.Health/Check, success only on SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    except grpc.RpcError as e:
        return False, f"{e.code().name} {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name
