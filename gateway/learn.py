"""Learn stage (pure): what one finished request teaches the rates, the policy and the index check.

Rule: a streamed answer's TTFT (upstream send -> first event) is a prefill-rate sample for its
replica, taken against the prompt tokens the engine really prefilled (prompt - engine-reported
cached, when the engine reports them; else the predicted uncached tokens) and the queue the policy
saw ahead of it; its mean inter-event interval is a decode-step sample; its TTFT beyond that prefill at the
replica's rate is the time it waited in the engine's queue (the index check discounts
over-predictions after a long wait: gateway.index_health). A whole (non-streamed)
answer's time is not a TTFT: no rate sample. The engine's `cached_tokens` against the index's
prediction is the index's accuracy (gateway.telemetry keeps its moving mean). The gateway and the
virtual-time simulator both learn through `learn()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gateway.context import Outcome
from policies.base import Policy
from policies.calibration import Calibrator

__all__ = ["Lesson", "learn", "usage_numbers"]


@dataclass(frozen=True, slots=True)
class Lesson:
    replica_id: str  # the replica that served the request
    prompt_tokens: int | None  # engine usage (None: not reported)
    completion_tokens: int | None  # engine usage
    cached_tokens: int | None  # engine-reported prefix-cache hit tokens
    predicted_cached_tokens: int | None  # the index's prediction (None: not predictable, no evidence for the index)
    uncached_tokens: int  # tokens the engine prefilled (reported, else predicted)
    queued_s: float = 0.0  # TTFT beyond its own prefill at the replica's rate: its wait in the engine's queue


def learn(outcome: Outcome, calibrator: Calibrator, policy: Policy) -> Lesson:
    rid = outcome.replica_id
    pt, ct, cached = usage_numbers(outcome.usage)
    uncached = (pt - cached) if (pt is not None and cached is not None) else outcome.uncached_tokens
    if outcome.ttft_s is not None:
        calibrator.observe_ttft(rid, outcome.ttft_s, uncached, outcome.backlog_tokens, outcome.running_reqs)
        policy.observe(rid, outcome.ttft_s, uncached)
    if outcome.decode_step_s is not None:
        calibrator.observe_token_interval(rid, outcome.decode_step_s)
    queued = 0.0
    if outcome.ttft_s is not None:
        queued = max(0.0, outcome.ttft_s - uncached * calibrator.prefill_s_per_token(rid))
    return Lesson(rid, pt, ct, cached, outcome.predicted_cached_tokens, uncached, queued)


def usage_numbers(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) from a usage object; None when absent."""
    if not isinstance(usage, Mapping):
        return None, None, None
    if "input_tokens" in usage:  # the Responses API's names
        details, pt, ct = usage.get("input_tokens_details"), usage.get("input_tokens"), usage.get("output_tokens")
    else:
        details, pt, ct = usage.get("prompt_tokens_details"), usage.get("prompt_tokens"), usage.get("completion_tokens")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return (_int(pt), _int(ct), _int(cached))


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
