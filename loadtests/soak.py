"""Soak: the whole system at steady load for a long time, watching the gateway's memory and index.

    python -m loadtests.soak --duration-s 600            # the documented 10-minute soak
    python -m loadtests.soak --duration-s 45 --warmup-s 15 --json out.json   # the short form CI runs

What runs (all on 127.0.0.1, every process started here and stopped at the end): a private
redis-server (unless --redis-url), `--replicas` simulated vLLM replicas (`warmroute sim` with KV
events), one `warmroute agent` per replica, and one `warmroute gateway` process on the Redis feed
with a small index budget (`--index-max-entries`). The load is open-loop: Poisson arrivals at
`--rate` requests/s, every prompt unique (so the index keeps filling and must evict to stay within
its budget), each a short stream; in-flight requests are capped at `--max-inflight` (arrivals over
the cap are counted as shed, never queued without bound).

What it reports, from a sample every second: the gateway's resident memory (VmRSS) at the end of
warm-up and its maximum after warm-up (growth must stay under `--max-rss-growth`, 5%), the index's
entries against its budget (never above it; evictions must have happened, or the budget was never
tested), and request errors (must be 0). Exit code 0 when every check holds, 1 otherwise.
`run_soak()` is the same as a function (tests/test_load_soak.py runs the short form).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtests.ports import free_port
from loadtests.processes import stop_processes
from loadtests.runner import wait_http

__all__ = ["SoakConfig", "SoakResult", "run_soak", "main"]

MODEL = "warmroute-sim"


@dataclass
class SoakConfig:
    duration_s: float = 600.0  # measured part, after warm-up
    warmup_s: float = 300.0  # load runs, nothing is judged yet: the index, pools and bounded caches fill
    rate_rps: float = 30.0  # Poisson arrival rate
    replicas: int = 2
    index_max_entries: int = 5000  # the gateway's index budget (entries)
    sim_num_blocks: int = 8192  # KV blocks per simulated replica (more than the budget: the budget binds)
    max_inflight: int = 256  # requests in flight at most (arrivals beyond are shed)
    max_rss_growth: float = 0.05  # allowed RSS growth after warm-up (fraction)
    redis_url: str | None = None  # None: start a private redis-server
    workdir: str | None = None  # logs; None: a temporary directory
    seed: int = 0


@dataclass
class SoakResult:
    requests: int = 0
    errors: int = 0
    shed: int = 0
    rss_warm_bytes: int = 0  # gateway VmRSS when warm-up ended
    rss_max_bytes: int = 0  # its maximum after warm-up
    rss_end_bytes: int = 0
    rss_growth: float = 0.0  # (max - warm) / warm
    index_max_seen: int = 0  # most index entries seen in any sample
    index_budget: int = 0
    index_evictions: int = 0
    samples: list = field(default_factory=list)  # (t_s, rss_bytes, index_entries) per second
    failures: list = field(default_factory=list)  # which checks failed
    error_examples: list = field(default_factory=list)  # the first few failed requests: what went wrong

    @property
    def ok(self) -> bool:
        return not self.failures


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Processes:
    """The soak's processes; each its own process group, all stopped by `stop()`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        stop_processes(reversed(self.procs), group=True)


def _start_system(cfg: SoakConfig, ps: _Processes) -> tuple[subprocess.Popen, str, str]:
    """Redis (unless given), sims, agents and the gateway; (gateway process, API URL, admin URL)."""
    wr = [sys.executable, "-m", "gateway.cli"]
    redis_url = cfg.redis_url
    if redis_url is None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server), or pass --redis-url")
        port = free_port()
        ps.start("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                           "--dir", str(ps.workdir)])
        redis_url = f"redis://127.0.0.1:{port}/0"
    replicas = []
    for i in range(cfg.replicas):
        http, pub, rep = free_port(), free_port(), free_port()
        sim = ps.start(f"sim{i}", wr + ["sim", "--host", "127.0.0.1", "--port", str(http), "--model", MODEL,
                                        "--num-blocks", str(cfg.sim_num_blocks), "--kv-events-endpoint", f"tcp://*:{pub}",
                                        "--replay-endpoint", f"tcp://127.0.0.1:{rep}"])
        url = f"http://127.0.0.1:{http}"
        wait_http(url + "/health", 60.0, sim)
        ps.start(f"agent{i}", wr + ["agent", "--replica-id", f"r{i}", "--engine-url", url, "--kv-events-endpoint",
                                    f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{rep}",
                                    "--feed", redis_url, "--model", MODEL, "--load-interval", "0.5"])
        replicas.append(f"r{i}={url}")
    api, admin = free_port(), free_port()
    gw_cfg = {"server": {"host": "127.0.0.1", "port": api, "admin_port": admin},
              "membership": {"replicas": replicas}, "auth": {"enabled": False},
              "model": {"name": MODEL, "max_model_len": 8192},
              "feed": {"url": redis_url, "index_max_entries": cfg.index_max_entries},
              "telemetry": {"log_level": "WARNING"}}
    path = ps.workdir / "gateway.yaml"
    path.write_text(json.dumps(gw_cfg))
    gw = ps.start("gateway", wr + ["gateway", "--config", str(path)])
    wait_http(f"http://127.0.0.1:{admin}/readyz", 60.0, gw)
    return gw, f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"


def _index_figures(metrics_text: str) -> tuple[int, int]:
    entries = evictions = 0
    for line in metrics_text.splitlines():
        if line.startswith("warmroute_gateway_index_entries "):
            entries = int(float(line.split()[1]))
        elif line.startswith("warmroute_gateway_index_evictions_total "):
            evictions = int(float(line.split()[1]))
    return entries, evictions


async def _load(cfg: SoakConfig, url: str, admin_url: str, gw_pid: int, res: SoakResult) -> None:
    import aiohttp

    rng = random.Random(cfg.seed)
    t_start = time.monotonic()
    t_end = t_start + cfg.warmup_s + cfg.duration_s
    inflight: set[asyncio.Task] = set()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one(n: int) -> None:
            words = " ".join(f"w{rng.randrange(10**9)}" for _ in range(60))  # unique: fresh blocks every time
            body = {"model": MODEL, "prompt": f"request {n}: {words}", "max_tokens": 8, "stream": True}
            t0 = time.monotonic()
            try:
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                    data = await r.read()
                ok = r.status == 200 and data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data
                why = f"HTTP {r.status}, body ends {data[-200:]!r}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                ok = False
                why = f"{type(exc).__name__}: {exc}"
            res.requests += 1
            res.errors += 0 if ok else 1
            if not ok and len(res.error_examples) < 3:
                res.error_examples.append(f"request {n} at {t0 - t_start:.1f} s, after {time.monotonic() - t0:.2f} s: {why}")

        async def sampler() -> None:
            while time.monotonic() < t_end:
                await asyncio.sleep(1.0)
                async with s.get(admin_url + "/metrics") as r:
                    entries, evictions = _index_figures(await r.text())
                t = time.monotonic() - t_start
                rss = _rss(gw_pid)
                res.samples.append((round(t, 1), rss, entries))
                res.index_max_seen = max(res.index_max_seen, entries)
                res.index_evictions = evictions
                if t <= cfg.warmup_s:
                    res.rss_warm_bytes = rss
                else:
                    res.rss_max_bytes = max(res.rss_max_bytes, rss)
                    res.rss_end_bytes = rss

        samp = asyncio.create_task(sampler())
        n = 0
        next_t = time.monotonic()
        while next_t < t_end:
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            next_t += rng.expovariate(cfg.rate_rps)
            if len(inflight) >= cfg.max_inflight:
                res.shed += 1
                continue
            task = asyncio.create_task(one(n))
            n += 1
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight)
        await samp


def run_soak(cfg: SoakConfig) -> SoakResult:
    """Start the system, run the load, judge it (module header); everything started is stopped."""
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="warmroute-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ps = _Processes(workdir)
    res = SoakResult(index_budget=cfg.index_max_entries)
    try:
        gw, url, admin = _start_system(cfg, ps)
        asyncio.run(_load(cfg, url, admin, gw.pid, res))
        if gw.poll() is not None:
            res.failures.append(f"the gateway exited ({gw.returncode})")
    finally:
        ps.stop()
    if res.errors:
        res.failures.append(f"{res.errors} request errors (first: {'; '.join(res.error_examples)})")
    if res.rss_warm_bytes:
        res.rss_growth = (res.rss_max_bytes - res.rss_warm_bytes) / res.rss_warm_bytes
    if res.rss_growth >= cfg.max_rss_growth:
        res.failures.append(f"RSS grew {100 * res.rss_growth:.1f}% after warm-up (limit {100 * cfg.max_rss_growth:g}%)")
    if res.index_max_seen > cfg.index_max_entries:
        res.failures.append(f"index reached {res.index_max_seen} entries, over its budget {cfg.index_max_entries}")
    if res.index_evictions == 0:
        res.failures.append("the index never reached its budget (no evictions): the budget was not tested")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="measured part, after warm-up (default 600)")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s)
    p.add_argument("--rate", type=float, default=d.rate_rps, help="requests per second (Poisson)")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--index-max-entries", type=int, default=d.index_max_entries)
    p.add_argument("--max-rss-growth", type=float, default=d.max_rss_growth)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--workdir", default=None, help="where process logs go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result (with every sample) here")
    a = p.parse_args(argv)
    cfg = SoakConfig(duration_s=a.duration_s, warmup_s=a.warmup_s, rate_rps=a.rate, replicas=a.replicas,
                     index_max_entries=a.index_max_entries, max_rss_growth=a.max_rss_growth, redis_url=a.redis_url,
                     workdir=a.workdir)
    res = run_soak(cfg)
    mib = 2**20
    print(f"soak {cfg.warmup_s:g}s warm-up + {cfg.duration_s:g}s at {cfg.rate_rps:g} req/s: {res.requests} requests, "
          f"{res.errors} errors, {res.shed} shed; gateway RSS {res.rss_warm_bytes / mib:.1f} MiB after warm-up, "
          f"max {res.rss_max_bytes / mib:.1f} MiB ({100 * res.rss_growth:+.2f}%); index max {res.index_max_seen} "
          f"entries of a {res.index_budget} budget, {res.index_evictions} evictions")
    for f in res.failures:
        print(f"FAILED: {f}")
    if a.json:
        Path(a.json).write_text(json.dumps({**asdict(res), "config": asdict(cfg)}, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
