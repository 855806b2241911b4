"""Upstream calls and the SSE relay.

Rules:
- Proxied requests go through `gateway.upstream.UpstreamPool` (lean HTTP/1.1 keep-alive pool,
  TCP_NODELAY); `make_session()` is the aiohttp session for the rest (health probes, discovery).
- `attempt()` sends one request to one replica and returns once the *first byte the client would
  see* is in hand: for a stream, status 200 plus the first complete SSE event; otherwise the whole
  body. Anything that goes wrong before that (connect refused or timed out, 5xx, no first event
  within `first_byte_timeout_s`, connection lost) raises `UpstreamFailure`, and the caller may
  try the next-ranked replica: the client has seen nothing yet. A 4xx is the engine's verdict on
  the request and is passed through, not retried.
- After the first byte, `SseRelay` forwards events as they complete (never buffering a whole
  response); the server's relay loop allows at most `idle_timeout_s` between upstream chunks (one
  lazily re-armed watchdog per stream, not a timer per chunk), and a failure then ends the
  client's stream with an OpenAI-style error event. The relay notes the first event's time, counts content events for the
  decode rate, and takes `usage` from the chunk that carries it, dropping that chunk when the
  client did not ask for usage (the gateway asks for it upstream for its own accounting). A
  Responses API stream (named events, no [DONE]) is told by its first event: its deltas are the
  content, its last event the end and the usage, and nothing is dropped.
`SseRelay` is pure (bytes in, bytes out); the I/O lives in `attempt()` and the server's loop.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import msgspec

from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse

__all__ = ["UpstreamFailure", "Attempt", "SseRelay", "attempt", "make_session"]

_json_decode = msgspec.json.decode
_SEP = b"\n\n"
_DONE = b"data: [DONE]"


class UpstreamFailure(Exception):
    """A replica failed before the first byte; `reason` is short and safe to log."""

    def __init__(self, phase: str, reason: str, status: int | None = None) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase  # "connect" | "status" | "first_byte"
        self.reason = reason  # e.g. "connection refused", "status 503", "timeout"
        self.status = status


@dataclass(slots=True)
class Attempt:
    status: int  # upstream HTTP status
    content_type: str  # upstream content type
    resp: UpstreamResponse | None  # open response of a stream (None when body is complete)
    body: bytes  # whole body (non-stream) or the first event(s) of a stream, already relayed-filtered
    relay: "SseRelay | None"  # the stream's relay state
    t_sent: float  # perf_counter when the request was sent
    t_first: float  # perf_counter when the first byte the client sees was ready


def make_session(pool_limit: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=pool_limit, limit_per_host=0, keepalive_timeout=30.0,
                                ttl_dns_cache=10, enable_cleanup_closed=False)
    return aiohttp.ClientSession(
        connector=conn,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        auto_decompress=False,
        # A proxy keeps no cookies: a replica's Set-Cookie must not ride on other tenants' requests,
        # and the default jar costs a filter/update on every request and response.
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
    )


class SseRelay:
    """Splits upstream bytes into SSE events and decides what the client gets (pure)."""

    __slots__ = ("client_wants_usage", "_buf", "usage", "content_events", "t_first_event", "t_last_event",
                 "done", "clock", "_responses", "_held", "final")

    def __init__(self, client_wants_usage: bool, clock=time.perf_counter) -> None:
        self.client_wants_usage = client_wants_usage  # False: strip the usage-only chunk
        self._buf = b""
        self.usage: dict | None = None  # the engine's usage object, when seen
        self.content_events = 0  # data events other than usage-only and [DONE]
        self.t_first_event = 0.0  # clock() at the first content event
        self.t_last_event = 0.0  # clock() at the last content event
        self.done = False  # saw data: [DONE] (the Responses API: its last event)
        self.clock = clock
        self._responses: bool | None = None  # a Responses API stream (named events); None: not seen yet
        self._held = b""  # a response's events before its first token (module rules)
        self.final: dict | None = None  # a Responses stream's response object, from its last event

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this chunk (complete events only; may be b"")."""
        buf = self._buf + chunk if self._buf else chunk
        end = buf.rfind(_SEP)
        if end < 0:
            self._buf = buf
            return b""
        complete, self._buf = buf[: end + 2], buf[end + 2:]
        if self._responses is None:
            self._responses = complete.startswith(b"event: response.")
        if self._responses:
            return self._response_events(complete)
        # Fast path: nothing that needs looking at (no usage object, no [DONE]) -> pass through.
        if b'"prompt_tokens"' not in complete and _DONE not in complete:
            n = complete.count(_SEP)
            self._count(n)
            return complete
        out = []
        for ev in complete.split(_SEP):
            if not ev:
                continue
            out.append(self._event(ev))
        return b"".join(out)

    def _count(self, n: int) -> None:
        if n <= 0:
            return
        now = self.clock()
        if self.content_events == 0:
            self.t_first_event = now
        self.t_last_event = now
        self.content_events += n

    def _event(self, ev: bytes) -> bytes:
        if ev.startswith(_DONE):
            self.done = True
            return ev + _SEP
        if b'"prompt_tokens"' in ev and ev.startswith(b"data:"):
            try:
                obj = _json_decode(ev[5:].strip())
            except msgspec.DecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if not obj.get("choices"):  # the usage-only final chunk
                    return ev + _SEP if self.client_wants_usage else b""
                if not self.client_wants_usage:  # continuous usage on a content chunk: drop the field
                    obj.pop("usage", None)
                    self._count(1)
                    return b"data: " + msgspec.json.encode(obj) + _SEP
        self._count(1)
        return ev + _SEP

    def _response_events(self, complete: bytes) -> bytes:
        """A Responses API stream: `event: <type>` then `data: <json>`; a `*.delta` event is content,
        the last event (completed, incomplete, failed) carries the usage and ends it. The events
        before the first content (created, in_progress) are held and go with it, so the first bytes
        out are the first token's, as for chat (`attempt` and the TTFT count from them)."""
        for ev in complete.split(_SEP):
            if not ev.startswith(b"event: "):
                continue
            name = ev[7: ev.find(b"\n")]
            if name.endswith(b".delta"):
                self._count(1)
            elif name in _RESPONSE_ENDS:
                self.done = True
                self.final = _event_response(ev)
                usage = self.final.get("usage") if self.final is not None else None
                self.usage = usage if isinstance(usage, dict) else None
        if self.content_events == 0 and not self.done:
            self._held += complete
            return b""
        if self._held:
            complete, self._held = self._held + complete, b""
        return complete

    @property
    def responses(self) -> bool:
        """The stream is a Responses API one (named events; its errors are `error` events)."""
        return bool(self._responses)

    def tail(self) -> bytes:
        """Whatever incomplete bytes remain at EOF (forwarded as is)."""
        rest, self._buf, self._held = self._held + self._buf, b"", b""
        return rest


_RESPONSE_ENDS = (b"response.completed", b"response.incomplete", b"response.failed")


def _event_response(ev: bytes) -> dict | None:
    """The response object of a Responses API stream's last event (`data: {"response": {...}}`:
    its usage, output and status)."""
    start = ev.find(b"\ndata:")
    try:
        obj = _json_decode(ev[start + 6:]) if start >= 0 else None
    except msgspec.DecodeError:
        return None
    resp = obj.get("response") if isinstance(obj, dict) else None
    return resp if isinstance(resp, dict) else None


async def attempt(pool: UpstreamPool, base_url: str, path: str, body: bytes, headers: dict[str, str], *,
                  stream: bool, client_wants_usage: bool, first_byte_timeout_s: float, method: str = "POST") -> Attempt:
    """One upstream try; see the module rules. Raises UpstreamFailure before the first byte."""
    t_sent = time.perf_counter()
    resp: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(first_byte_timeout_s):
            try:
                resp = await pool.request(base_url, method, path, body, headers)
            except UpstreamError as exc:
                raise UpstreamFailure("connect" if exc.phase == "connect" else "first_byte", exc.reason) from None
            status = resp.status
            ctype = resp.content_type or "application/json"
            if status >= 500:
                try:
                    await resp.read()
                except UpstreamError:
                    pass
                resp.release()
                raise UpstreamFailure("status", f"status {status}", status)
            if not stream or status != 200 or not ctype.startswith("text/event-stream"):
                data = await resp.read()
                resp.release()
                return Attempt(status, ctype, None, data, None, t_sent, time.perf_counter())
            relay = SseRelay(client_wants_usage)
            first = b""
            while not first:
                chunk = await resp.readany()
                if not chunk:  # EOF before any event
                    first = relay.tail()
                    if not first:
                        raise UpstreamFailure("first_byte", "stream ended before its first event")
                    break
                first = relay.feed(chunk)
            return Attempt(status, ctype, resp, first, relay, t_sent, time.perf_counter())
    except UpstreamFailure:
        if resp is not None:
            resp.close()
        raise
    except (TimeoutError, asyncio.TimeoutError):
        if resp is not None:
            resp.close()
        raise UpstreamFailure("first_byte", "timeout") from None
    except UpstreamError as exc:
        if resp is not None:
            resp.close()
        raise UpstreamFailure("first_byte", exc.reason) from None
    except BaseException:
        if resp is not None:
            resp.close()
        raise
