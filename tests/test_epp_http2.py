"""gateway/epp/http2.py, the picker's HTTP/2 server connection, sans I/O: driven by `h2`'s client
connection (an independent implementation) or by hand-made frames for what a well-behaved client
never sends."""
from __future__ import annotations

import struct

import h2.config
import hpack
import h2.connection
import h2.events
import h2.settings
import pytest

from gateway.epp import http2

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/svc/Method"), (b":authority", b"picker"),
           (b"content-type", b"application/grpc"), (b"te", b"trailers")]


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def on_request(self, sid, headers, end_stream):
        self.events.append(("request", sid, [(bytes(k), bytes(v)) for k, v in headers], end_stream))

    def on_data(self, sid, data, flow_len, end_stream):
        self.events.append(("data", sid, bytes(data), flow_len, end_stream))

    def on_end(self, sid):
        self.events.append(("end", sid))

    def on_reset(self, sid):
        self.events.append(("reset", sid))

    def on_window(self, sid):
        self.events.append(("window", sid))

    def on_goaway(self):
        self.events.append(("goaway",))


def pair(client_settings: dict | None = None, **server_kw):
    """A client (h2) and our server, past the preface and both SETTINGS."""
    rec = Recorder()
    srv = http2.Http2Server(rec, **server_kw)
    cli = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    cli.initiate_connection()
    if client_settings:
        cli.update_settings(client_settings)
    srv.initiate()
    srv.receive(cli.data_to_send())
    events = cli.receive_data(srv.take())
    srv.receive(cli.data_to_send())  # the client's ACK of our SETTINGS
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events)
    rec.events.clear()
    return cli, srv, rec


def test_a_request_and_its_reply_round_trip():
    cli, srv, rec = pair()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"\x00\x00\x00\x00\x03abc", end_stream=True)
    srv.receive(cli.data_to_send())
    assert rec.events == [("request", 1, REQUEST, False), ("data", 1, b"\x00\x00\x00\x00\x03abc", 8, True)]
    srv.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    srv.send_data(1, b"\x00\x00\x00\x00\x02ok")
    srv.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    got = cli.receive_data(srv.take())
    kinds = [type(e).__name__ for e in got]
    assert kinds == ["ResponseReceived", "DataReceived", "TrailersReceived", "StreamEnded"]
    assert got[1].data == b"\x00\x00\x00\x00\x02ok" and dict(got[2].headers)[b"grpc-status"] == b"0"
    assert 1 not in srv.streams  # both sides closed


def test_frames_split_at_every_byte_give_the_same_callbacks():
    cli, srv, rec = pair()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"x" * 100)
    cli.send_data(1, b"y" * 50, end_stream=True)
    data = cli.data_to_send()
    for i in range(len(data)):
        srv.receive(data[i:i + 1])
    assert rec.events == [("request", 1, REQUEST, False), ("data", 1, b"x" * 100, 100, False),
                          ("data", 1, b"y" * 50, 50, True)]


def test_a_header_block_over_one_frame_arrives_whole_through_continuation():
    cli, srv, rec = pair()
    big = REQUEST + [(b"x-big", b"v" * 40000)]  # over 16,384: HEADERS + CONTINUATION frames
    cli.send_headers(1, big, end_stream=True)
    srv.receive(cli.data_to_send())
    assert rec.events == [("request", 1, big, True)]
    # and ours over the peer's frame size goes out the same way
    srv.send_headers(1, [(b":status", b"200"), (b"x-big", b"w" * 40000)], end_stream=True)
    got = cli.receive_data(srv.take())
    assert dict(got[0].headers)[b"x-big"] == b"w" * 40000


def test_padding_is_stripped_but_counts_against_the_window():
    cli, srv, rec = pair()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"abc", pad_length=10)
    srv.receive(cli.data_to_send())
    assert rec.events[-1] == ("data", 1, b"abc", 3 + 10 + 1, False)


def test_sends_never_exceed_the_peers_window_and_resume_on_its_update():
    cli, srv, rec = pair(client_settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    cli.send_headers(1, REQUEST)
    srv.receive(cli.data_to_send())
    srv.send_headers(1, [(b":status", b"200")])
    assert srv.room(1) == 10
    with pytest.raises(ValueError):
        srv.send_data(1, b"z" * 11)
    srv.send_data(1, b"z" * 10)
    assert srv.room(1) == 0
    cli.receive_data(srv.take())
    rec.events.clear()
    cli.increment_flow_control_window(5, stream_id=1)
    srv.receive(cli.data_to_send())
    assert rec.events == [("window", 1)] and srv.room(1) == 5


def test_a_larger_initial_window_from_the_peer_opens_every_stream():
    cli, srv, rec = pair(client_settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    cli.send_headers(1, REQUEST)
    srv.receive(cli.data_to_send())
    cli.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    srv.receive(cli.data_to_send())
    assert ("window", 0) in rec.events and srv.room(1) == 1000


def test_consumed_data_gives_the_window_back_once_half_of_it_is_used():
    """A window update goes out once the consumed bytes reach half the advertised window (stream
    and connection each), with all of them; a small body gives nothing back (its own write, and
    frames for the peer to read, for no use); a stream whose peer finished sending gets none."""
    cli, srv, rec = pair(stream_window=1000, connection_window=4000)
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"a" * 300)
    cli.send_data(1, b"b" * 100)
    srv.receive(cli.data_to_send())
    srv.ack(1, 300)
    srv.ack(1, 100)
    assert srv.take() == b""  # 400 of 1000: not due
    cli.send_data(1, b"c" * 100)
    srv.receive(cli.data_to_send())
    srv.ack(1, 100)
    updates = [e for e in cli.receive_data(srv.take()) if isinstance(e, h2.events.WindowUpdated)]
    assert [(e.stream_id, e.delta) for e in updates] == [(1, 500)]  # the connection's 500 of 4000: not due
    assert srv.take() == b""
    cli.send_headers(3, REQUEST)
    cli.send_data(3, b"d" * 900)
    cli.send_data(3, b"e" * 100, end_stream=True)
    cli.send_data(1, b"f" * 600)
    srv.receive(cli.data_to_send())
    srv.ack(3, 1000)
    srv.ack(1, 600)
    updates = [e for e in cli.receive_data(srv.take()) if isinstance(e, h2.events.WindowUpdated)]
    # stream 3 ended: nothing for it; stream 1 its 600; the connection all 2,100 it took since the last
    assert sorted((e.stream_id, e.delta) for e in updates) == [(0, 2100), (1, 600)]
    assert srv.take() == b""


def test_ping_is_answered_with_its_payload():
    cli, srv, rec = pair()
    cli.ping(b"12345678")
    srv.receive(cli.data_to_send())
    got = cli.receive_data(srv.take())
    assert [(type(e).__name__, e.ping_data) for e in got] == [("PingAckReceived", b"12345678")]


def test_reset_and_goaway_from_the_peer_reach_the_handler():
    cli, srv, rec = pair()
    cli.send_headers(1, REQUEST)
    cli.reset_stream(1)
    cli.close_connection()
    srv.receive(cli.data_to_send())
    assert rec.events[1:] == [("reset", 1), ("goaway",)]
    assert srv.room(1) == -1
    with pytest.raises(KeyError):
        srv.send_data(1, b"late")


def test_streams_over_the_limit_are_refused():
    cli, srv, rec = pair(max_streams=1)
    cli.send_headers(1, REQUEST)
    srv.receive(cli.data_to_send())
    srv.receive(frame(1, 4, 3, hpack.Encoder().encode(REQUEST)))  # h2 keeps to our limit: hand-made
    assert [e[:2] for e in rec.events] == [("request", 1)]
    assert [(t, sid, int.from_bytes(p, "big")) for t, _, sid, p in frames(srv.take())] == [(3, 3, http2.REFUSED_STREAM)]


def frame(typ: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">BHBBL", len(payload) >> 16, len(payload) & 0xFFFF, typ, flags, sid) + payload


def frames(out: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each frame in `out`."""
    got, i = [], 0
    while i + 9 <= len(out):
        n = int.from_bytes(out[i:i + 3], "big")
        got.append((out[i + 3], out[i + 4], int.from_bytes(out[i + 5:i + 9], "big") & 0x7FFFFFFF, out[i + 9:i + 9 + n]))
        i += 9 + n
    assert i == len(out), "a partial frame"
    return got


def goaway_code(out: bytes) -> int:
    codes = [int.from_bytes(p[4:8], "big") for t, _, _, p in frames(out) if t == 7]
    assert len(codes) == 1
    return codes[0]


@pytest.mark.parametrize("bad, code", [
    (frame(0, 0, 1, b"x"), http2.PROTOCOL_ERROR),  # DATA on an idle stream
    (frame(6, 0, 0, b"short"), http2.FRAME_SIZE_ERROR),  # PING of 5 bytes
    (frame(4, 0, 1, b""), http2.PROTOCOL_ERROR),  # SETTINGS on a stream
    (frame(8, 0, 0, struct.pack(">L", 0)), http2.PROTOCOL_ERROR),  # WINDOW_UPDATE of 0
    (frame(8, 0, 0, struct.pack(">L", (1 << 31) - 1)), http2.FLOW_CONTROL_ERROR),  # window over 2^31-1
    (frame(5, 4, 1, b"\x00\x00\x00\x02"), http2.PROTOCOL_ERROR),  # PUSH_PROMISE from a client
    (frame(9, 4, 1, b""), http2.PROTOCOL_ERROR),  # CONTINUATION without HEADERS
    (frame(1, 5, 2, b""), http2.PROTOCOL_ERROR),  # a client opening an even stream
    (frame(1, 5, 1, b"\xff\xff\xff\xff"), http2.COMPRESSION_ERROR),  # an undecodable header block
    (frame(0, 0, 0, b"x" * 16385), http2.FRAME_SIZE_ERROR),  # over the frame size we accept
])
def test_connection_errors_send_goaway_with_their_code(bad, code):
    cli, srv, rec = pair()
    with pytest.raises(http2.ConnectionError_) as exc:
        srv.receive(bad)
    assert exc.value.code == code and goaway_code(srv.take()) == code
    srv.receive(frame(6, 0, 0, b"12345678"))  # nothing more is read
    assert srv.take() == b""


def test_a_peer_overrunning_the_stream_window_loses_the_stream_not_the_connection():
    cli, srv, rec = pair(stream_window=100, connection_window=1 << 20)
    cli.send_headers(1, REQUEST)
    srv.receive(cli.data_to_send())
    srv.receive(frame(0, 0, 1, b"q" * 101))  # h2 would not send it: hand-made
    assert rec.events[-1] == ("reset", 1)
    got = cli.receive_data(srv.take())
    assert any(isinstance(e, h2.events.StreamReset) and e.error_code == http2.FLOW_CONTROL_ERROR for e in got)
    cli.send_headers(3, REQUEST, end_stream=True)  # the connection goes on
    srv.receive(cli.data_to_send())
    assert rec.events[-1][:2] == ("request", 3)


def test_headers_on_a_stream_we_reset_are_ignored():
    cli, srv, rec = pair(max_streams=1)
    cli.send_headers(1, REQUEST)
    srv.receive(cli.data_to_send())
    enc = hpack.Encoder()
    srv.receive(frame(1, 4, 3, enc.encode(REQUEST)))  # refused: over the limit
    srv.receive(frame(1, 5, 3, enc.encode([(b"x-trailer", b"1")])))  # late frames of it: not an error
    srv.receive(frame(0, 1, 3, b"late"))
    srv.take()
    cli.send_data(1, b"still here", end_stream=True)
    srv.receive(cli.data_to_send())
    assert [e[:2] for e in rec.events] == [("request", 1), ("data", 1)]


def test_a_header_list_over_the_limit_ends_the_connection():
    cli, srv, rec = pair(max_header_list=1024)
    with pytest.raises(http2.ConnectionError_):  # hand-made: a well-behaved client keeps to our limit
        srv.receive(frame(1, 5, 1, hpack.Encoder().encode(REQUEST + [(b"x-big", b"v" * 2000)])))
    assert goaway_code(srv.take()) == http2.ENHANCE_YOUR_CALM and rec.events == []


def test_not_http2_is_refused_at_the_preface():
    srv = http2.Http2Server(Recorder())
    with pytest.raises(http2.ConnectionError_):
        srv.receive(b"GET / HTTP/1.1\r\n")
