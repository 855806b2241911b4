"""A running gateway and agent for the chart's monitoring tests (tests/test_chart_alerts.py,
tests/test_chart_dashboard.py), and a real Prometheus scraping them.

`running_system(tok, workdir)`: a simulated replica, a gateway in front of it (two tenants' API
keys) and an agent, in this process on one memory feed; `send(n)` makes traffic (both tenants,
streamed and whole answers, one repeated document so the cache is hit), `exposition()` is both
processes' /metrics. `running_prometheus()`: Debian's
`prometheus` binary on 127.0.0.1 scraping the given admin ports every second, each target labelled
with the release's namespace as the Prometheus Operator's monitors would, with the given rule
files; stopped by its PID. `metric_types` / `declared` / `metrics_read`: which metrics a set of
PromQL expressions reads, and the type each has in an exposition.
"""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
import zmq
import zmq.asyncio

from loadtests.processes import stop_processes
from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.chart.render import NAMESPACE
from tests.conftest import free_port

MODEL = "warmroute-sim"
DOC = " ".join(f"clause{i}" for i in range(120))  # a document of several blocks, sent again and again
KEYS = ("key-a", "key-b")  # tenant-a's and tenant-b's


@dataclass
class LiveSystem:
    gateway_url: str
    gateway_admin: str  # http://host:port
    agent_admin: str

    async def send(self, n: int) -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                body = {"model": MODEL, "prompt": f"{DOC} question {i}?", "max_tokens": 4, "stream": i % 2 == 0}
                headers = {"Authorization": f"Bearer {KEYS[i % len(KEYS)]}"}
                async with s.post(self.gateway_url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

    async def exposition(self) -> str:
        async with aiohttp.ClientSession() as s:
            texts = []
            for url in (self.gateway_admin, self.agent_admin):
                async with s.get(url + "/metrics") as r:
                    texts.append(await r.text())
        return "\n".join(texts)


@contextlib.asynccontextmanager
async def running_system(tokenizer, workdir: Path):
    """`tokenizer`: the gateway's TokenizerService (the tests' shared `tok`: loading one takes
    seconds); `workdir`: where the keys and salt files go."""
    feed = f"memory://live-metrics-{free_port()}"
    (workdir / "keys.yaml").write_text("".join(f"tenant-{k[-1]}: [{k}]\n" for k in KEYS))
    (workdir / "salt").write_text("live-metrics-salt\n")
    sim = await start_sim_server(SimConfig(model=MODEL))
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)  # no engine events: the agent runs, healthy, with nothing to translate
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    agent = g = None
    try:
        agent = await start_agent(AgentConfig(replica_id="r0", kv_events_endpoint=endpoint, engine_url=sim.url,
                                              model=MODEL, block_size=16, admin_port=0), open_feed(feed))
        cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                                "membership": {"replicas": [f"r0={sim.url}"], "health_interval_s": 0.5},
                                "auth": {"api_keys_file": str(workdir / "keys.yaml")},
                                "salt": {"secret_file": str(workdir / "salt")}, "feed": {"url": feed},
                                "model": {"name": MODEL, "tokenize_check_s": 1e-6}}, env={})
        g = await start_gateway(cfg, tokenizer=tokenizer)
        yield LiveSystem(g.url, g.admin_url, agent.admin_url)
    finally:
        if g is not None:
            await g.close()
        if agent is not None:
            await agent.close()
        pub.close(0)
        ctx.term()
        await sim.close()


def _prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus not found: install Debian's prometheus package (apt-get install prometheus; .ci/run does)")
    return path


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: dict[str, str], rule_files: list[Path] = ()):
    """Prometheus scraping `targets` (job -> http://host:port) every second; yields its base URL."""
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(p) for p in rule_files],
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [url.split("://", 1)[1]],
                                                                       "labels": {"namespace": NAMESPACE}}]}
                                 for job, url in targets.items()]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([_prometheus(), f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(base + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready in 30 s"
            time.sleep(0.2)
        yield base
    finally:
        stop_processes([proc])
        log.close()


def metric_types(exposition: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M))


def declared(name: str) -> tuple[str, str]:
    """The `# TYPE` line a series name belongs to, and its type: a counter's TYPE carries `_total`
    (prometheus_client's text format), a histogram's bucket series its base name."""
    if name.endswith("_bucket"):
        return name[: -len("_bucket")], "histogram"
    return name, "counter" if name.endswith("_total") else "gauge"


def metrics_read(exprs) -> set[str]:
    return set(re.findall(r"\bwarmroute_[a-z_]+", " ".join(exprs)))
