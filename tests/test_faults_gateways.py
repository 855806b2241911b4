"""Gateway processes dying: two gateways active-active on one Redis, one SIGKILLed under load (the
other keeps serving; the dead one's in-flight counts stop weighing on the replicas within
`feed.inflight_ttl_s`), and one worker of `--workers 2` SIGKILLed (the other keeps serving; the
supervisor restarts it and the new worker rebuilds its index from the feed)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from tests.fault_harness import MODEL, Procs, stream_chat

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.redis]


def _gw_config(sims, redis_url: str, **over) -> dict:
    cfg = {"membership": {"replicas": [f"s{i}={s.url}" for i, s in enumerate(sims)], "health_interval_s": 0.5},
           "auth": {"enabled": False}, "model": {"name": MODEL, "max_model_len": 8192},
           "feed": {"url": redis_url, "inflight_poll_s": 0.1, "stale_after_s": 3.0},
           "policy": {"name": "least_loaded"}, "telemetry": {"log_level": "WARNING"}}
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


async def _load(url: str, stop: asyncio.Event, clients: int, *, fresh: bool = False, max_tokens: int = 4) -> list:
    """Streams from `clients` loops until `stop`; `fresh`: a new connection per request."""
    out: list = []

    async def loop(c: int):
        conn = aiohttp.TCPConnector(force_close=fresh)
        async with aiohttp.ClientSession(connector=conn) as s:
            n = 0
            while not stop.is_set():
                out.append(await stream_chat(s, url, f"client {c} request {n} about load", max_tokens=max_tokens,
                                             timeout_s=30))
                n += 1
    await asyncio.gather(*(loop(c) for c in range(clients)))
    return out


async def test_active_active_one_gateway_killed(redis_server, tmp_path):
    ttl_s = 3.0
    with Procs(tmp_path) as procs:
        # Slow prefill (30 ms/token): a request stays "in flight" (no first token) for about 2 s.
        sims = [procs.sim(f"s{i}", "--prefill-ms-per-token", "30", "--step-overhead-ms", "5") for i in range(2)]
        for s in sims:
            procs.wait(s)
        ga = procs.gateway("gw-a", _gw_config(sims, redis_server.url, feed={"inflight_ttl_s": ttl_s}))
        gb = procs.gateway("gw-b", _gw_config(sims, redis_server.url, feed={"inflight_ttl_s": ttl_s}))
        for g in (ga, gb):
            procs.wait(g, "/readyz", base=g.admin_url)

        async with aiohttp.ClientSession() as s:
            held = [asyncio.create_task(stream_chat(s, ga.url, f"held {i} " + "word " * 60, max_tokens=2, timeout_s=30))
                    for i in range(6)]

            def others():
                return sum(r["others_inflight_reqs"] for r in _get_json(gb.admin_url + "/debug/index")["replicas"])

            deadline = time.monotonic() + 10
            while others() < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert others() == 6, "gateway b sees a's in-flight requests"
            stop = asyncio.Event()
            load = asyncio.create_task(_load(gb.url, stop, 4))
            await asyncio.sleep(0.5)
            ga.kill9()
            t_kill = time.monotonic()
            while others() > 0 and time.monotonic() - t_kill < ttl_s + 5:
                await asyncio.sleep(0.1)
            cleared_after_s = time.monotonic() - t_kill
            await asyncio.sleep(0.5)
            stop.set()
            seen_b = await load
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    assert cleared_after_s <= ttl_s + 1.5, f"a's in-flight counts still weighed {cleared_after_s:.1f}s after the kill"
    assert seen_b and all(x.status == 200 and x.whole for x in seen_b), [(x.status, x.exc) for x in seen_b if not x.whole]
    print(f"\ngateway a killed with 6 requests in flight: b served {len(seen_b)} streams without error; "
          f"a's counts stopped weighing after {cleared_after_s:.1f}s (ttl {ttl_s:g}s)")


async def test_worker_killed_is_restarted_and_rebuilds(redis_server, tmp_path):
    with Procs(tmp_path) as procs:
        sims = [procs.sim(f"s{i}", events=True) for i in range(2)]
        for s in sims:
            procs.wait(s)
        for i, s in enumerate(sims):
            procs.agent(f"s{i}", s.url, s.ports["pub"], s.ports["replay"], redis_server.url)
        g = procs.gateway("gw", _gw_config(sims, redis_server.url, server={"workers": 2}, policy={"name": "cache_aware"}))
        procs.wait(g, "/readyz", base=g.admin_url)

        def pid_and_entries() -> tuple[int, int]:
            try:
                d = _get_json(g.admin_url + "/debug/index")  # a fresh connection: either worker answers
            except OSError:  # a connection the killed worker had accepted
                return 0, 0
            return d["pid"], sum(r["entries"] for r in d["replicas"])

        async def pids(n: int = 40) -> set:
            out = set()
            for _ in range(n):
                out.add(pid_and_entries()[0])
            return out

        deadline = time.monotonic() + 30
        before = set()
        while len(before) < 2 and time.monotonic() < deadline:  # both workers up
            before = await pids(10) - {0}
        assert len(before) == 2, before
        async with aiohttp.ClientSession() as s:
            for i in range(6):  # some blocks in the feed for a new worker to rebuild from
                x = await stream_chat(s, g.url, f"document {i} " + "text " * 80, max_tokens=2)
                assert x.whole, (x.status, x.exc, x.body[-300:])
        victim = min(before)
        stop = asyncio.Event()
        load = asyncio.create_task(_load(g.url, stop, 4, fresh=True))
        await asyncio.sleep(1.0)
        import os
        import signal

        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        new = set()
        while time.monotonic() - t_kill < 60:
            new = (await pids(10)) - before - {0}
            if new:
                break
            await asyncio.sleep(0.2)
        assert new, "the supervisor restarted the killed worker"
        new_pid = new.pop()
        restarted_after_s = time.monotonic() - t_kill
        rebuilt = False
        while time.monotonic() - t_kill < 60 and not rebuilt:
            pid, entries = pid_and_entries()
            rebuilt = pid == new_pid and entries > 0
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stop.set()
        seen = await load
        assert g.alive(), "the supervisor kept running"
    assert rebuilt, "the new worker rebuilt its index from the feed"
    failed = [x for x in seen if not x.whole]
    late_failed = [x for x in failed if x.t_start > t_kill + 0.5]
    assert len(failed) <= 4 and not late_failed, [(x.status, x.exc, round(x.t_start - t_kill, 2)) for x in failed]
    print(f"\nworker {victim} killed: {len(seen) - len(failed)}/{len(seen)} streams whole ({len(failed)} cut with it), "
          f"new worker {new_pid} serving after {restarted_after_s:.1f}s, index rebuilt")
