"""Sans-I/O ext_proc conversation for one HTTP request: Envoy's ProcessingRequest messages in,
events and the ProcessingResponse messages to send back out. No sockets, no gRPC, no tasks.

The rules of the Endpoint Picker protocol live here (and nowhere else):
- Request path. Headers, then the body, gathered until `end_of_stream` (or the request
  trailers). In FULL_DUPLEX_STREAMED mode nothing is answered before the body is complete; in
  BUFFERED mode the headers get an immediate CONTINUE and the body arrives whole. A request
  without a body is complete at its headers. Then exactly one `RequestComplete` event: the owner
  answers it with `decide(Pick | Reject)`.
- The pick: header `x-gateway-destination-endpoint` = "ip:port[,ip:port...]" (primary first,
  fallbacks in order; it overwrites any client-sent value) AND the same string in the response's
  dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`, plus the rewritten body with
  its `content-length`. Full duplex: a headers response (mutations + metadata) then the body as
  one streamed chunk; buffered: one body response carrying everything.
- The subset hint (request metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-
  subset`, a list of ip:port) bounds the pick: an empty list is a 503 without asking the picker;
  endpoints of a Pick outside the hint are dropped, and a Pick left with none becomes a 503.
- Refusals are ImmediateResponses in OpenAI's error shape (`Reject`); a body over
  `max_body_bytes` is a 413 decided here.
- Response path. Response headers get a CONTINUE; the served endpoint is read from
  `metadata_context` `envoy.lb` / `x-gateway-destination-endpoint-served`. Every response body
  chunk is passed back untouched at once (full duplex: echoed as a streamed chunk; other modes:
  CONTINUE), while a read-only copy feeds the SSE reader (`gateway.proxy.SseRelay`: usage, first
  event time, [DONE]) or, for a JSON answer, is kept up to a bound to read `usage` at the end.
- One `Outcome` per Pick, never for a Reject: `receive` returns `ResponseDone` when the response
  ends, or `close()` returns it (with `ended_early=True`) when the stream stops first.

Messages out of order raise `ProtocolError` (Envoy's fault, or a mode this module does not
speak); the server then ends the stream with an error and Envoy applies its failure mode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgspec

from gateway.epp.wire import ext_proc_pb2 as pb
from gateway.errors import ApiError
from gateway.proxy import SseRelay

__all__ = [
    "DESTINATION_HEADER", "LB_NAMESPACE", "SUBSET_NAMESPACE", "SUBSET_KEY", "SERVED_KEY",
    "FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE",
    "Pick", "Reject", "Outcome", "RequestComplete", "ResponseDone", "Step", "ProtocolError", "ExtProcStream",
    "immediate",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # and the dynamic-metadata key
LB_NAMESPACE = "envoy.lb"  # metadata namespace of the pick and of the served endpoint
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # request metadata namespace of the subset hint
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

_Mode = pb.ProcessingMode
NONE, STREAMED, BUFFERED, FULL_DUPLEX_STREAMED = _Mode.NONE, _Mode.STREAMED, _Mode.BUFFERED, _Mode.FULL_DUPLEX_STREAMED
_OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_STREAM_CHUNK_BYTES = 1 << 20  # a rewritten request body goes back in pieces of at most this size
_JSON_KEEP_BYTES = 1 << 20  # a non-streamed answer's copy kept to read its usage (larger: no usage)
_decode = msgspec.json.decode


class ProtocolError(Exception):
    """Envoy sent something this conversation cannot follow (order, mode); ends the stream."""


@dataclass(frozen=True, slots=True)
class Pick:
    """The picker's answer: where the request goes and what body it carries."""

    body: bytes  # request body to send upstream (e.g. with the derived cache_salt); ignored for a bodiless request
    endpoints: Sequence[str]  # "ip:port", primary first, then fallbacks in the order to try
    ctx: Any = None  # the picker's own per-request state, handed back to observe()
    set_headers: Mapping[str, str] = field(default_factory=dict)  # extra upstream request headers (overwrite)
    remove_headers: Sequence[str] = ()  # upstream request headers to drop (e.g. the client's credentials)
    strip_usage: bool = False  # drop the usage-only SSE chunk from the answer (the picker asked for it, not the client)


@dataclass(frozen=True, slots=True)
class Reject:
    """An ImmediateResponse: the client gets `status` with `error_json` (OpenAI's error shape)."""

    status: int  # HTTP status: 4xx for the client's mistakes, 429 shed, 503 no endpoint
    error_json: bytes  # {"error": {"message", "type", "param", "code"}}
    headers: Mapping[str, str] = field(default_factory=dict)  # e.g. Retry-After, WWW-Authenticate

    @classmethod
    def from_api_error(cls, err: ApiError) -> "Reject":
        return cls(err.status, err.body(), dict(err.headers))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the response path saw for one picked request (input of the picker's learning)."""

    served_endpoint: str | None  # ip:port Envoy reports as the one that answered (None: not reported)
    status: int | None  # upstream (or Envoy's local) HTTP status; None: no response headers seen
    usage: dict | None  # the engine's `usage` object, when the answer carried one
    ttft_s: float | None  # pick sent -> first SSE event of the answer; None for a non-streamed answer
    decode_s: float | None  # mean interval between content events (>= 3 events), else None
    content_events: int  # SSE data events other than usage-only and [DONE]
    response_bytes: int  # body bytes passed through
    ended_early: bool  # the stream stopped before the answer ended (a stream: before [DONE])


class RequestComplete(NamedTuple):
    """Headers and whole body are in: answer with `decide()`."""

    headers: dict[str, str]  # lower-case names (pseudo-headers included: ":path", ":method")
    body: bytes
    subset: tuple[str, ...] | None  # the proxy's subset hint; None: pick from the whole pool


class ResponseDone(NamedTuple):
    """The response ended; observe it with the Pick's ctx."""

    ctx: Any
    outcome: Outcome


class Step(NamedTuple):
    replies: list  # ProcessingResponse messages to send now, in order
    event: RequestComplete | ResponseDone | None


_NO_REPLY = Step([], None)

# states
_HEADERS, _BODY, _DECIDING, _UPSTREAM, _RESPONSE, _DONE, _REJECTED = range(7)


def _header_map(hm) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in hm.headers:
        v = h.raw_value.decode("latin-1") if h.raw_value else h.value
        k = h.key
        out[k] = f"{out[k]},{v}" if k in out else v
    return out


def _subset_of(md) -> tuple[str, ...] | None:
    fm = md.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    v = fields[SUBSET_KEY]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return tuple(x.string_value for x in v.list_value.values if x.string_value)
    if kind == "string_value":  # tolerated: one comma-separated string
        return tuple(s.strip() for s in v.string_value.split(",") if s.strip())
    return ()


def _served_of(md) -> str | None:
    fm = md.filter_metadata
    if LB_NAMESPACE not in fm:
        return None
    fields = fm[LB_NAMESPACE].fields
    if SERVED_KEY not in fields:
        return None
    return fields[SERVED_KEY].string_value or None


def _option(key: str, value: str) -> pb.HeaderValueOption:
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode("latin-1")), append_action=_OVERWRITE)


def immediate(reject: Reject) -> pb.ProcessingResponse:
    """The ImmediateResponse for a Reject (content-type JSON)."""
    headers = pb.HeaderMutation(set_headers=[_option("content-type", "application/json")]
                                + [_option(k.lower(), v) for k, v in reject.headers.items()])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=reject.status), headers=headers, body=reject.error_json,
        details=f"warmroute_epp_{reject.status}"))


def _reject(status: int, message: str, code: str) -> Reject:
    return Reject.from_api_error(ApiError(status, message, code=code))


class ExtProcStream:
    """One ext_proc stream (one HTTP request and its response); see the module rules."""

    __slots__ = ("max_body_bytes", "request_body_mode", "response_body_mode", "clock", "_state", "_headers",
                 "_subset", "_body", "_body_bytes", "_bodiless", "_trailers", "_ctx", "_t_picked", "_status",
                 "_served", "_relay", "_json", "_json_over", "_resp_bytes", "_done_sent", "_strip")

    def __init__(self, *, max_body_bytes: int = 8 * 1024 * 1024, request_body_mode: int = FULL_DUPLEX_STREAMED,
                 response_body_mode: int = FULL_DUPLEX_STREAMED, clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_body_bytes = max_body_bytes  # larger request bodies get a 413
        self.request_body_mode = request_body_mode  # used when Envoy sends no protocol_config
        self.response_body_mode = response_body_mode  # likewise
        self.clock = clock  # for TTFT and decode intervals
        self._state = _HEADERS
        self._headers: dict[str, str] = {}
        self._subset: tuple[str, ...] | None = None
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._bodiless = False  # the request ended at its headers
        self._trailers = False  # the request body ended with trailers (answered after the body)
        self._ctx: Any = None
        self._t_picked = 0.0
        self._status: int | None = None
        self._served: str | None = None
        self._relay: SseRelay | None = None  # set for an SSE answer
        self._json: list[bytes] | None = None  # a non-SSE answer's copy
        self._json_over = False
        self._resp_bytes = 0
        self._done_sent = False
        self._strip = False  # Pick.strip_usage (applied only in FULL_DUPLEX_STREAMED, where we echo the body)

    # ------------------------------------------------------------------ receive
    def receive(self, msg: pb.ProcessingRequest) -> Step:
        """Take one message from Envoy; returns the replies to send now and at most one event."""
        if msg.observability_mode:
            raise ProtocolError("observability_mode is on: a picker must be able to answer")
        kind = msg.WhichOneof("request")
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "request_body":
            return self._request_body(msg.request_body)
        if kind == "request_headers":
            return self._request_headers(msg)
        if kind == "response_headers":
            return self._response_headers(msg)
        if kind == "request_trailers":
            return self._request_trailers()
        if kind == "response_trailers":
            return self._response_trailers()
        raise ProtocolError("ProcessingRequest without a request field")

    def _request_headers(self, msg: pb.ProcessingRequest) -> Step:
        if self._state != _HEADERS:
            raise ProtocolError("request headers twice")
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self.request_body_mode = pc.request_body_mode
            self.response_body_mode = pc.response_body_mode
        if self.request_body_mode not in (FULL_DUPLEX_STREAMED, BUFFERED):
            raise ProtocolError(f"request body mode {_Mode.BodySendMode.Name(self.request_body_mode)} is not supported: "
                                "configure FULL_DUPLEX_STREAMED (or BUFFERED)")
        rh = msg.request_headers
        self._headers = _header_map(rh.headers)
        if msg.HasField("metadata_context"):
            self._subset = _subset_of(msg.metadata_context)
        if rh.end_of_stream:
            self._bodiless = True
            return self._complete()
        self._state = _BODY
        if self.request_body_mode == BUFFERED:  # the body comes only after we answer the headers
            return Step([pb.ProcessingResponse(request_headers=pb.HeadersResponse())], None)
        return _NO_REPLY

    def _request_body(self, b: pb.HttpBody) -> Step:
        if self._state != _BODY:
            if self._state == _REJECTED:
                return _NO_REPLY  # Envoy may still be sending what it had when we refused
            raise ProtocolError("request body outside the request body phase")
        data = b.body
        if data:
            self._body_bytes += len(data)
            if self._body_bytes > self.max_body_bytes:
                self._state = _REJECTED
                self._body.clear()
                return Step([immediate(_reject(413, f"request body over {self.max_body_bytes} bytes", "body_too_large"))], None)
            self._body.append(data)
        if b.end_of_stream:
            return self._complete()
        return _NO_REPLY

    def _request_trailers(self) -> Step:
        if self._state == _BODY:
            self._trailers = True
            return self._complete()
        if self._state == _REJECTED:
            return _NO_REPLY
        raise ProtocolError("request trailers outside the request body phase")

    def _complete(self) -> Step:
        self._state = _DECIDING
        body = b"".join(self._body)
        self._body.clear()
        if self._subset is not None and not self._subset:
            return Step(self.decide(_reject(503, "the proxy's endpoint subset is empty", "no_endpoint")), None)
        return Step([], RequestComplete(self._headers, body, self._subset))

    # ------------------------------------------------------------------ decide
    def decide(self, result: Pick | Reject) -> list:
        """The answer to `RequestComplete`: the messages that carry it to Envoy."""
        if self._state != _DECIDING:
            raise ProtocolError("decide() without a complete request")
        if isinstance(result, Pick):
            endpoints = [e for e in result.endpoints if e]
            if self._subset is not None:
                allowed = set(self._subset)
                endpoints = [e for e in endpoints if e in allowed]
            if not endpoints:
                result = _reject(503, "no ready endpoint for this request", "no_endpoint")
        if isinstance(result, Reject):
            self._state = _REJECTED
            return [immediate(result)]
        self._ctx = result.ctx
        self._strip = result.strip_usage
        dest = ",".join(endpoints)
        opts = [_option(DESTINATION_HEADER, dest)]
        opts += [_option(k.lower(), v) for k, v in result.set_headers.items()]
        replace_body = not self._bodiless
        if replace_body:
            opts.append(_option("content-length", str(len(result.body))))
        mutation = pb.HeaderMutation(set_headers=opts, remove_headers=[h.lower() for h in result.remove_headers])
        common = pb.CommonResponse(header_mutation=mutation)
        out = []
        if self._bodiless:
            r = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
            out.append(r)
        elif self.request_body_mode == BUFFERED:
            common.body_mutation.body = result.body
            r = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
            out.append(r)
        else:
            r = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
            out.append(r)
            body = result.body
            last = max(0, len(body) - 1) // _STREAM_CHUNK_BYTES
            for i in range(last + 1):  # gRPC messages stay small; Envoy forwards the pieces as they come
                piece = body[i * _STREAM_CHUNK_BYTES:(i + 1) * _STREAM_CHUNK_BYTES]
                out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=piece, end_of_stream=(i == last and not self._trailers)))))))
        r.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = dest
        if self._trailers:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        self._state = _UPSTREAM
        self._t_picked = self.clock()
        return out

    # ------------------------------------------------------------------ response path
    def _response_headers(self, msg: pb.ProcessingRequest) -> Step:
        if self._state == _REJECTED:
            return Step([pb.ProcessingResponse(response_headers=pb.HeadersResponse())], None)
        if self._state != _UPSTREAM:
            raise ProtocolError("response headers before the request was picked")
        rh = msg.response_headers
        headers = _header_map(rh.headers)
        try:
            self._status = int(headers.get(":status", ""))
        except ValueError:
            self._status = None
        if msg.HasField("metadata_context"):
            self._served = _served_of(msg.metadata_context)
        if headers.get("content-type", "").startswith("text/event-stream"):
            # a reader; its output is what the client gets only when the usage chunk is stripped
            self._relay = SseRelay(not self._strip, clock=self.clock)
        else:
            self._json = []
        self._state = _RESPONSE
        reply = [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if rh.end_of_stream:
            return Step(reply, self._finish(False))
        return Step(reply, None)

    def _response_body(self, b: pb.HttpBody) -> Step:
        data, eos = b.body, b.end_of_stream
        if self._state != _RESPONSE:
            if self._state == _REJECTED:  # our own ImmediateResponse's body: nothing to read
                return Step([self._pass(data, eos)], None)
            raise ProtocolError("response body before response headers")
        out = data
        if data or (eos and self._relay is not None):
            self._resp_bytes += len(data)
            if self._relay is not None:
                fed = self._relay.feed(data) if data else b""
                if self._strip and self.response_body_mode == FULL_DUPLEX_STREAMED:
                    out = fed + self._relay.tail() if eos else fed
            elif not self._json_over:
                if self._resp_bytes <= _JSON_KEEP_BYTES:
                    self._json.append(data)
                else:
                    self._json_over = True
                    self._json = []
        reply = [self._pass(out, eos)]
        if eos:
            return Step(reply, self._finish(False))
        return Step(reply, None)

    def _response_trailers(self) -> Step:
        reply = [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        if self._state == _RESPONSE:
            return Step(reply, self._finish(False))
        return Step(reply, None)

    def _pass(self, data: bytes, eos: bool) -> pb.ProcessingResponse:
        if self.response_body_mode == FULL_DUPLEX_STREAMED:
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=eos)))))
        return pb.ProcessingResponse(response_body=pb.BodyResponse())

    # ------------------------------------------------------------------ the end
    def _finish(self, stopped: bool) -> ResponseDone | None:
        if self._done_sent or self._state not in (_UPSTREAM, _RESPONSE):
            return None
        self._done_sent = True
        relay, usage, ttft, decode, events = self._relay, None, None, None, 0
        ended_early = stopped
        if relay is not None:
            usage, events = relay.usage, relay.content_events
            if events:
                ttft = relay.t_first_event - self._t_picked
            if events >= 3 and relay.t_last_event > relay.t_first_event:
                decode = (relay.t_last_event - relay.t_first_event) / (events - 1)
            ended_early = ended_early or not relay.done
        elif self._json:
            try:
                obj = _decode(b"".join(self._json))
            except msgspec.DecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
        self._json = None
        self._state = _DONE
        return ResponseDone(self._ctx, Outcome(self._served, self._status, usage, ttft, decode, events,
                                               self._resp_bytes, ended_early))

    def close(self) -> ResponseDone | None:
        """The gRPC stream ended (Envoy closed it, or it broke). The Outcome not yet reported, if
        the request was picked: `ended_early` is True unless the answer had already ended."""
        return self._finish(True)

    @property
    def picked(self) -> bool:
        """The pick went out and its Outcome is still to come."""
        return self._state in (_UPSTREAM, _RESPONSE) and not self._done_sent

    @property
    def rejected(self) -> bool:
        """An ImmediateResponse went out: nothing more to say on this stream."""
        return self._state == _REJECTED
