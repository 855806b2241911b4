"""The EPP's gRPC server (gateway/epp/server.py) over a real socket, on each transport (h2 and
grpcio), with grpcio as the client playing Envoy: health services, one full conversation, picker
failures, protocol errors and graceful stop. The picker is the TEST DOUBLE of tests/epp_double.py."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.extproc import DESTINATION_HEADER, FULL_DUPLEX_STREAMED
from gateway.epp.server import EXT_PROC_SERVICE, METHOD, TRANSPORTS, EppServer
from gateway.epp.wire import ext_proc_pb2 as pb
from gateway.errors import ApiError
from tests.epp_double import StaticPickerDouble

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Envoyish:
    """A gRPC client speaking ext_proc to the server under test."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.process = self.channel.stream_stream(METHOD, request_serializer=pb.ProcessingRequest.SerializeToString,
                                                  response_deserializer=pb.ProcessingResponse.FromString)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def status(self, service: str) -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

    async def close(self) -> None:
        await self.channel.close()


def headers(path="/v1/chat/completions", eos=False) -> pb.ProcessingRequest:
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=path.encode()),
                               pb.HeaderValue(key=":method", raw_value=b"POST")])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))
    msg.protocol_config.request_body_mode = FULL_DUPLEX_STREAMED
    msg.protocol_config.response_body_mode = FULL_DUPLEX_STREAMED
    return msg


def body(data: bytes, eos: bool, response=False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)


@pytest.fixture(params=TRANSPORTS)
async def served(request):
    started: list = []

    async def start(picker, **kw):
        srv = EppServer(picker, host="127.0.0.1", port=0, transport=request.param, **kw)
        port = await srv.start()
        client = Envoyish(port)
        started.append((srv, client))
        return srv, client

    yield start
    for srv, client in started:
        await client.close()
        await srv.stop(0)


async def test_health_services_follow_readiness(served):
    srv, client = await served(StaticPickerDouble(["a:1"]))
    assert await client.status("liveness") == SERVING
    assert await client.status("readiness") == NOT_SERVING
    assert await client.status(EXT_PROC_SERVICE) == NOT_SERVING
    await srv.set_ready(True)
    assert await client.status("readiness") == SERVING and await client.status(EXT_PROC_SERVICE) == SERVING
    await srv.set_ready(False)
    assert await client.status(EXT_PROC_SERVICE) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await client.status("no-such-service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_one_request_and_its_response_over_grpc(served):
    picker = StaticPickerDouble(["10.0.0.1:8000", "10.0.0.2:8000"], salt="s1")
    srv, client = await served(picker)
    call = client.process()
    await call.write(headers())
    await call.write(body(b'{"model":"m","cache_salt":"mine",', False))
    await call.write(body(b'"messages":[]}', True))
    h, b = await call.read(), await call.read()
    mut = {o.header.key: o.header.raw_value for o in h.request_headers.response.header_mutation.set_headers}
    assert mut[DESTINATION_HEADER] == b"10.0.0.1:8000,10.0.0.2:8000"
    assert list(h.request_headers.response.header_mutation.remove_headers) == ["authorization"]
    sent = b.request_body.response.body_mutation.streamed_response.body
    assert json.loads(sent) == {"model": "m", "cache_salt": "s1", "messages": []}
    assert picker.picks[0][1] == b'{"model":"m","cache_salt":"mine","messages":[]}'
    rh = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key=":status", raw_value=b"200"), pb.HeaderValue(key="content-type", raw_value=b"text/event-stream")])))
    rh.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
    await call.write(rh)
    assert (await call.read()).WhichOneof("response") == "response_headers"
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', b"data: [DONE]\n\n"]
    for i, c in enumerate(chunks):
        await call.write(body(c, i == 1, response=True))
        assert (await call.read()).response_body.response.body_mutation.streamed_response.body == c
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    (ctx, outcome), = picker.outcomes
    assert ctx == {"n": 1} and outcome.served_endpoint == "10.0.0.2:8000" and not outcome.ended_early
    assert (srv.stats.streams, srv.stats.picks, srv.stats.observed) == (1, 1, 1)


class Exploding(StaticPickerDouble):
    def __init__(self, exc: Exception) -> None:
        super().__init__(["a:1"])
        self.exc = exc

    async def pick(self, headers, body, subset):
        raise self.exc


@pytest.mark.parametrize("exc,status,code", [(RuntimeError("bug with secret sk-123"), 500, "picker_error"),
                                             (ApiError(413, "too big", code="body_too_large"), 413, "body_too_large")])
async def test_picker_exception_becomes_an_immediate_response(served, exc, status, code, caplog):
    srv, client = await served(Exploding(exc))
    call = client.process()
    await call.write(headers(eos=True))
    resp = await call.read()
    assert resp.immediate_response.status.code == status
    err = json.loads(resp.immediate_response.body)["error"]
    assert err["code"] == code and "sk-123" not in err["message"]
    assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
    assert srv.stats.rejects == 1 and srv.stats.picker_errors == (1 if status == 500 else 0)


async def test_protocol_error_ends_the_stream_with_invalid_argument(served):
    srv, client = await served(StaticPickerDouble(["a:1"]))
    call = client.process()
    await call.write(body(b"{}", True))  # a body before any headers
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert srv.stats.protocol_errors == 1


async def test_stream_cancelled_after_the_pick_is_observed_as_ended_early(served):
    picker = StaticPickerDouble(["a:1"])
    srv, client = await served(picker)
    call = client.process()
    await call.write(headers(eos=True))
    await call.read()
    call.cancel()
    await asyncio.wait_for(picker.observed.wait(), 5)
    assert picker.outcomes[0][1].ended_early and srv.stats.ended_early == 1


async def test_stop_lets_open_streams_finish_and_refuses_new_ones(served):
    picker = StaticPickerDouble(["a:1"], delay_s=0.5)
    srv, client = await served(picker)
    await srv.set_ready(True)
    call = client.process()
    await call.write(headers(eos=True))
    await asyncio.sleep(0.1)  # the pick is under way
    stopping = asyncio.create_task(srv.stop(5))
    await asyncio.sleep(0.05)
    resp = await call.read()  # answered after stop() began
    assert resp.WhichOneof("response") == "request_headers"
    await call.done_writing()
    await stopping
    late = client.process()
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await late.write(headers(eos=True))
        await late.read()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_stop_ends_streams_still_open_after_the_grace_period(served):
    """A stream that outlasts the grace is ended (the client sees the RPC fail, not hang) and
    stop() returns promptly."""
    picker = StaticPickerDouble(["a:1"], delay_s=30)
    srv, client = await served(picker)
    call = client.process()
    await call.write(headers(eos=True))
    await asyncio.sleep(0.1)  # the pick is under way
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await srv.stop(0.3)
    assert loop.time() - t0 < 3
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await asyncio.wait_for(call.read(), 5)
    assert exc.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


async def test_port_in_use_is_an_error(served):
    srv, _ = await served(StaticPickerDouble(["a:1"]))
    second = EppServer(StaticPickerDouble(["a:1"]), host="127.0.0.1", port=srv.port, transport=srv.transport)
    with pytest.raises(OSError if srv.transport == "h2" else RuntimeError):  # grpcio: RuntimeError("Failed to bind")
        await second.start()


async def test_unknown_method_is_unimplemented(served):
    _, client = await served(StaticPickerDouble(["a:1"]))
    call = client.channel.unary_unary("/no.such.Service/Nothing")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(b"", timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_message_over_the_limit_is_refused_and_the_server_goes_on(served):
    srv, client = await served(StaticPickerDouble(["a:1"]), max_body_bytes=1024)
    call = client.process()
    await call.write(headers())
    await call.write(body(b"x" * (200 * 1024), True))  # over max_body_bytes + the framing allowance
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = client.process()  # the next stream on the same connection is served
    await ok.write(headers(eos=True))
    assert (await ok.read()).WhichOneof("response") == "request_headers"
    await ok.done_writing()


async def test_h2_refuses_compressed_messages():
    """grpcio's server decompresses; the h2 transport refuses (Envoy's gRPC client does not compress)."""
    srv = EppServer(StaticPickerDouble(["a:1"]), host="127.0.0.1", port=0, transport="h2")
    client = Envoyish(await srv.start())
    try:
        call = client.channel.stream_stream(METHOD, request_serializer=pb.ProcessingRequest.SerializeToString,
                                            response_deserializer=pb.ProcessingResponse.FromString)(
            compression=grpc.Compression.Gzip)
        await call.write(body(b"a" * 20000, True))  # compressible: gRPC sends a message uncompressed when gzip would not shrink it
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await client.close()
        await srv.stop(0)
