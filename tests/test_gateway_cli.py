"""`warmroute gateway` as an operator runs it: --check-config on good and bad files, and a real
multi-worker process (SO_REUSEPORT) in front of simulated replicas that drains a stream on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

from loadtests.sim.server import SimConfig, start_sim_server
from loadtests.sim.scheduler import TimeModel

from tests.conftest import free_port

MODEL = "warmroute-sim"


def _warmroute(*args: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_check_config_good_and_bad(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenant-a: [k1]\n")
    salt = tmp_path / "salt"
    salt.write_text("s3cret\n")
    good = tmp_path / "good.yaml"
    good.write_text(f"""
server: {{port: 9000, admin_port: 9001, workers: 2}}
membership:
  replicas: ["a=http://10.0.0.1:8000", "b=http://10.0.0.2:8000"]
policy: {{name: cache_aware, params: {{w_cache: 1.0, w_queue: 1.5}}}}
auth: {{api_keys_file: {keys}}}
salt: {{secret_file: {salt}}}
feed: {{url: "redis://127.0.0.1:6379/0"}}
""")
    r = _warmroute("--check-config", str(good))
    assert r.returncode == 0, r.stderr
    assert "valid" in r.stdout
    cases = {
        "server: {port: eighty}\n": "server.port",
        "proxy: {max_attempts: 0}\n": "proxy.max_attempts",
        "policy: {name: best}\n": "policy.name",
        "policy: {params: {w_nonsense: 1}}\nauth: {enabled: false}\n": "policy.params",
        "auth: {api_keys_file: /nonexistent/keys.yaml}\n": "auth.api_keys_file",
        "auth: {}\n": "auth",
        "membership: {replicas: [nope]}\n": "membership.replicas[0]",
        "not: [valid\n": "invalid YAML",
    }
    for i, (text, field) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(text)
        r = _warmroute("--check-config", str(bad))
        assert r.returncode == 2, (text, r.stdout, r.stderr)
        assert field in r.stderr, (field, r.stderr)


def test_help_lists_flags():
    r = _warmroute("--help")
    assert r.returncode == 0
    for flag in ("--replica", "--feed", "--policy", "--api-keys", "--no-auth", "--salt-secret-file", "--workers",
                 "--check-config", "--dns-service", "--model"):
        assert flag in r.stdout, flag


async def test_multi_worker_process_serves_and_drains_on_sigterm(tmp_path):
    sim = await start_sim_server(SimConfig(model=MODEL, time=TimeModel(step_overhead_s=0.01, decode_s_per_seq=1e-4)))
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
         "--admin-port", str(admin), "--replica", f"a={sim.url}", "--no-auth", "--workers", "2",
         "--feed", "memory://"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, aurl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 90
            ready = 0
            while time.monotonic() < deadline and ready < 6:
                try:
                    async with s.get(aurl + "/readyz") as r:
                        ready = ready + 1 if r.status == 200 else 0
                except aiohttp.ClientError:
                    ready = 0
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.25)
            assert ready >= 6, f"gateway not ready; rc={proc.poll()}"
            pids = set()
            for _ in range(12):
                body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
                async with aiohttp.ClientSession() as fresh:  # new connections spread over workers
                    async with fresh.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        await r.read()
                    async with fresh.get(aurl + "/healthz") as r:
                        pids.add((await r.json())["pid"])
            async with s.get(aurl + "/metrics") as r:
                text = await r.text()
            assert len(pids) == 2, "both worker processes serve the shared ports"
            from prometheus_client.parser import text_string_to_metric_families

            fams = {f.name: f for f in text_string_to_metric_families(text)}
            total = sum(smp.value for smp in fams["warmroute_gateway_requests"].samples if smp.name.endswith("_total"))
            assert total == 12, "metrics aggregate over both workers (whichever one answers the scrape)"
            # A long stream in flight survives SIGTERM: the gateway drains it, then exits 0.
            body = {"model": MODEL, "prompt": "long", "max_tokens": 150, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()
                proc.send_signal(signal.SIGTERM)
                data = await r.read()
            assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]
            rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            assert rc == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await sim.close()
