"""The wall-clock load runner: sends a prepared request stream to an OpenAI-compatible endpoint
and measures what a client sees.

Input: `BenchRequest`s (arrival offset, route, JSON body, API key). Open loop (`arrival_s` from a
Poisson process) or closed loop (`concurrency` clients, arrivals ignored). Every request streams
with `stream_options.include_usage` so the engine's `cached_tokens` comes back. Output: one
`Sample` per request (TTFT, inter-token gaps, end-to-end, tokens, cached tokens, replica if the
gateway names it, error) and `summarize()` turns samples into the report (requests, errors and their
reasons, throughput, TTFT/ITL/e2e percentiles, prompt and cached tokens, hit ratio by tokens,
per-replica requests). CPU is recorded with the result two ways (`CpuMeter`): this process's own
CPU seconds (in the embedded mode the sims, agents, gateway and load generator all run in it) and
the whole machine's busy share (other users' work included): a run taken while the CPU was
saturated measures the CPU, not the router. `run_interruptible` runs a bench's main coroutine so
SIGTERM and SIGINT cancel it (cleanly, at once) in any state.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterable, Sequence

import aiohttp

from loadtests.workloads import last_third_start

__all__ = ["BenchRequest", "Sample", "run_load", "summarize", "percentiles", "CpuMeter", "process_cpu_s", "error_reason",
           "Interrupted", "run_interruptible", "wait_http"]


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until GET `url` answers 200; RuntimeError after `timeout_s`, or at once if `proc` exits
    first (with the tail of its `log`). The soak's and the tests' wait for a started process."""
    import http.client
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered: {_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not listening yet, or answering half-started
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s: {_tail(log)}")


def _tail(log: Path | None, n: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-n:]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    arrival_s: float  # offset from the run's start (open loop)
    route: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict  # OpenAI request body (stream is forced on)
    api_key: str | None = None  # bearer credential (the tenant), None when auth is off
    tag: str = ""  # workload label, e.g. document id
    after: int = -1  # index (in the same list) of a request that must finish first: a chat's previous turn
    request_id: str = ""  # sent as X-Request-Id when set (the gateway passes it on to the engine: timelines)


@dataclass(slots=True)
class Sample:
    tag: str
    ok: bool = False
    status: int = 0
    error: str = ""
    start_s: float = 0.0
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    sent_at: float = 0.0  # time.perf_counter() at send (CLOCK_MONOTONIC on Linux: comparable across processes)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU over an interval: the whole machine's busy share, from /proc/stat (Linux; every process
    of every user), and this process's own CPU seconds (`process_s()`, user + system)."""

    def __init__(self) -> None:
        self._start = self._read()
        self._proc_start = time.process_time()

    def process_s(self) -> float:
        return time.process_time() - self._proc_start

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                parts = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
        return sum(parts), idle

    def share(self) -> float:
        end = self._read()
        if self._start is None or end is None:
            return float("nan")
        total, idle = end[0] - self._start[0], end[1] - self._start[1]
        return 1.0 - idle / total if total > 0 else float("nan")


async def _one(session: aiohttp.ClientSession, base_url: str, req: BenchRequest, t0: float, timeout_s: float) -> Sample:
    body = dict(req.body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    headers = {"Content-Type": "application/json"}
    if req.api_key:
        headers["Authorization"] = f"Bearer {req.api_key}"
    if req.request_id:
        headers["X-Request-Id"] = req.request_id
    s = Sample(tag=req.tag)
    start = time.perf_counter()
    s.start_s, s.sent_at = start - t0, start
    last = None
    try:
        async with session.post(base_url + req.route, data=json.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            s.status = resp.status
            s.replica = resp.headers.get("x-warmroute-replica", "")
            if resp.status != 200:
                s.error = (await resp.text())[:500]
                return s
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        s.error = json.dumps(msg["error"])[:300]
                        return s
                    now = time.perf_counter()
                    if msg.get("choices"):
                        ch = msg["choices"][0]
                        text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                        if text:
                            if last is None:
                                s.ttft_s = now - start
                            else:
                                s.itl_s.append(now - last)
                            last = now
                    usage = msg.get("usage")
                    if usage:
                        s.prompt_tokens = usage.get("prompt_tokens", 0) or 0
                        s.output_tokens = usage.get("completion_tokens", 0) or 0
                        details = usage.get("prompt_tokens_details") or {}
                        s.cached_tokens = details.get("cached_tokens", 0) or 0
            s.e2e_s = time.perf_counter() - start
            s.ok = last is not None
            if not s.ok:
                s.error = "stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        s.error = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
    return s


async def run_load(
    base_url: str | Sequence[str],
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    timeout_s: float = 120.0,
    fresh_connections: bool = False,
    on_done: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], float]:
    """Send `requests`; return (samples in request order, wall seconds). Open loop unless
    `concurrency` is given. Several base URLs (gateway instances): request i goes to the (i mod n)-th, as a
    Service spreads connections over its pods. `on_done(sample)` is called as each request
    finishes (progress). A request with `after` >= 0 is sent no sooner than that request has
    finished (a user reads answer k before sending turn k + 1; vtime's rule too), at its own
    arrival time or then."""
    done = on_done or (lambda _s: None)
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    samples: list[Sample | None] = [None] * len(requests)
    finished = [asyncio.Event() for _ in requests] if any(r.after >= 0 for r in requests) else []

    async def send(i: int, r: BenchRequest) -> None:
        if r.after >= 0:
            await finished[r.after].wait()
        try:
            samples[i] = await _one(session, urls[i % len(urls)], r, t0, timeout_s)
        finally:
            if finished:
                finished[i].set()
        done(samples[i])

    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        if concurrency:
            it = iter(enumerate(requests))

            async def worker() -> None:
                for i, r in it:
                    await send(i, r)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            async def timed(i: int, r: BenchRequest) -> None:
                delay = r.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                await send(i, r)

            await asyncio.gather(*(timed(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - t0
    return [s for s in samples if s is not None], wall


def percentiles(values: Iterable[float], ps: Sequence[float] = (50, 90, 95, 99)) -> dict[str, float]:
    vals = sorted(v for v in values if v == v)
    out: dict[str, float] = {}
    if not vals:
        return {**{f"p{int(p)}": float("nan") for p in ps}, "max": float("nan"), "mean": float("nan")}
    for p in ps:
        k = (len(vals) - 1) * p / 100.0
        lo = int(k)
        hi = min(lo + 1, len(vals) - 1)
        out[f"p{int(p)}"] = vals[lo] + (vals[hi] - vals[lo]) * (k - lo)
    out["max"] = vals[-1]
    out["mean"] = sum(vals) / len(vals)
    return out


def _ms(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1000.0, 2) for k, v in d.items()}


def last_third(samples: Sequence[Sample]) -> list[Sample]:
    """The answered requests sent in the last third of the run (by send time): a run's state once
    its start is behind it (the busy regime's caches and queues take a while to settle, or drift)."""
    ok = sorted((s for s in samples if s.ok), key=lambda s: s.start_s)
    return ok[last_third_start(len(ok)):]


def summarize(samples: Sequence[Sample], wall_s: float, **params) -> dict:
    """The report of one policy/target (the bench JSON contract: README "Results", `warmroute bench`)."""
    ok = [s for s in samples if s.ok]
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    out_tokens = sum(s.output_tokens for s in ok)
    per_replica: dict[str, int] = {}
    for s in ok:
        if s.replica:
            per_replica[s.replica] = per_replica.get(s.replica, 0) + 1
    errors = [s.error for s in samples if not s.ok]
    reasons = Counter(error_reason(s) for s in samples if not s.ok)
    return {
        "requests": len(samples),
        "errors": len(errors),
        "error_reasons": dict(reasons.most_common()),
        "error_examples": errors[:3],
        "duration_s": round(wall_s, 3),
        "throughput_rps": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_ms": _ms(percentiles(s.ttft_s for s in ok)),
        "ttft_ms_last_third": _ms(percentiles(s.ttft_s for s in last_third(samples))),
        "itl_ms": _ms(percentiles(x for s in ok for x in s.itl_s)),
        "e2e_ms": _ms(percentiles(s.e2e_s for s in ok)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out_tokens,
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "per_replica_requests": dict(sorted(per_replica.items())),
        "params": params,
        "cpu_count": os.cpu_count(),
    }


def error_reason(s: Sample) -> str:
    """One short line saying why a request failed, the same for every request that failed the same
    way: `HTTP 401 invalid_api_key: Invalid API key` (from an OpenAI-shaped error body), `HTTP 502:
    <body start>`, or the client-side error (`ClientConnectorError: ...`, `TimeoutError`)."""
    if s.status and s.status != 200:
        try:
            err = json.loads(s.error).get("error")
        except (ValueError, AttributeError):
            err = None
        if isinstance(err, dict):
            code = err.get("code") or err.get("type") or ""
            msg = str(err.get("message", ""))[:160]
            return f"HTTP {s.status}{' ' + str(code) if code else ''}: {msg}".rstrip(": ")
        body = " ".join(s.error.split())[:160]
        return f"HTTP {s.status}: {body}" if body else f"HTTP {s.status}"
    text = s.error or "unknown error"
    if text.startswith("{"):  # an error event inside a 200 stream
        try:
            err = json.loads(text)
            return f"error event in the stream: {str(err.get('message', text))[:160]}"
        except ValueError:
            pass
    return text[:200]


class Interrupted(Exception):
    """The run was stopped by a signal (`signum`); what it had not finished is lost."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_interruptible(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)`, with SIGTERM and SIGINT cancelling `main` (its `finally` and `async with`
    blocks run, so embedded systems close) and raising `Interrupted`; a second signal exits at once."""

    async def wrapper() -> Any:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        got: list[int] = []

        def on_signal(signum: int) -> None:
            if got:  # the user insists: do not wait for the cleanup
                os._exit(128 + signum)
            got.append(signum)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await main
        except asyncio.CancelledError:
            if got:
                raise Interrupted(got[0]) from None
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    return asyncio.run(wrapper())
