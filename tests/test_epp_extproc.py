"""The EPP's sans-I/O ext_proc conversation (gateway/epp/extproc.py): messages in, replies and
events out, for both request body modes, the subset hint, refusals and the response path."""
from __future__ import annotations

import json

import pytest

from gateway.epp.extproc import (BUFFERED, DESTINATION_HEADER, FULL_DUPLEX_STREAMED, ExtProcStream, Pick, ProtocolError,
                                 Reject, RequestComplete, ResponseDone)
from gateway.epp.wire import ext_proc_pb2 as pb
from gateway.errors import ApiError

BODY = json.dumps({"model": "m", "stream": True, "cache_salt": "client-salt",
                   "messages": [{"role": "user", "content": "hello " * 300}]}).encode()
SSE = [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
       b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\ndata: {"choi',
       b'ces":[{"index":0,"delta":{"content":"c"}}]}\n\n',
       b'data: {"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}\n\n',
       b"data: [DONE]\n\n"]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def headers_msg(headers: dict[str, str], *, eos: bool = False, subset=None, mode: int | None = FULL_DUPLEX_STREAMED,
                subset_as_string: bool = False) -> pb.ProcessingRequest:
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = FULL_DUPLEX_STREAMED
    if subset is not None:
        hint = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        if subset_as_string:
            hint.update({"x-gateway-destination-endpoint-subset": ",".join(subset)})
        else:
            hint.update({"x-gateway-destination-endpoint-subset": list(subset)})
    return msg


def body_msg(data: bytes, eos: bool, *, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)


def resp_headers_msg(status: int = 200, ctype: str = "text/event-stream", served: str | None = "10.0.0.2:8000",
                     eos: bool = False) -> pb.ProcessingRequest:
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":status", raw_value=str(status).encode()),
                               pb.HeaderValue(key="content-type", raw_value=ctype.encode())])
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))
    if served is not None:
        msg.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served})
    return msg


def set_headers(mutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def lb_metadata(resp) -> str:
    return resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value


def complete(conv: ExtProcStream, headers=None, body: bytes = BODY, chunks: int = 3, **kw) -> RequestComplete:
    hdrs = headers or {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
                       "content-length": str(len(body)), "authorization": "Bearer sk-1"}
    replies, ev = conv.receive(headers_msg(hdrs, **kw))
    assert replies == [] and ev is None  # full duplex: nothing answered before the body is complete
    step = len(body) // chunks + 1
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    for i, part in enumerate(parts):
        replies, ev = conv.receive(body_msg(part, i == len(parts) - 1))
        if i < len(parts) - 1:
            assert replies == [] and ev is None
    assert isinstance(ev, RequestComplete) and replies == []
    return ev


# ---------------------------------------------------------------------------------- request path
def test_full_duplex_gathers_chunks_then_answers_headers_metadata_and_body():
    conv = ExtProcStream()
    ev = complete(conv, chunks=5)
    assert ev.body == BODY and ev.subset is None
    assert ev.headers[":path"] == "/v1/chat/completions" and ev.headers["authorization"] == "Bearer sk-1"
    new_body = BODY.replace(b"client-salt", b"derived-salt-xyz")
    out = conv.decide(Pick(new_body, ["10.0.0.1:8000", "10.0.0.2:8000"], ctx="c1", remove_headers=["Authorization"]))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    common = out[0].request_headers.response
    hdrs = set_headers(common.header_mutation)
    assert hdrs[DESTINATION_HEADER] == "10.0.0.1:8000,10.0.0.2:8000" == lb_metadata(out[0])
    assert hdrs["content-length"] == str(len(new_body))
    assert list(common.header_mutation.remove_headers) == ["authorization"]
    # the pick overwrites a client-sent destination header
    opts = {o.header.key: o.append_action for o in common.header_mutation.set_headers}
    assert opts[DESTINATION_HEADER] == pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    sr = out[1].request_body.response.body_mutation.streamed_response
    assert sr.body == new_body and sr.end_of_stream
    assert conv.picked


def test_big_rewritten_body_goes_back_in_pieces_ending_with_end_of_stream():
    conv = ExtProcStream(max_body_bytes=10 << 20)
    big = b'{"prompt":"' + b"x" * (3 << 20) + b'"}'
    complete(conv, body=big, chunks=7)
    out = conv.decide(Pick(big, ["a:1"]))
    pieces = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert len(pieces) == 4 and b"".join(p.body for p in pieces) == big
    assert [p.end_of_stream for p in pieces] == [False, False, False, True]


def test_buffered_mode_continues_headers_then_answers_in_one_body_response():
    conv = ExtProcStream()
    replies, ev = conv.receive(headers_msg({":method": "POST", ":path": "/v1/completions"}, mode=BUFFERED))
    assert ev is None and [r.WhichOneof("response") for r in replies] == ["request_headers"]
    assert not replies[0].request_headers.response.HasField("header_mutation")
    replies, ev = conv.receive(body_msg(BODY, True))
    assert replies == [] and ev.body == BODY
    out = conv.decide(Pick(b'{"x":1}', ["10.0.0.3:9000"]))
    assert len(out) == 1 and out[0].WhichOneof("response") == "request_body"
    common = out[0].request_body.response
    assert common.body_mutation.body == b'{"x":1}'
    assert set_headers(common.header_mutation)[DESTINATION_HEADER] == "10.0.0.3:9000" == lb_metadata(out[0])
    assert set_headers(common.header_mutation)["content-length"] == "7"


def test_mode_without_protocol_config_comes_from_the_constructor():
    conv = ExtProcStream(request_body_mode=BUFFERED)
    replies, _ = conv.receive(headers_msg({":path": "/v1/completions"}, mode=None))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers"]
    with pytest.raises(ProtocolError, match="STREAMED is not supported"):
        ExtProcStream().receive(headers_msg({":path": "/x"}, mode=pb.ProcessingMode.STREAMED))


def test_bodiless_request_is_complete_at_headers_and_answered_there():
    conv = ExtProcStream()
    replies, ev = conv.receive(headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True))
    assert replies == [] and ev.body == b""
    out = conv.decide(Pick(b"ignored", ["10.0.0.9:8000"]))
    assert len(out) == 1 and out[0].WhichOneof("response") == "request_headers"
    hdrs = set_headers(out[0].request_headers.response.header_mutation)
    assert hdrs == {DESTINATION_HEADER: "10.0.0.9:8000"}  # no content-length for a request without a body


def test_request_trailers_end_the_body_and_are_answered_after_it():
    conv = ExtProcStream()
    conv.receive(headers_msg({":path": "/v1/completions"}))
    assert conv.receive(body_msg(b'{"prompt":"hi"}', False)) == ([], None)
    replies, ev = conv.receive(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert ev.body == b'{"prompt":"hi"}'
    out = conv.decide(Pick(ev.body, ["a:1"]))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_subset_hint_is_passed_on_and_bounds_the_pick():
    conv = ExtProcStream()
    ev = complete(conv, subset=["10.0.0.2:8000", "10.0.0.3:8000"])
    assert ev.subset == ("10.0.0.2:8000", "10.0.0.3:8000")
    out = conv.decide(Pick(BODY, ["10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.2:8000"]))
    assert set_headers(out[0].request_headers.response.header_mutation)[DESTINATION_HEADER] == "10.0.0.3:8000,10.0.0.2:8000"
    conv2 = ExtProcStream()
    assert complete(conv2, subset=["a:1", "b:2"], subset_as_string=True).subset == ("a:1", "b:2")


def test_pick_outside_the_subset_becomes_503():
    conv = ExtProcStream()
    complete(conv, subset=["10.0.0.2:8000"])
    out = conv.decide(Pick(BODY, ["10.0.0.1:8000"]))
    ir = out[0].immediate_response
    assert ir.status.code == 503 and json.loads(ir.body)["error"]["code"] == "no_endpoint"
    assert conv.rejected and conv.close() is None  # no Outcome for a refusal


def test_empty_subset_is_503_without_asking_the_picker():
    conv = ExtProcStream()
    conv.receive(headers_msg({":path": "/v1/completions"}, subset=[]))
    replies, ev = conv.receive(body_msg(BODY, True))
    assert ev is None and replies[0].immediate_response.status.code == 503
    assert json.loads(replies[0].immediate_response.body)["error"]["type"] == "service_unavailable_error"


def test_pick_without_endpoints_is_503():
    conv = ExtProcStream()
    complete(conv)
    assert conv.decide(Pick(BODY, []))[0].immediate_response.status.code == 503


@pytest.mark.parametrize("status,headers", [(429, {"Retry-After": "2"}), (401, {"WWW-Authenticate": "Bearer"}), (400, {})])
def test_reject_is_an_immediate_response_in_openai_shape(status, headers):
    conv = ExtProcStream()
    complete(conv)
    err = ApiError(status, "nope", code="some_code", headers=headers)
    out = conv.decide(Reject.from_api_error(err))
    ir = out[0].immediate_response
    assert ir.status.code == status
    assert json.loads(ir.body) == {"error": {"message": "nope", "type": err.type, "param": None, "code": "some_code"}}
    got = set_headers(ir.headers)
    assert got["content-type"] == "application/json"
    for k, v in headers.items():
        assert got[k.lower()] == v
    assert conv.rejected


def test_body_over_the_limit_is_413_mid_stream_and_later_chunks_are_ignored():
    conv = ExtProcStream(max_body_bytes=1000)
    conv.receive(headers_msg({":path": "/v1/completions"}))
    assert conv.receive(body_msg(b"x" * 600, False)) == ([], None)
    replies, ev = conv.receive(body_msg(b"x" * 600, False))
    assert ev is None and replies[0].immediate_response.status.code == 413
    assert json.loads(replies[0].immediate_response.body)["error"]["code"] == "body_too_large"
    assert conv.receive(body_msg(b"x", True)) == ([], None)


def test_out_of_order_messages_are_protocol_errors():
    with pytest.raises(ProtocolError):
        ExtProcStream().receive(body_msg(b"x", True))
    with pytest.raises(ProtocolError):
        ExtProcStream().receive(resp_headers_msg())
    conv = ExtProcStream()
    complete(conv)
    with pytest.raises(ProtocolError):
        conv.receive(resp_headers_msg())  # the picker has not answered yet
    with pytest.raises(ProtocolError):
        ExtProcStream().decide(Pick(b"", ["a:1"]))
    with pytest.raises(ProtocolError, match="observability"):
        ExtProcStream().receive(pb.ProcessingRequest(observability_mode=True, request_headers=pb.HttpHeaders()))


def test_repeated_header_values_are_joined():
    conv = ExtProcStream()
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key="x-a", raw_value=b"1"), pb.HeaderValue(key="x-a", raw_value=b"2"),
                               pb.HeaderValue(key="x-b", value="old-style")])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))
    _, ev = conv.receive(msg)
    assert ev.headers == {"x-a": "1,2", "x-b": "old-style"}


# ---------------------------------------------------------------------------------- response path
def picked(clock: Clock, **kw) -> ExtProcStream:
    conv = ExtProcStream(clock=clock, **kw)
    complete(conv)
    conv.decide(Pick(BODY, ["10.0.0.1:8000", "10.0.0.2:8000"], ctx={"rid": 7}))
    return conv


def test_streamed_response_passes_through_untouched_while_usage_and_ttft_are_read():
    clock = Clock()
    conv = picked(clock)
    replies, ev = conv.receive(resp_headers_msg(served="10.0.0.2:8000"))
    assert ev is None and replies[0].WhichOneof("response") == "response_headers"
    assert not replies[0].response_headers.response.HasField("header_mutation")
    echoed = []
    for i, chunk in enumerate(SSE):
        clock.t += 0.25
        replies, ev = conv.receive(body_msg(chunk, i == len(SSE) - 1, response=True))
        assert len(replies) == 1
        sr = replies[0].response_body.response.body_mutation.streamed_response
        assert sr.body == chunk and sr.end_of_stream == (i == len(SSE) - 1)  # each chunk at once, as it came
        echoed.append(sr.body)
    assert b"".join(echoed) == b"".join(SSE)
    assert isinstance(ev, ResponseDone) and ev.ctx == {"rid": 7}
    o = ev.outcome
    assert o.served_endpoint == "10.0.0.2:8000" and o.status == 200
    assert o.usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert o.ttft_s == pytest.approx(0.25) and o.content_events == 3
    assert o.decode_s == pytest.approx(0.25)  # events at t+0.25, +0.5 (a, b), +0.75 (c)
    assert not o.ended_early and o.response_bytes == sum(map(len, SSE))
    assert conv.close() is None  # reported once


def test_stream_cut_before_done_is_ended_early_at_close():
    clock = Clock()
    conv = picked(clock)
    conv.receive(resp_headers_msg())
    conv.receive(body_msg(SSE[0], False, response=True))
    done = conv.close()
    assert done.outcome.ended_early and done.outcome.content_events == 1 and done.ctx == {"rid": 7}
    assert conv.close() is None


def test_response_ending_without_done_is_ended_early():
    conv = picked(Clock())
    conv.receive(resp_headers_msg())
    _, ev = conv.receive(body_msg(SSE[0], True, response=True))
    assert ev.outcome.ended_early


def test_stream_closed_before_any_response_is_reported_once():
    conv = picked(Clock())
    done = conv.close()
    assert done.outcome.ended_early and done.outcome.status is None and done.outcome.served_endpoint is None


def test_json_answer_usage_is_read_at_the_end_and_has_no_ttft():
    conv = picked(Clock())
    conv.receive(resp_headers_msg(ctype="application/json", served=None))
    body = json.dumps({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}).encode()
    conv.receive(body_msg(body[:10], False, response=True))
    replies, ev = conv.receive(body_msg(body[10:], True, response=True))
    assert replies[0].response_body.response.body_mutation.streamed_response.body == body[10:]
    o = ev.outcome
    assert o.usage == {"prompt_tokens": 9, "completion_tokens": 1} and o.ttft_s is None
    assert o.served_endpoint is None and not o.ended_early


def test_local_reply_without_body_ends_at_response_headers():
    conv = picked(Clock())
    replies, ev = conv.receive(resp_headers_msg(status=503, ctype="text/plain", served=None, eos=True))
    assert replies[0].WhichOneof("response") == "response_headers"
    assert ev.outcome.status == 503 and not ev.outcome.ended_early


def test_non_duplex_response_mode_answers_continue_per_chunk():
    conv = ExtProcStream(clock=Clock())
    msg = headers_msg({":path": "/v1/completions"})
    msg.protocol_config.response_body_mode = pb.ProcessingMode.STREAMED
    conv.receive(msg)
    _, ev = conv.receive(body_msg(BODY, True))
    conv.decide(Pick(BODY, ["a:1"]))
    conv.receive(resp_headers_msg())
    replies, _ = conv.receive(body_msg(SSE[0], False, response=True))
    assert replies[0].WhichOneof("response") == "response_body"
    assert not replies[0].response_body.response.HasField("body_mutation")  # CONTINUE: Envoy keeps its bytes


def test_response_trailers_are_answered_and_end_the_response():
    conv = picked(Clock())
    conv.receive(resp_headers_msg())
    for chunk in SSE:
        conv.receive(body_msg(chunk, False, response=True))
    replies, ev = conv.receive(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert replies[0].WhichOneof("response") == "response_trailers"
    assert not ev.outcome.ended_early and ev.outcome.usage["prompt_tokens"] == 50
