"""Flow-control benchmark (not a test): a quiet tenant beside a noisy one on a saturated pool,
with flow control on and off, through one gateway and through two sharing Redis.

Side by side in one run, on the same simulated replicas (two `loadtests.sim` engines, wall-clock
time model, small `--max-num-seqs`, each with its agent publishing to a private redis-server):
  calibrate   the pool's capacity C (completed requests/s with every slot busy, flow control off)
  alone       the quiet tenant alone, within its fair share C/2: `--quiet-share` of it (default
              half, C/4), paced (one request every so often, as a client sending "one a second")
  noisy       the same quiet stream plus a noisy tenant at 5x its share (5C/2, Poisson arrivals; with
              `--noisy-n N` each of its requests asks N choices, at 1/N the rate: the same sequences)
each with flow control off and on, on once per `--headroom-reqs` value (flow.headroom_reqs: the
slots heavy tenants leave to light ones; default 1 and 0, side by side) and `--light-spill-s`
value (flow.light_spill_s: prefill seconds a light tenant may lose for a free slot; default 0.5, the gateway's), and each through one
gateway process and through two (each tenant's requests alternate between them; fair shares and
bounds shared over Redis). Tenants have equal weights. Every scenario starts from cold caches and fresh gateway processes.

Reported per scenario: the quiet tenant's TTFT p50/p99, over all its requests and over those
sent after the warm-up (its first request is cold in every scenario; with the default 12 s and
~45 quiet requests the p99 is about the slowest one: `--seconds 30` or more for a steady-state
p99), its five slowest requests (when, where, cached tokens, how many of its own requests were open
on that replica when each was sent) and its errors, the noisy tenant's
completed and refused (429) requests, total throughput (requests, and engine sequences, completed per second while
arrivals run, after a warm-up), the hit ratio (engine-reported cached / prompt tokens of
completed requests started after the warm-up) and the sims' slowdown (wall seconds per modelled
second of their steps: above ~1.05 the machine, not the pool, was the bottleneck), the gateways'
CPU per completed request (their processes together, while the requests ran; 429s included in
the work, not in the count) and, with flow control on, how many of the quiet tenant's requests
the gateways held and how long (from their `/metrics`: the part of its TTFT spent before an
engine). Then the goals: quiet p99 with the noisy tenant within 1.25x of alone
(flow on), the off figure beside it, throughput within 3% of flow control off, hit ratio not
lower. With flow control on the noisy tenant is shed with 429s; the bench sets the queue bounds
(`--max-queue-wait-s`, `--max-queue-reqs`) so its runs end promptly.

Run:  python -m loadtests.bench_flow [--seconds 12] [--max-num-seqs 8] [--json FILE]
Where the quiet tenant's time went, request by request: add `--trace DIR` (the sims keep
timelines; each scenario's go to DIR), then `python -m loadtests.flow_timelines DIR/2gw_on_h1_noisy.json`.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtests.ports import free_port
from loadtests.processes import stop_processes
from loadtests.runner import BenchRequest, _one, percentiles, process_cpu_s, run_load, wait_http

MODEL = "flow-bench"
TENANT_KEYS = {"quiet": "sk-flow-quiet", "noisy": "sk-flow-noisy"}
_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
          "tau upsilon phi chi psi omega river stone cloud ember lantern meadow harbor quartz willow").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


# --------------------------------------------------------------------------- the pool process
def pool_main(redis_url: str, port: int, index: int, args: dict) -> None:
    """One simulated replica and its agent (a process of its own), publishing to Redis."""
    import uvloop

    from loadtests.sim.scheduler import TimeModel
    from loadtests.sim.server import SimConfig, start_sim_server
    from replica_agent.agent import AgentConfig, start_agent
    from replica_agent.feed import open_feed

    async def main() -> None:
        feed = open_feed(redis_url)
        tm = TimeModel.wallclock(time_scale=args["time_scale"])
        tm.prefill_s_per_token = args["prefill_ms_per_token"] / 1000.0
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        sim = await start_sim_server(SimConfig(model=MODEL, num_blocks=args["num_blocks"], max_model_len=4096,
                                               max_num_seqs=args["max_num_seqs"], time=tm, kv_events_endpoint=ev,
                                               scheduling_policy=args.get("scheduling_policy", "fcfs"),
                                               trace=bool(args.get("trace")),
                                               replay_endpoint=rp, engine_label=f"r{index}"), port=port)
        agent = await start_agent(AgentConfig(replica_id=f"r{index}", kv_events_endpoint=ev, engine_url=sim.url,
                                              replay_endpoint=rp, bind=True, model=MODEL, block_size=16,
                                              load_interval_s=0.25), feed)
        try:
            await asyncio.Event().wait()
        finally:
            await agent.close()
            await sim.close()

    uvloop.run(main())


def _sim_stats(sims: list[str]) -> list[dict]:
    out = []
    for u in sims:
        with urllib.request.urlopen(u + "/sim/stats", timeout=5) as r:
            out.append(json.loads(r.read()))
    return out


def _slowdown(before: list[dict], after: list[dict]) -> float:
    """Wall seconds the sims' steps took per modelled second (1.0: the machine kept up)."""
    m = sum(a["modelled_s_total"] - b["modelled_s_total"] for a, b in zip(after, before))
    w = sum(a["actual_s_total"] - b["actual_s_total"] for a, b in zip(after, before))
    return round(w / m, 3) if m > 0 else float("nan")


# --------------------------------------------------------------------------- gateways
def _gateway_config(path: Path, redis_url: str, sims: list[str], ports: tuple[int, int], *, flow: bool,
                    args: argparse.Namespace, headroom: int, light_spill_s: float = 0.0) -> None:
    import yaml

    from loadtests.sim.scheduler import TimeModel

    tm = TimeModel.wallclock(time_scale=args.time_scale)
    (path.parent / "salt").write_text("flow-bench-salt-secret\n")
    cfg = {
        "server": {"host": "127.0.0.1", "port": ports[0], "admin_port": ports[1]},
        "model": {"name": MODEL, "max_model_len": 4096},
        "membership": {"replicas": [{"id": f"r{i}", "url": u} for i, u in enumerate(sims)], "health_interval_s": 0.5},
        "feed": {"url": redis_url},
        "policy": {"params": {"max_num_seqs": args.max_num_seqs}, "seed": 1,
                   "prior_prefill_s_per_token": args.prefill_ms_per_token * args.time_scale / 1000.0,
                   "prior_decode_step_s": tm.step_overhead_s * args.time_scale},
        "auth": {"api_keys": {t: ["sha256:" + hashlib.sha256(k.encode()).hexdigest()] for t, k in TENANT_KEYS.items()}},
        "salt": {"secret_file": str(path.parent / "salt")},
        "flow": {"enabled": flow, "max_queue_wait_s": args.max_queue_wait_s,
                 "max_queue_reqs_per_tenant": args.max_queue_reqs, "engine_queue_reqs": args.engine_queue_reqs,
                 "headroom_reqs": headroom, "light_spill_s": light_spill_s,
                 "engine_priority": args.engine_priority},
    }
    path.write_text(yaml.safe_dump(cfg))


class Gateways:
    """`n` gateway processes on one config shape; `urls` are their API bases."""

    def __init__(self, n: int, redis_url: str, sims: list[str], *, flow: bool, args, workdir: Path, headroom: int = 1,
                 light_spill_s: float = 0.0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.admin: list[str] = []
        for i in range(n):
            ports = (free_port(), free_port())
            d = workdir / f"gw{i}-{'on' if flow else 'off'}-{time.monotonic_ns()}"
            d.mkdir()
            _gateway_config(d / "gateway.yaml", redis_url, sims, ports, flow=flow, args=args, headroom=headroom,
                            light_spill_s=light_spill_s)
            log = open(d / "gateway.log", "w")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", str(d / "gateway.yaml")],
                                               stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{ports[0]}")
            self.admin.append(f"http://127.0.0.1:{ports[1]}")
        for a in self.admin:
            wait_http(a + "/readyz", 120.0)

    def cpu_s(self) -> float:
        """CPU seconds the gateway processes have used so far, together."""
        return sum(process_cpu_s(p.pid) for p in self.procs)

    def close(self) -> None:
        stop_processes(self.procs, 20)


def _reset_caches(sims: list[str]) -> None:
    for u in sims:
        urllib.request.urlopen(urllib.request.Request(u + "/reset_prefix_cache", method="POST"), timeout=5).close()


# --------------------------------------------------------------------------- workload
def _requests(tenant: str, times: list[float], args, seed: int, n: int = 1) -> list[BenchRequest]:
    """The tenant's requests at `times`, each asking `n` choices (as many engine sequences)."""
    rng = random.Random(seed)
    system = f"You are the assistant of {tenant}. " + _text(random.Random(tenant), args.system_words)
    out = []
    for i, t in enumerate(times):
        # varied lengths, as real answers are: equal ones finish together and free slots in bursts
        out_tokens = rng.randint(max(1, args.output_tokens // 2), args.output_tokens * 3 // 2)
        body = {"model": MODEL, "max_tokens": out_tokens, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Question {i}: " + _text(rng, args.question_words)}]}
        if n > 1:
            body["n"] = n
        out.append(BenchRequest(t, "/v1/chat/completions", body, api_key=TENANT_KEYS[tenant], tag=tenant,
                                request_id=f"{tenant}-{i}"))
    return out


def _paced(rate: float, seconds: float) -> list[float]:
    return [i / rate for i in range(int(seconds * rate))]


def _poisson(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


async def _send(urls: list[str], reqs: list[BenchRequest], timeout_s: float):
    """Each request to gateway i % len(urls) (by arrival order); samples in request order, wall."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    parts = [[order[k] for k in range(j, len(order), len(urls))] for j in range(len(urls))]
    results = await asyncio.gather(*(run_load(u, [reqs[i] for i in part], timeout_s=timeout_s) for u, part in zip(urls, parts)))
    samples: list = [None] * len(reqs)
    for part, (ss, _) in zip(parts, results):
        for i, s in zip(part, ss):
            samples[i] = s
    return samples, max(w for _, w in results)


def _summary(samples, seconds: float, warmup_s: float, noisy_n: int = 1) -> dict:
    ok = [s for s in samples if s.ok]
    quiet = [s for s in ok if s.tag == "quiet"]
    done_in_window = [s for s in ok if warmup_s <= s.start_s + s.e2e_s <= seconds]
    warm = [s for s in ok if s.start_s >= warmup_s]  # steady state: the caches' cold start is the same in every run
    prompt, cached = sum(s.prompt_tokens for s in warm), sum(s.cached_tokens for s in warm)
    q = percentiles(s.ttft_s for s in quiet)
    qw = percentiles(s.ttft_s for s in quiet if s.start_s >= warmup_s)
    slow = sorted(quiet, key=lambda s: -s.ttft_s)[:5]

    def quiet_ahead(x) -> int:  # the quiet tenant's own requests on x's replica still open when x was sent
        return sum(1 for s in quiet if s is not x and s.replica == x.replica and s.start_s < x.start_s < s.start_s + s.e2e_s)
    return {
        "quiet_ttft_ms": {"p50": round(q["p50"] * 1000, 1), "p99": round(q["p99"] * 1000, 1)},
        # steady state: the quiet tenant's requests sent after the warm-up (its first, cold
        # request and the noisy tenant's cold start excluded, in every scenario alike)
        "quiet_ttft_ms_warm": {"p50": round(qw["p50"] * 1000, 1), "p99": round(qw["p99"] * 1000, 1)},
        "quiet_slowest": [{"start_s": round(s.start_s, 2), "ttft_ms": round(s.ttft_s * 1000, 1), "cached": s.cached_tokens,
                           "prompt": s.prompt_tokens, "replica": s.replica, "quiet_open_there": quiet_ahead(s)} for s in slow],
        "quiet_open_there_mean": round(sum(quiet_ahead(s) for s in quiet) / len(quiet), 2) if quiet else 0.0,
        "quiet_ok": len(quiet), "quiet_errors": sum(1 for s in samples if s.tag == "quiet" and not s.ok),
        "noisy_ok": sum(1 for s in ok if s.tag == "noisy"),
        "noisy_429": sum(1 for s in samples if s.tag == "noisy" and s.status == 429),
        "noisy_other_errors": sum(1 for s in samples if s.tag == "noisy" and not s.ok and s.status != 429),
        "throughput_rps": round(len(done_in_window) / max(1e-9, seconds - warmup_s), 2),
        # engine sequences completed per second (a noisy request of --noisy-n N is N of them)
        "throughput_seqs": round(sum(noisy_n if s.tag == "noisy" else 1 for s in done_in_window) / max(1e-9, seconds - warmup_s), 2),
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "error_examples": sorted({s.error[:120] for s in samples if not s.ok and s.status != 429})[:3],
    }


async def _calibrate(urls: list[str], args) -> float:
    """Completed requests/s with every slot busy (a closed loop of two clients per slot, flow
    control off), counted over the second half of the run: the first wave's burst of
    completions is over by then."""
    import aiohttp

    n = args.max_num_seqs * 2 * 2
    reqs = _requests("noisy", [0.0] * 20_000, args, seed=99)
    done: list[float] = []
    t0 = time.perf_counter()
    stop = t0 + args.calibrate_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                s = await _one(session, urls[0], reqs[i % len(reqs)], t0, 60.0)
                if s.ok:
                    done.append(time.perf_counter() - t0)
                i += n

        await asyncio.gather(*(worker(k) for k in range(n)))
    half = args.calibrate_s / 2
    return sum(1 for t in done if half <= t <= args.calibrate_s) / half


def _scenario(name: str, n_gw: int, flow: bool, reqs, ctx, args, *, headroom: int = 1, light_spill_s: float = 0.0) -> dict:
    _reset_caches(ctx["sims"])
    if args.trace:  # drop what earlier runs left (calibration, stragglers)
        for u in ctx["sims"]:
            urllib.request.urlopen(u + "/sim/trace?clear=1", timeout=30).close()
    gws = Gateways(n_gw, ctx["redis"], ctx["sims"], flow=flow, args=args, workdir=ctx["workdir"], headroom=headroom,
                   light_spill_s=light_spill_s)
    try:
        import uvloop

        before, cpu0 = _sim_stats(ctx["sims"]), gws.cpu_s()
        samples, wall = uvloop.run(_send(gws.urls, reqs, timeout_s=args.client_timeout_s))
        slowdown, gw_cpu_s = _slowdown(before, _sim_stats(ctx["sims"])), gws.cpu_s() - cpu0
        held = _quiet_held(gws.admin) if flow else None
        if args.trace:
            _write_trace(Path(args.trace) / f"{n_gw}gw_{'on' if flow else 'off'}_h{headroom}_{name}.json", reqs, samples, ctx["sims"])
    finally:
        gws.close()
    row = {"scenario": name, "gateways": n_gw, "flow": "on" if flow else "off", "headroom": headroom if flow else None,
           "light_spill_s": light_spill_s if flow else None,
           "wall_s": round(wall, 1), "gateway_cpu_s": round(gw_cpu_s, 2),
           "gateway_cpu_ms_per_request": round(1000 * gw_cpu_s / max(1, sum(1 for s in samples if s.ok)), 2),
           "sim_slowdown": slowdown, **_summary(samples, args.seconds, args.warmup_s, args.noisy_n), "quiet_flow": held}
    label = (f"on, headroom {headroom}" + (f", spill {light_spill_s:g}" if light_spill_s else "")) if flow else "off"
    print(f"{n_gw} gw  flow {label:22s}  {name:5s}  quiet TTFT p50 {row['quiet_ttft_ms']['p50']:8.1f} p99 "
          f"{row['quiet_ttft_ms']['p99']:8.1f} ms (after warm-up p50 {row['quiet_ttft_ms_warm']['p50']:.1f} p99 "
          f"{row['quiet_ttft_ms_warm']['p99']:.1f}; errors {row['quiet_errors']})  noisy ok {row['noisy_ok']:4d} 429 "
          f"{row['noisy_429']:4d}  {row['throughput_rps']:6.2f} req/s ({row['throughput_seqs']:.2f} sequences/s)  hit {row['hit_ratio']:.3f}  sim x{slowdown}  "
          f"gateways {row['gateway_cpu_ms_per_request']:.2f} CPU-ms/request  "
          f"({row['wall_s']} s){'  ' + str(row['error_examples']) if row['error_examples'] else ''}",
          flush=True)
    if held and held["admitted"]:
        print(f"      quiet in the gateways: {held['released']} of {held['admitted']} held, mean wait of those "
              f"{held['mean_wait_ms']:.0f} ms, {held['waited_over_100ms']} over 100 ms", flush=True)
    return row


def _write_trace(path: Path, reqs, samples, sims: list[str]) -> None:
    """`--trace`: each request as the client saw it (X-Request-Id, send time, TTFT, replica) and
    each sim's timelines (requests at engine arrival, first scheduling and first token; steps),
    for loadtests.flow_timelines. The sims' traces are cleared for the next scenario."""
    client = [{"id": r.request_id, "tag": s.tag, "sent_at": s.sent_at, "ttft_s": s.ttft_s if s.ok else None,
               "status": s.status, "replica": s.replica, "cached": s.cached_tokens, "prompt": s.prompt_tokens}
              for r, s in zip(reqs, samples)]
    engines = {}
    for i, u in enumerate(sims):
        with urllib.request.urlopen(u + "/sim/trace?clear=1", timeout=30) as r:
            engines[f"r{i}"] = json.loads(r.read())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"client": client, "engines": engines}))


def _quiet_held(admin_urls: list[str]) -> dict:
    """The quiet tenant's passage through the gateways' flow control, from their /metrics: requests
    let on straight away or after being held, and the held ones' wait. What the gateway held is
    the part of the quiet tenant's TTFT spent before its request reached an engine."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.auth import tenant_hash

    th = tenant_hash("quiet")
    out = {"admitted": 0, "released": 0, "wait_s_sum": 0.0, "waited_over_100ms": 0}
    for a in admin_urls:
        with urllib.request.urlopen(a + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.labels.get("tenant_hash") != th:
                    continue
                if smp.name == "warmroute_gateway_flow_admissions_total":
                    out["admitted"] += int(smp.value)
                    if smp.labels.get("path") == "released":
                        out["released"] += int(smp.value)
                elif smp.name == "warmroute_gateway_flow_queue_wait_seconds_sum":
                    out["wait_s_sum"] += smp.value
                elif smp.name == "warmroute_gateway_flow_queue_wait_seconds_count":
                    out["waited_over_100ms"] += int(smp.value)
                elif smp.name == "warmroute_gateway_flow_queue_wait_seconds_bucket" and smp.labels.get("le") == "0.1":
                    out["waited_over_100ms"] -= int(smp.value)
    out["mean_wait_ms"] = round(1000 * out["wait_s_sum"] / out["released"], 1) if out["released"] else 0.0
    return out


def hot_path_us(n: int = 20_000, replicas: int = 4) -> dict[str, float]:
    """Microseconds the admission stage costs a request that goes straight on (in process, no
    I/O): flow control on, and off (the stage returns at once), side by side."""
    import random as _random

    from prometheus_client import CollectorRegistry

    from gateway.auth import Identity, TenantLimiter
    from gateway.config import config_from_dict
    from gateway.context import ParsedRequest, RequestContext
    from gateway.flow import FlowControl
    from gateway.index import KVIndex
    from gateway.load import LoadTracker
    from gateway.membership import Membership
    from gateway.routing import RoutingState
    from policies.base import RequestView
    from policies.calibration import Calibrator
    from policies.registry import get_policy

    async def one(enabled: bool) -> float:
        mem = Membership()
        mem.set_members({f"r{i}": f"http://r{i}" for i in range(replicas)})
        rs = RoutingState(KVIndex(max_entries=1000, stale_after_s=10.0), LoadTracker(), Calibrator(), speculative_ttl_s=2.0)
        fc = FlowControl(config_from_dict({"flow": {"enabled": enabled}}, env={}), routing=rs, membership=mem,
                         limiter=TenantLimiter({}), slots=256, registry=CollectorRegistry())
        routing = rs.decide(RequestView(prompt_tokens=100, block_size=16, keys=tuple(range(6))),
                            {r: True for r in mem.ids()}, get_policy("cache_aware"), _random.Random(0))
        ident = Identity("tenant")
        req = ParsedRequest("chat", MODEL, True, False, 16, messages=[{"role": "user", "content": "hi"}])
        t0 = time.perf_counter()
        for _ in range(n):
            ctx = RequestContext("x", "/v1/chat/completions", "chat", {}, 0.0, identity=ident, routing=routing, request=req)
            await fc.hold(ctx, None)
            fc.finished(ctx)
        return (time.perf_counter() - t0) / n * 1e6

    on, off = asyncio.run(one(True)), asyncio.run(one(False))
    return {"on_us": round(on, 2), "off_us": round(off, 2), "added_us": round(on - off, 2)}


def _verdicts(rows: list[dict]) -> list[dict]:
    out = []
    for n_gw, headroom, spill in sorted({(r["gateways"], r["headroom"], r.get("light_spill_s") or 0.0)
                                         for r in rows if r["flow"] == "on"}):
        get = {(r["flow"], r["headroom"], r.get("light_spill_s") or 0.0, r["scenario"]): r for r in rows if r["gateways"] == n_gw}
        alone, on, off = get[("on", headroom, spill, "alone")], get[("on", headroom, spill, "noisy")], get[("off", None, 0.0, "noisy")]
        ratio = on["quiet_ttft_ms"]["p99"] / alone["quiet_ttft_ms"]["p99"]
        ratio_warm = on["quiet_ttft_ms_warm"]["p99"] / alone["quiet_ttft_ms_warm"]["p99"]
        tput = on["throughput_seqs"] / off["throughput_seqs"] if off["throughput_seqs"] else float("nan")
        out.append({"gateways": n_gw, "headroom_reqs": headroom, "light_spill_s": spill, "quiet_p99_vs_alone": round(ratio, 2),
                    "quiet_p99_vs_alone_after_warmup": round(ratio_warm, 2),
                    "quiet_p99_vs_alone_flow_off": round(off["quiet_ttft_ms"]["p99"] / get[("off", None, 0.0, "alone")]["quiet_ttft_ms"]["p99"], 1),
                    "throughput_vs_off": round(tput, 3), "hit_ratio_on": on["hit_ratio"], "hit_ratio_off": off["hit_ratio"],
                    "goals": {"quiet_p99_within_1.25x": ratio <= 1.25, "throughput_within_3pct": tput >= 0.97,
                              "hit_ratio_not_lower": on["hit_ratio"] >= off["hit_ratio"] - 0.005}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="arrivals per scenario")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="throughput counts completions after this")
    ap.add_argument("--calibrate-s", type=float, default=12.0, help="closed-loop run measuring the capacity C")
    ap.add_argument("--capacity-rps", type=float, default=None, help="skip calibration: the pool's capacity C")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="sequence slots per simulated replica")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.25,
                    help="the sims' prefill time (the wall-clock profile's 1.0 makes a pool prefill-bound)")
    ap.add_argument("--time-scale", type=float, default=2.0,
                    help="multiplies the sims' step times (halves the events per second this machine must stream)")
    ap.add_argument("--system-words", type=int, default=300, help="each tenant's system prompt (shared, cached)")
    ap.add_argument("--question-words", type=int, default=40, help="each request's own text")
    ap.add_argument("--output-tokens", type=int, default=32, help="mean output tokens (uniform over 0.5x..1.5x)")
    ap.add_argument("--quiet-share", type=float, default=0.5,
                    help="the quiet tenant's rate, in fair shares (1.0: exactly its share, which leaves it no headroom "
                         "when the pool's capacity dips: its queue is then critically loaded)")
    ap.add_argument("--engine-queue-reqs", type=int, default=1, help="flow.engine_queue_reqs of the runs")
    ap.add_argument("--headroom-reqs", default="1,0", help="flow.headroom_reqs values to run flow control with, side by side")
    ap.add_argument("--light-spill-s", default="0.5", help="flow.light_spill_s values to run flow control with, side by side "
                    "(each with every --headroom-reqs value)")
    ap.add_argument("--engine-priority", action="store_true",
                    help="flow.engine_priority on, the sims on vLLM's priority scheduling (every scenario)")
    ap.add_argument("--noisy-multiple", type=float, default=5.0, help="the noisy tenant's rate, in fair shares")
    ap.add_argument("--noisy-n", type=int, default=1,
                    help="choices per noisy request (n: as many engine sequences), its request rate divided by it so its "
                         "sequences keep --noisy-multiple (default 1)")
    ap.add_argument("--max-queue-wait-s", type=float, default=5.0, help="flow.max_queue_wait_s of the runs")
    ap.add_argument("--max-queue-reqs", type=int, default=200, help="flow.max_queue_reqs_per_tenant of the runs")
    ap.add_argument("--client-timeout-s", type=float, default=120.0)
    ap.add_argument("--gateways", default="1,2", help="gateway counts to run")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--hot-path-only", action="store_true", help="only the in-process cost of the straight-on path")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write each scenario's per-request timelines (client and engines) here, for loadtests.flow_timelines")
    ap.add_argument("--flow-off", choices=["yes", "no"], default="yes",
                    help="no: skip the flow-off scenarios (diagnostic runs; the verdicts need them)")
    args = ap.parse_args(argv)
    if args.hot_path_only:
        print(json.dumps(hot_path_us()))
        return 0

    hot = hot_path_us()
    report_hot = {"admission_direct_path_us": hot}
    print(f"admission stage, straight-on path: {hot['on_us']} us/request with flow control, {hot['off_us']} without "
          f"(added {hot['added_us']} us)", flush=True)
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="warmroute-bench-flow-"))
    rport = free_port()
    redis = subprocess.Popen([exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctxp = __import__("multiprocessing").get_context("spawn")
    ports = [free_port(), free_port()]
    redis_url = f"redis://127.0.0.1:{rport}/0"
    pool: list = []
    report: dict = {"command": " ".join(["python -m loadtests.bench_flow"] + (argv if argv is not None else sys.argv[1:])),
                    "params": vars(args), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), **report_hot,
                    "rows": []}
    try:
        time.sleep(0.3)
        spec = {"max_num_seqs": args.max_num_seqs, "num_blocks": args.num_blocks, "time_scale": args.time_scale,
                "prefill_ms_per_token": args.prefill_ms_per_token,
                "scheduling_policy": "priority" if args.engine_priority else "fcfs", "trace": bool(args.trace)}
        pool = [ctxp.Process(target=pool_main, args=(redis_url, p, i, spec), daemon=True) for i, p in enumerate(ports)]
        for p in pool:
            p.start()
        sims = [f"http://127.0.0.1:{p}" for p in ports]
        for u in sims:
            wait_http(u + "/health", 60.0)
        ctx = {"sims": sims, "redis": redis_url, "workdir": workdir}
        cap = args.capacity_rps
        if cap is None:
            gws = Gateways(1, redis_url, sims, flow=False, args=args, workdir=workdir)
            try:
                import uvloop

                cap = uvloop.run(_calibrate(gws.urls, args))
            finally:
                gws.close()
        share = cap / 2
        print(f"pool capacity C = {cap:.2f} req/s; fair share C/2 = {share:.2f} req/s; quiet paced at {args.quiet_share * share:.2f}, "
              f"noisy Poisson at {args.noisy_multiple * share:.2f} sequences/s (n = {args.noisy_n})", flush=True)
        report["capacity_rps"] = round(cap, 3)
        quiet = _requests("quiet", _paced(args.quiet_share * share, args.seconds), args, seed=1)
        noisy = _requests("noisy", _poisson(args.noisy_multiple * share / args.noisy_n, args.seconds, seed=2), args, seed=3,
                          n=args.noisy_n)
        runs = [(True, int(h), float(ls)) for h in args.headroom_reqs.split(",") if h
                for ls in args.light_spill_s.split(",") if ls] + ([(False, 0, 0.0)] if args.flow_off == "yes" else [])
        for n_gw in [int(x) for x in args.gateways.split(",") if x]:
            for flow, headroom, spill in runs:
                for name, reqs in (("alone", quiet), ("noisy", quiet + noisy)):
                    report["rows"].append(_scenario(name, n_gw, flow, reqs, ctx, args, headroom=headroom, light_spill_s=spill))
        report["verdicts"] = _verdicts(report["rows"]) if args.flow_off == "yes" else []
        for v in report["verdicts"]:
            print(json.dumps(v), flush=True)
    finally:
        for p in pool:
            p.terminate()
        for p in pool:
            p.join(10)
        stop_processes([redis])
        report["loadavg_end"] = os.getloadavg()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
