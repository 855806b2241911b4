"""The Endpoint Picker's gRPC service: Envoy's `ExternalProcessor.Process` bidirectional stream,
one per HTTP request, plus the gRPC health services, on one of two transports: `h2` (the
default, gateway.epp.h2_transport: an asyncio protocol over the `h2` library) or `grpcio`
(gateway.epp.grpcio_transport: grpc.aio, the reference; ~1.4x the picker's CPU per request).

This module is what both transports run: `serve_stream` reads a message, hands it to the
conversation (`gateway.epp.extproc.ExtProcStream`), writes the replies in order, and calls the
`Picker` for the two things only the picker knows: `pick()` once the request is complete,
`observe()` once its response ended (or the stream stopped). Decisions, body rewriting and
learning are the picker's; protocol rules are the conversation's; framing is the transport's.

Failure rules: a picker exception becomes a 500 ImmediateResponse in OpenAI's error shape (the
client gets an answer, the error is logged without the request body); a protocol error ends the
stream with INVALID_ARGUMENT so Envoy applies its configured failure mode; an `observe()`
exception is logged and dropped (the response is already on its way).

Health (gRPC Health Checking Protocol): `liveness` is SERVING while the process runs;
`readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` follow `set_ready()` (the owner
says when its replicas and index are usable), and all go NOT_SERVING when `stop()` begins.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from grpc_health.v1 import health_pb2

from gateway.epp.extproc import (BUFFERED, FULL_DUPLEX_STREAMED, ExtProcStream, Outcome, Pick, ProtocolError, Reject,
                                 RequestComplete)
from gateway.epp.grpcio_transport import GrpcioServer
from gateway.epp.h2_transport import H2GrpcServer
from gateway.epp.wire import ext_proc_pb2 as pb
from gateway.errors import ApiError

__all__ = ["Picker", "EppServer", "EppStats", "EXT_PROC_SERVICE", "HEALTH_SERVICES", "METHOD", "TRANSPORTS"]

log = logging.getLogger("warmroute.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = f"/{EXT_PROC_SERVICE}/Process"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)
TRANSPORTS = ("h2", "grpcio")  # gateway.epp.h2_transport (default), gateway.epp.grpcio_transport
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_GRPC_OVERHEAD_BYTES = 64 * 1024  # message framing and headers on top of a body
_RESPONSE_PHASE = frozenset({"response_headers", "response_body", "response_trailers"})  # no pick, no wait


@runtime_checkable
class Picker(Protocol):
    """What the server asks for each request. The gateway's request pipeline implements it."""

    async def pick(self, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None) -> Pick | Reject:
        """Decide one request. `headers`: lower-case names, pseudo-headers included (":path",
        ":method", ":authority"); `body`: the whole request body (b"" for none); `subset`: the
        proxy's endpoint subset hint (None: the whole pool). Return the endpoints to try in order
        and the body to forward, or a Reject (4xx/429/503 in OpenAI's error shape)."""
        ...

    def observe(self, ctx: Any, outcome: Outcome) -> None:
        """Called exactly once per Pick (never for a Reject) when its response ended or its
        stream stopped; `ctx` is `Pick.ctx`. Must not block: it runs on the event loop."""
        ...


@dataclass(slots=True)
class EppStats:
    """Counters of one server (for tests and the owner's metrics)."""

    streams: int = 0  # Process streams opened
    picks: int = 0  # requests answered with a Pick
    rejects: int = 0  # requests answered with an ImmediateResponse (picker's or protocol's)
    picker_errors: int = 0  # pick() raised: answered 500
    protocol_errors: int = 0  # streams ended with INVALID_ARGUMENT
    observed: int = 0  # observe() calls
    ended_early: int = 0  # outcomes whose response stopped before it ended


class EppServer:
    """One gRPC server: ext_proc + health on `port` (and health also on `health_port`, if set)."""

    def __init__(self, picker: Picker, *, host: str = "0.0.0.0", port: int = 9002, health_port: int | None = None,
                 max_body_bytes: int = 8 * 1024 * 1024, default_request_body_mode: int = FULL_DUPLEX_STREAMED,
                 default_response_body_mode: int = FULL_DUPLEX_STREAMED, transport: str = "h2") -> None:
        if default_request_body_mode not in (FULL_DUPLEX_STREAMED, BUFFERED):
            raise ValueError("default_request_body_mode: FULL_DUPLEX_STREAMED or BUFFERED")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: one of {', '.join(TRANSPORTS)}")
        self.picker = picker
        self.host = host
        self.port = port  # 0: ephemeral; the bound port after start()
        self.health_port = health_port
        self.max_body_bytes = max_body_bytes
        self.default_request_body_mode = default_request_body_mode  # when Envoy sends no protocol_config
        self.default_response_body_mode = default_response_body_mode
        self.transport = transport
        self.stats = EppStats()
        self._health = {service: _NOT_SERVING for service in (*HEALTH_SERVICES, "")}  # "": the server as a whole
        self._server: H2GrpcServer | GrpcioServer | None = None

    async def start(self) -> int:
        """Bind and serve; returns the ext_proc port. Not ready until `set_ready(True)`."""
        limit = self.max_body_bytes + _GRPC_OVERHEAD_BYTES  # BUFFERED mode sends the whole body in one message
        self._health["liveness"] = _SERVING
        if self.transport == "h2":
            server = H2GrpcServer(self.serve_stream, self._health.get, method=METHOD, max_message_bytes=limit)
            self.port = await server.listen(self.host, self.port)
            if self.health_port is not None:
                self.health_port = await server.listen(self.host, self.health_port)
        else:
            server = GrpcioServer(self.serve_stream, service=EXT_PROC_SERVICE, max_message_bytes=limit)
            self.port = server.listen(self.host, self.port)
            if self.health_port is not None:
                self.health_port = server.listen(self.host, self.health_port)
            await server.start(self._health)
        self._server = server
        log.info("endpoint picker serving ext_proc on %s:%d (%s)", self.host, self.port, self.transport)
        return self.port

    async def set_ready(self, ready: bool) -> None:
        """`readiness` and the ext_proc service's health: SERVING iff `ready`."""
        status = _SERVING if ready else _NOT_SERVING
        for service in ("readiness", EXT_PROC_SERVICE, ""):
            self._health[service] = status
        if isinstance(self._server, GrpcioServer):
            await self._server.set_health(self._health)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Health goes NOT_SERVING, new streams are refused, open ones get `grace_s` to finish."""
        if self._server is None:
            return
        for service in self._health:
            self._health[service] = _NOT_SERVING
        server, self._server = self._server, None
        await server.stop(grace_s)

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------------ one stream
    async def serve_stream(self, read, write, inline=None) -> None:
        """One ext_proc stream over any transport: `read()` -> the next ProcessingRequest or None
        at the end; `write(ProcessingResponse)`. Raises ProtocolError (the transport ends the
        stream with INVALID_ARGUMENT). `inline(handler)`, when the transport offers it, receives
        `handler(msg, write_now) -> bool`: the transport may hand it a message in its own callback
        while this task waits in `read()`; it takes a response-phase message (no wait: replies via
        the synchronous `write_now`) and returns True, or returns False and leaves it to `read()`.
        A streamed answer's ~35 messages then cost no task switch each."""
        st = self.stats
        st.streams += 1
        conv = ExtProcStream(max_body_bytes=self.max_body_bytes, request_body_mode=self.default_request_body_mode,
                             response_body_mode=self.default_response_body_mode)
        if inline is not None:
            inline(partial(self._take_now, conv))
        try:
            while True:
                msg = await read()
                if msg is None:
                    return
                replies, event = self._receive(conv, msg)
                if event is not None and type(event) is not RequestComplete:
                    # The response ended. Envoy may cancel the stream as soon as it has our last
                    # reply, which interrupts that write: observe whatever happens to it.
                    try:
                        for r in replies:
                            await write(r)
                    finally:
                        self._observe(event.ctx, event.outcome)
                    continue
                for r in replies:
                    await write(r)
                if event is None:
                    if conv.rejected:
                        st.rejects += 1
                        return
                    continue
                result = await self._pick(event)
                for r in conv.decide(result):
                    await write(r)
                if conv.rejected:
                    st.rejects += 1
                    return
                st.picks += 1
        finally:
            done = conv.close()
            if done is not None:
                self._observe(done.ctx, done.outcome)

    def _receive(self, conv: ExtProcStream, msg: pb.ProcessingRequest):
        """`conv.receive(msg)`; a protocol error is counted and logged, then raised."""
        try:
            return conv.receive(msg)
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            log.warning("ext_proc protocol error: %s", exc)
            raise

    def _take_now(self, conv: ExtProcStream, msg: pb.ProcessingRequest, write_now) -> bool:
        """`serve_stream`'s `inline` handler: the loop's work for a response-phase message."""
        if msg.WhichOneof("request") not in _RESPONSE_PHASE or conv.rejected:
            return False
        replies, event = self._receive(conv, msg)
        try:
            for r in replies:
                write_now(r)
        finally:  # as in the loop: a reply Envoy cut short still observes the response
            if event is not None:
                self._observe(event.ctx, event.outcome)
        return True

    async def _pick(self, event: RequestComplete) -> Pick | Reject:
        try:
            return await self.picker.pick(event.headers, event.body, event.subset)
        except ApiError as err:
            return Reject.from_api_error(err)
        except Exception:  # noqa: BLE001 - the client gets a 500, the server goes on
            self.stats.picker_errors += 1
            log.exception("picker failed on %s %s", event.headers.get(":method"), event.headers.get(":path"))
            return Reject.from_api_error(ApiError(500, "the endpoint picker failed on this request", code="picker_error"))

    def _observe(self, ctx: Any, outcome: Outcome) -> None:
        st = self.stats
        st.observed += 1
        if outcome.ended_early:
            st.ended_early += 1
        try:
            self.picker.observe(ctx, outcome)
        except Exception:  # noqa: BLE001
            log.exception("picker observe() failed")
