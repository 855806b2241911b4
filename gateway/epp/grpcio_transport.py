"""The Endpoint Picker's gRPC transport on grpcio's asyncio server (`--transport grpcio`): the
`Process` bidirectional stream and the standard health services (Check and Watch), around
`EppServer.serve_stream`. Kept beside the `h2` transport (the default, gateway.epp.h2_transport)
as the reference implementation of gRPC: the Envoy tests run against both, and
loadtests/bench_epp compares them. It costs ~120-150 us of CPU per message round trip.
"""
from __future__ import annotations

from typing import Callable, Mapping

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from gateway.epp.extproc import ProtocolError
from gateway.epp.wire import ext_proc_pb2 as pb

__all__ = ["GrpcioServer"]


class GrpcioServer:
    """One grpc.aio server: `service`/`Process` served by `handler(read, write)`, and health."""

    def __init__(self, handler: Callable, *, service: str, max_message_bytes: int) -> None:
        self.handler = handler
        self.health = health.aio.HealthServicer()
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", max_message_bytes),  # BUFFERED mode sends the whole body in one message
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silent second listener
        ])
        rpc = grpc.stream_stream_rpc_method_handler(self._process, request_deserializer=pb.ProcessingRequest.FromString,
                                                    response_serializer=pb.ProcessingResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Process": rpc}),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._server = server

    def listen(self, host: str, port: int) -> int:
        """Bind `host:port` (before start). A port in use raises RuntimeError (grpcio's)."""
        return self._server.add_insecure_port(f"{host}:{port}")

    async def start(self, health_status: Mapping[str, int]) -> None:
        await self.set_health(health_status)
        await self._server.start()

    async def set_health(self, health_status: Mapping[str, int]) -> None:
        for service, status in health_status.items():
            await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)

    async def wait_closed(self) -> None:
        await self._server.wait_for_termination()

    async def _process(self, _requests, context: grpc.aio.ServicerContext) -> None:
        read = context.read
        eof = grpc.aio.EOF

        async def next_message() -> pb.ProcessingRequest | None:
            msg = await read()
            return None if msg is eof else msg

        try:
            await self.handler(next_message, context.write)
        except ProtocolError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

