"""The load generator keeps a chat's turns in order: turn k + 1 is sent no sooner than turn k has
finished (a user reads an answer before replying), at its own arrival time or then, as the
virtual-time simulator does; requests of other conversations are not held up. Against a real
HTTP server that answers as slowly as the test says."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from loadtests.bench import bench_requests
from loadtests.runner import BenchRequest, run_load
from loadtests.workloads import build_workload
from tests.conftest import serve_app


def test_bench_requests_link_each_turn_to_the_previous_turn_of_its_conversation():
    w = build_workload("multi_turn", 60, seed=1, rate_rps=50.0, sessions=6, turns=4, system_tokens=40,
                       user_tokens=10, answer_tokens=8)
    reqs = bench_requests(w, "m", None)
    prev: dict[str, int] = {}
    linked = 0
    for i, (wr, br) in enumerate(zip(w.requests, reqs)):
        assert br.after == (prev[wr.conversation] if wr.turn > 0 and wr.conversation in prev else -1)
        linked += br.after >= 0
        prev[wr.conversation] = i
    assert linked > 0
    docs = bench_requests(build_workload("shared_docs", 20, seed=1, rate_rps=50.0), "m", None)
    assert all(r.after == -1 for r in docs)


async def test_a_turn_waits_for_the_previous_one_and_nothing_else_waits():
    arrived: dict[str, float] = {}
    ended: dict[str, float] = {}
    delays = {"a0": 0.4, "a1": 0.0, "b0": 0.0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tag = body["messages"][-1]["content"]
        arrived[tag] = time.perf_counter()
        await asyncio.sleep(delays[tag])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        ended[tag] = time.perf_counter()
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, url = await serve_app(app, shutdown_timeout=1.0)
    try:
        def req(tag: str, after: int = -1) -> BenchRequest:
            return BenchRequest(0.0, "/v1/chat/completions", {"messages": [{"role": "user", "content": tag}]},
                                tag=tag, after=after)

        samples, _ = await run_load(url, [req("a0"), req("a1", after=0), req("b0")])
        assert all(s.ok for s in samples), [s.error for s in samples]
        assert arrived["a1"] >= ended["a0"]  # the next turn went after the answer
        assert arrived["b0"] - arrived["a0"] < 0.2  # another conversation did not wait
        # closed loop: the same rule
        arrived.clear(), ended.clear()
        samples, _ = await run_load(url, [req("a0"), req("a1", after=0), req("b0")], concurrency=3)
        assert all(s.ok for s in samples) and arrived["a1"] >= ended["a0"]
    finally:
        await runner.cleanup()


def test_the_report_gives_the_tail_of_the_requests_sent_in_the_last_third():
    """A busy run's start can dominate its tail (the busy regime: loadtests/results/busy_regime_log.md,
    "Past the start"): the report also gives the TTFT of the answered requests sent last, whatever
    order they finished in."""
    from loadtests.runner import Sample, last_third, summarize

    samples = [Sample(f"r{i}", ok=True, start_s=float(i), ttft_s=(2.0 if i < 20 else 0.1)) for i in range(30)][::-1]
    samples.append(Sample("failed", ok=False, start_s=99.0, error="TimeoutError"))  # not answered: not in it
    assert [s.start_s for s in sorted(last_third(samples), key=lambda s: s.start_s)] == [float(i) for i in range(20, 30)]
    report = summarize(samples, 30.0)
    assert report["ttft_ms_last_third"]["p99"] == 100.0  # the slow start is not in it
    assert report["ttft_ms"]["p99"] == 2000.0
    assert last_third(samples[:2]) == []
