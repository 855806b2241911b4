"""Measure one gateway process's memory and CPU under a short load (not a test: the figures the
chart's `gateway.resources` are sized from; values.yaml cites the output).

Starts, as separate processes on 127.0.0.1: a redis-server, two `warmroute sim` replicas (GPU time
profile), one `warmroute agent` per replica, and `warmroute gateway --workers 1` with API-key auth,
then drives it with `warmroute bench --target` (shared_docs: long shared documents, one question
each). It samples the gateway's RSS (/proc/PID/status VmRSS, peak VmHWM) after start, and its CPU
seconds (/proc/PID/stat utime+stime) across the load, and prints one JSON line:
  rss_ready_mib, rss_peak_mib, cpu_ms_per_request, cpu_cores_at_load, requests, errors,
  agent_rss_peak_mib, agent_cpu_cores_at_load (the busier of the two agents),
  throughput_rps, machine_cpu_share (the bench's reading: the machine is shared).

Run:  python -m tests.chart.measure_gateway [--requests 400] [--rate 20]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests.processes import stop_processes
from loadtests.runner import wait_http
from tests.conftest import free_port as _free_port


def _rss_kib(pid: int) -> tuple[int, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _cpu_s(pid: int) -> float:
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=20.0)
    args = ap.parse_args()
    exe = shutil.which("warmroute") or sys.exit("warmroute not installed (pip install -e .)")
    tmp = Path(tempfile.mkdtemp(prefix="wr-measure-"))
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], name: str) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=open(tmp / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        redis_port = _free_port()
        start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(tmp)], "redis")
        feed = f"redis://127.0.0.1:{redis_port}/0"
        replicas = []
        for i in range(2):
            http, ev, rep = _free_port(), _free_port(), _free_port()
            start([exe, "sim", "--host", "127.0.0.1", "--port", str(http), "--model", "m",
                   "--kv-events-endpoint", f"tcp://*:{ev}", "--replay-endpoint", f"tcp://127.0.0.1:{rep}"], f"sim{i}")
            replicas.append((f"r{i}", http, ev, rep))
        agents = []
        for rid, http, ev, rep in replicas:
            wait_http(f"http://127.0.0.1:{http}/health", 60)
            agents.append(start([exe, "agent", "--replica-id", rid, "--engine-url", f"http://127.0.0.1:{http}",
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}", "--replay-endpoint", f"tcp://127.0.0.1:{rep}",
                   "--feed", feed], f"agent-{rid}"))
        key = "sk-measure-0123456789"
        (tmp / "keys.yaml").write_text(f"t0: [{key}]\n")
        (tmp / "salt").write_text("measure-salt-" + "x" * 40)
        port, admin = _free_port(), _free_port()
        cmd = [exe, "gateway", "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin), "--workers", "1",
               "--feed", feed, "--api-keys", str(tmp / "keys.yaml"), "--salt-secret-file", str(tmp / "salt")]
        for rid, http, _, _ in replicas:
            cmd += ["--replica", f"{rid}=http://127.0.0.1:{http}"]
        gw = start(cmd, "gateway")
        wait_http(f"http://127.0.0.1:{admin}/readyz", 120)
        rss_ready, _ = _rss_kib(gw.pid)
        cpu0 = _cpu_s(gw.pid)
        agent_cpu0 = [_cpu_s(a.pid) for a in agents]
        report = tmp / "bench.json"
        env = dict(os.environ, WARMROUTE_BENCH_API_KEY=key)
        t0 = time.monotonic()
        subprocess.run([exe, "bench", "--target", f"http://127.0.0.1:{port}", "--model", "m", "--workload", "shared_docs",
                        "--requests", str(args.requests), "--rate", str(args.rate), "--param", "n_docs=8",
                        "--param", "doc_tokens=800", "--json", str(report)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        cpu = _cpu_s(gw.pid) - cpu0
        rss_now, rss_peak = _rss_kib(gw.pid)
        agent_cpu = max(_cpu_s(a.pid) - c for a, c in zip(agents, agent_cpu0))
        agent_rss_peak = max(_rss_kib(a.pid)[1] for a in agents)
        summary = next(iter(json.loads(report.read_text()).values()))
        out = {
            "rss_ready_mib": round(rss_ready / 1024, 1), "rss_after_mib": round(rss_now / 1024, 1),
            "rss_peak_mib": round(rss_peak / 1024, 1),
            "cpu_ms_per_request": round(1000 * cpu / max(1, summary["requests"]), 2),
            "cpu_cores_at_load": round(cpu / wall, 3), "requests": summary["requests"], "errors": summary["errors"],
            "agent_rss_peak_mib": round(agent_rss_peak / 1024, 1), "agent_cpu_cores_at_load": round(agent_cpu / wall, 3),
            "throughput_rps": summary["throughput_rps"], "machine_cpu_share": summary.get("machine_cpu_share"),
        }
        print(json.dumps(out))
        return 0
    finally:
        stop_processes(reversed(procs), 15)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
