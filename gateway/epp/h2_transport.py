"""The Endpoint Picker's gRPC transport on an asyncio protocol over HTTP/2 (the default): Envoy's
connections, gRPC's message framing, the `Process` bidirectional streams and the unary health
`Check`, with nothing of ext_proc itself (that is `EppServer.serve_stream`). The HTTP/2 protocol
state (frames, flow control, HPACK) is `gateway/epp/http2.py`'s.

Why not grpcio: a streamed answer is ~35 message round trips, and grpc.aio spends ~120-150 us of
the picker's CPU on each (its C core hands every message to the event loop through a task
wake-up); at 64 streams that kept the picker's one loop busy and added milliseconds to every
request. Here a connection's frames are handled in one callback, replies are queued and written
once per loop turn, and a message that needs no wait costs no task switch.

gRPC over HTTP/2 as served here: requests are POSTs with `content-type: application/grpc...`;
each message is a 5-byte prefix (compressed flag 0, big-endian length) and the protobuf bytes;
compressed messages are refused (Envoy's gRPC client does not compress); replies go out as
response headers, messages, then trailers with `grpc-status` (and a percent-encoded
`grpc-message`), or trailers alone when nothing was sent. Flow control: received data is
acknowledged at once while the stream holds under one message's limit unread, and as it is read
beyond that, so a peer cannot make us buffer without bound; a stream's replies wait in order in
its queue (`outq`) for the peer's window, its trailers after them.

Inline: while a stream's task waits in `read()`, a message that arrives is offered to
`serve_stream`'s inline handler in this connection's callback (the response phase: response
headers, body chunks, trailers, which need no pick and no wait), its replies queued with no await;
a message the handler declines, or any behind a reply still waiting for window, wakes the task as
before. A streamed answer's ~35 messages then cost no task switch each.

Stop: the listeners close, each connection gets a GOAWAY naming the last stream it will serve
(later streams are refused with REFUSED_STREAM, which a client may retry elsewhere), open
streams get the grace period, then whatever is left is cancelled and the connections close.
"""
from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from functools import partial
from typing import Awaitable, Callable
from urllib.parse import quote

from grpc_health.v1 import health_pb2

from gateway.epp import http2
from gateway.epp.extproc import ProtocolError
from gateway.epp.wire import ext_proc_pb2 as pb

__all__ = ["H2GrpcServer", "StreamGone", "HEALTH_CHECK_METHOD"]

log = logging.getLogger("warmroute.epp")

HEALTH_CHECK_METHOD = b"/grpc.health.v1.Health/Check"
_PREFIX = struct.Struct(">BI")  # compressed flag, message length
_OK, _CANCELLED, _INVALID_ARGUMENT, _NOT_FOUND, _RESOURCE_EXHAUSTED, _UNIMPLEMENTED, _INTERNAL = 0, 1, 3, 5, 8, 12, 13
_WINDOW = 1 << 20  # per-stream receive window we advertise (BUFFERED bodies arrive in one message)
_CONNECTION_WINDOW = 16 << 20
_MAX_STREAMS = 4096
_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))

Handler = Callable[[Callable[[], Awaitable[pb.ProcessingRequest | None]],
                    Callable[[pb.ProcessingResponse], Awaitable[None]]], Awaitable[None]]


class StreamGone(ConnectionError):
    """The peer reset the stream or the connection closed: nothing more can be written."""


class _Stream:
    """One HTTP/2 stream's gRPC state: parsed inbound messages, and our reply's progress."""

    __slots__ = ("conn", "sid", "kind", "buf", "inbox", "waiter", "remote_closed", "gone", "headers_sent",
                 "finished", "unacked", "window", "task", "outq", "trailers", "inline")

    def __init__(self, conn: "_Connection", sid: int, kind: str) -> None:
        self.conn, self.sid, self.kind = conn, sid, kind
        self.buf = bytearray()  # received bytes not yet a whole message
        self.inbox: deque = deque()  # whole messages (bytes), then None at the end
        self.waiter: asyncio.Future | None = None
        self.remote_closed = False
        self.gone = False
        self.headers_sent = False
        self.finished = False
        self.unacked = 0  # received bytes held back from the peer's window until read
        self.window: asyncio.Future | None = None  # a writer waiting for `outq` to drain
        self.task: asyncio.Task | None = None
        self.outq: deque = deque()  # framed messages waiting for the peer's window, in order
        self.trailers: list | None = None  # our trailers, once `outq` has drained
        self.inline = None  # serve_stream's handler for messages that need no wait (module docstring: Inline)

    def buffered(self) -> int:
        return len(self.buf) + sum(len(m) for m in self.inbox if m is not None)

    def wake(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def wake_window(self) -> None:
        w, self.window = self.window, None
        if w is not None and not w.done():
            w.set_result(None)

    # -- what serve_stream sees
    async def read(self) -> pb.ProcessingRequest | None:
        while not self.inbox:
            if self.remote_closed or self.gone:
                return None
            self.waiter = self.conn.loop.create_future()
            await self.waiter
        raw = self.inbox.popleft()
        if raw is None:
            return None
        if self.unacked:
            self.conn.release(self)
        try:
            return pb.ProcessingRequest.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise ProtocolError(f"undecodable ProcessingRequest ({len(raw)} bytes)") from exc

    async def write(self, msg) -> None:
        self.conn.queue(self, msg.SerializeToString())
        while self.outq and not self.gone:
            self.window = self.conn.loop.create_future()
            await self.window
        if self.gone:
            raise StreamGone(f"stream {self.sid} is closed")

    def write_now(self, msg) -> None:
        self.conn.queue(self, msg.SerializeToString())


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection (from one Envoy worker, typically): all its streams. The protocol
    state is `http2.Http2Server`'s; this class is its handler (gRPC on top) and its I/O."""

    def __init__(self, server: "H2GrpcServer") -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.h2 = http2.Http2Server(self, stream_window=_WINDOW, connection_window=_CONNECTION_WINDOW,
                                    max_streams=_MAX_STREAMS, max_header_list=64 * 1024)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.flush_scheduled = False
        self.draining = False
        self.last_stream_id = 0  # after GOAWAY: the last stream we serve
        self.closed = asyncio.Event()

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.h2.initiate()
        self.server.connections.add(self)
        self.flush()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        for st in list(self.streams.values()):
            self._lose(st)
        self.streams.clear()
        self.closed.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.h2.receive(data)
        except http2.ConnectionError_ as exc:
            log.warning("ext_proc HTTP/2 connection closed: %s", exc)
            self.flush()
            self.transport.close()
            return
        self.flush()

    # -- http2.Handler: inbound
    def on_request(self, sid: int, headers: list, end_stream: bool) -> None:
        if self.draining and sid > self.last_stream_id:
            self.h2.reset(sid, http2.REFUSED_STREAM)
            return
        path = ctype = None
        for k, v in headers:
            if k == b":path":
                path = v
            elif k == b"content-type":
                ctype = v
        if ctype is None or not ctype.startswith(b"application/grpc"):
            self.h2.send_headers(sid, ((b":status", b"415"),), end_stream=True)
            return
        if path == self.server.method:
            st = _Stream(self, sid, "process")
            self.streams[sid] = st
            st.task = self.loop.create_task(self.server.run_process(st))
        elif path == HEALTH_CHECK_METHOD:
            st = _Stream(self, sid, "check")
            self.streams[sid] = st
        else:
            self._trailers_only(sid, _UNIMPLEMENTED, f"unknown method {path.decode('latin-1') if path else ''}")
            return
        if end_stream:
            self.on_end(sid)

    def on_data(self, sid: int, data: bytes, n: int, end_stream: bool) -> None:
        st = self.streams.get(sid)
        if st is None or st.finished:  # a stream we are done with: keep the window open, drop the data
            self.h2.ack(sid, n)
        else:
            self._data(st, data, n)
        if end_stream:
            self.on_end(sid)

    def _data(self, st: _Stream, data: bytes, n: int) -> None:
        if st.buf:
            st.buf += data
            buf = st.buf
        else:
            buf = data
        limit = self.server.max_message_bytes
        pos, size_buf = 0, len(buf)
        while size_buf - pos >= 5:
            flag, size = _PREFIX.unpack_from(buf, pos)
            if flag != 0:
                self._fail(st, _UNIMPLEMENTED, "compressed gRPC messages are not supported")
                return
            if size > limit:
                self._fail(st, _RESOURCE_EXHAUSTED, f"message of {size} bytes over the limit of {limit}")
                return
            if size_buf - pos < 5 + size:
                break
            st.inbox.append(bytes(buf[pos + 5:pos + 5 + size]))
            pos += 5 + size
        if buf is st.buf:
            del buf[:pos]
        elif pos < size_buf:
            st.buf += buf[pos:]
        if n:
            if st.buffered() <= limit:
                self.h2.ack(st.sid, n)
            else:
                st.unacked += n  # released as the messages are read
        if st.inbox:
            if st.kind == "check":
                self._answer_check(st)
            elif st.inline is not None and st.waiter is not None and not st.waiter.done():
                self._inline(st)
            else:
                st.wake()

    def _inline(self, st: _Stream) -> None:
        """Messages the stream's task would take with no wait, taken here (module docstring:
        Inline); the rest, from the first it cannot take, wake the task."""
        inbox = st.inbox
        while inbox and inbox[0] is not None and not st.outq and not st.gone and not st.finished:
            try:
                msg = pb.ProcessingRequest.FromString(inbox[0])
            except Exception:  # noqa: BLE001 - the task reports it
                break
            try:
                taken = st.inline(msg, st.write_now)
            except (ProtocolError, StreamGone) as exc:
                inbox.popleft()
                self._fail(st, _INVALID_ARGUMENT, str(exc))
                return
            except Exception:  # noqa: BLE001 - one stream's failure never takes the server down
                inbox.popleft()
                log.exception("ext_proc stream failed")
                self._fail(st, _INTERNAL, "the endpoint picker failed on this stream")
                return
            if not taken:
                break
            inbox.popleft()
        if st.unacked:
            self.release(st)
        if inbox:
            st.wake()

    def on_end(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        st.remote_closed = True
        if st.kind == "check":
            if not st.finished:
                self._answer_check(st)
            if not st.outq and st.trailers is None:  # else _send_trailers drops it once they are out
                self.streams.pop(st.sid, None)
            return
        st.inbox.append(None)
        st.wake()
        if st.finished and not st.outq and st.trailers is None:
            self.streams.pop(st.sid, None)

    def on_reset(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self._lose(st)

    def on_window(self, sid: int) -> None:
        if sid == 0:
            for st in list(self.streams.values()):
                if st.outq or st.trailers is not None:
                    self._pump(st)
        elif (st := self.streams.get(sid)) is not None:
            self._pump(st)

    def on_goaway(self) -> None:
        self.flush()
        self.transport.close()

    def release(self, st: _Stream) -> None:
        """The reader consumed messages: give back the window held for them."""
        if st.buffered() <= self.server.max_message_bytes and st.unacked and not st.gone:
            n, st.unacked = st.unacked, 0
            self.h2.ack(st.sid, n)
            self.flush_soon()

    def _lose(self, st: _Stream) -> None:
        st.gone = True
        st.outq.clear()
        st.trailers = None
        st.wake()
        st.wake_window()

    # -- outbound
    def queue(self, st: _Stream, payload: bytes) -> None:
        """One message on `st`, sent as far as the peer's windows allow; the rest waits in order."""
        if st.gone or st.finished:
            raise StreamGone(f"stream {st.sid} is closed")
        try:
            if not st.headers_sent:
                self.h2.send_headers(st.sid, _RESPONSE_HEADERS)
                st.headers_sent = True
        except KeyError as exc:  # the stream closed under us
            raise StreamGone(f"stream {st.sid} is closed") from exc
        st.outq.append(_PREFIX.pack(0, len(payload)) + payload)
        self._pump(st)
        self.flush_soon()

    def _pump(self, st: _Stream) -> None:
        """Send what `st` has waiting, as the windows allow; its trailers once nothing is."""
        h, q, sid = self.h2, st.outq, st.sid
        while q:
            room = h.room(sid)
            if room <= 0:
                return  # < 0: the stream is gone (on_reset loses it)
            head = q[0]
            if len(head) <= room:
                h.send_data(sid, head)
                q.popleft()
            else:
                h.send_data(sid, head[:room])
                q[0] = head[room:]
        if st.trailers is not None:
            trailers, st.trailers = st.trailers, None
            self._send_trailers(st, trailers)
        st.wake_window()
        self.flush_soon()

    def finish(self, st: _Stream, status: int, message: str | None = None) -> None:
        """End our side: trailers (or trailers alone when nothing was sent), after what waits."""
        if st.finished or st.gone:
            return
        st.finished = True
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", quote(message, safe=" !#$&'()*+,/:;=?@[]~").encode()))
        if st.outq:
            st.trailers = trailers
            return
        self._send_trailers(st, trailers)
        self.flush_soon()

    def _send_trailers(self, st: _Stream, trailers: list) -> None:
        try:
            if st.headers_sent:
                self.h2.send_headers(st.sid, trailers, end_stream=True)
            else:
                self.h2.send_headers(st.sid, list(_RESPONSE_HEADERS) + trailers, end_stream=True)
        except KeyError:  # the peer reset it, or the connection is closing
            pass
        if st.remote_closed:
            self.streams.pop(st.sid, None)

    def _fail(self, st: _Stream, status: int, message: str) -> None:
        self.finish(st, status, message)
        self._lose(st)
        if st.task is not None:
            st.task.cancel()

    def _trailers_only(self, sid: int, status: int, message: str) -> None:
        hdrs = list(_RESPONSE_HEADERS) + [(b"grpc-status", str(status).encode()),
                                          (b"grpc-message", quote(message).encode())]
        try:
            self.h2.send_headers(sid, hdrs, end_stream=True)
        except KeyError:
            pass

    def _answer_check(self, st: _Stream) -> None:
        if not st.inbox or st.inbox[0] is None:
            self.finish(st, _INVALID_ARGUMENT, "a health check needs one HealthCheckRequest")
            return
        try:
            service = health_pb2.HealthCheckRequest.FromString(st.inbox.popleft()).service
        except Exception:  # noqa: BLE001
            self.finish(st, _INVALID_ARGUMENT, "undecodable HealthCheckRequest")
            return
        status = self.server.health_status(service)
        if status is None:
            self.finish(st, _NOT_FOUND, "unknown service")
            return
        self.queue(st, health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.finish(st, _OK)  # its trailers follow the answer, when the peer's window lets it out

    def flush_soon(self) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        data = self.h2.take()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # -- stop
    def goaway(self) -> None:
        """Graceful: no stream after the highest one seen will be served."""
        self.draining = True
        self.last_stream_id = self.h2.highest
        self.h2.goaway(self.last_stream_id)
        self.flush()

    def busy(self) -> bool:
        return any(st.kind == "process" and st.task is not None and not st.task.done() for st in self.streams.values())

    def close(self) -> None:
        for st in list(self.streams.values()):
            if st.task is not None and not st.task.done():
                st.task.cancel()
        if self.transport is not None and not self.transport.is_closing():
            self.h2.goaway(self.last_stream_id or self.h2.highest)
            self.flush()
            self.transport.close()


class H2GrpcServer:
    """Listeners for `method` (a bidirectional stream served by `handler(read, write)`) and the
    health `Check` (answered from `health_status(service)`: a HealthCheckResponse status, or
    None for an unknown service)."""

    def __init__(self, handler: Handler, health_status: Callable[[str], int | None], *, method: str,
                 max_message_bytes: int) -> None:
        self.handler = handler
        self.health_status = health_status
        self.method = method.encode()
        self.max_message_bytes = max_message_bytes
        self.connections: set[_Connection] = set()
        self._listeners: list[asyncio.base_events.Server] = []
        self._stopped = asyncio.Event()

    async def listen(self, host: str, port: int) -> int:
        """Serve on `host:port` (0: ephemeral); returns the bound port. A port in use raises OSError."""
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, reuse_port=False)
        self._listeners.append(srv)
        return srv.sockets[0].getsockname()[1]

    async def run_process(self, st: _Stream) -> None:
        conn = st.conn
        try:
            await self.handler(st.read, st.write, inline=partial(setattr, st, "inline"))
        except ProtocolError as exc:
            conn.finish(st, _INVALID_ARGUMENT, str(exc))
        except StreamGone:
            pass
        except asyncio.CancelledError:
            if not st.gone:
                conn.finish(st, _CANCELLED, "the endpoint picker is stopping")
            raise
        except Exception:  # noqa: BLE001 - one stream's failure never takes the server down
            log.exception("ext_proc stream failed")
            conn.finish(st, _INTERNAL, "the endpoint picker failed on this stream")
        else:
            conn.finish(st, _OK)

    async def stop(self, grace_s: float) -> None:
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.goaway()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace_s)
        while any(c.busy() for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        closing = [asyncio.ensure_future(c.closed.wait()) for c in self.connections]
        if closing:
            _, late = await asyncio.wait(closing, timeout=1.0)
            for f in late:
                f.cancel()
        for conn in list(self.connections):  # a peer not reading what we flushed: drop it
            if conn.transport is not None:
                conn.transport.abort()
        self._listeners.clear()
        self._stopped.set()

    async def wait_closed(self) -> None:
        await self._stopped.wait()
