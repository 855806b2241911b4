"""Flow control's exchange with the other gateways (gateway.background's `run_share_exchange`
carries it over the fair-share board, replica_agent.feed.fair_share): this gateway's row out, the
others' rows in, and what flow control and the tenant limiter take from them (gateway.flow's
module rules say how flow control uses it).

From the other gateways' rows, at each exchange:
- cost released since the last read: credited to the tenant in this gateway's fair queue, so
  fair shares hold over the pool (`apply` returns it; flow control credits it);
- held requests (`queued`): count against the tenant's queue bound;
- granted requests, sent on and not finished (`granted`): count toward the tenant's share of the
  pool's slots (light or heavy);
- requests asked of flow control since the last read: the tenant arrived recently (`apply`
  returns them), so the headroom kept for a light tenant holds whichever gateway its requests
  come through, not only while they happen to come through this one;
- the tenant limiter's active requests and arrivals: the limiter's view of the others' active
  requests and this gateway's share of each tenant's rate.
A gateway seen for the first time is a baseline: nothing of its past is credited or counted as
an arrival. A tenant with nothing held or granted here that has not asked or been released for
IDLE_FORGET_S leaves this gateway's row (`forget_idle`), so the row, and what every other gateway
keeps of it, is bounded by the tenants active in that window, not by every tenant ever seen (JWT
tenants come and go); its counters restart at 0 if it returns. A reader takes a tenant gone from
a row, or a counter that went down, as such a restart: the new counter is all new. While the
board is away (`lost`) everything read from the others is dropped and the limiter runs on this
gateway's part (divided by the gateways last seen); when it returns the others' counters are read
afresh as a baseline.
"""
from __future__ import annotations

from typing import Mapping

from gateway.auth import TenantLimiter, tenant_hash
from replica_agent.feed import TenantShare

__all__ = ["PeerShares"]

_MIN_RATE_SHARE = 0.05  # a gateway's share of a tenant's rate never drops below this
IDLE_FORGET_S = 300.0  # an idle tenant's counters leave the row after this (module header)


def _grown(new: float, old: float) -> float:
    """How much a counter grew since it was last read; a counter that went down restarted at 0."""
    return new - old if new >= old else new


class PeerShares:
    """What this gateway publishes and what it last read of the others (module header)."""

    def __init__(self, limiter: TenantLimiter, shared_gauge) -> None:
        self.limiter = limiter
        self.gauge = shared_gauge  # 1 while shared, 0 on the local share
        self.shared = False  # the board answered at the last exchange
        self.has_board = False  # an exchange runs at all (a feed with a board)
        self.n_gateways = 1  # gateways seen at the last successful exchange (this one included)
        self.owner = ""  # this gateway's name on the board (set by the exchange)
        self.others_holding: tuple[str, ...] = ()  # the other gateways holding requests at the last exchange
        self.queued: dict[str, int] = {}  # tenant -> requests the other gateways hold
        self.granted: dict[str, int] = {}  # tenant -> requests the other gateways granted, not finished
        self.released: dict[str, float] = {}  # tenant -> cost released here so far (published; grows)
        self.asked: dict[str, int] = {}  # tenant -> requests asked of flow control here so far (published; grows)
        self._touched: dict[str, float] = {}  # tenant -> when it last asked or was released here
        self._seen: dict[str, dict[str, float]] = {}  # owner -> tenant -> its released counter last read
        self._arrivals_seen: dict[str, dict[str, int]] = {}  # owner -> tenant -> its limiter arrivals last read
        self._asked_seen: dict[str, dict[str, int]] = {}  # owner -> tenant -> its asked counter last read
        self._my_arrivals: dict[str, int] = {}  # tenant id -> the limiter's arrivals here at the last exchange
        self._ids_of_hash = {tenant_hash(t): t for t in limiter.policies}
        shared_gauge.set(0)

    def count_ask(self, tenant: str, now: float) -> None:
        self.asked[tenant] = self.asked.get(tenant, 0) + 1
        self._touched[tenant] = now

    def count_release(self, tenant: str, cost: float, now: float) -> None:
        self.released[tenant] = self.released.get(tenant, 0.0) + cost
        self._touched[tenant] = now

    def forget_idle(self, now: float, busy) -> int:
        """Drop the counters of tenants idle for IDLE_FORGET_S and not in `busy` (held or granted
        here); returns how many were dropped."""
        drop = [t for t, at in self._touched.items() if now - at > IDLE_FORGET_S and t not in busy]
        for t in drop:
            del self._touched[t]
            self.released.pop(t, None)
            self.asked.pop(t, None)
        return len(drop)

    def row(self, held: Mapping[str, int], granted: Mapping[str, int]) -> dict[str, TenantShare]:
        """This gateway's row: `held` and `granted` are flow control's per tenant now."""
        lim = self.limiter
        row = {}
        for th in set(self.released) | set(held) | set(self._ids_of_hash) | set(granted) | set(self.asked):
            tid = self._ids_of_hash.get(th)
            row[th] = TenantShare(self.released.get(th, 0.0), held.get(th, 0),
                                  lim.active(tid) if tid else 0, lim.arrivals.get(tid, 0) if tid else 0,
                                  granted.get(th, 0), self.asked.get(th, 0))
        return row

    def apply(self, others: Mapping[str, Mapping[str, TenantShare]]) -> tuple[dict[str, float], set[str]]:
        """The other gateways' rows, read just now: (cost to credit per tenant, tenants that arrived
        at another gateway since the last read)."""
        credits: dict[str, float] = {}
        arrived: set[str] = set()
        queued: dict[str, int] = {}
        active: dict[str, int] = {}
        granted: dict[str, int] = {}
        arrivals_d: dict[str, int] = {}
        for owner, row in others.items():
            new = owner not in self._seen  # a gateway first seen: its past is a baseline
            seen = self._seen.setdefault(owner, {})
            aseen = self._arrivals_seen.setdefault(owner, {})
            asked_seen = self._asked_seen.setdefault(owner, {})
            for gone in [th for th in seen if th not in row]:  # left the row: restarts at 0 if back
                del seen[gone]
                aseen.pop(gone, None)
                asked_seen.pop(gone, None)
            for th, s in row.items():
                d = _grown(s.released, seen.get(th, 0.0))
                if not new and d > 0:
                    credits[th] = credits.get(th, 0.0) + d
                seen[th] = s.released
                da = _grown(s.arrivals, aseen.get(th, 0))
                if not new and da > 0:
                    arrivals_d[th] = arrivals_d.get(th, 0) + da
                aseen[th] = s.arrivals
                if not new and _grown(s.asked, asked_seen.get(th, 0)) > 0:
                    arrived.add(th)
                asked_seen[th] = s.asked
                queued[th] = queued.get(th, 0) + s.queued
                active[th] = active.get(th, 0) + s.active
                if s.granted > 0:
                    granted[th] = granted.get(th, 0) + s.granted
        for gone in set(self._seen) - set(others):
            del self._seen[gone]
            self._arrivals_seen.pop(gone, None)
            self._asked_seen.pop(gone, None)
        self.queued, self.granted = queued, granted
        self.others_holding = tuple(sorted(o for o, row in others.items() if any(s.queued > 0 for s in row.values())))
        self.n_gateways = 1 + len(others)
        lim = self.limiter
        lim.others_active = {tid: active.get(th, 0) for th, tid in self._ids_of_hash.items()}
        lim.concurrency_share = 1.0
        for th, tid in self._ids_of_hash.items():
            mine = lim.arrivals.get(tid, 0) - self._my_arrivals.get(tid, 0)
            self._my_arrivals[tid] = lim.arrivals.get(tid, 0)
            total = mine + arrivals_d.get(th, 0)
            prev = lim.rate_share.get(tid, 1.0 / self.n_gateways)
            share = prev if total <= 0 else 0.7 * prev + 0.3 * (mine / total)
            lim.rate_share[tid] = max(_MIN_RATE_SHARE, min(1.0, share))
        self._set_shared(True)
        return credits, arrived

    def lost(self) -> None:
        """The board is away: this gateway's local share of the bounds and limits."""
        lim = self.limiter
        lim.others_active = {}
        lim.concurrency_share = 1.0 / self.n_gateways
        lim.rate_share = {tid: 1.0 / self.n_gateways for tid in self._ids_of_hash.values()}
        self.queued, self.granted = {}, {}
        self.others_holding = ()
        self._seen.clear()  # the others' counters are re-read as a fresh baseline when it returns
        self._arrivals_seen.clear()
        self._asked_seen.clear()
        self._set_shared(False)

    def _set_shared(self, ok: bool) -> None:
        if ok != self.shared:
            self.shared = ok
            self.gauge.set(1 if ok else 0)

    def readiness_note(self) -> str | None:
        if self.has_board and not self.shared:
            return (f"flow control on its local share: the fair-share board is unavailable "
                    f"(limits divided by the {self.n_gateways} gateway(s) last seen)")
        return None
