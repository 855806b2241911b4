"""The server side of one HTTP/2 connection, sans I/O: bytes in, callbacks and bytes out. Just
what a gRPC server behind Envoy needs (RFC 9113): frames, stream states, flow control, SETTINGS,
PING, GOAWAY, RST_STREAM, HEADERS with CONTINUATION, and HPACK through the `hpack` library.

Why not `h2`'s H2Connection: the Endpoint Picker relays every response chunk as one gRPC message
each way (~35 DATA frames each way per streamed request), and h2's general state machine and
event objects cost ~12 us per frame received and ~9 us per frame sent; profiled at 64 streams,
that was a third of the picker's CPU. Here a DATA frame is a header unpack, two window counters
and a callback.

Rules:
- `receive(data)` parses whole frames and calls the handler: `on_request(sid, headers,
  end_stream)` for a new stream, `on_data(sid, data, flow_len, end_stream)`, `on_end(sid)` (the
  peer's END_STREAM on trailers), `on_reset(sid)` (the peer reset it, or we did for a stream
  error), `on_window(sid)` (more send window; 0: the connection's or every stream's), and
  `on_goaway()`. Handlers only queue output; `take()` returns the bytes to write.
- A connection error queues GOAWAY with its code and raises `ConnectionError_`; the caller writes
  what `take()` returns and closes. A stream error resets that stream only.
- Inbound flow control: we advertise `stream_window` per stream and `connection_window` for the
  connection, and count what the peer sends against them (over: FLOW_CONTROL_ERROR); the caller
  gives windows back with `ack(sid, n)` as it consumes data. A WINDOW_UPDATE goes out at a
  `take()` once the window it reopens is due: the consumed bytes reach half the advertised window,
  or what the peer may still send falls under half of it (a stream whose peer has finished
  sending gets none). Why not one per `take()`: a small request body then cost a write of its own
  (the window update ahead of the picker's answer) and two frames more for Envoy to read per
  message; with windows of 1 and 16 MiB nothing of a chat request's few kilobytes needs giving back.
- Outbound flow control: `room(sid)` is what may be sent now (the smaller window, at most one
  frame); `send_data` never sends more (the caller waits for `on_window`).
"""
from __future__ import annotations

import struct
from typing import Protocol

import hpack

__all__ = ["ConnectionError_", "Http2Server", "Handler", "NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR",
           "FLOW_CONTROL_ERROR", "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL",
           "COMPRESSION_ERROR", "ENHANCE_YOUR_CALM", "PREFACE"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# frame types and flags
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# settings
_S_HEADER_TABLE_SIZE, _S_ENABLE_PUSH, _S_MAX_CONCURRENT_STREAMS, _S_INITIAL_WINDOW_SIZE, _S_MAX_FRAME_SIZE, _S_MAX_HEADER_LIST_SIZE = range(1, 7)

_HEAD = struct.Struct(">BHBBL")  # length (high byte, low 16 bits), type, flags, stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_MAX_WINDOW = (1 << 31) - 1
_DEFAULT_WINDOW = 65535
_MAX_FRAME = 16384  # what we accept (we advertise no larger SETTINGS_MAX_FRAME_SIZE)


class ConnectionError_(Exception):
    """A connection error (GOAWAY queued with `code`): write `take()` and close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Handler(Protocol):
    def on_request(self, sid: int, headers: list, end_stream: bool) -> None: ...
    def on_data(self, sid: int, data: bytes, flow_len: int, end_stream: bool) -> None: ...
    def on_end(self, sid: int) -> None: ...
    def on_reset(self, sid: int) -> None: ...
    def on_window(self, sid: int) -> None: ...
    def on_goaway(self) -> None: ...


def _frame(typ: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, typ, flags, sid) + payload


class _S:
    """One open stream's counters."""

    __slots__ = ("send", "recv", "remote_closed", "local_closed")

    def __init__(self, send: int, recv: int) -> None:
        self.send = send  # what we may still send (the peer's window for us)
        self.recv = recv  # what the peer may still send us
        self.remote_closed = False
        self.local_closed = False


class Http2Server:
    """One connection's protocol state (module rules)."""

    def __init__(self, handler: Handler, *, stream_window: int = _DEFAULT_WINDOW, connection_window: int = _DEFAULT_WINDOW,
                 max_streams: int = 100, max_header_list: int = 64 * 1024) -> None:
        self.h = handler
        self.stream_window = stream_window
        self.connection_window = connection_window
        self.max_streams = max_streams
        self.max_header_list = max_header_list
        self.streams: dict[int, _S] = {}
        self.highest = 0  # the highest stream id the peer opened
        self._buf = bytearray()
        self._preface = False
        self._out: list[bytes] = []
        self._dec = hpack.Decoder()
        self._dec.max_header_list_size = max_header_list
        self._enc = hpack.Encoder()
        self._cont: tuple[int, int, list] | None = None  # a header block awaiting CONTINUATION: (sid, flags, fragments)
        self._send_conn = _DEFAULT_WINDOW  # the peer's connection window for us
        self._peer_initial = _DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._peer_max_frame = 16384
        self._recv_conn = connection_window  # what the peer may still send on the connection
        self._acks: dict[int, int] = {}  # sid -> bytes to give back at the next take()
        self._conn_ack = 0
        self.closed = False

    # ------------------------------------------------------------------ output
    def initiate(self) -> None:
        """Our SETTINGS and the connection window beyond the default: the first bytes we send."""
        settings = b"".join(_SETTING.pack(k, v) for k, v in ((_S_MAX_CONCURRENT_STREAMS, self.max_streams),
                                                              (_S_INITIAL_WINDOW_SIZE, self.stream_window),
                                                              (_S_MAX_HEADER_LIST_SIZE, self.max_header_list)))
        self._out.append(_frame(_SETTINGS, 0, 0, settings))
        if self.connection_window > _DEFAULT_WINDOW:
            self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(self.connection_window - _DEFAULT_WINDOW)))

    def take(self) -> bytes:
        """The bytes queued since the last call (window updates included, once due: module rules)."""
        if self._acks:
            half = self.stream_window // 2
            for sid in list(self._acks):
                st = self.streams.get(sid)
                if st is None or st.remote_closed:  # the peer sends no more on it: nothing to give back
                    del self._acks[sid]
                elif self._acks[sid] >= half or st.recv < half:
                    n = self._acks.pop(sid)
                    st.recv += n
                    self._out.append(_frame(_WINDOW_UPDATE, 0, sid, _U32.pack(n)))
        half = self.connection_window // 2
        if self._conn_ack and (self._conn_ack >= half or self._recv_conn < half):
            self._recv_conn += self._conn_ack
            self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(self._conn_ack)))
            self._conn_ack = 0
        if not self._out:
            return b""
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        return data

    def ack(self, sid: int, n: int) -> None:
        """`n` received bytes of stream `sid` were consumed: give them back (at the next take())."""
        if n > 0:
            self._acks[sid] = self._acks.get(sid, 0) + n
            self._conn_ack += n

    def room(self, sid: int) -> int:
        """Bytes of DATA that may go on `sid` now (-1: the stream is gone or our side closed)."""
        st = self.streams.get(sid)
        if st is None or st.local_closed:
            return -1
        return max(0, min(st.send, self._send_conn, self._peer_max_frame))

    def send_headers(self, sid: int, headers, end_stream: bool = False) -> None:
        st = self.streams.get(sid)
        if st is None or st.local_closed:
            raise KeyError(sid)
        block = self._enc.encode(headers)
        mf = self._peer_max_frame
        flags = _END_STREAM if end_stream else 0
        if len(block) <= mf:
            self._out.append(_frame(_HEADERS, flags | _END_HEADERS, sid, block))
        else:
            parts = [block[i:i + mf] for i in range(0, len(block), mf)]
            self._out.append(_frame(_HEADERS, flags, sid, parts[0]))
            for i, part in enumerate(parts[1:], 2):
                self._out.append(_frame(_CONTINUATION, _END_HEADERS if i == len(parts) else 0, sid, part))
        if end_stream:
            self._close_local(sid, st)

    def send_data(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        st = self.streams.get(sid)
        if st is None or st.local_closed:
            raise KeyError(sid)
        n = len(data)
        if n > min(st.send, self._send_conn, self._peer_max_frame):
            raise ValueError(f"{n} bytes over the send window on stream {sid}")
        st.send -= n
        self._send_conn -= n
        self._out.append(_HEAD.pack(n >> 16, n & 0xFFFF, _DATA, _END_STREAM if end_stream else 0, sid) + data)
        if end_stream:
            self._close_local(sid, st)

    def reset(self, sid: int, code: int) -> None:
        """RST_STREAM: the stream is over for both sides."""
        self._out.append(_frame(_RST_STREAM, 0, sid, _U32.pack(code)))
        self.streams.pop(sid, None)

    def goaway(self, last_sid: int, code: int = NO_ERROR) -> None:
        self._out.append(_frame(_GOAWAY, 0, 0, _U32.pack(last_sid) + _U32.pack(code)))

    def _close_local(self, sid: int, st: _S) -> None:
        st.local_closed = True
        if st.remote_closed:
            self.streams.pop(sid, None)

    # ------------------------------------------------------------------ input
    def receive(self, data: bytes) -> None:
        """Parse what arrived (module rules); raises ConnectionError_ on a connection error."""
        if self.closed:
            return
        buf = self._buf
        buf += data
        pos = 0
        try:
            if not self._preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if bytes(buf[:len(PREFACE)]) != PREFACE:
                    self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                pos = len(PREFACE)
                self._preface = True
            n = len(buf)
            unpack = _HEAD.unpack_from
            while n - pos >= 9:
                hi, lo, typ, flags, sid = unpack(buf, pos)
                length = (hi << 16) | lo
                if length > _MAX_FRAME:
                    self._fail(FRAME_SIZE_ERROR, f"frame of {length} bytes over {_MAX_FRAME}")
                end = pos + 9 + length
                if end > n:
                    break
                payload = bytes(buf[pos + 9:end])
                pos = end
                sid &= _MAX_WINDOW
                if self._cont is not None and typ != _CONTINUATION:
                    self._fail(PROTOCOL_ERROR, "a header block was interrupted")
                if typ == _DATA:
                    self._data(sid, flags, payload)
                elif typ == _HEADERS:
                    self._headers(sid, flags, payload)
                elif typ == _WINDOW_UPDATE:
                    self._window_update(sid, payload)
                elif typ == _CONTINUATION:
                    self._continuation(sid, flags, payload)
                else:
                    self._control(typ, flags, sid, payload)
        finally:
            del buf[:pos]

    def _control(self, typ: int, flags: int, sid: int, payload: bytes) -> None:
        if typ == _RST_STREAM:
            if sid == 0 or len(payload) != 4:
                self._fail(PROTOCOL_ERROR if sid == 0 else FRAME_SIZE_ERROR, "bad RST_STREAM")
            if self.streams.pop(sid, None) is not None:
                self.h.on_reset(sid)
        elif typ == _SETTINGS:
            self._settings(sid, flags, payload)
        elif typ == _PING:
            if sid != 0:
                self._fail(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                self._fail(FRAME_SIZE_ERROR, "PING of a wrong size")
            if not flags & _ACK:
                self._out.append(_frame(_PING, _ACK, 0, payload))
        elif typ == _GOAWAY:
            self.h.on_goaway()
        elif typ == _PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown types: ignored (RFC 9113 5.3.2, 5.5)

    def _fail(self, code: int, reason: str) -> None:
        self.goaway(self.highest, code)
        self.closed = True
        raise ConnectionError_(code, reason)

    def _data(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            self._fail(PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)
        self._recv_conn -= flow
        if self._recv_conn < 0:
            self._fail(FLOW_CONTROL_ERROR, "the peer overran the connection window")
        if flags & _PADDED:
            if not payload or payload[0] >= flow:
                self._fail(PROTOCOL_ERROR, "bad DATA padding")
            data = payload[1:flow - payload[0]]
        else:
            data = payload
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.highest:
                self._fail(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self._conn_ack += flow  # a stream that is over: keep the connection's window open
            if st is not None:  # half-closed (remote): a stream error
                self.reset(sid, STREAM_CLOSED)
                self.h.on_reset(sid)
            return
        st.recv -= flow
        if st.recv < 0:
            self._conn_ack += flow
            self.reset(sid, FLOW_CONTROL_ERROR)
            self.h.on_reset(sid)
            return
        end = bool(flags & _END_STREAM)
        if end:
            st.remote_closed = True
            if st.local_closed:
                self.streams.pop(sid, None)
        self.h.on_data(sid, data, flow, end)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & _PADDED:
            if not payload:
                self._fail(PROTOCOL_ERROR, "bad HEADERS padding")
            start, end = 1, end - payload[0]
        if flags & _PRIORITY_FLAG:
            start += 5
        if start > end:
            self._fail(PROTOCOL_ERROR, "bad HEADERS padding")
        fragment = payload[start:end]
        if flags & _END_HEADERS:
            self._header_block(sid, flags, fragment)
        else:
            self._cont = (sid, flags, [fragment])

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if self._cont is None or self._cont[0] != sid:
            self._fail(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        parts = self._cont[2]
        parts.append(payload)
        if sum(len(p) for p in parts) > 2 * self.max_header_list:
            self._fail(PROTOCOL_ERROR, "header block too large")
        if flags & _END_HEADERS:
            head_flags = self._cont[1]
            self._cont = None
            self._header_block(sid, head_flags, b"".join(parts))

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._dec.decode(block, raw=True)  # always decoded: HPACK's table is the connection's
        except hpack.OversizedHeaderListError:  # the table may be half updated: the connection cannot go on
            self._fail(ENHANCE_YOUR_CALM, f"a header list over {self.max_header_list} bytes")
        except hpack.HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"undecodable header block ({type(exc).__name__})")
        end = bool(flags & _END_STREAM)
        st = self.streams.get(sid)
        if st is not None:  # trailers
            if st.remote_closed:
                self.reset(sid, STREAM_CLOSED)
                self.h.on_reset(sid)
                return
            if not end:
                self.reset(sid, PROTOCOL_ERROR)
                self.h.on_reset(sid)
                return
            st.remote_closed = True
            if st.local_closed:
                self.streams.pop(sid, None)
            self.h.on_end(sid)
            return
        if sid % 2 == 0:
            self._fail(PROTOCOL_ERROR, f"HEADERS on stream {sid}, which a client cannot open")
        if sid <= self.highest:
            return  # a stream that is over (one we reset, say): ignored (RFC 9113 5.1)
        self.highest = sid
        if len(self.streams) >= self.max_streams:
            self._out.append(_frame(_RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        st = _S(self._peer_initial, self.stream_window)
        st.remote_closed = end
        self.streams[sid] = st
        self.h.on_request(sid, headers, end)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        inc = _U32.unpack(payload)[0] & _MAX_WINDOW
        if sid == 0:
            if inc == 0:
                self._fail(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_conn += inc
            if self._send_conn > _MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self.h.on_window(0)
            return
        st = self.streams.get(sid)
        if st is None:
            return  # a stream that is over (or idle: harmless)
        st.send += inc
        if inc == 0 or st.send > _MAX_WINDOW:
            self.reset(sid, PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR)
            self.h.on_reset(sid)
            return
        self.h.on_window(sid)

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & _ACK:
            if payload:
                self._fail(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            self._fail(FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        grew = False
        for i in range(0, len(payload), 6):
            key, val = _SETTING.unpack_from(payload, i)
            if key == _S_INITIAL_WINDOW_SIZE:
                if val > _MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                delta = val - self._peer_initial
                self._peer_initial = val
                for st in self.streams.values():
                    st.send += delta
                    if st.send > _MAX_WINDOW:
                        self._fail(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
                grew = grew or delta > 0
            elif key == _S_MAX_FRAME_SIZE:
                if not 16384 <= val <= 16777215:
                    self._fail(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self._peer_max_frame = val
            elif key == _S_HEADER_TABLE_SIZE:
                self._enc.header_table_size = val
            elif key == _S_ENABLE_PUSH and val > 1:
                self._fail(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        self._out.append(_frame(_SETTINGS, _ACK, 0))
        if grew:
            self.h.on_window(0)
