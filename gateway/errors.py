"""OpenAI-shaped errors: every 4xx/5xx the gateway itself answers goes through `ApiError`.

Rule: a client mistake is a 4xx with `{"error": {"message", "type", "param", "code"}}` (OpenAI's
shape); the gateway's own trouble (no replica, upstream down) is a 502/503/504 in the same shape.
An engine's own 4xx (vLLM's shapes: `{"error": {...}}` now, `{"object": "error", "message"...}`
before) is re-shaped by `engine_error` so clients see one shape; its message is the engine's.
Nothing here does I/O; the server turns an `ApiError` into a response, and the proxy turns a
failure after the first streamed byte into `sse_error_event(...)`.
"""
from __future__ import annotations

import json

__all__ = ["ApiError", "error_body", "sse_error_event", "engine_error"]

# status -> OpenAI error "type"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error the gateway answers itself, in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # HTTP status
        self.message = message  # human text; never contains secrets or prompt text
        self.code = code  # machine code, e.g. "model_not_found", "context_length_exceeded"
        self.param = param  # the offending request field, when one is to blame
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
        self.headers = headers or {}  # extra response headers (Retry-After, WWW-Authenticate)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def response_headers(self, request_id: str | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **self.headers}
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def sse_error_event(message: str, type_: str = "upstream_error", code: str | None = "upstream_failed", *,
                    responses: bool = False) -> bytes:
    """The event that ends a stream that failed after its first byte (then `data: [DONE]`); in a
    Responses API stream (`responses`), its `error` event (which has no [DONE] after it)."""
    if responses:
        return b"event: error\ndata: " + json.dumps({"type": "error", "code": code, "message": message, "param": None,
                                                      "sequence_number": 0}).encode() + b"\n\n"
    return b"data: " + error_body(message, type_, None, code) + b"\n\ndata: [DONE]\n\n"


def engine_error(status: int, body: bytes) -> ApiError:
    """An engine's error answer as an ApiError in OpenAI's shape (its message, param and code kept)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    src = err if isinstance(err, dict) else obj if isinstance(obj, dict) else {}
    message = src.get("message") if isinstance(src.get("message"), str) else ""
    if not message:
        text = body[:200].decode("utf-8", "replace").strip() if body else ""
        message = f"the engine refused the request (HTTP {status})" + (f": {text}" if text else "")
    param = src.get("param") if isinstance(src.get("param"), str) else None
    code = src.get("code") if isinstance(src.get("code"), str) else None
    return ApiError(status, message, code=code or "engine_error", param=param)
