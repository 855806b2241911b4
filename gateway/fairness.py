"""Flow control's ordering core (pure): which held request goes next when capacity frees.

Rules:
- Between tenants: weighted fair queuing, as start-time fair queuing per tenant. Each tenant has
  an attained service `served` (the cost of its requests released so far, by any gateway that
  shares it) and a weight; a tenant with held requests has the tag `max(served / weight, V)`,
  where V, the queue's virtual time, is the tag of the last request released (it never goes
  back). The lowest tag goes next; equal tags go to the tenant whose key sorts first (a rule no
  held request can change: arrival order would let a leaving request reorder the others). Releasing a request
  of cost c adds c to its tenant's `served`; a tenant new to the queue starts at served = V x
  weight, and a weight change keeps served / weight. So two tenants with held requests are served in
  proportion to their weights, within one request's cost of it at every point
  (|served_i/w_i - served_j/w_j| <= c_max/w_i + c_max/w_j over any stretch both are held), and
  a tenant that was idle competes from V: no credit is banked while idle.
- Within a tenant: priority classes, 0 the highest; a lower class waits while the tenant has a
  request of a higher one held. FIFO within a class. Classes never reorder tenants: a tenant's
  high class spends that tenant's own share.
- Leaving (a client that disconnects, a request past its maximum wait) removes the request and
  changes nothing else: the others come out in the order they would have without it.
- Bounds are the caller's: `tenant_len` for a per-tenant queue length, `expired` for a queue wait.
- Shared service: `credit(tenant, cost)` adds service other gateways gave a tenant, so a tenant
  served elsewhere waits here in proportion; that is how fair shares hold across gateways. V
  stays each queue's own: another gateway's V is set by tenants that may not compete here, and
  raising ours to it would wipe the lag of a tenant that only this gateway serves.
Nothing here does I/O or reads a clock: times are arguments. Costs and weights are > 0.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Iterator

__all__ = ["FairQueue", "Entry"]


class Entry:
    """One held request (the handle `push` returns, for `remove`)."""

    __slots__ = ("seq", "tenant", "cls", "cost", "t_queued", "payload", "queued")

    def __init__(self, seq: int, tenant: str, cls: int, cost: float, t_queued: float, payload: Any) -> None:
        self.seq = seq  # global push order
        self.tenant = tenant  # tenant key (the gateway uses the tenant's hash)
        self.cls = cls  # priority class, 0 highest
        self.cost = cost  # service it takes (the gateway counts requests: 1.0)
        self.t_queued = t_queued  # when it was queued (the caller's clock)
        self.payload = payload  # the caller's object
        self.queued = True  # False once released, removed or expired

    def __repr__(self) -> str:
        return f"Entry({self.seq}, {self.tenant!r}, cls={self.cls})"


class _Tenant:
    __slots__ = ("weight", "served", "classes", "n")

    def __init__(self, weight: float, n_classes: int, vtime: float) -> None:
        self.weight = weight
        self.served = vtime * weight  # attained service (cost units), local plus credited; a new tenant starts at V
        self.classes: list[deque[Entry]] = [deque() for _ in range(n_classes)]
        self.n = 0  # held entries

    def head(self) -> Entry | None:
        for q in self.classes:
            if q:
                return q[0]
        return None


class FairQueue:
    """Held requests in release order (module rules). `n_classes` priority classes, 0 highest."""

    def __init__(self, n_classes: int = 1) -> None:
        if n_classes < 1:
            raise ValueError("n_classes must be >= 1")
        self.n_classes = n_classes
        self.vtime = 0.0  # V: the tag of the last release (normalized service)
        self._tenants: dict[str, _Tenant] = {}
        self._backlogged: dict[str, _Tenant] = {}  # tenants with held entries
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def tenant_len(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.n if t is not None else 0

    def class_len(self, tenant: str, cls: int) -> int:
        t = self._tenants.get(tenant)
        return len(t.classes[cls]) if t is not None else 0

    def push(self, tenant: str, payload: Any, *, now: float, cls: int = 0, weight: float = 1.0,
             cost: float = 1.0) -> Entry:
        """Hold `payload` for `tenant` in class `cls`; the tenant's weight becomes `weight`."""
        if not 0 <= cls < self.n_classes:
            raise ValueError(f"class {cls} out of range 0..{self.n_classes - 1}")
        if not (weight > 0 and cost > 0):
            raise ValueError("weight and cost must be > 0")
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(weight, self.n_classes, self.vtime)
        elif t.weight != weight:  # keep its place (served / weight) across a weight change
            t.served *= weight / t.weight
            t.weight = weight
        e = Entry(next(self._seq), tenant, cls, cost, now, payload)
        t.classes[cls].append(e)
        t.n += 1
        self._len += 1
        self._backlogged[tenant] = t
        return e

    def tag(self, tenant: str) -> float:
        """The tenant's start tag: max(served / weight, V)."""
        t = self._tenants.get(tenant)
        if t is None:
            return self.vtime
        return max(t.served / t.weight, self.vtime)

    def peek(self) -> Entry | None:
        """The entry `pop` would release, without releasing it."""
        best: tuple[float, str] | None = None
        best_t = None
        v = self.vtime
        for name, t in self._backlogged.items():
            key = (max(t.served / t.weight, v), name)
            if best is None or key < best:
                best, best_t = key, t
        return best_t.head() if best_t is not None else None

    def pop(self) -> Entry | None:
        """Release the next entry (module rules); None when nothing is held."""
        e = self.peek()
        if e is None:
            return None
        t = self._tenants[e.tenant]
        start = max(t.served / t.weight, self.vtime)  # its tag: a tenant back from idle starts at V
        self.vtime = start
        t.served = start * t.weight + e.cost
        self._take(t, e, t.classes[e.cls].popleft)
        return e

    def remove(self, e: Entry) -> bool:
        """Take a held entry out (its client left); False if it was no longer held."""
        if not e.queued:
            return False
        t = self._tenants[e.tenant]
        self._take(t, e, lambda: t.classes[e.cls].remove(e))
        return True

    def expired(self, now: float, max_wait_s: float) -> list[Entry]:
        """Take out and return every entry queued at or before `now - max_wait_s`, oldest first."""
        cutoff = now - max_wait_s
        out: list[Entry] = []
        for t in list(self._backlogged.values()):
            for q in t.classes:
                while q and q[0].t_queued <= cutoff:
                    e = q[0]
                    self._take(t, e, q.popleft)
                    out.append(e)
        out.sort(key=lambda e: e.seq)
        return out

    def _take(self, t: _Tenant, e: Entry, unlink) -> None:
        unlink()
        e.queued = False
        t.n -= 1
        self._len -= 1
        if t.n == 0:
            self._backlogged.pop(e.tenant, None)

    # ------------------------------------------------------------------ shared service
    def credit(self, tenant: str, cost: float, weight: float | None = None) -> None:
        """Service another gateway gave `tenant` (counts against its share here too)."""
        if cost <= 0:
            return
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(weight or 1.0, self.n_classes, self.vtime)
        t.served += cost

    def served(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return t.served if t is not None else 0.0

    def prune(self) -> int:
        """Forget idle tenants whose tag is V anyway (no held entries, served/weight <= V): a
        forgotten tenant comes back exactly as it would have. Returns how many were dropped."""
        drop = [k for k, t in self._tenants.items() if t.n == 0 and t.served / t.weight <= self.vtime]
        for k in drop:
            del self._tenants[k]
        return len(drop)

    # ------------------------------------------------------------------ views
    def entries(self) -> Iterator[Entry]:
        for t in self._backlogged.values():
            for q in t.classes:
                yield from q

    def counts(self) -> dict[tuple[str, int], int]:
        """(tenant, class) -> held entries."""
        out = {}
        for k, t in self._backlogged.items():
            for c, q in enumerate(t.classes):
                if q:
                    out[(k, c)] = len(q)
        return out
