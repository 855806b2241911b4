"""Relay stage: an attempt's answer to the client, whole or streamed.

Rules:
- A whole answer (non-streamed, or a 4xx the engine gave) goes out as one response. An engine's
  error body is re-shaped into OpenAI's error shape (`errors.engine_error`), so the client sees
  one shape whoever refused the request.
- A stream: headers and the first event(s) go out in one send (with the end of the body too when
  the engine already finished); later chunks are relayed from the upstream connection's data
  callback, not by a task wake-up per token event (that was most of the gateway's CPU on long
  streams), through `proxy.SseRelay` (which decides what bytes the client gets). Flow control
  runs from the client's send buffer back to the upstream socket (`on_flow` -> pause/resume).
- The stream ends in exactly one of these ways: whole (the engine's `[DONE]`); the engine failed
  or sent nothing for `idle_timeout_s` (an OpenAI-style error event ends the client's stream, and
  the upstream is closed, which aborts the engine's request); the engine's stream ended without
  `[DONE]` (error event "truncated"); the client went away (upstream closed). An idle timeout
  needs no timer per chunk: one watchdog per stream re-arms itself from the last chunk's time.
`relay()` returns what happened (`Relayed`); the caller counts and learns from it.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.errors import engine_error, sse_error_event
from gateway.proxy import Attempt
from gateway.upstream import UpstreamError

__all__ = ["Relayed", "relay", "send_whole"]

log = logging.getLogger("warmroute.gateway.relay")


@dataclass(frozen=True, slots=True)
class Relayed:
    client_gone: bool  # the client disconnected before the answer was whole
    error: str | None  # why a stream did not end whole ("truncated", "idle timeout", an I/O reason); None if it did
    usage: Any  # the engine's usage object, when one was seen
    decode_step_s: float | None  # mean interval between content events (None: fewer than 3)
    final: dict | None = None  # a Responses answer's response object (whole, or a stream's last event's)


async def send_whole(client, at: Attempt, headers: dict[str, str]) -> Relayed:
    """A whole body to the client; an engine error re-shaped (module rules)."""
    body, ctype = at.body, at.content_type
    if at.status >= 400:
        e = engine_error(at.status, at.body)
        body, ctype = e.body(), "application/json"
        headers = {**e.headers, **headers}
    try:
        await client.send(at.status, {**headers, "Content-Type": ctype}, body)
    except ConnectionResetError:
        return Relayed(True, None, None, None)
    obj = _decoded(at.body) if at.status == 200 else None
    usage = obj.get("usage") if obj is not None else None
    return Relayed(False, None, usage, None, obj if obj is not None and obj.get("object") == "response" else None)


async def relay(client, at: Attempt, headers: dict[str, str], *, idle_timeout_s: float,
                request_id: str = "") -> Relayed:
    """Stream `at` (an open upstream SSE response) to `client`; see the module rules."""
    s = _Stream(client, at, idle_timeout_s, request_id)
    try:
        # Headers and the first event(s) in one send (and the end of the body, if it came too).
        await client.start(200, {**headers, "Content-Type": at.content_type, "Cache-Control": "no-cache"},
                           at.body, end=s.ended)
        client.on_flow(at.resp.pause_reading, at.resp.resume_reading)
        at.resp.pipe(s.on_data, s.on_end)
        err = await s.done
        reason = await s.finish(err)
    except ConnectionResetError:
        at.resp.close()  # the client went away: closing the upstream aborts the engine's request
        return Relayed(True, None, at.relay.usage, None, at.relay.final)
    except asyncio.CancelledError:
        at.resp.close()
        raise
    finally:
        s.stop()
    return Relayed(False, reason, at.relay.usage, _decode_step_s(at.relay), at.relay.final)


class _Stream:
    """The callback side of one relayed stream (module rules)."""

    __slots__ = ("client", "at", "idle_s", "request_id", "loop", "last", "handle", "ended", "done", "idle_expired")

    def __init__(self, client, at: Attempt, idle_s: float, request_id: str) -> None:
        self.client, self.at, self.idle_s, self.request_id = client, at, idle_s, request_id
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # time of the last upstream chunk
        self.handle = self.loop.call_later(idle_s, self.watchdog)
        # [DONE] went out together with the end of the chunked body (one send, not two); the
        # upstream is then only read to its end, so its connection goes back to the pool.
        self.ended = at.relay.done
        self.done: asyncio.Future = self.loop.create_future()  # resolves to None or an UpstreamError
        self.idle_expired = UpstreamError("io", "idle timeout")

    def watchdog(self) -> None:
        remaining = self.last + self.idle_s - self.loop.time()
        if remaining > 0:
            self.handle = self.loop.call_later(remaining, self.watchdog)
        else:
            self.on_end(self.idle_expired)

    def on_data(self, chunk: bytes) -> None:
        self.last = self.loop.time()
        relay = self.at.relay
        try:
            out = relay.feed(chunk)
            if self.ended:
                return
            if relay.done:
                self.ended = True
                self.client.end_nowait(out)
            elif out:
                self.client.write_nowait(out)
        except Exception:  # noqa: BLE001 - a relay bug ends this stream, nothing else
            log.exception("relay failed", extra={"fields": {"request_id": self.request_id}})
            self.on_end(UpstreamError("io", "relay error"))

    def on_end(self, err: UpstreamError | None) -> None:
        if not self.done.done():
            self.done.set_result(err)

    async def finish(self, err: UpstreamError | None) -> str | None:
        """End the client's stream after the upstream ended with `err`; the failure reason, if any."""
        client = self.client
        if err is self.idle_expired:
            self.at.resp.close()  # stop the engine's request, and the pipe: nothing more from it
        if err is not None:
            if not self.ended:
                await client.write(sse_error_event(f"upstream replica sent nothing for {self.idle_s:g}s"
                                                   if err is self.idle_expired
                                                   else f"upstream replica failed mid-stream ({err.reason})",
                                                   responses=self.at.relay.responses))
            await client.end()
            return err.reason
        if self.ended:
            await client.end()
            return None
        tail = self.at.relay.tail()
        if tail:
            await client.write(tail)
        responses = self.at.relay.responses
        await client.write(sse_error_event(f"upstream stream ended without {'its last event' if responses else '[DONE]'}",
                                           responses=responses))
        await client.end()
        return "truncated"

    def stop(self) -> None:
        self.handle.cancel()
        self.client.on_flow(None, None)
        if not self.at.resp.closed:
            self.at.resp.release()


def _decode_step_s(relay) -> float | None:
    if relay.content_events >= 3 and relay.t_last_event > relay.t_first_event:
        return (relay.t_last_event - relay.t_first_event) / (relay.content_events - 1)
    return None


def _decoded(body: bytes) -> dict | None:
    """A whole answer's JSON object, when it has a usage (a chat, completion or response)."""
    if b'"usage"' not in body:
        return None
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None
