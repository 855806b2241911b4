"""Replica faults under load, with real processes where the fault is a process's: a simulated
replica killed with SIGKILL mid-run, a replica that dies while the request body is being sent, one
that accepts connections and never answers, and a stalled one (ejected, traffic moves, back after
recovery). What must hold: a request without a first byte is retried elsewhere and succeeds; a
stream already started on the dead replica ends with an OpenAI-style error event; nothing else is
affected."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

import aiohttp
import pytest

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from tests.fault_harness import MODEL, Procs, metric_sum, metrics_text, stream_chat

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def _cfg(replicas: list[str], **over) -> object:
    d = {"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
         "membership": {"replicas": replicas, "health_interval_s": 0.2, "eject_base_s": 1.0, "eject_max_s": 4.0},
         "auth": {"enabled": False}, "feed": {"load_only": True},
         "model": {"name": MODEL, "max_model_len": 8192}}
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return config_from_dict(d, env={})


async def _run_load(url: str, n_requests: int, concurrency: int, *, max_tokens: int, on_progress=None,
                    timeout_s: float = 60.0) -> list:
    """`n_requests` streamed chats (unique prompts) from `concurrency` workers."""
    results: list = [None] * n_requests
    counter = iter(range(n_requests))
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker():
            for i in counter:
                results[i] = await stream_chat(s, url, f"request {i}: tell me about routing.", max_tokens=max_tokens,
                                               timeout_s=timeout_s)
                if on_progress is not None:
                    on_progress(i)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def test_replica_killed_under_load(tok, tmp_path):
    """3 sim processes, 240 streams from 16 concurrent clients; one sim is SIGKILLed a third of the way,
    while streams are running on it."""
    with Procs(tmp_path) as procs:
        sims = [procs.sim(f"s{i}", "--time-profile", "wallclock") for i in range(3)]
        for s in sims:
            procs.wait(s)
        # probes far apart: the gateway learns of the death from the requests it sends there (the
        # retry path under test), not from a probe that happened to run first
        g = await start_gateway(_cfg([f"s{i}={s.url}" for i, s in enumerate(sims)], policy={"name": "least_loaded"},
                                     membership={"health_interval_s": 30.0}), tokenizer=tok)
        try:
            killed_at = []

            def kill() -> None:
                sims[1].kill9()
                killed_at.append(time.monotonic())

            def progress(i):
                # A quarter second after request 80 ends: the 16 workers tend to run in step, so at
                # the moment one ends the others are often just starting (no first byte yet; once in
                # CI no stream on s1 had started). By then the new ones are mid-stream.
                if i == 80:
                    asyncio.get_running_loop().call_later(0.25, kill)

            seen = await _run_load(g.url, 240, 16, max_tokens=30, on_progress=progress)
            async with aiohttp.ClientSession() as s:
                text = await metrics_text(s, g.admin_url)
        finally:
            await g.close()
    t_kill = killed_at[0]
    assert all(x.status == 200 and not x.exc for x in seen), [(x.status, x.exc) for x in seen if x.status != 200 or x.exc]
    on_dead = [x for x in seen if x.replica == "s1"]
    broken = [x for x in on_dead if not x.whole]
    # Streams that had started on the killed replica end with the error event, and only those.
    assert 1 <= len(broken) <= 16, len(broken)
    for x in broken:
        assert x.error_event["code"] == "upstream_failed" and x.body.endswith(b"data: [DONE]\n\n"), x.body[-300:]
        assert x.t_start < t_kill
    assert all(x.t_start < t_kill for x in on_dead), "nothing reached the dead replica after the kill"
    # Nothing else is affected: every stream served elsewhere is whole.
    others = [x for x in seen if x.replica != "s1"]
    assert others and all(x.whole for x in others)
    # Requests the dead replica had not answered yet were retried on another one.
    failed_before_first_byte = metric_sum(text, "warmroute_gateway_upstream_errors_total", replica="s1", phase="connect") + \
        metric_sum(text, "warmroute_gateway_upstream_errors_total", replica="s1", phase="first_byte")
    assert failed_before_first_byte >= 1 and metric_sum(text, "warmroute_gateway_retries_total") >= failed_before_first_byte
    print(f"\nkilled s1 0.25 s after request 80: {len(broken)} streams ended with an error event, "
          f"{failed_before_first_byte:.0f} tries retried elsewhere, {len(others)} others whole, 0 client errors")


class _Misbehaving:
    """A raw TCP replica: `mode="reset"` reads part of the request then resets the connection (dies
    while the body is being sent); `mode="silent"` reads it all and never answers. GET /health is 200;
    `connections` counts the proxied requests (POST), not the gateway's own GETs of /v1/models."""

    def __init__(self, mode: str, read_bytes: int = 65536) -> None:
        self.mode = mode
        self.read_bytes = read_bytes
        self.connections = 0
        self.server = None
        self.url = ""
        self._writers: list = []

    async def start(self) -> "_Misbehaving":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            if head.startswith(b"POST "):  # a proxied request (not the gateway's own GET /v1/models)
                self.connections += 1
            if self.mode == "reset":
                await reader.read(self.read_bytes)
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                writer.transport.abort()
                return
            while await reader.read(65536):  # silent: swallow everything, answer nothing
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        self.server.close()
        for w in self._writers:
            w.transport.abort()
        await self.server.wait_closed()


@pytest.mark.parametrize("mode", ["reset", "silent"])
async def test_replica_that_dies_mid_body_or_never_answers_is_retried(tok, mode):
    """The bad replica is ranked first (round robin from it); every request still succeeds, on the good one."""
    bad = await _Misbehaving(mode).start()
    good = await start_sim_server(SimConfig(model=MODEL))
    g = await start_gateway(_cfg([f"bad={bad.url}", f"good={good.url}"], policy={"name": "round_robin"},
                                 proxy={"first_byte_timeout_s": 1.0}, membership={"health_interval_s": 30.0}),
                            tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            # A 4 MB body (an unknown field the engine ignores) is still being written when "reset" cuts it.
            big = {"x_padding": "p" * (4 << 20)} if mode == "reset" else {}
            t0 = time.monotonic()
            seen = [await stream_chat(s, g.url, f"body fault {i}", max_tokens=4, extra=big) for i in range(4)]
            elapsed = time.monotonic() - t0
            text = await metrics_text(s, g.admin_url)
        assert [(x.status, x.replica, x.whole) for x in seen] == [(200, "good", True)] * 4, [(x.status, x.exc) for x in seen]
        assert bad.connections >= 1  # it was tried (then ejected, so not on every request)
        reason = "timeout" if mode == "silent" else None
        errs = metric_sum(text, "warmroute_gateway_upstream_errors_total", replica="bad")
        assert errs == bad.connections
        if reason:
            assert metric_sum(text, "warmroute_gateway_upstream_errors_total", replica="bad", reason=reason) == errs
            assert elapsed < 1.0 * bad.connections + 5.0  # one first-byte timeout per try, no more
        assert metric_sum(text, "warmroute_gateway_ejections_total", replica="bad") == bad.connections
    finally:
        await g.close()
        await good.close()
        await bad.close()


async def test_stalled_replica_is_ejected_and_returns_after_recovery(tok):
    """A stalled engine (no scheduler steps): first-byte timeouts fire, it is ejected with backoff,
    traffic moves to the other replica, and once the stall is over it serves again."""
    fast = TimeModel(step_overhead_s=0.002, prefill_s_per_token=1e-5, decode_s_per_seq=1e-5)
    a = await start_sim_server(SimConfig(model=MODEL, time=fast))
    b = await start_sim_server(SimConfig(model=MODEL, time=fast))
    g = await start_gateway(_cfg([f"a={a.url}", f"b={b.url}"], policy={"name": "round_robin"},
                                 proxy={"first_byte_timeout_s": 0.5}, membership={"eject_base_s": 0.5, "eject_max_s": 2.0}),
                            tokenizer=tok)
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(4):  # both serve before the fault
                assert (await stream_chat(s, g.url, f"warm {i}", max_tokens=2)).whole
            stall_s = 3.0
            a.server.apply_fault({"kind": "stall", "duration_s": stall_s})
            t_stall = time.monotonic()
            seen = []
            while time.monotonic() - t_stall < stall_s + 4.0:
                seen.append(await stream_chat(s, g.url, f"during stall {len(seen)}", max_tokens=2))
                await asyncio.sleep(0.05)
            text = await metrics_text(s, g.admin_url)
        assert all(x.status == 200 and x.whole for x in seen)
        # "during": could not have been answered by a (a try there would time out before the stall ends)
        during = [x for x in seen if x.t_start < t_stall + stall_s - 0.5]
        after = [x for x in seen if x.t_start >= t_stall + stall_s]
        assert {x.replica for x in during} == {"b"}, "while stalled, every request is answered by b"
        slow = [x for x in during if x.ttfb_s > 0.4]  # the tries that waited out a first-byte timeout
        assert 1 <= len(slow) <= 4, [round(x.ttfb_s, 2) for x in during]  # ejection spares the others the wait
        assert "a" in {x.replica for x in after}, "a serves again after the stall"
        timeouts = metric_sum(text, "warmroute_gateway_upstream_errors_total", replica="a", reason="timeout")
        assert len(slow) <= timeouts <= len(slow) + 1  # (+1: a try in the last half second of the stall)
        assert metric_sum(text, "warmroute_gateway_ejections_total", replica="a") == timeouts
    finally:
        await g.close()
        await a.close()
        await b.close()
