"""Gateway overhead benchmark (not a test): added TTFT and streamed requests/s per worker process.

Side by side in one run, against the same upstream:
  direct   client -> upstream
  gateway  client -> `warmroute gateway` (one worker, uvloop, cache_aware, no auth) -> upstream
at 1, 64 and 256 concurrent streams of short chat prompts (or Responses API requests, side by side with
`--routes chat,responses`), keep-alive connections; each stream
is `--tokens` token events `--interval-ms` apart (a decode step), so concurrency means streams
open at once, as in production, not a closed loop of instant requests. Two arrival patterns
(`--arrivals`): "steady" (streams start at independent times, as users' requests do) and "burst"
(all streams start together and, being of equal length, keep restarting together: c requests
in the same instant, the worst case for a single-threaded proxy). Added TTFT
is the gateway's TTFT percentile minus the direct one at the same concurrency and arrivals. Then a saturation
phase (one-token streams, closed loop) drives the gateway alone to find peak streamed requests/s, and reads the gateway process's
CPU seconds (from /proc) to give CPU-ms per request and requests/s per core.

Processes: the gateway runs in its own process; with `--gateway-cpu N` it is pinned to CPU N and
the upstream and this load generator to the other CPU(s), as the peer routers' published overhead
measurements do (default: no pinning; see the flag's help). The
upstream is by default a minimal fake replica (answers `/v1/chat/completions` with an immediate
first event, then a few events, usage and [DONE]) so the figures measure the gateway and not a
simulated engine; `--upstream sim` uses the replica simulator instead.

Run:  python -m loadtests.bench_gateway_overhead [--levels 1,64,256] [--seconds 6] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time

from loadtests.ports import free_port
from loadtests.processes import stop_processes
from loadtests.runner import process_cpu_s, wait_http

MODEL = "bench-model"


# --------------------------------------------------------------------------- fake upstream
def fake_upstream_main(port: int, interval_ms: float) -> None:
    """A minimal vLLM-shaped streaming replica (runs in its own process): the first event at once,
    then `max_tokens` token events `interval_ms` apart (a decode step), usage if asked, [DONE].
    Served by gateway.http_front, the leanest HTTP server we have, so the replica's own CPU
    disturbs the measurement as little as possible (the same replica serves both sides)."""
    import uvloop

    from gateway.http_front import start_front

    head = b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    # the Responses API's stream (vLLM's event types; the gateway reads the usage of response.completed)
    r_head = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"resp_b",'
              b'"object":"response","status":"in_progress","model":"bench-model","output":[]}}\n\n')
    r_tok = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":1,'
             b'"item_id":"msg_b","output_index":0,"content_index":0,"delta":" tok"}\n\n')
    r_done = (b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,"response":{"id":"resp_b",'
              b'"object":"response","status":"completed","model":"bench-model","output":[],"usage":{"input_tokens":12,'
              b'"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"total_tokens":%d}}}\n\n')
    tok = b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
    done = b"data: [DONE]\n\n"
    sse = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}).encode()

    async def handle(req, resp) -> None:
        if req.path == "/health":
            return await resp.send(200, {}, b"")
        if req.path == "/v1/models":
            return await resp.send(200, {"Content-Type": "application/json"}, models)
        body = json.loads(req.body)
        responses = req.path == "/v1/responses"
        events = int(body.get("max_output_tokens" if responses else "max_tokens") or 8)
        await resp.start(200, sse, r_head if responses else head)
        for _ in range(events):
            if interval_ms > 0:
                await asyncio.sleep(interval_ms / 1000)
            await resp.write(r_tok if responses else tok)
        if responses:
            return await resp.end(r_done % (events, events + 12))
        tail = done
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = (b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":[],"usage":{"prompt_tokens":12,'
                    b'"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":0}}}\n\n' % (events, events + 12)) + done
        await resp.end(tail)

    async def main():
        await start_front(handle, "127.0.0.1", port, max_body_bytes=1 << 20)
        await asyncio.Event().wait()

    uvloop.run(main())


def sim_upstream_main(port: int) -> None:
    import uvloop

    from loadtests.sim.server import SimConfig, start_sim_server

    async def main():
        await start_sim_server(SimConfig(model=MODEL, max_model_len=4096), port=port)
        await asyncio.Event().wait()

    uvloop.run(main())


# --------------------------------------------------------------------------- load generator
def _fail(errors: list[int], kinds: dict, kind: str) -> None:
    errors[0] += 1
    kinds[kind] = kinds.get(kind, 0) + 1


async def _one(session, url: str, body: bytes, ttfts: list[float], errors: list[int], kinds: dict) -> None:
    t0 = time.perf_counter()
    marker = _first_token_marker(url[url.index("/v1/"):])
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                _fail(errors, kinds, f"status {r.status}")
                await r.read()
                return
            while True:
                line = await r.content.readline()
                if not line:
                    _fail(errors, kinds, "empty stream")
                    return
                if marker in line:
                    ttfts.append(time.perf_counter() - t0)
                    break
            rest = await r.read()
            if b'"error"' in rest:
                _fail(errors, kinds, "error event")
    except Exception as exc:  # noqa: BLE001
        _fail(errors, kinds, type(exc).__name__)


def _first_token_marker(path: str) -> bytes:
    """What marks a stream's first token: any event of chat's (vLLM sends its first with the first
    token), a text delta of the Responses API's (vLLM sends `response.created` at once, and the
    gateway holds it until the first token: gateway.proxy)."""
    return b"response.output_text.delta" if path == "/v1/responses" else b"data:"


async def _one_lean(pool, base: str, path: str, body: bytes, ttfts: list[float], errors: list[int], kinds: dict) -> None:
    t0 = time.perf_counter()
    marker = _first_token_marker(path)
    try:
        r = await pool.request(base, "POST", path, body, {"Content-Type": "application/json"})
        try:
            if r.status != 200:
                _fail(errors, kinds, f"status {r.status}")
                await r.read()
                return
            seen = b""
            while True:
                chunk = await r.readany()
                if not chunk:
                    _fail(errors, kinds, "empty stream")
                    return
                seen += chunk
                if marker in seen:
                    ttfts.append(time.perf_counter() - t0)
                    break
            rest = await r.read()
            if b'"error"' in rest:
                _fail(errors, kinds, "error event")
        finally:
            r.release()
    except Exception as exc:  # noqa: BLE001
        _fail(errors, kinds, type(exc).__name__)


async def run_level(base_url: str, concurrency: int, seconds: float, max_tokens: int, warmup_s: float = 1.0,
                    client: str = "lean", stagger_s: float = 0.0, seed: int = 0, route: str = "chat") -> dict:
    """`concurrency` streams back to back for warmup + `seconds`; TTFT of those that start after
    the warmup. `client`: "lean" (gateway.upstream's pool: the load generator's own CPU per event
    is small, so on a 2-core machine it steals less time from what is measured) or "aiohttp".
    `stagger_s`: each stream's first request waits uniform(0, stagger_s) (seeded), so streams
    start and end independently ("steady" arrivals); 0 starts all at once, and streams of equal
    length then keep restarting together ("burst": `concurrency` requests arriving at once).
    `route`: "chat" (/v1/chat/completions) or "responses" (/v1/responses, not stored)."""
    import aiohttp

    from gateway.upstream import UpstreamPool

    path = "/v1/responses" if route == "responses" else "/v1/chat/completions"
    url = base_url + path
    if route == "responses":
        body = json.dumps({"model": MODEL, "input": "Say hello in one word.", "max_output_tokens": max_tokens,
                           "stream": True, "store": False}).encode()
    else:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one word."}],
                           "max_tokens": max_tokens, "stream": True}).encode()
    ttfts: list[float] = []
    errors = [0]
    kinds: dict[str, int] = {}
    done = [0]
    if client == "lean":
        pool = UpstreamPool(connect_timeout_s=5.0, idle_keepalive_s=30.0)
        session = None
        one = functools.partial(_one_lean, pool, base_url, path)
    else:
        pool = None
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=False))
        one = functools.partial(_one, session, url)
    try:
        stop_at = time.perf_counter() + warmup_s + seconds
        measure_from = time.perf_counter() + warmup_s

        rng = random.Random(seed)
        delays = [rng.uniform(0, stagger_s) for _ in range(concurrency)]

        async def worker(delay: float):
            if delay > 0:
                await asyncio.sleep(delay)
            while time.perf_counter() < stop_at:
                sink: list[float] = []
                await one(body, sink, errors, kinds)
                if sink and time.perf_counter() >= measure_from:
                    ttfts.extend(sink)
                    done[0] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(d) for d in delays))
        wall = time.perf_counter() - max(t0, measure_from - warmup_s) - warmup_s
    finally:
        if pool is not None:
            await pool.close()
        if session is not None:
            await session.close()
    ttfts.sort()

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000 if ttfts else float("nan")

    return {"concurrency": concurrency, "requests": len(ttfts), "errors": errors[0], "error_kinds": kinds,
            "rps": done[0] / max(wall, 1e-9), "ttft_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                                                         "mean": statistics.fmean(ttfts) * 1000 if ttfts else float("nan")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,64,256", help="concurrent streams per phase")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per phase and target")
    ap.add_argument("--saturate", type=int, default=128, help="concurrency of the peak-throughput phase (0: skip)")
    ap.add_argument("--upstream", choices=["fake", "sim"], default="fake")
    ap.add_argument("--arrivals", default="steady,burst",
                    help="steady: streams start at independent times (each stream's first request after "
                         "uniform(0, tokens*interval)); burst: all at once, and equal-length streams keep "
                         "restarting together (c requests arriving in the same instant); comma-separated")
    ap.add_argument("--client", choices=["lean", "aiohttp"], default="lean",
                    help="the load generator's HTTP client (see run_level)")
    ap.add_argument("--routes", default="chat",
                    help="the APIs measured, side by side in each phase: chat (/v1/chat/completions) and/or responses "
                         "(/v1/responses, not stored; the fake upstream only), comma-separated (default chat)")
    ap.add_argument("--tokens", type=int, default=32, help="token events per stream in the latency phases")
    ap.add_argument("--interval-ms", type=float, default=15.0, help="fake decode step between token events")
    ap.add_argument("--gateway-cpu", type=int, default=-1,
                    help="pin the gateway to this CPU and everything else to the others (-1: no pinning, the default: "
                         "on a shared machine other pinned work, e.g. vLLM's CPU worker threads, can starve a pinned gateway)")
    ap.add_argument("--workers", type=int, default=1, help="gateway worker processes (CPU figures then count the supervisor only)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--gateway-log", default="/tmp/warmroute-bench-gateway.log", help="the gateway's stderr")
    args = ap.parse_args(argv)
    if "responses" in args.routes.split(",") and args.upstream != "fake":
        ap.error("--routes responses needs the fake upstream (the simulator's Responses are its own workload)")

    ncpu = os.cpu_count() or 1
    pin = args.gateway_cpu >= 0 and ncpu >= 2
    others = {c for c in range(ncpu) if c != args.gateway_cpu} if pin else None
    up_port, gw_port, gw_admin = free_port(), free_port(), free_port()
    ctx = __import__("multiprocessing").get_context("spawn")
    if args.upstream == "fake":
        up = ctx.Process(target=fake_upstream_main, args=(up_port, args.interval_ms), daemon=True)
    else:
        up = ctx.Process(target=sim_upstream_main, args=(up_port,), daemon=True)
    up.start()
    if others:
        os.sched_setaffinity(up.pid, others)
        os.sched_setaffinity(0, others)
    wait_http(f"http://127.0.0.1:{up_port}/health", 120.0)
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "gateway", "--host", "127.0.0.1", "--port", str(gw_port),
         "--admin-port", str(gw_admin), "--replica", f"r0=http://127.0.0.1:{up_port}", "--no-auth",
         "--feed", "memory://", "--model", MODEL, "--max-model-len", "4096", "--workers", str(args.workers)],
        stdout=subprocess.DEVNULL, stderr=open(args.gateway_log, "w"),
        preexec_fn=(lambda: os.sched_setaffinity(0, {args.gateway_cpu})) if pin else None)
    report: dict = {"command": " ".join(sys.argv), "upstream": args.upstream, "client": args.client, "cpus": ncpu, "tokens_per_stream": args.tokens,
                    "interval_ms": args.interval_ms, "loadavg_start": os.getloadavg(), "gateway_pinned_cpu": args.gateway_cpu if pin else None,
                    "seconds_per_phase": args.seconds, "levels": []}
    try:
        wait_http(f"http://127.0.0.1:{gw_admin}/readyz", 300.0)
        direct, via = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
        import uvloop

        stream_s = args.tokens * args.interval_ms / 1000
        for arrivals in [a for a in args.arrivals.split(",") if a]:
            stagger = stream_s if arrivals == "steady" else 0.0
            for c, route in [(int(x), r) for x in args.levels.split(",") if x for r in args.routes.split(",") if r]:
                kw = dict(client=args.client, stagger_s=stagger, route=route)
                d = uvloop.run(run_level(direct, c, args.seconds, args.tokens, **kw))
                cpu0 = process_cpu_s(gw.pid)
                g = uvloop.run(run_level(via, c, args.seconds, args.tokens, **kw))
                cpu1 = process_cpu_s(gw.pid)
                row = {"arrivals": arrivals, "concurrency": c, "route": route, "direct": d, "gateway": g,
                       "added_ttft_ms": {k: g["ttft_ms"][k] - d["ttft_ms"][k] for k in ("p50", "p90", "p99", "mean")},
                       "gateway_cpu_ms_per_request": (cpu1 - cpu0) * 1000 / max(1, g["requests"])}
                report["levels"].append(row)
                print(f"{arrivals:6s} {route:9s} c={c:4d} n={g['requests']:5d}  direct p50 {d['ttft_ms']['p50']:7.2f} p99 "
                      f"{d['ttft_ms']['p99']:7.2f} ms | gateway p50 {g['ttft_ms']['p50']:7.2f} p99 {g['ttft_ms']['p99']:7.2f} ms | "
                      f"added p50 {row['added_ttft_ms']['p50']:6.2f} p99 {row['added_ttft_ms']['p99']:6.2f} ms | "
                      f"gw {g['rps']:7.1f} req/s, {row['gateway_cpu_ms_per_request']:.3f} CPU-ms/req, errors {d['errors']}/{g['errors']}"
                      + (f" {g['error_kinds']}" if g["errors"] else ""),
                      flush=True)
        if args.saturate:
            cpu0, t0 = process_cpu_s(gw.pid), time.perf_counter()
            sat = uvloop.run(run_level(via, args.saturate, args.seconds, 1, client=args.client))
            cpu1, wall = process_cpu_s(gw.pid), time.perf_counter() - t0
            cpu_per_req = (cpu1 - cpu0) / max(1, sat["requests"])
            report["saturation"] = {
                "concurrency": args.saturate, "rps": sat["rps"], "errors": sat["errors"],
                "gateway_cpu_share": (cpu1 - cpu0) / wall, "gateway_cpu_ms_per_request": cpu_per_req * 1000,
                "rps_per_core_projected": 1.0 / cpu_per_req if cpu_per_req > 0 else None}
            s = report["saturation"]
            print(f"peak: {s['rps']:.0f} streamed req/s through one worker (gateway CPU share {s['gateway_cpu_share']:.2f}, "
                  f"{s['gateway_cpu_ms_per_request']:.3f} CPU-ms/req -> {s['rps_per_core_projected']:.0f} req/s per core)", flush=True)
    finally:
        stop_processes([gw], 15)
        up.terminate()
        up.join(5)
    report["loadavg_end"] = os.getloadavg()
    print(f"machine load average: start {report['loadavg_start'][0]:.2f}, end {report['loadavg_end'][0]:.2f} "
          f"(on {ncpu} CPUs; other work running makes every figure worse)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
