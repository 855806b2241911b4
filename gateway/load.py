"""In-flight work per replica, as this gateway and the others see it (pure, no I/O).

Rule: a request counts as *in flight* on a replica from dispatch until its first token (or its
failure), with its uncached prompt tokens (prompt tokens minus the predicted cached ones); from
the first token until the end it counts as *active* (this gateway only: a running request the
agent's next scrape will show). Other gateways' in-flight work comes from the feed's shared
counters, which include this gateway's own increments; so does their *open* count (requests sent
and not finished, in flight or active): the sequence slots they hold, which flow control needs
between two engine reports (a report is up to a scrape period old, and with several gateways the
others' grants since it would otherwise be invisible). Our changes are batched (`take_pending`,
flushed by the server's poll loop every `inflight_poll_s`, so no feed call sits on the request
path); `others = shared - own_flushed`, and the view is `others + own_now`: always fresh for our
own work and at most one poll stale for theirs.

Per replica it also counts this gateway's open requests per LoRA adapter, in flight
(`inflight_loras`: no first token yet, so running or waiting for a slot) and active
(`active_loras`: generating, so holding a slot): the adapters it has just given work there, before
the engine's next report can say so. It publishes them with every exchange (`adapters`) and
reads the other gateways' back (`others_lora_running`, `others_lora_wanting`): with several
processes, each otherwise saw only its own since the engine's last report, and two could take a
replica's last free slot for two adapters in the same second.

Per replica it also keeps a mean of the uncached prefill tokens of requests sent there
(`mean_uncached_tokens`), which the cache-aware policy uses to price a waiting request, and a
moving mean of their max_tokens (`mean_output_tokens`, requests that give one), with which it
prices the wait on a replica whose sequence slots are full (a wait for completions).
`mean_uncached_tokens` weighs each request by its age, e^(-age / SIZE_TAU_S), when dispatch is
given the time (the gateway always gives it), else by count (weight _EWMA_ALPHA for the newest).
Why by age: the mean moves only when this gateway sends a request there, so after one miss (a
3,000-token document) a replica it then avoids kept the miss in its mean, its queue looked that
much longer, and it was avoided on; with several gateway processes, each seeing only its share of
the requests, that fed a collapse on the busy regime (cache_aware, two processes, uniform
popularity: seeds 0-9, 4,795 requests unfinished; by age, none). By age, the first request sent
there after a lull outweighs what was sent long before it.

Both per-replica rates of dispatch (`routed_rps`, the requests routed there per second, which the
balance guard compares) and the by-age size mean are this gateway's own, and several gateway
processes each see only their share of the requests: a quarter of the sample with four, so the
guard's rate test fired on noise and one process's single miss priced a replica's whole queue.
So each gateway also publishes them as *dispatch gauges* with every exchange (`gauges`: per
replica its rate, its size weight and weight x mean, decayed to the exchange) and reads the
others' sums back (`set_shared` with six-field counters); `pool_routed_rps` and
`pool_mean_uncached` are what every gateway's dispatches give, which the views carry. Virtual time,
busy regime, four processes exchanging every 0.1 s, cache_aware, uniform popularity, seeds 0-19:
3,794 requests unfinished without them (six seeds collapsed), none with them
(loadtests/results/vtime_busy_4gateways_20seeds.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

__all__ = ["LoadTracker", "ReplicaLoad", "Flight"]

_EWMA_ALPHA = 0.1  # weight of a new request in the means (by count: mean_output_tokens; dispatch without a time)
SIZE_TAU_S = 5.0  # age at which a request's weight in mean_uncached_tokens has fallen to 1/e (seconds)


ROUTED_TAU_S = 10.0  # default time constant of the routed-rate EWMA (a policy that reads the rate may set its own)


@dataclass(slots=True)
class ReplicaLoad:
    inflight_reqs: int = 0  # this gateway: dispatched, no first token yet
    inflight_tokens: int = 0  # their uncached prompt tokens
    active_reqs: int = 0  # this gateway: first token seen, not finished
    others_reqs: int = 0  # other gateways' in-flight requests (last poll)
    others_tokens: int = 0  # other gateways' in-flight uncached tokens (last poll)
    mean_uncached_tokens: float = -1.0  # mean by age (module header); -1 until the first request
    mean_output_tokens: float = -1.0  # moving mean of max_tokens (requests that set it); -1 until one
    routed_rps: float = 0.0  # EWMA of requests this gateway routed here per second (at routed_t)
    routed_t: float = 0.0  # clock reading routed_rps was last decayed to
    others_open: int = 0  # other gateways' requests sent here and not finished (last poll)
    size_weight: float = 0.0  # total weight of the requests in mean_uncached_tokens, at size_t
    size_t: float = 0.0  # clock reading size_weight was last decayed to
    others_rps: float = 0.0  # other gateways' routed_rps here, summed (their gauges at the last exchange)
    others_size_weight: float = 0.0  # their size weights, summed (same)
    others_size_tokens: float = 0.0  # their weight x mean uncached tokens, summed (same)
    inflight_loras: dict[str, int] | None = None  # this gateway: LoRA adapter -> its requests here without a first token
    active_loras: dict[str, int] | None = None  # this gateway: LoRA adapter -> its requests here generating
    others_lora_running: tuple[str, ...] = ()  # other gateways' adapters with requests here generating (last exchange)
    others_lora_wanting: tuple[str, ...] = ()  # theirs with requests here without a first token (same)


class Flight:
    """One dispatched request; `first_token()` and `finish()` are idempotent."""

    __slots__ = ("tracker", "replica_id", "tokens", "pending", "done", "lora", "seqs")

    def __init__(self, tracker: "LoadTracker", replica_id: str, tokens: int, lora: str | None = None, seqs: int = 1) -> None:
        self.tracker = tracker
        self.replica_id = replica_id  # replica the request went to
        self.tokens = tokens  # uncached prompt tokens
        self.lora = lora  # the LoRA adapter it runs (None: the base model)
        self.seqs = seqs  # sequences the engine runs for it (a batch's prompts x n), counted as requests
        self.pending = True  # no first token yet
        self.done = False

    def first_token(self) -> None:
        if self.pending and not self.done:
            self.pending = False
            self.tracker._move_to_active(self)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.tracker._finish(self)

    def handed_over(self) -> "Flight":
        """The same count under a new owner, whose `finish()` ends it; this one's no longer does."""
        f = Flight(self.tracker, self.replica_id, self.tokens, self.lora, self.seqs)
        f.pending, f.done = self.pending, self.done
        self.done = True
        return f


def _count(counts: dict[str, int], key: str, n: int) -> None:
    """Add `n` to `counts[key]`, dropping the key at 0 (a key never counted is left alone)."""
    if n < 0 and key not in counts:
        return
    v = counts.get(key, 0) + n
    if v > 0:
        counts[key] = v
    else:
        counts.pop(key, None)


class LoadTracker:
    def __init__(self, *, routed_tau_s: float = ROUTED_TAU_S) -> None:
        if not routed_tau_s > 0:
            raise ValueError(f"routed_tau_s must be > 0, got {routed_tau_s!r}")
        self.routed_tau_s = routed_tau_s  # time constant of routed_rps (seconds)
        self._loads: dict[str, ReplicaLoad] = {}
        # replica -> [reqs, tokens, open] (the feed's three counters, module header)
        self._pending: dict[str, list[int]] = {}  # not yet flushed to the feed
        self._flushed: dict[str, list[int]] = {}  # flushed so far (net)
        self._published: dict[str, tuple[float, float, float]] = {}  # our dispatch gauges at the last exchange

    def _shared_delta(self, rid: str, reqs: int, tokens: int, opened: int) -> None:
        p = self._pending.get(rid)
        if p is None:
            self._pending[rid] = [reqs, tokens, opened]
        else:
            p[0] += reqs
            p[1] += tokens
            p[2] += opened

    def take_pending(self) -> dict[str, tuple[int, int, int]]:
        """Net (reqs, tokens, open) changes since the last call (to add to the feed's shared
        counters); marks them flushed."""
        out = {}
        for rid, c in self._pending.items():
            if any(c):
                out[rid] = tuple(c)
                f = self._flushed.setdefault(rid, [0, 0, 0])
                for i, n in enumerate(c):
                    f[i] += n
        self._pending = {}
        return out

    def restore_pending(self, deltas: Mapping[str, tuple[int, int, int]]) -> None:
        """A flush failed: `deltas` (from take_pending) did not reach the feed; flush them again later."""
        for rid, c in deltas.items():
            f = self._flushed.setdefault(rid, [0, 0, 0])
            for i, n in enumerate(c):
                f[i] -= n
            self._shared_delta(rid, *c)

    def lost_by_feed(self, shared: Mapping[str, tuple[int, int, int]]) -> bool:
        """The feed's counters (all gateways) hold less than this gateway flushed: ours were lost
        (Redis restarted empty, or our key expired while the feed was unreachable). Every gateway's
        own counts are >= 0, so the sum can only be below ours if some of ours are gone."""
        for rid, f in self._flushed.items():
            got = shared.get(rid, (0, 0, 0))
            if any(g < n for g, n in zip(got, f)):
                return True
        return False

    def rebase(self, held: Mapping[str, tuple[int, int, int]] | None = None) -> None:
        """After `lost_by_feed`: the feed now holds `held` of ours (what the exchange that found
        the loss just added to an empty counter; none by default); the next flush makes it this
        gateway's current work, whole."""
        held = held or {}
        self._flushed = {rid: list(c) for rid, c in held.items()}
        self._pending = {}
        for rid in set(self._loads) | set(held):
            ld = self._loads.get(rid) or ReplicaLoad()
            h = held.get(rid, (0, 0, 0))
            c = [ld.inflight_reqs - h[0], ld.inflight_tokens - h[1], ld.inflight_reqs + ld.active_reqs - h[2]]
            if any(c):
                self._pending[rid] = c

    def _get(self, rid: str) -> ReplicaLoad:
        ld = self._loads.get(rid)
        if ld is None:
            ld = self._loads[rid] = ReplicaLoad()
        return ld

    def dispatch(self, replica_id: str, uncached_tokens: int, now: float | None = None, max_tokens: int = 0,
                 lora: str | None = None, seqs: int = 1) -> Flight:
        """Count a request sent to `replica_id`; `max_tokens` (0: not given) feeds mean_output_tokens;
        `lora`: the adapter it runs, counted in `inflight_loras`, then `active_loras`, until it finishes;
        `seqs`: the engine requests it makes (a completions batch's prompts x `n`: vLLM runs each
        as one), each counted as a request in flight, then active (its rate and size stay one's)."""
        ld = self._get(replica_id)
        if lora is not None:
            if ld.inflight_loras is None:
                ld.inflight_loras = {}
            _count(ld.inflight_loras, lora, 1)
        if now is not None:
            ld.routed_rps = self.routed_rps(replica_id, now) + 1.0 / self.routed_tau_s
            ld.routed_t = now
        ld.inflight_reqs += seqs
        ld.inflight_tokens += uncached_tokens
        m = ld.mean_uncached_tokens
        if now is None:
            ld.mean_uncached_tokens = float(uncached_tokens) if m < 0 else m + _EWMA_ALPHA * (uncached_tokens - m)
        else:  # by age (module header): the earlier requests' weight decayed to now, this one's is 1
            w = self._size_weight(ld, now)
            ld.mean_uncached_tokens = (max(m, 0.0) * w + uncached_tokens) / (w + 1.0)
            ld.size_weight, ld.size_t = w + 1.0, now
        if max_tokens > 0:
            o = ld.mean_output_tokens
            ld.mean_output_tokens = float(max_tokens) if o < 0 else o + _EWMA_ALPHA * (max_tokens - o)
        self._shared_delta(replica_id, seqs, uncached_tokens, seqs)
        return Flight(self, replica_id, uncached_tokens, lora, seqs)

    def _move_to_active(self, f: Flight) -> None:
        ld = self._get(f.replica_id)
        ld.inflight_reqs = max(0, ld.inflight_reqs - f.seqs)
        ld.inflight_tokens = max(0, ld.inflight_tokens - f.tokens)
        ld.active_reqs += f.seqs
        self._shared_delta(f.replica_id, -f.seqs, -f.tokens, 0)
        if f.lora is not None and ld.inflight_loras:
            _count(ld.inflight_loras, f.lora, -1)
            if ld.active_loras is None:
                ld.active_loras = {}
            _count(ld.active_loras, f.lora, 1)

    def _finish(self, f: Flight) -> None:
        ld = self._get(f.replica_id)
        if f.pending:
            ld.inflight_reqs = max(0, ld.inflight_reqs - f.seqs)
            ld.inflight_tokens = max(0, ld.inflight_tokens - f.tokens)
            self._shared_delta(f.replica_id, -f.seqs, -f.tokens, -f.seqs)
        else:
            ld.active_reqs = max(0, ld.active_reqs - f.seqs)
            self._shared_delta(f.replica_id, 0, 0, -f.seqs)
        if f.lora is not None:
            counts = ld.inflight_loras if f.pending else ld.active_loras
            if counts:
                _count(counts, f.lora, -1)

    def gauges(self, now: float) -> dict[str, tuple[float, float, float]]:
        """This gateway's dispatch gauges to publish with the exchange (module header): replica ->
        (routed_rps, size weight, size weight x mean uncached tokens), decayed to `now`; remembered,
        so that `set_shared` can take them out of the sums it is given."""
        out = {}
        for rid, ld in self._loads.items():
            w = self._size_weight(ld, now)
            out[rid] = (self.routed_rps(rid, now), w, w * max(ld.mean_uncached_tokens, 0.0))
        self._published = out
        return out

    def adapters(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """This gateway's LoRA adapters to publish with the exchange: replica -> (those its requests
        there are generating, those without a first token), replicas with none left out."""
        return {rid: (tuple(ld.active_loras or ()), tuple(ld.inflight_loras or ()))
                for rid, ld in self._loads.items() if ld.active_loras or ld.inflight_loras}

    def set_shared(self, shared: Mapping[str, tuple]) -> None:
        """The feed's counters, all gateways including this one: replica -> (reqs, tokens, open),
        optionally followed by the summed dispatch gauges (routed_rps, size weight, weight x mean)
        when the exchange published ours (`gauges`), and by the other gateways' adapters there
        (running, wanting)."""
        for rid, ld in self._loads.items():
            if rid not in shared:
                ld.others_reqs = ld.others_tokens = ld.others_open = 0
                ld.others_rps = ld.others_size_weight = ld.others_size_tokens = 0.0
                ld.others_lora_running = ld.others_lora_wanting = ()
        for rid, counts in shared.items():
            reqs, tokens, opened = counts[:3]
            ld = self._get(rid)
            mine = self._flushed.get(rid, (0, 0, 0))
            ld.others_reqs = max(0, int(reqs) - mine[0])
            ld.others_tokens = max(0, int(tokens) - mine[1])
            # a gateway of the version before the open counter adds none: its in-flight ones at least
            ld.others_open = max(ld.others_reqs, int(opened) - mine[2])
            if len(counts) >= 6:
                own = self._published.get(rid, (0.0, 0.0, 0.0))
                ld.others_rps, ld.others_size_weight, ld.others_size_tokens = (
                    max(0.0, float(t) - o) for t, o in zip(counts[3:6], own))
            else:  # no gauges in this exchange: only ours are known
                ld.others_rps = ld.others_size_weight = ld.others_size_tokens = 0.0
            ld.others_lora_running, ld.others_lora_wanting = counts[6:8] if len(counts) >= 8 else ((), ())

    @staticmethod
    def _size_weight(ld: ReplicaLoad, now: float) -> float:
        if ld.mean_uncached_tokens < 0 or ld.size_weight <= 0.0:
            return 0.0
        return ld.size_weight * math.exp(-max(0.0, now - ld.size_t) / SIZE_TAU_S)

    def pool_routed_rps(self, replica_id: str, now: float) -> float:
        """Requests every gateway routes to the replica per second: ours now, the others' as of the
        last exchange (only ours when the exchange carries no gauges)."""
        return self.routed_rps(replica_id, now) + self.get(replica_id).others_rps

    def pool_mean_uncached(self, replica_id: str, now: float) -> float:
        """Mean uncached prompt tokens of the requests every gateway sent the replica, by age (ours
        weighed at `now`, the others' at the last exchange); -1 when none is known. A gateway whose
        dispatches carry no time (by-count mean) counts its mean alone."""
        ld = self.get(replica_id)
        if ld.size_weight <= 0.0 and ld.mean_uncached_tokens >= 0:
            return ld.mean_uncached_tokens  # by count (dispatch without a time)
        w = self._size_weight(ld, now)
        total_w = w + ld.others_size_weight
        if total_w <= 0.0:
            return -1.0
        return (w * max(ld.mean_uncached_tokens, 0.0) + ld.others_size_tokens) / total_w

    def others_active(self) -> bool:
        """Another gateway had requests in flight at the last exchange."""
        return any(ld.others_reqs or ld.others_tokens or ld.others_open for ld in self._loads.values())

    def routed_rps(self, replica_id: str, now: float) -> float:
        """Requests routed here per second, an EWMA with time constant routed_tau_s, decayed to `now`
        (the cache_aware balance guard compares it across replicas)."""
        ld = self._loads.get(replica_id)
        if ld is None or ld.routed_rps == 0.0:
            return 0.0
        return ld.routed_rps * math.exp(-max(0.0, now - ld.routed_t) / self.routed_tau_s)

    def get(self, replica_id: str) -> ReplicaLoad:
        return self._loads.get(replica_id) or ReplicaLoad()

    def forget(self, replica_id: str) -> None:
        self._loads.pop(replica_id, None)
        self._published.pop(replica_id, None)
        self._pending.pop(replica_id, None)
        self._flushed.pop(replica_id, None)

    def snapshot(self) -> dict[str, ReplicaLoad]:
        return dict(self._loads)
