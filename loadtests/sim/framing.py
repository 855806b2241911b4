"""The simulated replica's answers as vLLM frames them (server.py, choices.py): its error bodies,
the event that ends a stream whose request the engine dropped, a stream's last events, and the
record that connects an engine request to the HTTP handler streaming it."""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

__all__ = ["Stream", "error_response", "json_response", "aborted_event", "aborted_response", "end_stream"]

_json = msgspec.json.Encoder()


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def aborted_event(reason: str) -> bytes:
    """The error event vLLM ends a stream with when its engine dropped the request (crash, restart)."""
    err = {"error": {"message": f"request aborted: {reason}", "type": "InternalServerError", "param": None, "code": 500}}
    return b"data: " + _json.encode(err) + b"\n\n"


def aborted_response(reason: str) -> web.Response:
    """The same, for a whole answer."""
    return error_response(f"request aborted: {reason}", 500, "InternalServerError")


async def end_stream(resp: web.StreamResponse, parts: list[bytes], usage_chunk: dict | None) -> web.StreamResponse:
    """Write a stream's last events (`parts`, the usage chunk when asked for, [DONE]) and end it."""
    if usage_chunk is not None:
        parts.append(b"data: " + _json.encode(usage_chunk) + b"\n\n")
    parts.append(b"data: [DONE]\n\n")
    await resp.write(b"".join(parts))
    await resp.write_eof()
    return resp


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


class Stream:
    """Connects an engine request to its HTTP handler."""

    __slots__ = ("event", "done", "aborted", "t_arrival", "t_first", "n_delivered", "t_sched", "trace")

    def __init__(self, t_arrival: float) -> None:
        self.event = asyncio.Event()
        # output tokens whose modelled time has come; the engine's own count runs a step ahead
        self.n_delivered = 0
        self.done = False  # the engine finished the request
        self.aborted: str | None = None  # why the engine dropped it (crash, restart)
        self.t_arrival = t_arrival
        self.t_first: float | None = None
        self.t_sched: float | None = None  # start of the first step that scheduled it (traced only)
        self.trace: dict | None = None  # its timeline record when the server traces (SimConfig.trace)
