"""gateway.upstream against real servers on 127.0.0.1: an aiohttp app for well-behaved upstreams,
raw asyncio servers for the misbehaving ones. Every test runs on the stdlib loop and on uvloop
(the gateway's loop): their transports differ in pause/close details."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import socket
from types import SimpleNamespace

import pytest
import uvloop
from aiohttp import web

from gateway.upstream import UpstreamError, UpstreamPool
from tests.conftest import serve_app

pytestmark = pytest.mark.timeout(20)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_both_loops(fn):
    @pytest.mark.parametrize("loop_name", list(LOOPS))
    def test(loop_name):
        with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
            runner.run(asyncio.wait_for(fn(), 15))

    test.__name__ = fn.__name__
    test.__doc__ = fn.__doc__
    return test


PIECES = [b"data: %d\n\n" % i for i in range(5)]
BIG = bytes(range(256)) * (4 * 4096)  # 4 MiB


@contextlib.asynccontextmanager
async def aio_server():
    st = SimpleNamespace(peers=set(), order=[], disconnected=asyncio.Event())

    def seen(request):
        peer = request.transport.get_extra_info("peername")
        st.peers.add(peer)
        st.order.append(peer)

    async def stream(request):
        seen(request)
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Echo-Len": str(len(body))})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for p in PIECES:
            await resp.write(p)
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp

    async def fixed(request):
        seen(request)
        return web.Response(body=b"hello world", content_type="text/plain")

    async def status(request):
        seen(request)
        return web.Response(status=int(request.match_info["code"]), text="nope")

    async def forever(request):
        seen(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(500):
                await resp.write(b"data: tick\n\n")
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            st.disconnected.set()
            raise
        return resp

    async def big(request):
        seen(request)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(BIG), 65536):
            await resp.write(BIG[i:i + 65536])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_get("/fixed", fixed)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/forever", forever)
    app.router.add_get("/big", big)
    runner, url = await serve_app(app, shutdown_timeout=0.5)
    try:
        yield url, st
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handler):
    """handler(reader, writer, n, st): n is the 1-based accept count; EOF from the client sets st.eof."""
    st = SimpleNamespace(accepts=0, requests=[], eof=asyncio.Event())

    async def on_conn(reader, writer):
        st.accepts += 1
        try:
            await handler(reader, writer, st.accepts, st)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", st
    finally:
        srv.close()


async def read_request(reader, st):
    """One request off the wire (recorded in st.requests), or None at EOF (which sets st.eof)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        st.eof.set()
        return None
    m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    body = await reader.readexactly(int(m.group(1))) if m else b""
    st.requests.append((head, body))
    return head, body


def ok_keepalive(body: bytes = b"ok") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def serve_keepalive(reader, writer, n, st):
    while await read_request(reader, st) is not None:
        writer.write(ok_keepalive())


@on_both_loops
async def test_streamed_chunked_body_arrives_in_pieces():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "POST", "/stream", b'{"x": 1}', {"Content-Type": "application/json"})
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert resp.headers["x-echo-len"] == "8"  # lowercased names; body was sent with its length
        assert resp.headers["transfer-encoding"] == "chunked"
        got = []
        while chunk := await resp.readany():
            got.append(chunk)
        assert b"".join(got) == b"".join(PIECES)
        assert len(got) >= 3  # streamed, not buffered to the end
        assert await resp.readany() == b""
        resp.release()
        assert pool.stats() == {"idle": 1, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_keepalive_reuses_one_connection():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        for path in ("/fixed", "/status/404", "/status/503", "/fixed"):
            resp = await pool.request(url, "GET", path, b"", {})
            assert pool.stats()["in_use"] == 1
            body = await resp.read()
            resp.release()
            assert resp.closed
            assert (resp.status, body) == ((200, b"hello world") if path == "/fixed" else (int(path[-3:]), b"nope"))
        resp = await pool.request(url, "POST", "/stream", b"{}", {})
        assert await resp.read() == b"".join(PIECES)
        resp.release()
        assert len(st.peers) == 1
        assert pool.stats() == {"idle": 1, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_most_recently_released_connection_is_reused_first():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        a = await pool.request(url, "GET", "/fixed", b"", {})
        b = await pool.request(url, "GET", "/fixed", b"", {})
        for r in (a, b):
            await r.read()
        a.release()
        b.release()
        assert pool.stats() == {"idle": 2, "in_use": 0, "opened_total": 2}
        for _ in range(2):
            r = await pool.request(url, "GET", "/fixed", b"", {})
            await r.read()
            r.release()
        assert st.order[2:] == [st.order[1]] * 2  # b's connection, the warm one, both times
        await pool.close()


@on_both_loops
async def test_idle_per_host_is_capped():
    async def handler(reader, writer, n, st):
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool(max_idle_per_host=1)
        a = await pool.request(url, "GET", "/", b"", {})
        b = await pool.request(url, "GET", "/", b"", {})
        for r in (a, b):
            await r.read()
            r.release()
        assert pool.stats() == {"idle": 1, "in_use": 0, "opened_total": 2}
        await asyncio.wait_for(st.eof.wait(), 1.0)  # the surplus one was closed, not leaked
        await pool.close()


@on_both_loops
async def test_release_before_body_end_closes_connection():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "POST", "/stream", b"{}", {})
        assert await resp.readany() == PIECES[0]
        resp.release()
        resp.release()  # idempotent
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        with pytest.raises(UpstreamError):
            await resp.readany()  # a truncated body must not look complete
        resp = await pool.request(url, "GET", "/fixed", b"", {})
        assert await resp.read() == b"hello world"
        resp.release()
        assert len(st.peers) == 2
        assert pool.stats()["opened_total"] == 2
        await pool.close()


@on_both_loops
async def test_close_mid_stream_disconnects_server():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/forever", b"", {})
        assert (await resp.readany()).startswith(b"data: tick")
        resp.close()
        resp.close()  # idempotent
        assert resp.closed
        await asyncio.wait_for(st.disconnected.wait(), 1.0)
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_connect_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        pool = UpstreamPool()
        with pytest.raises(UpstreamError) as ei:
            await pool.request(f"http://127.0.0.1:{port}", "GET", "/", b"", {})
    assert (ei.value.phase, ei.value.reason) == ("connect", "connection refused")
    assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 0}


@on_both_loops
async def test_connect_timeout():
    # Non-routable addresses are not reliable here (a sandbox may answer them), so: a listener with
    # backlog 0 whose accept queue is full; Linux then drops further SYNs and connect() hangs.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        try:
            for f in fillers:
                f.setblocking(False)
                f.connect_ex(("127.0.0.1", port))
            pool = UpstreamPool(connect_timeout_s=0.2)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamError) as ei:
                await pool.request(f"http://127.0.0.1:{port}", "GET", "/", b"", {})
            assert asyncio.get_running_loop().time() - t0 < 1.0
        finally:
            for f in fillers:
                f.close()
    assert (ei.value.phase, ei.value.reason) == ("connect", "connect timeout")


@on_both_loops
async def test_server_closes_mid_body():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        if n == 1:  # chunked, one chunk, then gone
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        else:  # promises 100 bytes, sends 5
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.05)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        for _ in range(2):
            resp = await pool.request(url, "GET", "/", b"", {})
            assert resp.status == 200
            assert await resp.readany() == b"hello"
            with pytest.raises(UpstreamError) as ei:
                await resp.readany()
            assert (ei.value.phase, ei.value.reason) == ("io", "server disconnected")
            resp.release()
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 2}
        await pool.close()


@on_both_loops
async def test_stale_keepalive_race_is_retried_on_fresh_connection():
    # Connection 1 answers once, then closes on reading the next request without answering: the
    # request crossed the server's keep-alive close. The pool must resend it on a new connection.
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(ok_keepalive(b"conn%d" % n))
        if n == 1:
            await read_request(reader, st)
            return
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        for expected in (b"conn1", b"conn2"):
            resp = await pool.request(url, "POST", "/v1/x", b"payload", {"X-Request-Id": "r"})
            assert await resp.read() == expected
            resp.release()
        assert [body for _, body in st.requests] == [b"payload"] * 3  # the retried one arrived twice
        assert st.accepts == 2
        assert pool.stats()["opened_total"] == 2
        await pool.close()


@on_both_loops
async def test_stale_keepalive_closed_while_idle():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(ok_keepalive())
        await writer.drain()
        await asyncio.sleep(0.05)  # then close, like uvicorn's keep-alive timeout

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        for _ in range(2):
            resp = await pool.request(url, "GET", "/", b"", {})
            assert await resp.read() == b"ok"
            resp.release()
            await asyncio.sleep(0.2)
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 2}
        await pool.close()


@on_both_loops
async def test_fresh_connection_is_not_retried():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)  # then close without answering

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        with pytest.raises(UpstreamError) as ei:
            await pool.request(url, "POST", "/", b"x", {})
        assert (ei.value.phase, ei.value.reason) == ("io", "server disconnected")
        assert st.accepts == 1
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_reused_connection_not_retried_after_response_bytes():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(ok_keepalive())
        await read_request(reader, st)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")  # partial response, then gone

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/", b"", {})
        assert await resp.read() == b"ok"
        resp.release()
        with pytest.raises(UpstreamError) as ei:
            await pool.request(url, "GET", "/", b"", {})
        assert ei.value.phase == "io"
        assert st.accepts == 1
        await pool.close()


@on_both_loops
async def test_garbage_response():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(b"NOT HTTP\r\n\r\n")
        await reader.read()

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        with pytest.raises(UpstreamError) as ei:
            await pool.request(url, "GET", "/", b"", {})
        assert (ei.value.phase, ei.value.reason) == ("io", "invalid response")
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_invalid_chunk_mid_body():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nZZ\r\n")
        await reader.read()

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/", b"", {})
        assert await resp.readany() == b"ok"
        with pytest.raises(UpstreamError) as ei:
            await resp.readany()
        assert (ei.value.phase, ei.value.reason) == ("io", "invalid response")
        resp.release()
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_idle_connection_expires():
    async def handler(reader, writer, n, st):
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool(idle_keepalive_s=0.2)
        resp = await pool.request(url, "GET", "/", b"", {})
        assert await resp.read() == b"ok"
        resp.release()
        assert pool.stats()["idle"] == 1
        await asyncio.sleep(0.5)
        assert pool.stats()["idle"] == 0
        await asyncio.wait_for(st.eof.wait(), 1.0)  # closed by us, not left for the server to close
        await pool.close()


@on_both_loops
async def test_expired_idle_connection_not_reused():
    async def handler(reader, writer, n, st):
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool(idle_keepalive_s=0.3)
        resp = await pool.request(url, "GET", "/", b"", {})
        await resp.read()
        resp.release()
        pool._keepalive = 0.01  # expire it without waiting for the sweep timer (still armed at 0.3 s)
        await asyncio.sleep(0.05)
        resp = await pool.request(url, "GET", "/", b"", {})
        await resp.read()
        resp.release()
        assert st.accepts == 2
        await pool.close()


@on_both_loops
async def test_flow_control_bounds_buffer():
    high = 64 * 1024
    async with aio_server() as (url, st):
        pool = UpstreamPool(read_high_water=high)
        resp = await pool.request(url, "GET", "/big", b"", {})
        conn = resp._conn
        got, peak, saw_paused = [], 0, False
        while True:
            await asyncio.sleep(0.003)  # a slow client
            peak = max(peak, conn.buffered)  # buffered only grows between reads
            saw_paused |= conn.paused
            chunk = await resp.readany()
            if not chunk:
                break
            got.append(chunk)
        assert b"".join(got) == BIG
        assert saw_paused
        # Over the mark by at most one socket read (both loops read <= 256 KiB at a time).
        assert peak <= high + 256 * 1024 + 4096
        resp.release()
        assert pool.stats()["idle"] == 1  # paused then resumed, complete: still reusable
        await pool.close()


@on_both_loops
async def test_read_until_close_body():
    variants = [b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"]

    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(variants[n - 1] + b"part1,")
        await writer.drain()
        await asyncio.sleep(0.03)
        writer.write(b"part2")

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        for _ in variants:
            resp = await pool.request(url, "GET", "/", b"", {})
            assert resp.status == 200
            assert await resp.read() == b"part1,part2"
            assert await resp.readany() == b""
            resp.release()
            assert pool.stats()["idle"] == 0
        assert pool.stats()["opened_total"] == 2
        await pool.close()


@on_both_loops
async def test_pool_close():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        busy = await pool.request(url, "GET", "/forever", b"", {})
        idle = await pool.request(url, "GET", "/fixed", b"", {})
        await idle.read()
        idle.release()
        assert pool.stats() == {"idle": 1, "in_use": 1, "opened_total": 2}
        await pool.close()
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 2}
        with pytest.raises(UpstreamError):
            while await busy.readany():
                pass
        await asyncio.wait_for(st.disconnected.wait(), 1.0)
        with pytest.raises(UpstreamError) as ei:
            await pool.request(url, "GET", "/fixed", b"", {})
        assert ei.value.phase == "connect"
        assert pool.stats()["opened_total"] == 2


@on_both_loops
async def test_cancelled_request_closes_connection():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        await read_request(reader, st)  # never answers; returns at EOF

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        task = asyncio.create_task(pool.request(url, "GET", "/", b"", {}))
        while not st.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await asyncio.wait_for(st.eof.wait(), 1.0)
        await pool.close()


@on_both_loops
async def test_cancelled_readany_leaves_connection_out_of_pool():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/forever", b"", {})
        await resp.readany()
        task = asyncio.create_task(resp.readany())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await resp.readany()).startswith(b"data: tick")  # still usable after the cancel
        resp.release()  # mid-body
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await asyncio.wait_for(st.disconnected.wait(), 1.0)
        await pool.close()


@on_both_loops
async def test_dropped_response_closes_connection():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/forever", b"", {})
        await resp.readany()
        del resp
        gc.collect()
        assert pool.stats() == {"idle": 0, "in_use": 0, "opened_total": 1}
        await asyncio.wait_for(st.disconnected.wait(), 1.0)
        await pool.close()


@on_both_loops
async def test_interim_1xx_skipped_and_head_has_no_body():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok_keepalive(b"final"))
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "POST", "/", b"x", {})
        assert (resp.status, await resp.read()) == (200, b"final")
        resp.release()
        resp = await pool.request(url, "GET", "/", b"", {})
        assert await resp.read() == b"ok"
        resp.release()
        assert st.accepts == 1
        await pool.close()

    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "HEAD", "/fixed", b"", {})
        assert resp.headers["content-length"] == "11"
        assert await resp.read() == b""
        resp.release()
        await pool.close()


@on_both_loops
async def test_request_wire_format_and_bad_input():
    async def handler(reader, writer, n, st):
        await serve_keepalive(reader, writer, n, st)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        for method, body in (("GET", b""), ("POST", b"abc"), ("POST", b"")):
            resp = await pool.request(url, method, "/p?q=1", body, {"X-A": "1"})
            await resp.read()
            resp.release()
        port = url.rsplit(":", 1)[1]
        heads = [h.decode() for h, _ in st.requests]
        assert heads[0] == f"GET /p?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-A: 1\r\n\r\n"
        assert heads[1].endswith("X-A: 1\r\nContent-Length: 3\r\n\r\n")
        assert heads[2].endswith("Content-Length: 0\r\n\r\n")
        assert [b for _, b in st.requests] == [b"", b"abc", b""]
        with pytest.raises(ValueError):
            await pool.request(url, "GET", "/", b"", {"X-Request-Id": "a\r\nX-Evil: 1"})
        with pytest.raises(ValueError):
            await pool.request("ftp://127.0.0.1:1", "GET", "/", b"", {})
        assert len(st.requests) == 3
        await pool.close()


@on_both_loops
async def test_pipe_pushes_chunks_then_ends_and_the_connection_is_reused():
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        for _ in range(2):
            resp = await pool.request(url, "POST", "/stream", b"{}", {})
            first = await resp.readany()  # pull mode first (the proxy reads the first event this way)
            got, ended = [first], asyncio.get_running_loop().create_future()
            resp.pipe(got.append, ended.set_result)
            assert await asyncio.wait_for(ended, 5) is None
            assert b"".join(got) == b"".join(PIECES)
            assert len(got) >= 3  # pushed as they came, not at the end
            resp.release()
        assert pool.stats() == {"idle": 1, "in_use": 0, "opened_total": 1}
        await pool.close()


@on_both_loops
async def test_pipe_reports_a_lost_connection_and_buffered_bytes_first():
    async def handler(reader, writer, n, st):
        await read_request(reader, st)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)

    async with raw_server(handler) as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/", b"", {})
        await asyncio.sleep(0.05)  # "hello" is buffered before we pipe
        got, ended = [], asyncio.get_running_loop().create_future()
        resp.pipe(got.append, ended.set_result)
        assert got == [b"hello"]
        err = await asyncio.wait_for(ended, 5)
        assert isinstance(err, UpstreamError) and (err.phase, err.reason) == ("io", "server disconnected")
        resp.release()
        assert pool.stats()["idle"] == 0
        await pool.close()


@on_both_loops
async def test_pipe_pause_reading_holds_the_upstream_back():
    async with aio_server() as (url, st):
        pool = UpstreamPool(read_high_water=64 * 1024)
        resp = await pool.request(url, "GET", "/big", b"", {})
        got, ended = [], asyncio.get_running_loop().create_future()
        resp.pipe(got.append, ended.set_result)
        resp.pause_reading()
        await asyncio.sleep(0.3)
        held = sum(map(len, got))
        assert held < len(BIG) // 2  # paused: the 4 MiB did not all come through
        await asyncio.sleep(0.1)
        assert sum(map(len, got)) - held <= 256 * 1024  # at most what one read had in hand
        resp.resume_reading()
        assert await asyncio.wait_for(ended, 10) is None
        assert b"".join(got) == BIG
        resp.release()
        await pool.close()


def _self_signed(tmp: "os.PathLike") -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def test_https_replica_with_a_base_path_and_an_untrusted_certificate(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)

    async def run():
        seen = []

        async def handler(request):
            seen.append(request.path)
            return web.Response(body=b"over tls")

        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)
        runner, url = await serve_app(app, ssl_context=server_ctx, shutdown_timeout=0.2)
        port = url.rsplit(":", 1)[1]
        try:
            client_ctx = ssl.create_default_context(cafile=cert)
            pool = UpstreamPool(ssl_context=client_ctx)
            for _ in range(2):
                resp = await pool.request(f"https://localhost:{port}/engine/", "GET", "/v1/models", b"", {})
                assert resp.status == 200 and await resp.read() == b"over tls"
                resp.release()
            assert seen == ["/engine/v1/models"] * 2
            assert pool.stats()["opened_total"] == 1  # TLS connections are pooled too
            await pool.close()
            untrusting = UpstreamPool()  # the system store does not know our self-signed cert
            with pytest.raises(UpstreamError) as ei:
                await untrusting.request(f"https://localhost:{port}", "GET", "/", b"", {})
            assert ei.value.phase == "connect" and ei.value.reason.startswith("tls error")
            await untrusting.close()
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        r.run(asyncio.wait_for(run(), 15))


@on_both_loops
async def test_upstream_connections_have_nodelay():
    """Tokens are tiny writes: Nagle must never hold them back (the loop sets TCP_NODELAY on connect)."""
    async with aio_server() as (url, st):
        pool = UpstreamPool()
        resp = await pool.request(url, "GET", "/fixed", b"", {})
        sock = resp._conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        await resp.read()
        resp.release()
        await pool.close()
