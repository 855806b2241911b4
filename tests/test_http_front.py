"""The API port's HTTP/1.1 server (gateway.http_front) over real sockets: framing, keep-alive and
pipelining, limits (413 readable by the client, 414, 431, 408), malformed requests, HEAD,
HTTP/1.0, 100-continue, client disconnect cancelling the handler, write backpressure, handler
bugs costing one response only, idle keep-alive expiry, and graceful drain."""
from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
import uvloop

from gateway.errors import ApiError
from gateway.http_front import FrontRequest, FrontResponse, send_error, start_front

pytestmark = pytest.mark.timeout(30)


class App:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, req: FrontRequest, resp: FrontResponse) -> None:
        self.seen.append(req.path)
        if req.path == "/echo":
            await resp.send(200, {"Content-Type": "application/json"}, json.dumps({
                "method": req.method, "path": req.path, "query": req.query_string, "body": req.body.decode(),
                "x": req.headers.get("x-test"), "version": req.http_version}).encode())
        elif req.path == "/stream":
            await resp.start(200, {"Content-Type": "text/event-stream"}, b"data: 1\n\n")
            for i in range(2, 5):
                await asyncio.sleep(0.01)
                await resp.write(b"data: %d\n\n" % i)
            await resp.end(b"data: [DONE]\n\n")
        elif req.path == "/hold":
            await resp.start(200, {"Content-Type": "text/event-stream"}, b"data: held\n\n")
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            await resp.end(b"data: [DONE]\n\n")
        elif req.path == "/big":
            n = int(req.query_string or "64")
            await resp.start(200, {"Content-Type": "application/octet-stream"})
            for _ in range(n):
                await resp.write(b"x" * 65536)
            await resp.end()
        elif req.path == "/push":  # a callback-driven producer, as the gateway's relay is
            paused = asyncio.Event()
            resumed = asyncio.Event()
            self.pauses = 0

            def pause():
                self.pauses += 1
                paused.set()
                resumed.clear()

            def resume():
                paused.clear()
                resumed.set()

            await resp.start(200, {"Content-Type": "application/octet-stream"})
            resp.on_flow(pause, resume)
            for _ in range(256):
                if paused.is_set():
                    await resumed.wait()
                resp.write_nowait(b"y" * 65536)
                await asyncio.sleep(0)
            resp.end_nowait(b"end")
        elif req.path == "/bug":
            raise RuntimeError("handler bug")
        else:
            await send_error(resp, ApiError(404, f"unknown route {req.path}", code="unknown_route"))


async def _front(app, **kw):
    kw.setdefault("max_body_bytes", 1024)
    srv, port = await start_front(app, "127.0.0.1", 0, **kw)
    return srv, port


async def _raw(port: int, data: bytes, *, read_until_close: bool = True, timeout: float = 5.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = b""
    try:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await r.read(65536)
                if not chunk:
                    break
                out += chunk
                if not read_until_close:
                    break
    finally:
        w.close()
    return out


def _split(resp: bytes) -> tuple[int, dict, bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, hdrs, body


async def test_keep_alive_pipelining_in_order_and_query():
    app = App()
    srv, port = await _front(app)
    try:
        reqs = b"".join(
            b"POST /echo?n=%d HTTP/1.1\r\nHost: x\r\nX-Test: v%d\r\nContent-Length: 3\r\n\r\nab%d" % (i, i, i)
            for i in range(3))
        data = await _raw(port, reqs + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        parts = data.split(b"HTTP/1.1 200 OK")[1:]
        assert len(parts) == 4
        bodies = [json.loads(p.partition(b"\r\n\r\n")[2]) for p in parts]
        assert [b["query"] for b in bodies] == ["n=0", "n=1", "n=2", ""]
        assert [b["body"] for b in bodies[:3]] == ["ab0", "ab1", "ab2"]
        assert [b["x"] for b in bodies[:3]] == ["v0", "v1", "v2"]
        assert b"Connection: close" in parts[3] and b"Connection: close" not in parts[0]
    finally:
        await srv.close(1)


async def test_streaming_with_aiohttp_client_and_connection_reuse():
    srv, port = await _front(App())
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(f"http://127.0.0.1:{port}/stream", data=b"{}") as r:
                    assert r.status == 200 and r.headers["Transfer-Encoding"] == "chunked"
                    body = await r.read()
                assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: [DONE]\n\n"
            assert len(srv.conns) == 1  # one keep-alive connection served all three
    finally:
        await srv.close(1)


async def test_413_is_readable_by_the_client_and_connection_closes():
    srv, port = await _front(App(), max_body_bytes=1024)
    try:
        body = b"x" * 200_000  # the whole body is in flight before the client reads our answer
        data = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        status, hdrs, payload = _split(data)
        assert status == 413 and hdrs["connection"] == "close"
        assert json.loads(payload)["error"]["code"] == "body_too_large"
        # Chunked body over the limit: no Content-Length to check up front.
        chunks = b"".join(b"400\r\n" + b"y" * 1024 + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
        data = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        assert _split(data)[0] == 413
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/echo", data=b"z" * 5000) as r:
                assert r.status == 413
                assert (await r.json())["error"]["type"] == "invalid_request_error"
    finally:
        await srv.close(1)


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /echo HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"b" * 70000 + b"\r\n\r\n", 431),
])
async def test_malformed_requests_get_a_json_4xx_and_others_are_unaffected(raw, status):
    srv, port = await _front(App())
    try:
        data = await _raw(port, raw)
        st, hdrs, payload = _split(data)
        assert st == status and hdrs["content-type"] == "application/json"
        assert "message" in json.loads(payload)["error"]
        data = await _raw(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _split(data)[0] == 200
    finally:
        await srv.close(1)


async def test_head_http10_and_expect_continue():
    srv, port = await _front(App())
    try:
        st, hdrs, body = _split(await _raw(port, b"HEAD /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        assert st == 200 and int(hdrs["content-length"]) > 0 and body == b""
        # HTTP/1.0: no chunked framing; the body ends at close.
        st, hdrs, body = _split(await _raw(port, b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n"))
        assert st == 200 and "transfer-encoding" not in hdrs and body.endswith(b"data: [DONE]\n\n")
        assert body.startswith(b"data: 1\n\n")
        # Expect: 100-continue: the interim answer comes before we send the body.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
        await w.drain()
        interim = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert interim.startswith(b"HTTP/1.1 100")
        w.write(b"hi")
        rest = await asyncio.wait_for(r.read(), 5)
        w.close()
        assert json.loads(_split(rest)[2])["body"] == "hi"
    finally:
        await srv.close(1)


async def test_client_disconnect_cancels_the_handler():
    app = App()
    srv, port = await _front(app)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        assert b"data: held" in await asyncio.wait_for(r.readuntil(b"held\n\n\r\n"), 5)
        w.transport.abort()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        await asyncio.sleep(0.05)
        assert srv.active == 0 and not srv.conns
    finally:
        await srv.close(1)


async def test_handler_bug_is_a_500_and_the_server_keeps_serving():
    srv, port = await _front(App())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/bug") as r:
                assert r.status == 500
                assert (await r.json())["error"]["code"] == "internal_error"
            async with s.post(f"http://127.0.0.1:{port}/echo", data=b"ok") as r:
                assert r.status == 200 and (await r.json())["body"] == "ok"
    finally:
        await srv.close(1)


async def test_backpressure_on_a_slow_reader_bounds_our_buffer():
    srv, port = await _front(App())
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(b"GET /big?256 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # 16 MiB
        await asyncio.sleep(0.5)  # we read nothing: the server must be paused, not buffering 16 MiB
        (conn,) = srv.conns
        buffered = conn.transport.get_write_buffer_size()
        assert buffered < 4 * 1024 * 1024, buffered
        assert conn._writable is not None and not conn._writable.done()
        sock.setblocking(False)
        total = 0
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.sock_recv(sock, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
        sock.close()
        assert total > 256 * 65536
    finally:
        await srv.close(1)


async def test_idle_keepalive_and_slow_request_timeouts():
    srv, port = await _front(App(), keepalive_timeout_s=0.3, request_timeout_s=0.3)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        await r.readuntil(b"}")
        assert await asyncio.wait_for(r.read(), 3) == b""  # closed by us once idle
        w.close()
        # A request whose headers never finish: 408, then closed.
        data = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\n", timeout=3)
        assert _split(data)[0] == 408
    finally:
        await srv.close(1)


async def test_graceful_drain_finishes_in_flight_and_stops_accepting():
    app = App()
    srv, port = await _front(app)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await w.drain()
    await r.readuntil(b"held\n\n\r\n")
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(srv.close(5))
    await asyncio.sleep(0.2)
    assert await asyncio.wait_for(idle_r.read(), 2) == b""  # an idle keep-alive connection is closed at once
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer accepting
    assert not closing.done()  # the held stream is still being served
    app.release.set()
    rest = await asyncio.wait_for(r.read(), 5)
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    await asyncio.wait_for(closing, 5)
    assert not app.cancelled.is_set()
    w.close()
    idle_w.close()


async def test_callback_writes_get_flow_control_from_a_slow_reader():
    app = App()
    srv, port = await _front(app)
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(b"GET /push HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # 16 MiB
        await asyncio.sleep(0.5)
        (conn,) = srv.conns
        assert app.pauses >= 1
        assert conn.transport.get_write_buffer_size() < 4 * 1024 * 1024
        sock.setblocking(False)
        data = bytearray()
        loop = asyncio.get_running_loop()
        while chunk := await loop.sock_recv(sock, 1 << 20):
            data += chunk
        sock.close()
        assert data.partition(b"\r\n\r\n")[2].count(b"y") == 256 * 65536 and data.endswith(b"3\r\nend\r\n0\r\n\r\n")
    finally:
        await srv.close(1)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_accepted_connections_have_nodelay(loop_name):
    """Streamed tokens are tiny writes: every accepted socket must have TCP_NODELAY (the loop sets it)."""
    async def main():
        srv, port = await _front(App())
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if srv.conns:
                    break
                await asyncio.sleep(0.01)
            (conn,) = srv.conns
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            w.close()
        finally:
            await srv.close(1)

    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
