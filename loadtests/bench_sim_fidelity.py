"""Benchmark (not a test): how faithfully one `warmroute sim` process keeps its time model under load.

For each concurrency level, start a fresh simulator process (wall-clock time profile), keep C
streaming chat requests in flight from this process for D seconds, then read the simulator's
`/sim/stats`: modelled vs measured step time (sum and mean per step) and timer lateness
(measured step end minus modelled deadline; p50/p99/max), plus the sim process's CPU share.
A ratio near 1.0 and lateness of a few ms mean the model holds; a growing ratio means the
process (or the machine) cannot keep up and wall-clock results measure the CPU, not the model.

    python -m loadtests.bench_sim_fidelity [--levels 1,64,256] [--duration-s 8] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import aiohttp

from loadtests.ports import free_port
from loadtests.processes import stop_processes
from loadtests.runner import process_cpu_s


async def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"simulator at {url} did not become healthy")


async def _client(session: aiohttp.ClientSession, url: str, idx: int, stop_at: float, max_tokens: int, counts: dict) -> None:
    doc = " ".join(f"shared fact {i}" for i in range(60))  # a shared prefix, so some prefill is cached
    n = 0
    while time.monotonic() < stop_at:
        body = {
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"client {idx} question {n}"}],
            "max_tokens": max_tokens, "stream": True,
        }
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                    counts["chunks"] += 1
        counts["requests"] += 1
        n += 1


async def run_level(concurrency: int, duration_s: float, max_tokens: int, extra_args: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())", "sim", "--port", str(port),
           "--time-profile", "wallclock", "--num-blocks", "20000", "--max-num-seqs", "256", *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url)
        counts = {"requests": 0, "chunks": 0}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
            stop_at = t0 + duration_s
            await asyncio.gather(*(_client(s, url, i, stop_at, max_tokens, counts) for i in range(concurrency)))
            wall = time.monotonic() - t0
            cpu = process_cpu_s(proc.pid) - cpu0
            async with s.get(url + "/sim/stats") as r:
                stats = await r.json()
        steps = max(stats["steps"], 1)
        return {
            "concurrency": concurrency,
            "requests": counts["requests"],
            "steps": stats["steps"],
            "modelled_step_ms": 1000 * stats["modelled_s_total"] / steps,
            "measured_step_ms": 1000 * stats["actual_s_total"] / steps,
            "ratio": stats["actual_s_total"] / max(stats["modelled_s_total"], 1e-9),
            "lateness_ms": {k: 1000 * v for k, v in stats["lateness_s"].items()},
            "sim_cpu_share": cpu / wall,
            "wall_s": wall,
        }
    finally:
        stop_processes([proc])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,64,256", help="comma-separated concurrent streams")
    p.add_argument("--duration-s", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("sim_args", nargs="*", help="extra `warmroute sim` flags (after --)")
    a = p.parse_args(argv)
    rows = []
    for c in (int(x) for x in a.levels.split(",")):
        rows.append(asyncio.run(run_level(c, a.duration_s, a.max_tokens, a.sim_args)))
    hdr = f"{'streams':>7} {'reqs':>6} {'steps':>6} {'model ms/step':>13} {'real ms/step':>12} {'real/model':>10} {'late p50':>8} {'p99':>7} {'max':>7} {'sim CPU':>7}"
    print(hdr)
    for r in rows:
        lt = r["lateness_ms"]
        print(f"{r['concurrency']:>7} {r['requests']:>6} {r['steps']:>6} {r['modelled_step_ms']:>13.2f} {r['measured_step_ms']:>12.2f} "
              f"{r['ratio']:>10.3f} {lt['p50']:>8.2f} {lt['p99']:>7.2f} {lt['max']:>7.2f} {100 * r['sim_cpu_share']:>6.0f}%")
    print("(lateness in ms: measured step end minus modelled deadline; wall-clock profile: 12 ms + 1 ms/prefill token + 0.1 ms/seq)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
