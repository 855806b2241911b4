"""The picker's own gRPC transport (gateway/epp/h2_transport.py) over a real socket, driven by a
raw HTTP/2 client (`h2`) so the test controls what grpcio would hide: the client's flow-control
window, and the whole ext_proc conversation sent before any reply is read. Response-phase
messages are taken in the connection's callback (EppServer.serve_stream's `inline`), and their
replies must still come out in order, whole, trailers last, however the window opens."""
from __future__ import annotations

import asyncio
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from grpc_health.v1 import health_pb2

from gateway.epp.h2_transport import HEALTH_CHECK_METHOD
from gateway.epp.server import METHOD, EppServer
from gateway.epp.wire import ext_proc_pb2 as pb
from tests.epp_double import StaticPickerDouble
from tests.test_epp_server import body, headers


def grpc_frame(msg) -> bytes:
    raw = msg.SerializeToString()
    return struct.pack(">BI", 0, len(raw)) + raw


def response_headers() -> pb.ProcessingRequest:
    rh = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key=":status", raw_value=b"200"), pb.HeaderValue(key="content-type", raw_value=b"text/event-stream")])))
    rh.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.1:8000"})
    return rh


class RawClient:
    """One HTTP/2 connection and one `Process` stream, reading only when asked."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.data = bytearray()  # the reply stream's DATA, not yet parsed into messages
        self.trailers: dict | None = None
        self.reset = False

    async def open(self, port: int, path: bytes = METHOD.encode()) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window})
        self.conn.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                   (b":authority", b"picker"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        await self.flush()

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def send(self, msgs, end: bool = False) -> None:
        payload = b"".join(grpc_frame(m) for m in msgs)
        self.conn.send_data(1, payload, end_stream=end)
        await self.flush()

    async def read_some(self, credit: int) -> None:
        """Read what arrives for a moment, giving back at most `credit` bytes of window."""
        try:
            chunk = await asyncio.wait_for(self.reader.read(65536), 0.2)
        except asyncio.TimeoutError:
            chunk = b""
        for ev in self.conn.receive_data(chunk):
            if isinstance(ev, h2.events.DataReceived):
                self.data += ev.data
                self.conn.acknowledge_received_data(min(credit, ev.flow_controlled_length), 1)
            elif isinstance(ev, h2.events.TrailersReceived):
                self.trailers = dict(ev.headers)
            elif isinstance(ev, h2.events.StreamReset):
                self.reset = True
        await self.flush()

    def replies(self) -> list:
        out, pos = [], 0
        while len(self.data) - pos >= 5:
            _, n = struct.unpack_from(">BI", self.data, pos)
            if len(self.data) - pos < 5 + n:
                break  # the rest of it waits for window
            out.append(pb.ProcessingResponse.FromString(bytes(self.data[pos + 5:pos + 5 + n])))
            pos += 5 + n
        return out


async def converse(window: int, response_msgs, rounds: int = 400):
    picker = StaticPickerDouble(["10.0.0.1:8000"])
    srv = EppServer(picker, host="127.0.0.1", port=0, transport="h2")
    port = await srv.start()
    cli = RawClient(window)
    try:
        await cli.open(port)
        await cli.send([headers(), body(b'{"model":"m","messages":[]}', True)])
        while len(cli.replies()) < 2 and not cli.reset:  # the pick's two replies: then the task waits in read()
            await cli.read_some(window)
        await cli.send(response_msgs, end=True)  # all of it at once: the connection's callback takes it
        for _ in range(rounds):
            if cli.trailers is not None or cli.reset:
                break
            await cli.read_some(window)
        return cli, picker, srv
    finally:
        cli.writer.close()
        await srv.stop(0)


def sse(i: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"' + b"t%03d" % i + b'"}}]}\n\n'


@pytest.mark.parametrize("window", [64, 1 << 20])
async def test_replies_keep_their_order_and_end_with_trailers_whatever_the_window(window):
    # 1 MiB: every response message is taken in the connection's callback; 64 bytes: the first
    # replies fill the window, the rest wait in order behind them and the stream's task takes over
    chunks = [sse(i) for i in range(40)] + [b"data: [DONE]\n\n"]
    msgs = [response_headers()] + [body(c, i == len(chunks) - 1, response=True) for i, c in enumerate(chunks)]
    cli, picker, srv = await converse(window, msgs)
    replies = cli.replies()
    assert cli.trailers is not None and cli.trailers[b"grpc-status"] == b"0"
    assert [r.WhichOneof("response") for r in replies] == (["request_headers", "request_body", "response_headers"]
                                                             + ["response_body"] * len(chunks))
    assert [r.response_body.response.body_mutation.streamed_response.body for r in replies[3:]] == chunks
    (_, outcome), = picker.outcomes
    assert outcome.served_endpoint == "10.0.0.1:8000" and not outcome.ended_early
    assert srv.stats.observed == 1


async def test_a_protocol_error_taken_inline_ends_the_stream_with_invalid_argument():
    # a response body before the response headers: the conversation is out of order
    cli, picker, srv = await converse(1 << 20, [body(sse(0), True, response=True)])
    assert cli.trailers is not None and cli.trailers[b"grpc-status"] == b"3"  # INVALID_ARGUMENT
    assert srv.stats.protocol_errors == 1
    assert len(picker.outcomes) == 0 or picker.outcomes[0][1].ended_early


async def test_a_health_check_answers_through_a_two_byte_window():
    srv = EppServer(StaticPickerDouble(["10.0.0.1:8000"]), host="127.0.0.1", port=0, transport="h2")
    cli = RawClient(2)  # the answer (7 bytes) waits in the stream's queue, its trailers behind it
    try:
        await cli.open(await srv.start(), HEALTH_CHECK_METHOD)
        await cli.send([health_pb2.HealthCheckRequest(service="liveness")], end=True)
        for _ in range(100):
            if cli.trailers is not None or cli.reset:
                break
            await cli.read_some(2)
        assert cli.trailers is not None and cli.trailers[b"grpc-status"] == b"0"
        raw = bytes(cli.data)
        assert health_pb2.HealthCheckResponse.FromString(raw[5:]).status == health_pb2.HealthCheckResponse.SERVING
        assert all(not c.streams for c in srv._server.connections)  # the stream is dropped once its trailers are out
    finally:
        cli.writer.close()
        await srv.stop(0)


async def test_a_request_body_larger_than_the_stream_window_flows_as_the_window_is_given_back():
    """A 3 MiB body over a 1 MiB stream window: the picker gives the window back once half of it is
    consumed (gateway/epp/http2.py), so the client can go on sending until the whole body is in
    and the pick is answered."""
    picker = StaticPickerDouble(["10.0.0.1:8000"])
    srv = EppServer(picker, host="127.0.0.1", port=0, transport="h2")
    port = await srv.start()
    cli = RawClient(1 << 20)
    try:
        await cli.open(port)
        big = b'{"model":"m","messages":[],"x":"' + b"a" * (3 << 20) + b'"}'
        step = 1 << 16
        payload = grpc_frame(headers()) + b"".join(
            grpc_frame(body(big[i:i + step], i + step >= len(big))) for i in range(0, len(big), step))
        sent = 0
        for _ in range(400):
            room = min(cli.conn.local_flow_control_window(1), cli.conn.max_outbound_frame_size)
            if sent < len(payload) and room > 0:
                n = min(room, len(payload) - sent)
                cli.conn.send_data(1, payload[sent:sent + n])
                sent += n
                await cli.flush()
                continue
            if len(cli.replies()) >= 2 or cli.reset:
                break
            await cli.read_some(1 << 20)
        assert sent == len(payload) and not cli.reset
        assert len(cli.replies()) >= 2 and picker.picks[-1][1] == big
    finally:
        cli.writer.close()
        await srv.stop(0)
