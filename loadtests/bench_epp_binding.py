"""ext_proc binding benchmark (not a test): CPU per message and per picked request of each way
to speak Envoy's external processing protocol from Python, side by side in one run.

Bindings (message classes + gRPC server):
  upb+grpcio        gateway/epp/wire (protobuf's C runtime, upb) on grpcio's asyncio server (C core)
  upb+grpclib       the same messages on grpclib (pure-Python HTTP/2 via h2)
  betterproto+grpclib  envoy-data-plane's betterproto2 dataclasses on grpclib (the package's own stack)
(xds-protos would be upb+grpcio again, with the generated closure of the whole Envoy API; it is
not measured because installing it breaks the OpenTelemetry exporter: see gateway/epp/wire.)

Two phases:
  codec   in this process: decode a request-headers message (16 headers), decode a 2 KiB body
          chunk, encode the pick (header mutation + dynamic metadata + streamed body), encode one
          passthrough SSE chunk. Microseconds of CPU per operation.
  stream  the server runs in its own process; a grpcio client process plays Envoy: per request,
          headers + one body chunk (end of stream), the server answers headers + body, then
          response headers and `--chunks` response body chunks, each answered by a passthrough.
          Server CPU (from /proc) per request at each concurrency level, and requests/s.

Run: python -m loadtests.bench_epp_binding [--levels 1,32] [--seconds 4] [--chunks 20] [--json FILE]
(betterproto+grpclib needs `pip install envoy-data-plane grpclib`, both in the test extra.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time

from loadtests.ports import free_port
from loadtests.runner import process_cpu_s

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BINDINGS = ("upb+grpcio", "upb+grpclib", "betterproto+grpclib")
_HEADERS = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gw.example"), (":scheme", "http"),
            ("content-type", "application/json"), ("content-length", "2048"), ("authorization", "Bearer sk-" + "x" * 40),
            ("user-agent", "OpenAI/Python 1.99.0"), ("accept", "application/json"), ("x-request-id", "5d6c1c8e-4b1f-4e8a-9a0e-7f1d2c3b4a59"),
            ("x-forwarded-proto", "http"), ("x-stainless-lang", "python"), ("x-stainless-os", "Linux"),
            ("x-stainless-runtime", "CPython"), ("x-envoy-expected-rq-timeout-ms", "300000"), ("accept-encoding", "gzip")]
_BODY = (b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + b"lorem ipsum " * 165 + b'"}]}')
_SSE = b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
_EP = "10.0.0.7:8000,10.0.0.8:8000"


# --------------------------------------------------------------------------- the two message APIs
class UpbMessages:
    """gateway/epp/wire: protobuf's generated classes."""

    def __init__(self) -> None:
        from google.protobuf import struct_pb2

        from gateway.epp.wire import ext_proc_pb2 as pb

        self.pb, self.struct_pb2 = pb, struct_pb2
        self.Req, self.Resp = pb.ProcessingRequest, pb.ProcessingResponse

    def request_headers(self) -> object:
        pb = self.pb
        hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in _HEADERS])
        return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm),
                                    protocol_config=pb.ProtocolConfiguration(request_body_mode=4, response_body_mode=4))

    def body(self, data: bytes, eos: bool, response: bool) -> object:
        b = self.pb.HttpBody(body=data, end_of_stream=eos)
        return self.pb.ProcessingRequest(response_body=b) if response else self.pb.ProcessingRequest(request_body=b)

    def response_headers(self) -> object:
        pb = self.pb
        hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":status", raw_value=b"200"),
                                   pb.HeaderValue(key="content-type", raw_value=b"text/event-stream")])
        md = pb.Metadata()
        md.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.7:8000"})
        return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm), metadata_context=md)

    def kind(self, msg) -> str:
        return msg.WhichOneof("request")

    def headers_of(self, msg) -> dict:
        return {h.key: h.raw_value for h in msg.request_headers.headers.headers}

    def body_of(self, msg, response: bool) -> tuple[bytes, bool]:
        b = msg.response_body if response else msg.request_body
        return b.body, b.end_of_stream

    def pick(self, body: bytes) -> list:
        pb = self.pb
        opt = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        mut = pb.HeaderMutation(set_headers=[
            pb.HeaderValueOption(header=pb.HeaderValue(key="x-gateway-destination-endpoint", raw_value=_EP.encode()), append_action=opt),
            pb.HeaderValueOption(header=pb.HeaderValue(key="content-length", raw_value=str(len(body)).encode()), append_action=opt)])
        h = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mut)))
        h.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value = _EP
        b = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True)))))
        return [h, b]

    def continue_headers(self) -> object:
        return self.pb.ProcessingResponse(response_headers=self.pb.HeadersResponse())

    def passthrough(self, data: bytes, eos: bool) -> object:
        pb = self.pb
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=eos)))))

    def encode(self, msg) -> bytes:
        return msg.SerializeToString()


class BetterprotoMessages:
    """envoy-data-plane: betterproto2 dataclasses generated from the whole Envoy API."""

    def __init__(self) -> None:
        import betterproto2
        from envoy_data_plane.envoy.config.core import v3 as core
        from envoy_data_plane.envoy.service.ext_proc import v3 as ep
        from envoy_data_plane.google import protobuf as gp

        self.bp, self.core, self.ep, self.gp = betterproto2, core, ep, gp
        self.Req, self.Resp = ep.ProcessingRequest, ep.ProcessingResponse

    def request_headers(self) -> object:
        core, ep = self.core, self.ep
        hm = core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in _HEADERS])
        return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm), protocol_config=ep.ProtocolConfiguration(
            request_body_mode=4, response_body_mode=4))

    def body(self, data: bytes, eos: bool, response: bool) -> object:
        b = self.ep.HttpBody(body=data, end_of_stream=eos)
        return self.ep.ProcessingRequest(response_body=b) if response else self.ep.ProcessingRequest(request_body=b)

    def response_headers(self) -> object:
        core, ep, gp = self.core, self.ep, self.gp
        hm = core.HeaderMap(headers=[core.HeaderValue(key=":status", raw_value=b"200"),
                                     core.HeaderValue(key="content-type", raw_value=b"text/event-stream")])
        md = core.Metadata(filter_metadata={"envoy.lb": gp.Struct(fields={
            "x-gateway-destination-endpoint-served": gp.Value(string_value="10.0.0.7:8000")})})
        return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm), metadata_context=md)

    def kind(self, msg) -> str:
        return self.bp.which_one_of(msg, "request")[0]

    def headers_of(self, msg) -> dict:
        return {h.key: h.raw_value for h in msg.request_headers.headers.headers}

    def body_of(self, msg, response: bool) -> tuple[bytes, bool]:
        b = msg.response_body if response else msg.request_body
        return b.body, b.end_of_stream

    def pick(self, body: bytes) -> list:
        core, ep, gp = self.core, self.ep, self.gp
        opt = core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
        mut = ep.HeaderMutation(set_headers=[
            core.HeaderValueOption(header=core.HeaderValue(key="x-gateway-destination-endpoint", raw_value=_EP.encode()), append_action=opt),
            core.HeaderValueOption(header=core.HeaderValue(key="content-length", raw_value=str(len(body)).encode()), append_action=opt)])
        md = gp.Struct(fields={"envoy.lb": gp.Value(struct_value=gp.Struct(fields={
            "x-gateway-destination-endpoint": gp.Value(string_value=_EP)}))})
        h = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mut)), dynamic_metadata=md)
        b = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=True)))))
        return [h, b]

    def continue_headers(self) -> object:
        return self.ep.ProcessingResponse(response_headers=self.ep.HeadersResponse())

    def passthrough(self, data: bytes, eos: bool) -> object:
        ep = self.ep
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=data, end_of_stream=eos)))))

    def encode(self, msg) -> bytes:
        return bytes(msg)


def messages_for(binding: str):
    return BetterprotoMessages() if binding.startswith("betterproto") else UpbMessages()


# --------------------------------------------------------------------------- codec phase
def codec_phase(binding: str, n: int) -> dict[str, float]:
    m = messages_for(binding)
    wire_headers = m.encode(m.request_headers())
    wire_body = m.encode(m.body(_BODY, True, False))
    out: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        fn()
        t0 = time.process_time()
        for _ in range(n):
            fn()
        out[name] = (time.process_time() - t0) / n * 1e6

    parse = (lambda b: m.Req.FromString(b)) if not binding.startswith("betterproto") else (lambda b: m.Req.parse(b))
    timed("decode_headers_us", lambda: m.headers_of(parse(wire_headers)))
    timed("decode_body_us", lambda: m.body_of(parse(wire_body), False))
    timed("encode_pick_us", lambda: [m.encode(r) for r in m.pick(_BODY)])
    timed("encode_passthrough_us", lambda: m.encode(m.passthrough(_SSE, False)))
    return out


# --------------------------------------------------------------------------- servers (own process)
def _handle_sync(m, kind: str, msg, state: dict) -> list:
    """The picker's work per message, identical for every binding: answer in ext_proc order."""
    if kind == "request_headers":
        state["headers"] = m.headers_of(msg)
        return []
    if kind == "request_body":
        data, eos = m.body_of(msg, False)
        state["body"] = state.get("body", b"") + data
        return m.pick(state["body"]) if eos else []
    if kind == "response_headers":
        return [m.continue_headers()]
    if kind == "response_body":
        data, eos = m.body_of(msg, True)
        return [m.passthrough(data, eos)]
    return []


def server_main(binding: str, port: int, ready) -> None:
    import uvloop

    m = messages_for(binding)

    async def grpcio_server() -> None:
        import grpc

        async def process(_it, ctx):
            state: dict = {}
            while True:
                msg = await ctx.read()
                if msg is grpc.aio.EOF:
                    return
                for r in _handle_sync(m, msg.WhichOneof("request"), msg, state):
                    await ctx.write(r)

        srv = grpc.aio.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("envoy.service.ext_proc.v3.ExternalProcessor", {
            "Process": grpc.stream_stream_rpc_method_handler(process, request_deserializer=m.Req.FromString,
                                                              response_serializer=m.Resp.SerializeToString)}),))
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        ready.set()
        await srv.wait_for_termination()

    async def grpclib_server() -> None:
        import grpclib.const
        from grpclib.server import Server

        async def process(stream) -> None:
            state: dict = {}
            while True:
                msg = await stream.recv_message()
                if msg is None:
                    return
                for r in _handle_sync(m, m.kind(msg), msg, state):
                    await stream.send_message(r)

        class Svc:
            def __mapping__(self):
                return {METHOD: grpclib.const.Handler(process, grpclib.const.Cardinality.STREAM_STREAM, m.Req, m.Resp)}

        srv = Server([Svc()])
        await srv.start("127.0.0.1", port)
        ready.set()
        await srv.wait_closed()

    uvloop.run(grpcio_server() if binding == "upb+grpcio" else grpclib_server())


# --------------------------------------------------------------------------- the Envoy-playing client
def client_main(port: int, levels: list[int], seconds: float, chunks: int, server_pid: int, out) -> None:
    import grpc
    import uvloop

    m = UpbMessages()  # any client speaks to any server: the bytes are the same
    reqs = [m.encode(m.request_headers()), m.encode(m.body(_BODY, True, False)), m.encode(m.response_headers())]
    resp_chunks = [m.encode(m.body(_SSE, i == chunks - 1, True)) for i in range(chunks)]

    async def run() -> dict:
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call_of = ch.stream_stream(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)

        async def one() -> None:
            call = call_of()
            await call.write(reqs[0])
            await call.write(reqs[1])
            await call.read()
            await call.read()
            await call.write(reqs[2])
            await call.read()
            for c in resp_chunks:
                await call.write(c)
                await call.read()
            await call.done_writing()

        results = {}
        for level in levels:
            stop_at = [0.0]
            count = [0]

            async def worker() -> None:
                while time.monotonic() < stop_at[0]:
                    await one()
                    count[0] += 1

            stop_at[0] = time.monotonic() + 0.5  # warm-up
            await asyncio.gather(*(worker() for _ in range(level)))
            count[0] = 0
            cpu0, t0 = process_cpu_s(server_pid), time.monotonic()
            stop_at[0] = t0 + seconds
            await asyncio.gather(*(worker() for _ in range(level)))
            wall, cpu = time.monotonic() - t0, process_cpu_s(server_pid) - cpu0
            results[level] = {"requests": count[0], "req_per_s": count[0] / wall,
                              "server_cpu_ms_per_req": cpu / max(1, count[0]) * 1e3,
                              "server_cpu_share": cpu / wall}
        await ch.close()
        return results

    out.put(uvloop.run(run()))


def stream_phase(binding: str, levels: list[int], seconds: float, chunks: int) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    ready = ctx.Event()
    srv = ctx.Process(target=server_main, args=(binding, port, ready), daemon=True)
    srv.start()
    try:
        if not ready.wait(30):
            raise RuntimeError(f"{binding} server did not start")
        out = ctx.Queue()
        cli = ctx.Process(target=client_main, args=(port, levels, seconds, chunks, srv.pid, out), daemon=True)
        cli.start()
        res = out.get(timeout=60 + len(levels) * (seconds + 5) * 4)
        cli.join(10)
        return res
    finally:
        srv.terminate()
        srv.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bindings", default=",".join(BINDINGS))
    p.add_argument("--levels", default="1,32", help="concurrent ext_proc streams")
    p.add_argument("--seconds", type=float, default=4.0, help="measured time per level")
    p.add_argument("--chunks", type=int, default=20, help="response body chunks per request")
    p.add_argument("--codec-n", type=int, default=20000, help="iterations per codec operation")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    report: dict = {"chunks": a.chunks, "body_bytes": len(_BODY), "results": {}}
    for b in a.bindings.split(","):
        try:
            messages_for(b)
            if "grpclib" in b:
                import grpclib  # noqa: F401
        except ImportError as exc:
            print(f"{b}: not installed ({exc.name}); pip install envoy-data-plane grpclib", file=sys.stderr)
            continue
        report["results"][b] = {"codec": codec_phase(b, a.codec_n), "stream": stream_phase(b, levels, a.seconds, a.chunks)}
    res = report["results"]
    names = list(res)
    if not names:
        return 1
    print("per message, CPU us (in-process)        " + "".join(f"{n:>22}" for n in names))
    for k in ("decode_headers_us", "decode_body_us", "encode_pick_us", "encode_passthrough_us"):
        print(f"  {k:<38}" + "".join(f"{res[n]['codec'][k]:>22.1f}" for n in names))
    print(f"per request ({2 + 1 + a.chunks} messages in, {3 + a.chunks} out), server process")
    for lv in levels:
        print(f"  {lv:>3} streams: CPU ms / request      " + "".join(f"{res[n]['stream'][lv]['server_cpu_ms_per_req']:>22.3f}" for n in names))
        print(f"  {lv:>3} streams: requests / s          " + "".join(f"{res[n]['stream'][lv]['req_per_s']:>22.0f}" for n in names))
    base = names[0]
    for n in names[1:]:
        ratios = ", ".join(f"{lv} streams x{res[n]['stream'][lv]['server_cpu_ms_per_req'] / res[base]['stream'][lv]['server_cpu_ms_per_req']:.2f}" for lv in levels)
        print(f"CPU per request, {n} / {base}: {ratios}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
