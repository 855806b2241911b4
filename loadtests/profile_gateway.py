"""Where the gateway's CPU goes per request (a benchmark, not a test), and code trees side by side.

    python -m loadtests.profile_gateway [--requests 400] [--rate 24] [--replicas 4]
        [--variant NAME=DIR ...] [--rounds 2] [--py-spy] [--json FILE]
    python -m loadtests.profile_gateway --regime busy --case shared_docs --policy cache_plan --regime-requests 600

`--regime NAME --case CASE` runs a virtual-time regime's case exactly as `loadtests.compare_peers
--regime` does (its replicas, KV, step budget, rate, pre-warm and the text rendered to the nominal
token counts): the router CPU per request of the busy-regime comparison, profiled. Without it
the shared_docs shape below is sent as text of 1.49 tokens per nominal one with the sims' default
step budget, which overloads the pool at 24 requests/s (most requests time out, and the CPU per
request is a collapsed gateway's: held requests re-checked, timeouts); the report says when
requests failed.

The same processes as loadtests.compare_peers (N `warmroute sim` replicas with the wall-clock time
model and KV smaller than the working set, one `warmroute agent` each, a private redis-server as
the feed), and one `warmroute gateway` (cache_aware, no auth) at a time on the same workload shape
as compare_peers' long-prompt regime (shared_docs: 24 documents of 3,000 tokens, 100-token
questions, 32 output tokens, Poisson arrivals, a fresh TCP connection per request), with fewer
requests. Per gateway run: its CPU seconds (utime+stime from /proc) over the load, per request,
and over an idle stretch after it (`--idle-s`: the background wake-ups alone).

`--variant NAME=DIR` (repeatable) runs the gateway from another code tree (PYTHONPATH=DIR; e.g. a
`git archive` of a baseline commit), and `--variant NAME=@sglang` (or `@vllm`) a peer router from
loadtests/setup_peers.sh's venv, so a change is measured before/after, and against a peer, in one run: rounds
alternate the variants (A B A B ...) against the same sims, each started fresh after the sims
drained and their prefix caches were reset, and the report gives each variant's CPU per request
and its ratio to the first. The machine may be shared: alternating rounds spread that noise over
every variant rather than one.

`--py-spy` samples the gateway with py-spy (`record --format raw --nonblocking --gil`: only samples
holding the GIL, so a thread that is runnable but waiting for a CPU on a busy machine, e.g. just
woken from epoll, is not counted as working; native frames off) during the load and attributes every sample to the innermost warmroute frame on its stack (rules
in `CATEGORIES`: e.g. a sample in redis' parser under `RedisFeed.read` is "feed: XREAD"), so the
attribution table sums to the sampled CPU; samples with no warmroute frame are "event loop / other".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from loadtests.ports import free_port
from loadtests.bench import _parse_params, bench_requests
from loadtests.compare_peers import DEFAULT_PEERS_VENV, MODEL, _apply_regime, _router_argv, _warmup
from loadtests.peer_pool import Procs, Unavailable, drain_and_reset, sim_counters, wait_ready
from loadtests.compare_peers import _workload as _regime_workload
from loadtests.vtime_regimes import REGIMES
from loadtests.runner import BenchRequest, run_load

REPO = Path(__file__).resolve().parent.parent
_CLK = os.sysconf("SC_CLK_TCK")
PEER_PREFIX = "@"  # --variant NAME=@sglang (or @vllm): that peer router instead of a warmroute tree
REGIME = dict(n_docs=24, doc_tokens=3000, question_tokens=100, output_tokens=32)

# (category, file fragment, function names or None for any): the innermost frame that matches one
# names the sample's category; earlier rules win for the same frame; an empty category marks
# plumbing shared by several callers (the category is then the caller's).
CATEGORIES: list[tuple[str, str, frozenset | None]] = [
    ("", "replica_agent/feed/redis_feed.py", frozenset({"run", "_drop", "_call", "_direct"})),  # shared plumbing: look further out
    ("feed: index apply", "gateway/index.py", frozenset({"apply", "_store", "_remove", "_evict", "maintain",
                                                         "load_snapshot", "_clear_slot", "_replica_bits"})),
    ("index match + speculation", "gateway/index.py", None),
    ("feed: record decode", "replica_agent/feed/records.py", None),
    ("inflight exchange", "replica_agent/feed/redis_feed.py", frozenset({"inflight", "incr_inflight", "scan", "exchange_inflight", "_sum_inflight"})),
    ("feed: XREAD", "replica_agent/feed/redis_feed.py", None),
    ("feed: sync loop", "gateway/index_sync.py", None),
    ("inflight exchange", "gateway/background.py", frozenset({"run_inflight_exchange", "flush_inflight"})),
    ("background: other", "gateway/background.py", None),
    ("health probes / membership", "gateway/membership.py", None),
    ("chat template render", "gateway/tokenization.py", frozenset({"_render", "render_chat"})),
    ("chat template render", "gateway/chat_messages.py", None),
    ("tokenize (encode, segment cache)", "gateway/tokenization.py", None),
    ("tokenize (encode, segment cache)", "gateway/token_backends.py", None),
    ("tokenize (encode, segment cache)", "gateway/encode.py", None),
    ("block keys", "hashing/", None),
    ("JSON decode of the body", "gateway/parse.py", frozenset({"parse_body"})),
    ("validate", "gateway/parse.py", None),
    ("auth + salt", "gateway/auth.py", None),
    ("auth + salt", "gateway/salt.py", None),
    ("views + policy", "gateway/routing.py", None),
    ("views + policy", "policies/", None),
    ("load tracking", "gateway/load.py", None),
    ("rewrite (body encode)", "gateway/rewrite.py", None),
    ("SSE relay", "gateway/relay.py", None),
    ("SSE relay", "gateway/proxy.py", frozenset({"feed", "_event", "_count", "tail"})),
    ("upstream request", "gateway/proxy.py", None),
    ("upstream request", "gateway/upstream.py", None),
    ("HTTP front", "gateway/http_front.py", None),
    ("metrics", "gateway/telemetry.py", None),
    ("metrics", "prometheus_client/", None),
    ("tracing", "gateway/tracing.py", None),
    ("logging", "logging/", None),
    ("learn", "gateway/learn.py", None),
    ("flow control", "gateway/flow.py", None),
    ("flow control", "gateway/fairness.py", None),
    ("flow control", "gateway/admission.py", None),
    ("pipeline glue", "gateway/pipeline.py", None),
    ("pipeline glue", "gateway/dispatch.py", None),
    ("pipeline glue", "gateway/context.py", None),
    ("admin port", "gateway/admin.py", None),
]


# The gateway under cProfile (`--cprofile`): the profiler measures the event-loop thread's CPU time
# (time.thread_time) between SIGUSR1 (start) and SIGUSR2 (stop and write the stats file); run with
# `python -c` so that it does not depend on the variant's tree having this module.
CPROFILE_CHILD = """
import cProfile, signal, sys, time
out, argv = sys.argv[1], sys.argv[2:]
prof = cProfile.Profile(time.thread_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
def _stop(*_):
    prof.disable()
    prof.dump_stats(out)
signal.signal(signal.SIGUSR2, _stop)
from gateway.cli import main
sys.exit(main(argv))
"""

# functions whose inclusive CPU the cProfile table shows, by (file fragment, function name)
CPROFILE_ROWS: list[tuple[str, str, str]] = [
    ("request: whole pipeline (HTTP handler)", "gateway/pipeline.py", "handle"),
    ("  admit + plan + rewrite", "gateway/pipeline.py", "prepare"),
    ("    JSON decode of the body", "gateway/parse.py", "parse_body"),
    ("    tokenize (render + encode)", "gateway/encode.py", "tokenize"),
    ("      chat template render", "gateway/tokenization.py", "_render"),
    ("      encode text (segment cache)", "gateway/tokenization.py", "_encode_text"),
    ("    block keys", "hashing/keys.py", "request_keys"),
    ("    decide (views + policy)", "gateway/routing.py", "decide"),
    ("      index match", "gateway/index.py", "match"),
    ("      policy rank", "policies/cache_aware.py", "rank"),
    ("    rewrite (body encode)", "gateway/rewrite.py", "upstream_body"),
    ("  dispatch: upstream attempt", "gateway/proxy.py", "attempt"),
    ("  dispatch: speculative insert", "gateway/index.py", "insert_speculative"),
    ("  relay (SSE stream)", "gateway/relay.py", "relay"),
    ("  relay callbacks (per chunk)", "gateway/relay.py", "on_data"),
    ("  learn", "gateway/pipeline.py", "learn"),
    ("  finish (metrics, span, log)", "gateway/pipeline.py", "finish"),
    ("HTTP front: bytes in (parser callbacks)", "gateway/http_front.py", "data_received"),
    ("HTTP front: connection made/lost", "gateway/http_front.py", "connection_made"),
    ("upstream: bytes in", "gateway/upstream.py", "data_received"),
    ("feed: sync step (XREAD + apply)", "gateway/index_sync.py", "step"),
    ("  feed: XREAD (redis client + decode)", "replica_agent/feed/redis_feed.py", "read"),
    ("    feed: record decode", "replica_agent/feed/records.py", "decode_event"),
    ("  feed: handle records", "gateway/index_sync.py", "_handle"),
    ("    feed: index apply", "gateway/index.py", "apply"),
    ("inflight exchange", "gateway/background.py", "run_inflight_exchange"),
    ("health probes", "gateway/membership.py", "probe_all"),
    ("flow control: admission (hold)", "gateway/flow.py", "hold"),
    ("flow control: releases", "gateway/flow.py", "_release"),
    ("  flow control: pool room check", "gateway/flow.py", "_pool_has_room"),
    ("flow control: timer (sweep)", "gateway/flow.py", "sweep"),
]


def categorize(stack: list[str]) -> str:
    """The category of one sampled stack (root first, as py-spy prints it): see CATEGORIES."""
    for frame in reversed(stack):
        func, _, where = frame.partition(" (")
        func = func.rsplit(".", 1)[-1]  # py-spy prints qualified names (KVIndex.apply)
        for cat, frag, funcs in CATEGORIES:
            if frag in where and (funcs is None or func in funcs):
                if cat:
                    return cat
                break  # a transparent frame: the category is its caller's
    return "event loop / other"


def attribute(raw: str) -> Counter:
    """Samples per category from py-spy's raw (collapsed) output: `frame;frame;... count` lines."""
    out: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        out[categorize(stack.split(";"))] += int(n)
    return out


def hot_frames(raw: str, top: int) -> list[tuple[str, int]]:
    """The leaf frames with the most samples (what the categories hide)."""
    out: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[stack.split(";")[-1]] += int(n)
    return out.most_common(top)


# ------------------------------------------------------------------------------ processes


def _start_pool(args, procs: Procs, tmp: Path, wr_bin: str) -> tuple[dict, dict]:
    """redis + sims + agents (as compare_peers); (sims rid -> url, router ctx)."""
    redis_port = free_port()
    procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(tmp)])
    feed_url = f"redis://127.0.0.1:{redis_port}/0"
    salt_file = tmp / "salt-secret"
    salt_file.write_text(os.urandom(24).hex())
    sims = {}
    for i in range(args.replicas):
        rid, port = f"r{i}", free_port()
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        procs.start(f"agent-{rid}", [wr_bin, "agent", "--replica-id", rid, "--engine-url", f"http://127.0.0.1:{port}",
                                     "--kv-events-endpoint", ev, "--replay-endpoint", rp, "--bind", "--feed", feed_url,
                                     "--model", MODEL, "--block-size", "16", "--load-interval", str(args.agent_load_interval)])
        procs.start(f"sim-{rid}", [wr_bin, "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                                   "--block-size", "16", "--num-blocks", str(args.num_blocks),
                                   "--max-model-len", str(args.num_blocks * 16), "--max-num-seqs", str(args.max_num_seqs),
                                   *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []),
                                   "--time-profile", "wallclock", "--kv-events-endpoint", ev, "--replay-endpoint", rp])
        sims[rid] = f"http://127.0.0.1:{port}"
    return sims, {"warmroute_bin": wr_bin, "feed_url": feed_url, "salt_file": str(salt_file), "max_num_seqs": args.max_num_seqs}


def cprofile_table(stats_path: Path, n_requests: int, top: int) -> tuple[list[tuple[str, float, int]], list[tuple[str, float]]]:
    """(rows of CPROFILE_ROWS: label, CPU-ms/request inclusive, calls; top functions by own CPU-ms/request)."""
    st = pstats.Stats(str(stats_path)).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
    rows = []
    for label, frag, func in CPROFILE_ROWS:
        ct = nc = 0
        for (f, _, fn), (_, calls, _, cum, _) in st.items():
            if fn == func and frag in f:
                ct, nc = ct + cum, nc + calls
        rows.append((label, 1000 * ct / n_requests, nc))
    own = sorted(((f"{fn} ({f.rsplit('/site-packages/', 1)[-1]}:{ln})", tt) for (f, ln, fn), (_, _, tt, _, _) in st.items()),
                 key=lambda x: -x[1])[:top]
    total = sum(v[2] for v in st.values())
    rows.insert(0, ("everything profiled (event-loop thread)", 1000 * total / n_requests, 0))
    return rows, [(name, 1000 * tt / n_requests) for name, tt in own]


def _cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, its threads included."""
    with open(f"/proc/{pid}/stat") as f:
        st = f.read()
    fields = st[st.rfind(")") + 2:].split()
    return int(fields[11]) / _CLK, int(fields[12]) / _CLK


def prewarm_requests(workload, reqs: list[BenchRequest]) -> list[BenchRequest]:
    """One request per document (its first in the workload), all due at once: the regime's pre-warm."""
    seen, out = set(), []
    for w, r in zip(workload.requests, reqs):
        doc = next((s.seg_id for s in w.segments if s.seg_id.startswith("doc/")), None)
        if doc is not None and doc not in seen:
            seen.add(doc)
            out.append(BenchRequest(0.0, r.route, r.body, api_key=r.api_key, tag="prewarm-" + doc))
    return out


async def _wait_idle(session, sims: dict, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await sim_counters(session, sims)
        if not any(s["stats"]["num_running"] or s["stats"]["num_waiting"] for s in stats.values()):
            return
        await asyncio.sleep(0.3)


def _py_spy(pid: int, out: Path, rate: int, native: bool = False) -> subprocess.Popen:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise SystemExit("--py-spy needs py-spy (pip install py-spy)")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate), "--nonblocking",
                             "--output", str(out), "--gil", *(["--native"] if native else [])], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _stop_py_spy(p: subprocess.Popen) -> None:
    p.send_signal(2)  # SIGINT: py-spy writes its output and exits
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


async def _one_run(session, args, procs: Procs, variant: tuple[str, str], load: tuple[list, list],
                   pool: tuple[dict, dict]) -> dict:
    """One gateway (one variant) under the load: its CPU seconds, per request, idle; py-spy samples."""
    (vname, vdir), (reqs, warm), (sims, ctx) = variant, load, pool
    await drain_and_reset(session, sims, 120)
    port = free_port()
    peer = vdir.startswith(PEER_PREFIX)  # a peer router (e.g. @sglang): its own venv, no profilers
    kind = vdir[len(PEER_PREFIX):] if peer else "warmroute"
    argv, env, ready, _ = _router_argv(kind, args.policy if not peer else "cache_aware", port, list(sims.values()),
                                       Path(args.peers_venv), ctx)
    name = f"gw-{vname}"
    prof_path = procs.logdir / f"{name}-{time.monotonic_ns()}.pstats"
    if args.cprofile and not peer:
        argv = [sys.executable, "-c", CPROFILE_CHILD, str(prof_path), *argv[1:]]
    if not peer:
        env = {**env, **dict(kv.split("=", 1) for kv in args.env), "PYTHONPATH": vdir}
    p = procs.start(name, argv, env)
    url = f"http://127.0.0.1:{port}"
    await wait_ready(session, ready, procs, name, 90)
    await _warmup(session, url)
    await drain_and_reset(session, sims, 120)
    if warm:
        await run_load(url, warm, concurrency=2 * len(sims), fresh_connections=True, timeout_s=120)
        await _wait_idle(session, sims)
    raw_path = procs.logdir / f"{name}.raw"
    spy = _py_spy(p.pid, raw_path, args.py_spy_rate, args.native) if args.py_spy and not peer else None
    profiled = args.cprofile and not peer
    if profiled:
        os.kill(p.pid, signal.SIGUSR1)
    (u0, s0), g0, t0 = _cpu(p.pid), procs.cpu_s(name), time.monotonic()
    samples, wall = await run_load(url, reqs, fresh_connections=True, timeout_s=args.request_timeout)
    (u1, s1), g1, t1 = _cpu(p.pid), procs.cpu_s(name), time.monotonic()
    if profiled:
        os.kill(p.pid, signal.SIGUSR2)
    if spy is not None:
        _stop_py_spy(spy)
    t2 = time.monotonic()
    await asyncio.sleep(args.idle_s)
    g2 = procs.cpu_s(name)
    idle_s = time.monotonic() - t2
    procs.stop(name)
    n, cpu = max(1, len(samples)), g1 - g0  # the router's whole process group (a peer may fork)
    ttfts = sorted(s.ttft_s for s in samples if s.ok and s.ttft_s is not None)
    out = {"variant": vname, "requests": len(samples), "ok": sum(1 for s in samples if s.ok), "wall_s": round(t1 - t0, 2),
           "cpu_s": round(cpu, 3), "user_s": round(u1 - u0, 3), "sys_s": round(s1 - s0, 3),
           "cpu_ms_per_request": round(1000 * cpu / n, 3),
           "idle_cpu_ms_per_s": round(1000 * (g2 - g1) / idle_s, 2) if args.idle_s else None,
           "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
           "hit_ratio": round(sum(s.cached_tokens for s in samples) / max(1, sum(s.prompt_tokens for s in samples)), 3)}
    if spy is not None:
        raw = raw_path.read_text() if raw_path.exists() else ""
        if not raw:
            out["py_spy_error"] = (spy.stderr.read() or b"").decode(errors="replace")[-500:]
        out["samples"] = dict(attribute(raw))
        out["hot_frames"] = hot_frames(raw, args.top)
    if profiled:
        for _ in range(50):
            if prof_path.exists():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        rows, own = cprofile_table(prof_path, n, args.top)
        out["cprofile_rows"], out["cprofile_own"] = rows, own
    return out


async def _run(args, procs: Procs, tmp: Path, variants: list[tuple[str, str]]) -> list[dict]:
    from loadtests.workloads import build_workload

    if args.regime:  # compare_peers' own workload of the case (regime applied in main)
        workload, reqs, warm = _regime_workload(args)
        load = (reqs, [] if args.no_prewarm else warm)
    else:
        params = dict(REGIME) if args.workload == "shared_docs" else {}  # the regime's shape is a shared_docs one
        params.update(_parse_params(args.param))
        params.update(rate_rps=args.rate, concurrency=None)
        workload = build_workload(args.workload, args.requests, seed=args.seed, **params)
        reqs = bench_requests(workload, MODEL, None)
        load = (reqs, prewarm_requests(workload, reqs) if not args.no_prewarm else [])
    wr_bin = str(Path(sys.executable).with_name("warmroute"))
    pool = _start_pool(args, procs, tmp, wr_bin)
    runs = []
    async with aiohttp.ClientSession() as session:
        for rid, url in pool[0].items():
            await wait_ready(session, url + "/health", procs, f"sim-{rid}", 60)
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for v in order:
                r = await _one_run(session, args, procs, v, load, pool)
                r["round"] = rnd
                runs.append(r)
                print(f"  round {rnd} {v[0]}: {r['cpu_ms_per_request']} CPU-ms/request, {r['ok']}/{r['requests']} ok, "
                      f"(user {r['user_s']} s, sys {r['sys_s']} s in {r['wall_s']} s), idle {r['idle_cpu_ms_per_s']} CPU-ms/s, TTFT p50 {r['ttft_p50_ms']} ms", file=sys.stderr)
    return runs


# ------------------------------------------------------------------------------ report


def report(runs: list[dict], variants: list[tuple[str, str]]) -> str:
    lines = []
    failed = [r for r in runs if r["ok"] < r["requests"]]
    if failed:  # a collapsed run's CPU is not the workload's: say so first
        lines += [f"WARNING: {len(failed)} of {len(runs)} runs had failed requests ("
                  + ", ".join(f"{r['variant']} {r['requests'] - r['ok']}/{r['requests']}" for r in failed)
                  + "): their CPU per request is an overloaded gateway's", ""]
    lines += ["| variant | runs | CPU-ms / request (each run) | mean | ratio to first | idle CPU-ms/s | ok |", "|---|---|---|---|---|---|---|"]
    means = {}
    for vname, _ in variants:
        rs = [r for r in runs if r["variant"] == vname]
        means[vname] = sum(r["cpu_ms_per_request"] for r in rs) / len(rs)
        base = means[variants[0][0]]
        lines.append(f"| {vname} | {len(rs)} | {' '.join(str(r['cpu_ms_per_request']) for r in rs)} | {means[vname]:.3f} | "
                     f"{means[vname] / base:.2f} | {' '.join(str(r['idle_cpu_ms_per_s']) for r in rs)} | "
                     f"{' '.join(str(r['ok']) + '/' + str(r['requests']) for r in rs)} |")
    for vname, _ in variants:
        tot: Counter = Counter()
        nreq = 0
        for r in runs:
            if r["variant"] == vname and "samples" in r:
                tot.update(r["samples"])
                nreq += r["requests"]
        if not tot:
            continue
        all_n = sum(tot.values())
        cpu_ms = sum(r["cpu_ms_per_request"] * r["requests"] for r in runs if r["variant"] == vname and "samples" in r) / nreq
        lines += ["", f"**{vname}**: py-spy samples by category ({all_n} samples; CPU-ms/request scaled from the measured {cpu_ms:.3f})",
                  "", "| category | share | CPU-ms / request |", "|---|---|---|"]
        for cat, n in tot.most_common():
            lines.append(f"| {cat} | {n / all_n:.1%} | {cpu_ms * n / all_n:.3f} |")
    for vname, _ in variants:
        rs = [r for r in runs if r["variant"] == vname and "cprofile_rows" in r]
        if not rs:
            continue
        lines += ["", f"**{vname}**: cProfile, event-loop thread CPU (inflated by the profiler's own cost per call), "
                  f"CPU-ms per request, mean of {len(rs)} run(s)", "", "| stage (inclusive) | CPU-ms / request | calls / request |", "|---|---|---|"]
        for i, (label, _, _) in enumerate(rs[0]["cprofile_rows"]):
            ms = sum(r["cprofile_rows"][i][1] for r in rs) / len(rs)
            calls = sum(r["cprofile_rows"][i][2] / r["requests"] for r in rs) / len(rs)
            lines.append(f"| {label} | {ms:.3f} | {calls:.1f} |")
        lines += ["", "| function (own time) | CPU-ms / request |", "|---|---|"]
        lines += [f"| {fn} | {ms:.3f} |" for fn, ms in rs[0]["cprofile_own"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.profile_gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=24.0, help="Poisson arrivals per second")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--workload", default="shared_docs")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a workload parameter (shared_docs defaults: {REGIME}; other workloads: their own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=1616, help="KV capacity per sim, in blocks of 16 tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                   help="a code tree to run the gateway from (PYTHONPATH, so DIR may list several; repeatable; "
                        "default: this tree as 'this')")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the gateway (e.g. WARMROUTE_FEED__INFLIGHT_POLL_S=1; repeatable)")
    p.add_argument("--peers-venv", default=str(DEFAULT_PEERS_VENV), help="venv of the peer routers (loadtests/setup_peers.sh)")
    p.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating the order")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle seconds measured after each load")
    p.add_argument("--py-spy", action="store_true", help="sample the gateway with py-spy and attribute its CPU")
    p.add_argument("--cprofile", action="store_true",
                   help="run the gateway under cProfile (thread CPU time; adds overhead) and tabulate its stages")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too; slower sampling)")
    p.add_argument("--no-prewarm", action="store_true", help="skip the pre-warm (one request per document, not measured)")
    p.add_argument("--py-spy-rate", type=int, default=400, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25, help="hottest leaf frames kept per run in --json")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--policy", default="cache_aware", help="the gateway's policy (a peer router runs its cache_aware)")
    p.add_argument("--regime", choices=sorted(REGIMES), default=None,
                   help="run a virtual-time regime's case as compare_peers --regime does (replicas, KV, step budget, rate, "
                        "pre-warm, request count, text rendered to the nominal token counts); overrides the shape flags")
    p.add_argument("--case", default="shared_docs", help="with --regime: the case (e.g. shared_docs, shared_docs_zipf, multi_turn)")
    p.add_argument("--regime-requests", type=int, default=None, help="with --regime: this many requests instead of the case's")
    # what --regime sets (compare_peers._apply_regime); without it: the sims' step budget, 120 s, 0.25 s
    p.set_defaults(max_num_batched_tokens=None, request_timeout=120.0, agent_load_interval=0.25)
    args = p.parse_args(argv)
    if args.regime:
        _apply_regime(args)
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [("this", str(REPO))]
    variants = [(n, d if d.startswith(PEER_PREFIX) else os.pathsep.join(str(Path(x).resolve()) for x in d.split(os.pathsep)))
                for n, d in variants]
    tmp = Path(tempfile.mkdtemp(prefix="warmroute-profile-"))
    procs = Procs(tmp)
    try:
        runs = asyncio.run(_run(args, procs, tmp, variants))
    except (KeyboardInterrupt, Unavailable) as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(runs, variants))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"),
                                               "variants": variants, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
