"""Online per-replica rates: prefill seconds per uncached token and decode step seconds.

Rule. Each observation becomes one *sample* of a rate; the current rate is the median of the last
`window` accepted samples, clamped to [floor, ceiling]; until `min_samples` samples exist it is the
configured prior. A median of a window ignores up to half the window being outliers (a stalled
replica, a GC pause, a network hiccup) and is deterministic: same observations, same values.

- Prefill sample, from one request's TTFT on a replica::

      prefill_sample_s_per_token = (ttft_s - fixed_s) / (uncached_tokens + queued_tokens)
      fixed_s = overhead_s + (decode_step_s x (1 + busy_step_share) if running_reqs > 0 else 0)

  where `queued_tokens` is the uncached prefill work that was ahead of the request at dispatch
  (gateway.routing.queued_prefill_tokens, the same estimate as cache_aware's ``backlog_tokens``:
  the modelled queue wait, counted in tokens at the same rate,
  so it is taken out of the TTFT rather than attributed to this request's prefill) and
  `running_reqs` the running requests then. Under load the rate absorbs the decode work that
  shares the prefill's steps, which is what predicting a queue needs. On a busy replica the fixed
  part is the step in progress (`busy_step_share` of a decode step) plus the decode work sharing
  the prefill's own step (one decode step). Samples are not used when the request's *own*
  uncached tokens are below `min_sample_tokens`, or when the result is non-positive.

  Why the request's own tokens: a cache hit's TTFT is step overheads and the wait for the steps
  ahead, not prefill; when such a request sat behind a queue (`queued_tokens` large, estimated
  from stale counts) the sample used to pass the token threshold on the queue's tokens alone and
  attributed all that unmodelled waiting to prefill. Under 70% load on shared documents (mostly
  hits) that read 3.3x the true rate in loadtests/vtime.py; counting only requests that prefill
  at least `min_sample_tokens` themselves reads 1.3x (the rest is the decode work sharing their
  steps, which the rate is meant to absorb). The median over the window then ignores the
  remaining stragglers (up to half the window).
- Decode sample: one inter-token interval of a streamed response (seconds per decode step).

Parameters: prior_prefill_s_per_token (s/token, default 5e-5 = 20k tokens/s), prior_decode_step_s
(s, default 0.02), window (samples, >= 1, default 64), min_samples (>= 1, default 8), floor and
ceiling for each rate (defaults: prior / 20 .. prior x 20), overhead_s (s, default 0.0),
busy_step_share (0..1, default 0.5), min_sample_tokens (tokens, default 256).

API: `observe_ttft`, `observe_token_interval`, `prefill_s_per_token(rid)`, `decode_step_s(rid)`,
`snapshot()` (per replica: both rates and sample counts, for metrics and spans), `forget(rid)`.
Pure: no I/O, no clock; the caller passes measured durations.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Calibrator", "RateEstimator"]


@dataclass(slots=True)
class RateEstimator:
    """Median of the last `window` samples, clamped; the prior until `min_samples` arrive."""

    prior: float  # value before enough samples
    floor: float  # lowest value ever reported
    ceiling: float  # highest value ever reported
    window: int = 64  # samples kept
    min_samples: int = 8  # samples before the median replaces the prior
    samples: deque = field(default_factory=deque)  # recent accepted samples
    count: int = 0  # accepted samples ever
    _value: float = -1.0  # cached current value (-1: recompute)

    def add(self, sample: float) -> None:
        if not sample > 0.0 or sample != sample or sample == float("inf"):
            return
        self.samples.append(sample)
        if len(self.samples) > self.window:
            self.samples.popleft()
        self.count += 1
        self._value = -1.0

    @property
    def value(self) -> float:
        if self._value < 0.0:
            if len(self.samples) < self.min_samples:
                v = self.prior
            else:
                s = sorted(self.samples)
                n = len(s)
                v = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
            self._value = min(self.ceiling, max(self.floor, v))
        return self._value


class Calibrator:
    """Per-replica prefill and decode rate estimates (see the module header)."""

    def __init__(
        self,
        *,
        prior_prefill_s_per_token: float = 5e-5,
        prior_decode_step_s: float = 0.02,
        window: int = 64,
        min_samples: int = 8,
        prefill_floor_s_per_token: float | None = None,
        prefill_ceiling_s_per_token: float | None = None,
        decode_floor_s: float | None = None,
        decode_ceiling_s: float | None = None,
        overhead_s: float = 0.0,
        busy_step_share: float = 0.5,
        min_sample_tokens: int = 256,
    ) -> None:
        if prior_prefill_s_per_token <= 0 or prior_decode_step_s <= 0:
            raise ValueError("priors must be positive seconds")
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be >= 1, got {window}, {min_samples}")
        self.prior_prefill_s_per_token = prior_prefill_s_per_token
        self.prior_decode_step_s = prior_decode_step_s
        self.window = window
        self.min_samples = min(min_samples, window)
        self.prefill_floor = prefill_floor_s_per_token if prefill_floor_s_per_token is not None else prior_prefill_s_per_token / 20
        self.prefill_ceiling = prefill_ceiling_s_per_token if prefill_ceiling_s_per_token is not None else prior_prefill_s_per_token * 20
        self.decode_floor = decode_floor_s if decode_floor_s is not None else prior_decode_step_s / 20
        self.decode_ceiling = decode_ceiling_s if decode_ceiling_s is not None else prior_decode_step_s * 20
        if not (self.prefill_floor <= prior_prefill_s_per_token <= self.prefill_ceiling):
            raise ValueError("prefill prior must lie within [floor, ceiling]")
        if not (self.decode_floor <= prior_decode_step_s <= self.decode_ceiling):
            raise ValueError("decode prior must lie within [floor, ceiling]")
        self.overhead_s = overhead_s
        self.busy_step_share = busy_step_share
        self.min_sample_tokens = min_sample_tokens
        self._prefill: dict[str, RateEstimator] = {}
        self._decode: dict[str, RateEstimator] = {}

    def _est(self, table: dict, rid: str, prior: float, floor: float, ceiling: float) -> RateEstimator:
        e = table.get(rid)
        if e is None:
            e = table[rid] = RateEstimator(prior, floor, ceiling, self.window, self.min_samples)
        return e

    def observe_ttft(self, replica_id: str, ttft_s: float, uncached_tokens: int, queued_tokens: float = 0.0, running_reqs: int = 0) -> None:
        """One request's TTFT on `replica_id` with its uncached tokens and the work ahead of it."""
        if uncached_tokens < self.min_sample_tokens:
            return  # dominated by fixed costs and unmodelled waiting (module header)
        tokens = uncached_tokens + max(0.0, queued_tokens)
        fixed = self.overhead_s + (self.decode_step_s(replica_id) * (1.0 + self.busy_step_share) if running_reqs > 0 else 0.0)
        e = self._est(self._prefill, replica_id, self.prior_prefill_s_per_token, self.prefill_floor, self.prefill_ceiling)
        e.add((ttft_s - fixed) / tokens)

    def observe_token_interval(self, replica_id: str, interval_s: float) -> None:
        """One inter-token interval of a streamed response from `replica_id`."""
        e = self._est(self._decode, replica_id, self.prior_decode_step_s, self.decode_floor, self.decode_ceiling)
        e.add(interval_s)

    def prefill_s_per_token(self, replica_id: str) -> float:
        e = self._prefill.get(replica_id)
        return e.value if e is not None else self.prior_prefill_s_per_token

    def decode_step_s(self, replica_id: str) -> float:
        e = self._decode.get(replica_id)
        return e.value if e is not None else self.prior_decode_step_s

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per replica: current rates and sample counts (for metrics, spans, the debug route)."""
        out: dict[str, dict[str, float]] = {}
        for rid in sorted(set(self._prefill) | set(self._decode)):
            p, d = self._prefill.get(rid), self._decode.get(rid)
            out[rid] = {
                "prefill_s_per_token": self.prefill_s_per_token(rid),
                "decode_step_s": self.decode_step_s(rid),
                "prefill_samples": float(p.count if p else 0),
                "decode_samples": float(d.count if d else 0),
            }
        return out

    def forget(self, replica_id: str) -> None:
        """Drop a replica's estimates (it left the pool or restarted with different hardware)."""
        self._prefill.pop(replica_id, None)
        self._decode.pop(replica_id, None)
