"""Tokenizer drift check: now and then the replica that served a request tokenizes it itself
(vLLM's `POST /tokenize`), and its token ids are compared with the ones the gateway routed on.

Why: every key the gateway computes assumes it tokenizes exactly as the engines do (the same
tokenizer files, the same chat template). An engine redeployed with another template, or a gateway
given another tokenizer, breaks that silently: the index-accuracy metric falls as well, but it
cannot tell a tokenization mismatch from eviction churn. This check can, and says where.

Rules:
- Sampled per replica by time: a replica's first answered request is checked, then at most one
  every `model.tokenize_check_s` (0: off), one at a time per replica. Only a request the replica
  answered with 200 is checked, after its answer: a check never delays a client, and a failed
  check is not the client's business.
- What is compared: the ids of the request's (first) prompt, as the gateway routed it, with the
  engine's `tokens`. A chat request sends its messages and the template options vLLM's
  `/tokenize` takes (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
  `tools` as the template got them, `add_special_tokens` as the client set it, else false); a
  completions request its text prompt (`add_special_tokens` as the client set it, else true). A
  prompt given as token ids or as embeddings has nothing to check. A chat with media parts, whose
  ids the gateway has up to its first item only (gateway.encode), matches when the engine's ids
  (the media expanded by its processor) begin with them and go on.
- Outcome: `warmroute_gateway_tokenize_checks_total{replica, result}` with result match, mismatch
  or error. A mismatch logs a warning with the replica, both lengths and the first position that
  differs (never the text or the ids: prompts stay out of logs) and is listed under "degraded" on
  `/readyz` until that replica's next check matches; an error (timeout, a non-200 answer, no ids
  in it) is counted and logged at debug level.
`compare`, `tokenize_body` and `DriftCheck` are pure; `TokenizeChecker` does the I/O.
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from gateway.context import RESPONSES, ParsedRequest

__all__ = ["DriftCheck", "TokenizeChecker", "Verdict", "compare", "tokenize_body"]

log = logging.getLogger("warmroute.gateway.tokenize_check")

CHECK_TIMEOUT_S = 10.0  # a /tokenize call slower than this counts as an error


@dataclass(frozen=True, slots=True)
class Verdict:
    result: str  # "match" | "mismatch" | "error"
    ours: int  # tokens the gateway counted
    theirs: int = 0  # tokens the engine counted (0 on error)
    first_diff: int = -1  # first position that differs (a mismatch; a length difference: the shorter length)
    reason: str = ""  # why a check failed (error)


def compare(ours: Sequence[int], theirs: Any, *, prefix: bool = False) -> Verdict:
    """Our ids against the `tokens` of the engine's answer; `prefix`: ours are the start of a longer
    prompt (module rules: media)."""
    if not isinstance(theirs, list) or not all(type(t) is int for t in theirs):
        return Verdict("error", len(ours), reason="no token ids in the answer")
    n = min(len(ours), len(theirs))
    for i in range(n):
        if ours[i] != theirs[i]:
            return Verdict("mismatch", len(ours), len(theirs), i)
    if prefix and len(theirs) > len(ours):
        return Verdict("match", len(ours), len(theirs))
    if prefix or len(ours) != len(theirs):
        return Verdict("mismatch", len(ours), len(theirs), n)
    return Verdict("match", len(ours), len(theirs))


def tokenize_body(req: ParsedRequest, payload: dict, model: str | None) -> dict | None:
    """vLLM's `/tokenize` body for the request's (first) prompt; None when there is no text to check
    (or its prompt was truncated: `/tokenize` does not truncate; or given as embeddings). `model`:
    the served name the request went out with (None: not known, left out)."""
    if req.truncate is not None or req.embeds:
        return None
    ast = payload.get("add_special_tokens")
    ast = ast if isinstance(ast, bool) else None
    body: dict = {"model": model} if model else {}
    if req.messages is not None:  # chat, and the Responses API rendered as one
        messages = req.messages if req.kind != RESPONSES else [_as_chat_parts(m) for m in req.messages]
        body.update(messages=messages, add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    add_special_tokens=False if ast is None else ast)
        if req.chat_template_kwargs:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        if req.tools is not None:
            body["tools"] = req.tools
        return body
    prompt = req.prompts[0] if req.prompts else None
    if not isinstance(prompt, str):
        return None
    body.update(prompt=prompt, add_special_tokens=True if ast is None else ast)
    return body


def _as_chat_parts(msg: dict) -> dict:
    """A Responses message with its `input_text` / `output_text` parts as chat's `text` parts:
    `/tokenize` takes chat's part types only, and vLLM renders the three alike."""
    content = msg.get("content")
    if not isinstance(content, list):
        return msg
    return {**msg, "content": [{"type": "text", "text": p["text"]} if isinstance(p, dict) and
                               p.get("type") in ("input_text", "output_text") else p for p in content]}


class DriftCheck:
    """Which replica is due a check, and the last mismatch of each (module rules)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s  # between two checks of one replica; <= 0: off
        self._next: dict[str, float] = {}  # replica -> time (monotonic) its next check is due
        self._busy: set[str] = set()  # replicas with a check in flight
        self.mismatched: dict[str, Verdict] = {}  # replica -> its last check's mismatch, until one matches
        self.failed: dict[str, str] = {}  # replica -> why its last check got no answer, until one does

    def due(self, replica_id: str, now: float) -> bool:
        """Is a check of `replica_id` due (none in flight, the interval past)?"""
        return self.interval_s > 0 and replica_id not in self._busy and now >= self._next.get(replica_id, -math.inf)

    def take(self, replica_id: str, now: float) -> bool:
        """Is a check of `replica_id` due? If so it is counted as started (end it with `done`)."""
        if not self.due(replica_id, now):
            return False
        self._busy.add(replica_id)
        self._next[replica_id] = now + self.interval_s
        return True

    def done(self, replica_id: str, verdict: Verdict) -> None:
        self._busy.discard(replica_id)
        if verdict.result == "error":
            self.failed[replica_id] = verdict.reason
            return
        self.failed.pop(replica_id, None)
        if verdict.result == "mismatch":
            self.mismatched[replica_id] = verdict
        else:
            self.mismatched.pop(replica_id, None)

    def forget(self, replica_id: str) -> None:
        """The replica left the pool."""
        self._next.pop(replica_id, None)
        self.mismatched.pop(replica_id, None)
        self.failed.pop(replica_id, None)

    def describe(self) -> dict:
        return {"interval_s": self.interval_s, "checking": sorted(self._busy),
                "mismatched": {rid: {"engine_tokens": v.theirs, "gateway_tokens": v.ours, "first_diff": v.first_diff}
                               for rid, v in sorted(self.mismatched.items())},
                "failed": dict(sorted(self.failed.items()))}

    def degraded(self) -> list[str]:
        return [f"replica {rid}: tokenizes differently from the gateway (its last check: {v.theirs} tokens against "
                f"our {v.ours}, first difference at token {v.first_diff}): check that both use the same tokenizer "
                f"and chat template" for rid, v in sorted(self.mismatched.items())]


class TokenizeChecker:
    """Runs the sampled checks in the background (module rules); `close()` cancels the ones in flight."""

    def __init__(self, interval_s: float, session: aiohttp.ClientSession, metrics, *,
                 timeout_s: float = CHECK_TIMEOUT_S, clock=None) -> None:
        self.drift = DriftCheck(interval_s)
        self.session = session
        self.metrics = metrics
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock or asyncio.get_running_loop().time
        self._tasks: set[asyncio.Task] = set()

    def after_answer(self, replica_id: str, base_url: str, req: ParsedRequest, payload: dict, model: str | None,
                     ours: Sequence[int], *, prefix: bool = False) -> None:
        """A request `replica_id` answered: check it if that replica is due one (`prefix`: `ours` are
        the start of its prompt, module rules)."""
        now = self._clock()
        if not self.drift.due(replica_id, now):  # the common case: one dict lookup per request
            return
        body = tokenize_body(req, payload, model)
        if body is None or not self.drift.take(replica_id, now):
            return
        task = asyncio.create_task(self._check(replica_id, base_url, body, list(ours), prefix), name="tokenize-check")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, replica_id: str, base_url: str, body: dict, ours: list[int], prefix: bool) -> None:
        try:
            verdict = await self._ask(base_url, body, ours, prefix)
        except asyncio.CancelledError:  # the gateway is closing: not a result
            self.drift.done(replica_id, Verdict("error", len(ours), reason="cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not stop this replica's checks for good
            verdict = Verdict("error", len(ours), reason=f"{type(exc).__name__} (a gateway bug)")
        self.drift.done(replica_id, verdict)
        m = self.metrics
        m.child(m.tokenize_checks, replica_id, verdict.result).inc()
        if verdict.result == "mismatch":
            log.warning("replica %s tokenizes a request differently from the gateway: %d tokens against our %d, "
                        "first difference at token %d (same tokenizer and chat template on both?)",
                        replica_id, verdict.theirs, verdict.ours, verdict.first_diff,
                        extra={"fields": {"replica": replica_id, "engine_tokens": verdict.theirs,
                                          "gateway_tokens": verdict.ours, "first_diff": verdict.first_diff}})
        elif verdict.result == "error":
            log.debug("tokenize check on %s failed: %s", replica_id, verdict.reason)

    async def _ask(self, base_url: str, body: dict, ours: list[int], prefix: bool) -> Verdict:
        try:
            async with self.session.post(base_url + "/tokenize", json=body, timeout=self.timeout) as r:
                if r.status != 200:
                    return Verdict("error", len(ours), reason=f"HTTP {r.status}")
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return Verdict("error", len(ours), reason=type(exc).__name__)
        return compare(ours, data.get("tokens") if isinstance(data, dict) else None, prefix=prefix)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
