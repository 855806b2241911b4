"""Index health (pure): does the KV index still predict what each engine reports?

The gateway predicts, for every request, the prompt tokens the chosen engine will find cached (the
index's leading run there); the engine reports what it really found
(`usage.prompt_tokens_details.cached_tokens`). A wrong index (a chat template or tokenizer that
differs from the engine's, a hash contract broken by an engine upgrade, a feed that lost records)
shows as the two disagreeing. This closes that loop per replica.

Rule, per replica:
  - a *sample* is one answer whose engine reported cached tokens, unless the prediction and the
    report are both 0 (the index knew nothing and the engine had nothing: no evidence either way),
    or the replica's feed was silent (its matches did not count: `RoutingState.checked`), or the
    engine found less than predicted after the request had waited in its queue more than
    `queued_evict_s` (1 s: its TTFT beyond its own prefill at the replica's measured rate).
    Blocks that were there at dispatch are evicted by the running requests while a request
    waits: a busy replica's over-predictions say nothing about the index, and counting them
    distrusted every replica of an overloaded pool, whose load-only routing then made the
    overload worse. A stale index (a lost removal) still shows: the engine prefills what was
    predicted cached, so the TTFT is that prefill, not a wait;
  - its *agreement* is min(predicted, reported) / max(predicted, reported) (1.0: exact);
  - over the last `window_reqs` (16) samples: the replica becomes *distrusted* when at least
    `min_samples` (8) are in the window and their mean agreement is below `distrust_below` (0.5),
    and trusted again when the mean is at least `trust_from` (0.8) (hysteresis: no flapping).
A distrusted replica is routed by load only: its index matches are ignored, exactly as for a
replica whose feed went silent (gateway.routing `RoutingState.views`). Its predictions go on being
checked, so trust comes back by itself once the index agrees again. Evidence may stop coming (load
only, the replica may get only prompts nobody sent before), so after `retry_after_s` (60 s) of
distrust the replica is given another chance, like a circuit breaker's half-open state: its window
is emptied and it is trusted; a still-wrong index is distrusted again after 8 samples.
Worst cases: from a window of perfect agreement, 9 consecutive zero-agreement samples distrust a
replica (mean 7/16 < 0.5); from an empty window, 8; from a window of zeros, 13 exact samples trust
it again (13/16 >= 0.8). Each change is logged once (WARNING when distrusted, INFO when trusted
again) and counted (`changes`, exported as a metric); `/readyz` lists distrusted replicas.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable
from dataclasses import dataclass, field

__all__ = ["IndexHealth", "ReplicaHealth", "WINDOW_REQS", "MIN_SAMPLES", "DISTRUST_BELOW", "TRUST_FROM", "RETRY_AFTER_S",
           "QUEUED_EVICT_S"]

log = logging.getLogger("warmroute.gateway.index_health")

WINDOW_REQS = 16  # samples the mean agreement is taken over
MIN_SAMPLES = 8  # samples needed before a replica can be distrusted
DISTRUST_BELOW = 0.5  # mean agreement below this: distrusted
TRUST_FROM = 0.8  # mean agreement at least this: trusted again
RETRY_AFTER_S = 60.0  # distrusted this long: window emptied, trusted again (half-open)
QUEUED_EVICT_S = 1.0  # an over-prediction after a queue wait longer than this is no evidence


@dataclass(slots=True)
class ReplicaHealth:
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW_REQS))  # recent agreements
    total: float = 0.0  # sum of `window`
    trusted: bool = True
    distrusted_count: int = 0  # times it became distrusted
    distrusted_at: float = 0.0  # clock() when it last became distrusted
    samples: int = 0  # samples ever

    def mean(self) -> float | None:
        return self.total / len(self.window) if self.window else None


class IndexHealth:
    """Per-replica agreement windows and trust verdicts (module rule)."""

    def __init__(self, *, window_reqs: int = WINDOW_REQS, min_samples: int = MIN_SAMPLES,
                 distrust_below: float = DISTRUST_BELOW, trust_from: float = TRUST_FROM,
                 retry_after_s: float = RETRY_AFTER_S, queued_evict_s: float = QUEUED_EVICT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= min_samples <= window_reqs:
            raise ValueError(f"need 1 <= min_samples <= window_reqs, got {min_samples}, {window_reqs}")
        if not 0.0 < distrust_below <= trust_from <= 1.0:
            raise ValueError(f"need 0 < distrust_below <= trust_from <= 1, got {distrust_below}, {trust_from}")
        self.window_reqs = window_reqs
        self.min_samples = min_samples
        self.distrust_below = distrust_below
        self.trust_from = trust_from
        self.retry_after_s = retry_after_s
        self.queued_evict_s = queued_evict_s
        self.clock = clock
        self._reps: dict[str, ReplicaHealth] = {}

    def observe(self, replica_id: str, predicted_tokens: int, reported_tokens: int, queued_s: float = 0.0) -> bool | None:
        """One answer's prediction, the engine's report and how long the request waited in the
        engine's queue; the new verdict (True: trusted again, False: distrusted) when it changed,
        else None."""
        if predicted_tokens <= 0 and reported_tokens <= 0:
            return None  # no evidence either way
        if reported_tokens < predicted_tokens and queued_s > self.queued_evict_s:
            return None  # evicted while it waited (module rule)
        rh = self._reps.get(replica_id)
        if rh is None:
            rh = self._reps[replica_id] = ReplicaHealth(deque(maxlen=self.window_reqs))
        hi = max(predicted_tokens, reported_tokens)
        agree = max(0, min(predicted_tokens, reported_tokens)) / hi
        if len(rh.window) == rh.window.maxlen:
            rh.total -= rh.window[0]
        rh.window.append(agree)
        rh.total += agree
        rh.samples += 1
        mean = rh.total / len(rh.window)
        if rh.trusted and len(rh.window) >= self.min_samples and mean < self.distrust_below:
            rh.trusted = False
            rh.distrusted_count += 1
            rh.distrusted_at = self.clock()
            log.warning("index disagrees with the engine: routing the replica by load only", extra={"fields": {
                "replica": replica_id, "agreement": round(mean, 3), "window_reqs": len(rh.window),
                "distrust_below": self.distrust_below}})
            return False
        if not rh.trusted and mean >= self.trust_from:
            rh.trusted = True
            log.info("index agrees with the engine again: matches count for the replica", extra={"fields": {
                "replica": replica_id, "agreement": round(mean, 3), "window_reqs": len(rh.window)}})
            return True
        return None

    def trusted(self, replica_id: str) -> bool:
        rh = self._reps.get(replica_id)
        if rh is None or rh.trusted:
            return True
        if self.clock() - rh.distrusted_at >= self.retry_after_s:  # half-open: another chance
            rh.window.clear()
            rh.total = 0.0
            rh.trusted = True
            log.info("index distrusted for a while without evidence either way: trusting it again", extra={"fields": {
                "replica": replica_id, "after_s": self.retry_after_s}})
            return True
        return False

    def agreement(self, replica_id: str) -> float | None:
        """Mean agreement over the replica's window; None before its first sample."""
        rh = self._reps.get(replica_id)
        return None if rh is None else rh.mean()

    def distrusted(self) -> dict[str, float]:
        """Distrusted replicas -> their window's mean agreement."""
        return {rid: rh.mean() or 0.0 for rid, rh in self._reps.items() if not rh.trusted}

    def distrusted_counts(self) -> dict[str, int]:
        """Replica -> times it became distrusted (a counter)."""
        return {rid: rh.distrusted_count for rid, rh in self._reps.items()}

    def forget(self, replica_id: str) -> None:
        self._reps.pop(replica_id, None)
