"""The API port's HTTP/1.1 server: an asyncio Protocol on httptools (llhttp, the C parser).

Why not aiohttp on this port: the gateway's goal is under 1 ms of added time to first token at
64 concurrent streams, and aiohttp's per-request Python (request and response objects, router,
payload writer) cost more CPU than the whole routing decision; a bare aiohttp proxy alone added
3 ms p50 at 64 streams in loadtests/bench_gateway_overhead.py. This module does only what the
API port needs, in one place:
- parse requests (C parser), bound the request line, headers and body (`413` while the body is
  still arriving, read to its end before closing so the client sees the answer, not a reset);
- keep-alive and pipelining (one request at a time per connection, in order), HTTP/1.0,
  `Expect: 100-continue`, `HEAD` without a body;
- cancel the handler's task when the client disconnects (the handler turns that into upstream
  cancellation), flow control on writes (`pause_writing`), idle keep-alive and slow-request
  timeouts from one periodic sweep (no timer per request);
- graceful drain: stop accepting, close idle connections, let in-flight responses finish (each
  then closes its connection) up to a grace period, then abort the rest.
What to answer is the handler's: `handler(req: FrontRequest, resp: FrontResponse)`; a response
is whole (`send`) or streamed chunked (`start` / `write` / `end`, headers and first bytes in one
send). The admin port (metrics, health, debug) stays on aiohttp: few requests, many routes.
"""
from __future__ import annotations

import asyncio
import collections
import http
import logging
import time
from email.utils import formatdate
from typing import Awaitable, Callable

import httptools
from multidict import CIMultiDict

from gateway.errors import ApiError

__all__ = ["FrontRequest", "FrontResponse", "FrontServer", "send_error", "start_front"]

log = logging.getLogger("warmroute.gateway.http")

MAX_URL = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_PIPELINED = 8  # queued requests per connection before we stop reading from it


class FrontRequest:
    __slots__ = ("method", "path", "query_string", "headers", "body", "http_version", "keep_alive")

    def __init__(self, method: str, path: str, query_string: str, headers: CIMultiDict, body: bytes, *,
                 http_version: str, keep_alive: bool) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.http_version = http_version
        self.keep_alive = keep_alive


class FrontResponse:
    """One response on one connection. Writes raise ConnectionResetError once the client is gone."""

    __slots__ = ("_conn", "_req", "started", "finished", "status", "_chunked", "_close")

    def __init__(self, conn: "_Conn", req: FrontRequest) -> None:
        self._conn = conn
        self._req = req
        self.started = False
        self.finished = False
        self.status = 0
        self._chunked = True
        self._close = not req.keep_alive

    def _head(self, status: int, headers: dict[str, str], framing: bytes) -> bytes:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self._conn.server.draining:
            self._close = True
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _phrase(status)), _date_header()]
        for k, v in headers.items():
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
                raise ValueError(f"invalid character in response header {k!r}")
            parts.append(f"{k}: {v}\r\n".encode("latin-1"))
        parts.append(framing)
        if self._close:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """A whole response (Content-Length)."""
        head = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        self.finished = True
        await self._conn.write(head if self._req.method == "HEAD" else head + body)

    async def start(self, status: int, headers: dict[str, str], first: bytes = b"", *, end: bool = False) -> None:
        """Start a streamed response; `first` goes out with the headers, and with `end` so does
        the end of the body (one send for a whole short stream)."""
        if self._req.http_version == "1.0":  # no chunked encoding: the body ends when we close
            self._chunked = False
            self._close = True
            head = self._head(status, headers, b"")
        else:
            head = self._head(status, headers, b"Transfer-Encoding: chunked\r\n")
        if self._req.method == "HEAD":
            self.finished = True
            await self._conn.write(head)
            return
        data = head + self._frame(first)
        if end:
            self.finished = True
            if self._chunked:
                data += b"0\r\n\r\n"
        await self._conn.write(data)

    def _frame(self, data: bytes) -> bytes:
        if not data or not self._chunked:
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)

    async def write(self, data: bytes) -> None:
        if self.finished:
            return
        if data:
            await self._conn.write(self._frame(data))

    async def end(self, last: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        out = self._frame(last)
        if self._chunked:
            out += b"0\r\n\r\n"
        await self._conn.write(out)

    # Synchronous variants for callback-driven relays (no await per chunk); they drop the data if
    # the client is gone (its handler task is being cancelled then) and leave flow control to
    # `on_flow()`.
    def write_nowait(self, data: bytes) -> None:
        if data and not self.finished and not self._conn.lost:
            self._conn.transport.write(self._frame(data))

    def end_nowait(self, last: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        if not self._conn.lost:
            out = self._frame(last)
            self._conn.transport.write(out + b"0\r\n\r\n" if self._chunked else out)

    def on_flow(self, pause, resume) -> None:
        """Call `pause()` when the client stops keeping up (our send buffer is over its high-water
        mark) and `resume()` when it has drained; None, None to stop."""
        self._conn._flow = (pause, resume) if pause is not None else None
        if pause is not None and self._conn._writable is not None and not self._conn._writable.done():
            pause()

    def client_gone(self) -> bool:
        return self._conn.lost


Handler = Callable[[FrontRequest, FrontResponse], Awaitable[None]]


class _Conn(asyncio.Protocol):
    __slots__ = ("server", "transport", "parser", "lost", "_url", "_headers", "_header_bytes", "_body",
                 "_body_size", "_reject", "_queue", "_task", "_resp", "_writable", "_last_active", "_in_message",
                 "_paused_reading", "_close_after", "_msg_start", "_dropped", "_flow")

    def __init__(self, server: "FrontServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self._queue: collections.deque[FrontRequest] = collections.deque()
        self._task: asyncio.Task | None = None
        self._resp: FrontResponse | None = None  # the response `_task` is writing
        self._writable: asyncio.Future | None = None  # set while the transport is paused
        self._flow = None  # (pause, resume) of a callback-driven relay (FrontResponse.on_flow)
        self._last_active = time.monotonic()
        self._in_message = False
        self._msg_start = 0.0
        self._dropped = 0
        self._paused_reading = False
        self._close_after = False
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._reject: ApiError | None = None

    # --- transport callbacks
    def connection_made(self, transport) -> None:
        # TCP_NODELAY (tokens are tiny writes) is already set on every accepted TCP socket by
        # uvloop and by asyncio; setting it again cost a syscall per connection
        # (tests/test_http_front.py checks it is on).
        self.transport = transport
        self.server.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.server.conns.discard(self)
        if self._task is not None and not self._task.done() and not (self._resp is not None and self._resp.finished):
            # the handler turns this into cancelling the upstream request; one whose answer went out
            # whole (it is draining the upstream, then learns from the answer) is left to finish
            self._task.cancel()
        w = self._writable
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("client disconnected"))
        self._queue.clear()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()
        if self._flow is not None:
            self._flow[0]()

    def resume_writing(self) -> None:
        w = self._writable
        if w is not None and not w.done():
            w.set_result(None)
        if self._flow is not None:
            self._flow[1]()

    def data_received(self, data: bytes) -> None:
        self._last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if self._reject is None:
                self._fail(400, f"malformed HTTP request: {exc}")

    # --- parser callbacks
    def on_message_begin(self) -> None:
        self._in_message = True
        self._msg_start = time.monotonic()
        self._dropped = 0
        self._reset_message()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL:
            self._fail(414, "request URI too long")
            raise httptools.HttpParserError("uri too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._fail(431, "request headers too large")
            raise httptools.HttpParserError("headers too large")
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        limit = self.server.max_body_bytes
        cl = None
        for k, v in self._headers:
            if len(k) == 14 and k.lower() == "content-length":
                cl = v
        if cl is not None and cl.strip().isdigit() and int(cl) > limit:
            if int(cl) > _drop_limit(limit):  # not worth reading to the end: answer and close now
                self._fail(413, f"request body over {limit} bytes")
                raise httptools.HttpParserError("body too large")
            self._reject = ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        elif self.parser.get_http_version() == "1.1":
            for k, v in self._headers:
                if k.lower() == "expect" and v.lower() == "100-continue":
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._reject is not None:
            # Read and dropped: answered once the body ends, so the client reads our 413 instead
            # of a reset (closing with unread bytes makes the kernel send RST).
            self._dropped += len(body)
            if self._dropped > _drop_limit(self.server.max_body_bytes):
                self._fail(413, f"request body over {self.server.max_body_bytes} bytes")
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body_bytes:
            self._reject = ApiError(413, f"request body over {self.server.max_body_bytes} bytes", code="body_too_large")
            self._body.clear()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        p = self.parser
        if self._reject is not None:
            # The connection's request stream is fine, but we answer and close: simplest safe path.
            self._close_after = True
            err = self._reject
            self._reset_message()
            self._queue.append(_Rejected(err))
        else:
            url = self._url
            path, _, query = url.partition(b"?")
            if not path.startswith(b"/"):  # absolute-form (proxy style): keep the path
                try:
                    parsed = httptools.parse_url(url)
                    path, query = parsed.path or b"/", parsed.query or b""
                except httptools.HttpParserInvalidURLError:
                    pass
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            req = FrontRequest(p.get_method().decode("latin-1"), path.decode("latin-1"), query.decode("latin-1"),
                               CIMultiDict(self._headers), body, http_version=p.get_http_version(),
                               keep_alive=p.should_keep_alive())
            self._reset_message()
            self._queue.append(req)
        if len(self._queue) >= MAX_PIPELINED and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        if self._task is None:
            self._next()

    # --- request processing
    def _next(self) -> None:
        if not self._queue or self.lost:
            self._task = None
            return
        if self._paused_reading and len(self._queue) < MAX_PIPELINED:
            self._paused_reading = False
            self.transport.resume_reading()
        req = self._queue.popleft()
        self._task = asyncio.get_running_loop().create_task(self._serve(req))

    async def _serve(self, req) -> None:
        server = self.server
        server.active += 1
        close = True
        try:
            if isinstance(req, _Rejected):
                resp = FrontResponse(self, _REJECT_REQ)
                await send_error(resp, req.error)
            else:
                resp = self._resp = FrontResponse(self, req)
                try:
                    await server.handler(req, resp)
                except (asyncio.CancelledError, ConnectionResetError):
                    if self.lost:
                        return
                    raise
                except Exception:  # noqa: BLE001 - a handler bug costs one response, not the connection's peers
                    log.exception("handler failed", extra={"fields": {"path": req.path}})
                    if not resp.started:
                        resp._close = True  # we close after it: say so, or a client may reuse the connection
                        await send_error(resp, ApiError(500, "internal error", code="internal_error"))
                    return  # close: a half-written response cannot be repaired
                if not resp.started:
                    await send_error(resp, ApiError(500, "handler sent no response", code="internal_error"))
                elif not resp.finished:
                    await resp.end()
                close = resp._close or self._close_after
        except ConnectionResetError:
            return
        finally:
            server.active -= 1
            self._flow = self._resp = None
            self._last_active = time.monotonic()
            if self.lost:
                self._task = None
            elif close or (server.draining and not self._queue):
                self._task = None
                self.transport.close()
            else:
                self._next()  # the next pipelined request, or idle
            server._idle_changed()

    async def write(self, data: bytes) -> None:
        if self.lost:
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)
        w = self._writable
        if w is not None and not w.done():
            await w

    def _fail(self, status: int, message: str) -> None:
        """A request we cannot parse: answer (if nothing is being answered) and close."""
        if self.lost or self.transport.is_closing():
            return
        if self._task is None:
            err = ApiError(status, message, code=_FAIL_CODES.get(status, "invalid_request"))
            body = err.body()
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"Connection: close\r\n\r\n%b" % (status, _phrase(status), len(body), body))
        self.transport.close()

    def idle(self) -> bool:
        return self._task is None and not self._queue and not self._in_message


_FAIL_CODES = {413: "body_too_large", 408: "request_timeout", 414: "uri_too_long", 431: "headers_too_large"}


def _drop_limit(limit: int) -> int:
    return 4 * limit + (16 << 20)


class _Rejected:
    __slots__ = ("error",)

    def __init__(self, error: ApiError) -> None:
        self.error = error


_REJECT_REQ = FrontRequest("POST", "", "", CIMultiDict(), b"", http_version="1.1", keep_alive=False)


async def send_error(resp: FrontResponse, e: ApiError, request_id: str | None = None) -> None:
    """`e` as a whole response in OpenAI's error shape."""
    await resp.send(e.status, e.response_headers(request_id), e.body())


class FrontServer:
    """Listening sockets plus every open connection; see the module header."""

    def __init__(self, handler: Handler, *, max_body_bytes: int, keepalive_timeout_s: float = 75.0,
                 request_timeout_s: float = 60.0) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.request_timeout_s = request_timeout_s  # a request's head and body must arrive within this
        self.conns: set[_Conn] = set()
        self.active = 0  # requests being answered
        self.draining = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._idle_event: asyncio.Event | None = None

    async def listen(self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 1024) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), host, port, reuse_port=reuse_port or None,
                                                backlog=backlog)
        self._sweeper = loop.create_task(self._sweep(), name="http-sweep")
        return self._server.sockets[0].getsockname()[1]

    async def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.keepalive_timeout_s / 4, self.request_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for c in list(self.conns):
                if c._task is not None or c._queue:
                    continue
                if c._in_message:
                    if now - c._msg_start > self.request_timeout_s:
                        c._fail(408, f"request not received within {self.request_timeout_s:g}s")
                elif now - c._last_active > self.keepalive_timeout_s:
                    c.transport.close()

    def _idle_changed(self) -> None:
        if self._idle_event is not None and self.active == 0:
            self._idle_event.set()

    async def close(self, grace_s: float) -> None:
        """Stop accepting; let in-flight responses finish within `grace_s`; then close everything."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            if c.idle():
                c.transport.close()
        if self.active:
            self._idle_event = asyncio.Event()
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
                async with asyncio.timeout(grace_s):
                    await self._idle_event.wait()
            except TimeoutError:
                log.warning("drain grace over; closing %d in-flight requests", self.active)
        for c in list(self.conns):
            if c._task is not None and not c._task.done():
                c._task.cancel()
            c.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self._server is not None:
            await self._server.wait_closed()


async def start_front(handler: Handler, host: str, port: int, *, max_body_bytes: int, reuse_port: bool = False,
                      keepalive_timeout_s: float = 75.0, request_timeout_s: float = 60.0) -> tuple[FrontServer, int]:
    srv = FrontServer(handler, max_body_bytes=max_body_bytes, keepalive_timeout_s=keepalive_timeout_s,
                      request_timeout_s=request_timeout_s)
    port = await srv.listen(host, port, reuse_port=reuse_port)
    return srv, port


_PHRASES: dict[int, bytes] = {}


def _phrase(status: int) -> bytes:
    p = _PHRASES.get(status)
    if p is None:
        try:
            p = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            p = b"Unknown"
        _PHRASES[status] = p
    return p


_date = [0, b""]


def _date_header() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0] = now
        _date[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date[1]
