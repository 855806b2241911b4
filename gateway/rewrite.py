"""Rewrite stage (pure): the body the engine gets.

Rule: the derived `cache_salt` replaces any the client sent (a client never chooses its salt),
`model` becomes the canonical served name (aliases resolve; a LoRA adapter keeps its own), and the engine options the gateway
needs for its own accounting are added: `stream_options.include_usage` on streams (the relay
strips the usage chunk again when the client did not ask for it), and
`vllm_xargs.kv_cache_report_mode` when configured (hits re-reported as KV events). A client's
vLLM `priority` is dropped: on engines run with `--scheduling-policy priority` its own value
would put it ahead of every other tenant's requests in the engine's queue, past flow control's
fair order (on the default policy a non-zero one is refused); with `flow.engine_priority` the
gateway sets it (0 for a tenant under its fair share, 1 for the rest). A Responses request the
engine will store carries the id the gateway chose for it as vLLM's `request_id`, in place of
any the client sent (gateway.stored_responses). Everything else passes through as
the client sent it. An engine that refuses a priority (`refuses_priority`: vLLM on its default
policy) is sent the same body without one (`without_priority`): the dispatch and keep-alive's
refreshes fall back to that instead of failing the request.
"""
from __future__ import annotations

import msgspec

from gateway.context import RESPONSES, ParsedRequest

__all__ = ["upstream_body", "refuses_priority", "without_priority", "PRIORITY_RETRY_S", "PriorityRefusals"]

_encode = msgspec.json.encode
PRIORITY_RETRY_S = 300.0  # a replica that refused a priority gets requests and refreshes without one this long


def upstream_body(payload: dict, req: ParsedRequest, *, salt: str, model_name: str, force_include_usage: bool,
                  kv_cache_report_mode: str | None, engine_priority: int | None = None,
                  response_id: str | None = None) -> bytes:
    """The upstream JSON body; `payload` (the client's parsed body) is updated in place.
    `engine_priority`: vLLM's `priority` to set (flow control's, gateway.flow), None: none;
    `response_id`: the id a stored response gets (vLLM's `request_id`, gateway.stored_responses)."""
    payload["cache_salt"] = salt
    if response_id is not None:
        payload["request_id"] = response_id
    payload["model"] = model_name
    payload.pop("priority", None)
    if engine_priority is not None:
        payload["priority"] = engine_priority
    if req.stream and force_include_usage and req.kind != RESPONSES:  # a response's usage is always in it
        so = payload.get("stream_options")
        payload["stream_options"] = {**(so or {}), "include_usage": True}
    if kv_cache_report_mode:
        xa = payload.get("vllm_xargs")
        payload["vllm_xargs"] = {**(xa if isinstance(xa, dict) else {}), "kv_cache_report_mode": kv_cache_report_mode}
    return _encode(payload)


def refuses_priority(status: int, raw: bytes) -> bool:
    """An engine's answer to a request that carried a vLLM `priority`, refusing it because the engine
    does not schedule by priority (vLLM on its default policy: 400 "Got priority 1 but Priority
    scheduling is not enabled")."""
    return status == 400 and b"priority" in raw.lower()


def without_priority(payload: dict) -> bytes:
    """The upstream body `upstream_body` made from `payload`, without its `priority`."""
    return _encode({k: v for k, v in payload.items() if k != "priority"})


class PriorityRefusals:
    """The replicas that refused a priority, each sent none for PRIORITY_RETRY_S after its refusal,
    then tried with one again (it may have been restarted with --scheduling-policy priority). Pure:
    the caller gives the time (time.monotonic)."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def allows(self, rid: str, now: float) -> bool:
        """Whether requests to `rid` may carry a priority at `now`."""
        until = self._until.get(rid)
        if until is not None and until <= now:
            del self._until[rid]
            until = None
        return until is None

    def refused(self, rid: str, now: float) -> bool:
        """`rid` refused one at `now`; True when it was not already known to (the caller says so once)."""
        new = self.allows(rid, now)
        self._until[rid] = now + PRIORITY_RETRY_S
        return new
