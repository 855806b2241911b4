"""warmroute beside the peer routers (sglang-router, vllm-router) on one workload, in one run.

    python -m loadtests.compare_peers [--replicas 4] [--requests N] [--rate R]
        [--workload shared_docs|shared_docs_zipf|...] [--routers warmroute:cache_aware,...]
        [--json FILE] [--md FILE]
    python -m loadtests.compare_peers --regime busy --case shared_docs_zipf [--seed S] [--routers ...]

`--regime NAME --case CASE` runs a virtual-time regime's case (loadtests/vtime_regimes.py) on the
wall clock: its replicas, KV blocks, max_num_seqs, token budget per step, client timeout, agent
interval, request stream and rate, and its pre-warm (one request per shared document, sent one
after another through the router under test before the measured stream). The text is rendered
so the engine sees the nominal token counts vtime uses (loadtests.workloads.text_words_per_token:
a pseudo-word is ~1.5 tokens). The gateway's max_num_seqs policy parameter is set to the sims'.

Every component is a separate process on 127.0.0.1, started here and stopped here by PID (process
group = that PID; also on error and Ctrl-C): N `warmroute sim` replicas (wall-clock time profile,
KV smaller than the working set, KV events over tcp), one `warmroute agent` per sim (binds the SUB
socket; the sim connects), a private `redis-server` as the feed, and, one after another, each
router under test pointed at the SAME sims: `warmroute gateway` (cache_aware, round_robin),
sglang-router and vllm-router (from their own venv: loadtests/setup_peers.sh). Before each
router's run the sims drain, their prefix caches are reset (POST /reset_prefix_cache) and the
router is freshly started, so every router starts cold; then the identical request stream (same
seed, Poisson arrivals and prompts: loadtests.bench.bench_requests + runner.run_load) is sent with
a fresh TCP connection per request (sglang-router sets no TCP_NODELAY on accepted sockets, which
adds ~40 ms to TTFT on reused connections: Nagle's algorithm meets delayed ACKs).

Per router the report has the client-side figures (runner.summarize), and from the sims' own
counters (deltas of /metrics, since peers do not name the replica in a header): requests per
replica, engine-side prompt/cached tokens, replica busy share (modelled step seconds / wall),
mean timer lateness per step, preemptions; and CPU: the machine's share (/proc/stat; the machine
is shared, so other people's work shows up here), the CPU seconds of our own processes (router,
sims, agents, redis, this load generator) and the router's alone. A router that cannot be
installed or started is reported as unavailable with the reason: this is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.tokenization import TokenizerService
from loadtests.ports import free_port
from loadtests.peer_pool import SIM_COUNTERS, Procs, Unavailable, drain_and_reset, drain_sims, sim_counters, wait_ready
from loadtests.bench import WALLCLOCK_DEFAULTS, _parse_params, bench_requests
from loadtests.runner import CpuMeter, run_load, summarize
from loadtests.vtime_regimes import REGIMES, build_case
from loadtests.workloads import build_workload, exact_word_counts, text_words_per_token
from policies.registry import policy_params

MODEL = "warmroute-sim"
DEFAULT_ROUTERS = "warmroute:cache_aware,warmroute:round_robin,sglang:cache_aware,sglang:round_robin,vllm:cache_aware"
DEFAULT_PEERS_VENV = Path(os.environ.get("WARMROUTE_PEERS_VENV", Path.home() / ".cache/warmroute/peers-venv"))


# ------------------------------------------------------------------------------ routers


@dataclass
class RouterRun:
    key: str  # e.g. "sglang:cache_aware"
    label: str  # e.g. "sglang-router cache_aware"
    url: str = ""
    name: str = ""  # process name in Procs


def _router_argv(kind: str, policy: str, port: int, sim_urls: list[str], venv: Path, ctx: dict) -> tuple[list[str], dict, str, str]:
    """(argv, env, readiness URL, Prometheus URL) of one router."""
    if kind == "warmroute":
        admin = free_port()
        argv = [ctx["warmroute_bin"], "gateway", "--no-auth", "--host", "127.0.0.1", "--port", str(port),
                "--admin-port", str(admin), "--feed", ctx["feed_url"], "--policy", policy, "--block-size", "16",
                "--model", MODEL, "--salt-secret-file", ctx["salt_file"]]
        for i, u in enumerate(sim_urls):
            argv += ["--replica", f"r{i}={u}"]
        # the sims run the wall-clock time model: give the calibration the same priors the
        # embedded harness gives (loadtests/harness.py), and log warnings only (as the peers)
        env = {"WARMROUTE_POLICY__PRIOR_PREFILL_S_PER_TOKEN": "0.001", "WARMROUTE_POLICY__PRIOR_DECODE_STEP_S": "0.012",
               "WARMROUTE_TELEMETRY__LOG_LEVEL": "WARNING"}
        if "max_num_seqs" in policy_params(policy):  # the operator's setting mirrors the engines' --max-num-seqs
            env["WARMROUTE_POLICY__PARAMS__MAX_NUM_SEQS"] = str(ctx["max_num_seqs"])
        return argv, env, f"http://127.0.0.1:{admin}/readyz", f"http://127.0.0.1:{admin}/metrics"
    prom = free_port()
    if kind == "sglang":
        py = venv / "bin" / "python"
        if not py.exists():
            raise Unavailable(f"no peers venv at {venv} (run loadtests/setup_peers.sh)")
        argv = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--worker-urls", *sim_urls,
                "--policy", policy, "--log-level", "warn"]
        return argv, {}, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{prom}/metrics"
    if kind == "vllm":
        exe = venv / "bin" / "vllm-router"
        if not exe.exists():
            raise Unavailable(f"no vllm-router in {venv} (run loadtests/setup_peers.sh)")
        argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(prom), "--worker-urls", *sim_urls, "--worker-startup-check-interval", "1",
                "--policy", policy, "--log-level", "warning"]
        return argv, {}, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{prom}/metrics"
    raise Unavailable(f"unknown router kind {kind!r}")


_LABELS = {"warmroute": "warmroute", "sglang": "sglang-router", "vllm": "vllm-router"}


async def _warmup(session: aiohttp.ClientSession, url: str) -> None:
    """One tiny request through the router (proves the path works; lazy initialisation)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    last = ""
    for _ in range(10):
        try:
            async with session.post(url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                text = await r.text()
                if r.status == 200 and "data:" in text:
                    return
                last = f"HTTP {r.status}: {text[:300]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(1.0)
    raise Unavailable(f"warm-up request through {url} failed: {last}")


_KEPT_COUNTERS = {  # a router's counters worth keeping, by kind
    "warmroute": ("keepalive", "flow_admissions", "flow_sheds"),  # refreshes and what they computed; flow control
    "peer": ("render", "tokeniz", "processed_requests", "policy_decisions"),  # calls to workers besides the request
}


async def _router_metrics(session: aiohttp.ClientSession, url: str, kind: str) -> dict[str, float]:
    """The router's counters worth keeping (_KEPT_COUNTERS), as scraped now."""
    words = _KEPT_COUNTERS["warmroute" if kind == "warmroute" else "peer"]
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    out = {}
    for line in text.splitlines():
        if line and line[0] != "#" and "_created{" not in line and any(w in line for w in words):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def _code_state() -> dict:
    """The warmroute code a gateway process loads (the working tree: it may differ from HEAD)."""
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    import hashlib

    paths = ["gateway", "policies", "replica_agent", "hashing", "loadtests/sim"]
    diff = git("diff", "HEAD", "--", *paths)
    return {"head": git("rev-parse", "--short", "HEAD"),
            "dirty_files": git("diff", "HEAD", "--name-only", "--", *paths).split(),
            "dirty_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else ""}


# ------------------------------------------------------------------------------ the comparison


def _apply_regime(args) -> None:
    """`--regime NAME --case CASE`: the replicas, KV, scheduler, client timeout and agent interval
    of a virtual-time regime (loadtests/vtime_regimes.py), so the wall clock runs what vtime does."""
    reg = REGIMES[args.regime]
    if args.case not in reg.cases:
        raise SystemExit(f"--case: {args.regime} has {', '.join(reg.cases)}")
    p = reg.params
    args.replicas, args.num_blocks, args.max_num_seqs = reg.replicas, p.num_blocks, p.max_num_seqs
    args.max_num_batched_tokens = p.max_batched_tokens
    args.request_timeout = p.request_timeout_s or args.request_timeout
    args.agent_load_interval = p.report_interval_s


def _workload(args):
    """(workload, its bench requests, pre-warm bench requests) of the run."""
    if args.regime:
        c = build_case(args.regime, args.case, args.seed, n_requests=args.regime_requests)
        workload, warm = c.workload, c.warmup
        args.rate, args.requests, args.prewarmed = round(c.rate_rps, 3), len(c.workload.requests), bool(warm)
        # the engine must see the token counts vtime uses: each segment's text made exactly as long
        # (the average factor alone left documents tens of tokens off; on the busy regime a few
        # tokens per request are the difference between queues that drain and queues that do not)
        with TokenizerService() as tok:
            wpt = text_words_per_token(tok.encode_prompt)
            words = exact_word_counts(list(warm) + list(workload.requests), tok.encode_prompt, wpt)
    else:
        params = dict(WALLCLOCK_DEFAULTS.get(args.workload, {}))
        params.update(_parse_params(args.param))
        params.update(rate_rps=args.rate, concurrency=None)
        workload = build_workload(args.workload, args.requests, seed=args.seed, **params)
        warm, wpt, words = [], 1.0, None
    return (workload, bench_requests(workload, MODEL, None, wpt, words=words),
            bench_requests(workload, MODEL, None, wpt, requests=warm, words=words))


async def _prewarm(url: str, warm: list, timeout_s: float) -> None:
    """The pre-warm requests through the router, one after another (one per shared document)."""
    if warm:
        samples, _ = await run_load(url, warm, concurrency=1, fresh_connections=True, timeout_s=timeout_s)
        failed = [x for x in samples if x.error]
        if failed:
            raise Unavailable(f"{len(failed)} of {len(warm)} pre-warm requests failed: {failed[0].error}")


async def _compare(args, procs: Procs, tmp: Path) -> dict:
    workload, reqs, warm = _workload(args)
    venv = Path(args.peers_venv)
    wr_bin = str(Path(sys.executable).with_name("warmroute"))
    if not Path(wr_bin).exists():
        raise SystemExit(f"warmroute console script not found next to {sys.executable}")

    # feed: a private redis-server
    redis_port = free_port()
    procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(tmp)])
    feed_url = f"redis://127.0.0.1:{redis_port}/0"
    salt_file = tmp / "salt-secret"
    salt_file.write_text(os.urandom(24).hex())
    ctx = {"warmroute_bin": wr_bin, "feed_url": feed_url, "salt_file": str(salt_file), "max_num_seqs": args.max_num_seqs}

    sims: dict[str, str] = {}
    endpoints = {}
    for i in range(args.replicas):
        rid, port = f"r{i}", free_port()
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        endpoints[rid] = (ev, rp)
        procs.start(f"agent-{rid}", [wr_bin, "agent", "--replica-id", rid, "--engine-url", f"http://127.0.0.1:{port}",
                                     "--kv-events-endpoint", ev, "--replay-endpoint", rp, "--bind", "--feed", feed_url,
                                     "--model", MODEL, "--block-size", "16", "--load-interval", str(args.agent_load_interval)])
        procs.start(f"sim-{rid}", [wr_bin, "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                                   "--block-size", "16", "--num-blocks", str(args.num_blocks),
                                   "--max-model-len", str(args.num_blocks * 16), "--max-num-seqs", str(args.max_num_seqs),
                                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                   "--time-profile", "wallclock", "--kv-events-endpoint", ev, "--replay-endpoint", rp,
                                   "--scheduling-policy", args.sim_scheduling_policy])
        sims[rid] = f"http://127.0.0.1:{port}"
    sim_urls = list(sims.values())

    report: dict[str, dict] = {}
    async with aiohttp.ClientSession() as session:
        for rid, url in sims.items():
            await wait_ready(session, url + "/health", procs, f"sim-{rid}", 60)
        for rid in sims:
            if not procs.alive(f"agent-{rid}"):
                raise RuntimeError(f"agent-{rid} exited: {procs.log_tail(f'agent-{rid}')}")
        print(f"{args.replicas} sims + agents up; feed {feed_url}; logs in {tmp}", file=sys.stderr)

        for key in [k.strip() for k in args.routers.split(",") if k.strip()]:
            kind, _, policy = key.partition(":")
            label = f"{_LABELS.get(kind, kind)} {policy}"
            name = f"router-{kind}-{policy}"
            print(f"== {label}", file=sys.stderr)
            argv: list[str] = []
            try:
                drained_s = await drain_and_reset(session, sims, args.drain_timeout)
                port = free_port()
                argv, env, ready, prom_url = _router_argv(kind, policy, port, sim_urls, venv, ctx)
                code = _code_state() if kind == "warmroute" else None
                procs.start(name, argv, env)
                url = f"http://127.0.0.1:{port}"
                await wait_ready(session, ready, procs, name, args.startup_timeout)
                await _warmup(session, url)
                await drain_and_reset(session, sims, args.drain_timeout)
                await _prewarm(url, warm, args.request_timeout)
                await drain_sims(session, sims, args.drain_timeout)
            except Unavailable as exc:
                print(f"  unavailable: {exc}", file=sys.stderr)
                report[label] = {"available": False, "reason": str(exc), "command": shlex.join(argv)}
                procs.stop(name)
                continue
            before = await sim_counters(session, sims)
            rm0 = await _router_metrics(session, prom_url, kind)
            own = ["redis", name, *(f"sim-{r}" for r in sims), *(f"agent-{r}" for r in sims)]
            cpu0 = {n: procs.cpu_s(n) for n in own}
            me0 = os.times()
            meter = CpuMeter()
            samples, wall = await run_load(url, reqs, fresh_connections=not args.keep_alive, timeout_s=args.request_timeout)
            share = meter.share()
            me1 = os.times()
            cpu1 = {n: procs.cpu_s(n) for n in own}
            after = await sim_counters(session, sims)
            rm1 = await _router_metrics(session, prom_url, kind)
            router_metrics = {k: v - rm0.get(k, 0.0) for k, v in rm1.items()}  # this run only (not the warm-up)
            router_alive = procs.alive(name)
            router_log = procs.log_tail(name, 5)
            procs.stop(name)
            s = summarize(samples, wall, router=label, command=shlex.join(argv), workload=workload.name,
                          workload_params=workload.params, replicas=args.replicas, num_blocks_per_replica=args.num_blocks,
                          time_profile="wallclock", rate_rps=args.rate, seed=args.seed,
                          fresh_connections=not args.keep_alive)
            d = {rid: {k: after[rid].get(k, 0.0) - before[rid].get(k, 0.0) for k in SIM_COUNTERS.values() if k != "lateness_max_s"}
                 for rid in sims}
            steps = sum(x["steps"] for x in d.values())
            q = sum(x["cache_queries_tokens"] for x in d.values())
            h = sum(x["cache_hits_tokens"] for x in d.values())
            ours = sum(cpu1[n] - cpu0[n] for n in own) + (me1.user - me0.user) + (me1.system - me0.system)
            ncpu = os.cpu_count() or 1
            s.update({
                "available": True,
                "warmroute_code": code,
                "per_replica_requests": {rid: int(x["requests"]) for rid, x in d.items()},
                "per_replica_busy_share": {rid: round(x["modelled_s"] / wall, 3) for rid, x in d.items()},
                "engine_prompt_tokens": int(q), "engine_cached_tokens": int(h),
                "engine_hit_ratio": round(h / q, 4) if q else 0.0,
                "sim_preemptions": int(sum(x["preemptions"] for x in d.values())),
                "sim_timer_lateness_ms_mean": round(1000 * sum(x["actual_s"] - x["modelled_s"] for x in d.values()) / steps, 2) if steps else 0.0,
                "sim_timer_lateness_ms_max_run": round(1000 * max(
                    (after[r]["lateness_max_s"] for r in sims if after[r]["lateness_max_s"] > before[r]["lateness_max_s"]), default=0.0), 1),
                "sim_timer_lateness_ms_p99_recent": round(1000 * max(after[r]["stats"]["lateness_s"]["p99"] for r in sims), 2),
                "machine_cpu_share": round(share, 3),
                "our_cpu_share": round(ours / (wall * ncpu), 3),
                "cpu_s": {"router": round(cpu1[name] - cpu0[name], 2),
                          "sims": round(sum(cpu1[n] - cpu0[n] for n in own if n.startswith("sim-")), 2),
                          "agents+redis": round(sum(cpu1[n] - cpu0[n] for n in own if n.startswith("agent-") or n == "redis"), 2),
                          "load_generator": round((me1.user - me0.user) + (me1.system - me0.system), 2)},
                "router_alive_at_end": router_alive,
                # peers' own counters of the calls they make besides the request (vllm-router's
                # cache_aware renders every request: kv_routing_inputs_total{result="render"})
                "router_extra_calls": int(sum(v for k, v in router_metrics.items() if "render" in k or "tokeniz" in k)),
                "router_metrics": router_metrics,
                "drain_s_before": round(drained_s, 1),
            })
            if not router_alive:
                s["router_log_tail"] = router_log
            report[label] = s
            if args.samples:  # one line per request: where each router's misses fall, request by request
                with open(args.samples, "a") as f:
                    for x in samples:
                        f.write(json.dumps({"router": label, "tag": x.tag, "ok": x.ok, "start_s": round(x.start_s, 3),
                                            "ttft_s": round(x.ttft_s, 4) if x.ttft_s == x.ttft_s else None,
                                            "prompt_tokens": x.prompt_tokens, "cached_tokens": x.cached_tokens,
                                            "replica": x.replica}) + "\n")
            print(f"  {s['requests']} req, {s['errors']} errors, {wall:.0f}s, TTFT p50 {s['ttft_ms']['p50']} ms, "
                  f"hit {s['hit_ratio']}, spread {list(s['per_replica_requests'].values())}, cpu {share:.2f}", file=sys.stderr)
    return report


# ------------------------------------------------------------------------------ output


def _fmt(v, nd=0) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def format_table(report: dict[str, dict]) -> str:
    head = ["router", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "e2e p50 ms", "rps", "hit ratio (client / engine)",
            "requests per replica", "replica busy", "errors", "extra calls", "CPU machine / ours", "router CPU s", "sim lateness mean / max ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in report.items():
        if not r.get("available", True):
            lines.append(f"| {label} | unavailable: {r['reason'][:200]} |" + " |" * (len(head) - 2))
            continue
        row = [label, _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p90"]), _fmt(r["ttft_ms"]["p99"]),
               _fmt(r["e2e_ms"]["p50"]), _fmt(r["throughput_rps"], 2),
               f'{r["hit_ratio"]:.3f} / {r["engine_hit_ratio"]:.3f}',
               " ".join(str(v) for v in r["per_replica_requests"].values()),
               " ".join(f"{v:.2f}" for v in r["per_replica_busy_share"].values()),
               f'{r["errors"]}/{r["requests"]}', str(r.get("router_extra_calls", 0)), f'{r["machine_cpu_share"]:.2f} / {r["our_cpu_share"]:.2f}',
               _fmt(r["cpu_s"]["router"], 1), f'{r["sim_timer_lateness_ms_mean"]:.1f} / {r["sim_timer_lateness_ms_max_run"]:.0f}']
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _markdown(report: dict, args, command: str, started: str) -> str:
    any_r = next((r for r in report.values() if r.get("available")), {})
    wp = (any_r.get("params") or {}).get("workload_params", {})
    return "\n".join([
        (f"### regime {args.regime}, {args.case}: {args.replicas} replicas, {args.requests} requests at {args.rate} rps "
         f"(seed {args.seed}; max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens} tokens per step, "
         f"pre-warmed: {'yes' if args.prewarmed else 'no'})" if args.regime else
         f"### {args.workload}: {args.replicas} replicas, {args.requests} requests at {args.rate} rps (seed {args.seed})"),
        "",
        f"- date: {started}; command: `{command}`",
        "- warmroute code (working tree, loaded when each gateway started): " + "; ".join(
            f'{k}: HEAD {r["warmroute_code"]["head"]}' + (f' + uncommitted diff {r["warmroute_code"]["dirty_diff_sha1"]} in '
                                                         + ", ".join(r["warmroute_code"]["dirty_files"]) if r["warmroute_code"]["dirty_files"] else " (clean)")
            for k, r in report.items() if r.get("warmroute_code")),
        f"- workload params: `{json.dumps(wp, sort_keys=True)}`; KV {args.num_blocks} blocks x 16 tokens per replica; "
        f"sims: `--time-profile wallclock` (prefill 1 ms/token, ~12 ms decode steps); "
        f"{'fresh TCP connection per request' if not args.keep_alive else 'keep-alive connections'}; "
        "every router started fresh after the sims drained and their prefix caches were reset",
        "- hit ratio: client = cached/prompt tokens from the streamed usage; engine = the sims' prefix-cache "
        "hit/query token counters. requests per replica and replica busy (modelled step seconds / wall) from the sims' "
        "counters. CPU machine = whole machine (/proc/stat; shared with other users), ours = all processes of this run "
        "(router, sims, agents, redis, load generator) / (wall x cores). extra calls = calls a peer router makes to the "
        "workers besides the request, from its own Prometheus counters (vllm-router: render). sim lateness = how far the sims' step timers "
        "fell behind the time model (mean per step / max in the run).",
        "",
        format_table(report),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compare_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--workload", default="shared_docs")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="override a workload parameter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=256, help="KV capacity per sim, in blocks of 16 tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--routers", default=DEFAULT_ROUTERS, help=f"comma list of KIND:POLICY (default {DEFAULT_ROUTERS})")
    p.add_argument("--peers-venv", default=str(DEFAULT_PEERS_VENV), help="venv with sglang-router and vllm-router")
    p.add_argument("--keep-alive", action="store_true", help="reuse client connections (default: a fresh one per request)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=120.0, help="wait this long for the sims to go idle between routers")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--agent-load-interval", type=float, default=0.25)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--samples", default=None, metavar="FILE",
                   help="append one JSON line per measured request (router, tag, start, TTFT, prompt and cached tokens, replica)")
    p.add_argument("--md", default=None, metavar="FILE", help="append the markdown section to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their directory is printed)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the sims' token budget per step (chunked prefill)")
    p.add_argument("--sim-scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="the sims' --scheduling-policy (vLLM's): priority for keep_alive.engine_priority or flow.engine_priority")
    p.add_argument("--regime", default=None, choices=sorted(REGIMES),
                   help="run a virtual-time regime's case on the wall clock (replicas, KV, scheduler, rate, pre-warm, "
                        "request count from loadtests/vtime_regimes.py; the text is rendered to the nominal token counts)")
    p.add_argument("--regime-requests", type=int, default=None, help="with --regime: this many requests instead of the case's (a short run)")
    p.add_argument("--case", default="shared_docs", help="the regime's case (e.g. shared_docs, shared_docs_zipf, multi_turn, no_sharing)")
    args = p.parse_args(argv)
    if args.regime:
        _apply_regime(args)

    command = "python -m loadtests.compare_peers " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    tmp = Path(tempfile.mkdtemp(prefix="warmroute-peers-"))
    procs = Procs(tmp)

    def _term(signum, frame):  # noqa: ARG001 - SIGTERM: clean up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        report = asyncio.run(_compare(args, procs, tmp))
    except KeyboardInterrupt:
        print("interrupted; stopping every process", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        if not args.keep_logs:
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    md = _markdown(report, args, command, started)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "date": started, "report": report}, indent=2))
    if args.md:
        with open(args.md, "a") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
