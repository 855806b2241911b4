"""Flow control's admission rules (pure): does a replica have room for one more request now, and
which tenant share, weight and priority class a request counts against.

Room, per replica r, from the signals the cache_aware policy prices (policies/cache_aware.py):
    occupancy_reqs = running + waiting of r's last engine report, brought up to date with this
                     gateway's own grants (+1) since the report's time and finishes (-1) since
                     REPORT_SLACK_S before it (`SlotLedger`s), and never below what the gateways
                     know is there (this gateway's active and in-flight requests, the other
                     gateways' open ones: sent and not finished, from the shared counters; with
                     several gateways this floor is what shows the others' grants since the
                     report);
                     without a usable report (load-only, an agent not heard from, a report older
                     than the ledger's horizon): that floor alone
    backlog_s      = gateway.routing.queued_prefill_tokens (max(waiting x mean uncached prefill
                     tokens, in-flight prefill tokens): the queue the policies price) x prefill
                     seconds per token
    room           = healthy AND occupancy_reqs < max_num_seqs + engine_queue_reqs
                     AND backlog_s <= max_queue_penalty_s
So a request goes on while an engine can start it now (a free sequence slot, little prefill ahead
of it) and waits in the gateway, where tenants are ordered fairly, instead of in an engine's
first-come queue. The ledger is what keeps the slots busy: an engine report is up to an agent
scrape old, and without it a slot freed by a finish would stay idle until the next report. The
slack is there because a report's time is the agent's (after its scrape returned) while the
engine's counts are from earlier, and an engine frees a slot before the gateway relays the end:
a finish seen just before the report's time may not be in it. Counting it again errs on the
side that costs little (a request waiting briefly inside the engine) instead of the one that
costs throughput (a free slot left idle until the next report).

Classification (`FlowRules.classify`), each field from the first source that sets it: the JWT's
claims (flow.weight_claim, priority_claim, allowed_priorities_claim), the tenant's keys-file
entry (`tenant: {keys: [...], weight, priority, allowed_priorities}`), `flow.tenants.<id>`, the
defaults (flow.default_weight, default_priority). The priority header (flow.priority_header) may
always name the tenant's own class or a lower one, and a higher one only if allowed: unknown
class 400, not allowed 403. Tenants are keyed by their hash (gateway.auth.tenant_hash).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gateway.auth import Identity, read_keys_file
from gateway.config import FlowConfig
from gateway.errors import ApiError
from gateway.routing import queued_prefill_tokens
from policies.base import ReplicaView

__all__ = ["TenantFlow", "FlowClass", "FlowRules", "SlotLedger", "occupancy_reqs", "backlog_s", "has_room",
           "load_tenant_flows", "tenant_flow", "retry_after_s", "REPORT_SLACK_S", "matched_blocks"]

REPORT_SLACK_S = 0.05  # finishes this long before a report's time still count as after it (module header)


@dataclass(frozen=True, slots=True)
class TenantFlow:
    """A tenant's flow settings from its credential (keys-file entry or JWT claims); None: unset."""

    weight: float | None = None  # share weight, > 0
    priority: str | None = None  # its priority class
    allowed_priorities: frozenset[str] | None = None  # higher classes it may ask for by header


@dataclass(frozen=True, slots=True)
class FlowClass:
    """What flow control counts one request against."""

    tenant: str  # the tenant's hash
    priority: int  # class index, 0 highest
    priority_name: str
    weight: float


def tenant_flow(weight: Any, priority: Any, allowed: Any, *, where: str) -> TenantFlow:
    """A checked TenantFlow from raw values (None: not given); ValueError naming `where`."""
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not (weight > 0 and math.isfinite(weight))):
        raise ValueError(f"{where}: weight must be a number > 0, got {weight!r}")
    if priority is not None and (not isinstance(priority, str) or not priority):
        raise ValueError(f"{where}: priority must be a class name, got {priority!r}")
    if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(p, str) and p for p in allowed)):
        raise ValueError(f"{where}: allowed_priorities must be a list of class names, got {allowed!r}")
    return TenantFlow(float(weight) if weight is not None else None, priority,
                      frozenset(allowed) if allowed is not None else None)


def load_tenant_flows(path: str | Path, priorities: list[str]) -> dict[str, TenantFlow]:
    """The flow fields of the keys file's mapping entries, checked (class names against
    `priorities`); ValueError naming the file, tenant and field."""
    out: dict[str, TenantFlow] = {}
    for tenant, entry in read_keys_file(path).items():
        if not isinstance(entry, dict):
            continue
        where = f"api keys file {path}: tenant {tenant!r}"
        unknown = set(entry) - {"keys", "weight", "priority", "allowed_priorities"}
        if unknown:
            raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r} "
                             "(known: keys, weight, priority, allowed_priorities)")
        tf = tenant_flow(entry.get("weight"), entry.get("priority"), entry.get("allowed_priorities"), where=where)
        for p in ([tf.priority] if tf.priority else []) + sorted(tf.allowed_priorities or ()):
            if p not in priorities:
                raise ValueError(f"{where}: unknown priority class {p!r} (flow.priorities: {', '.join(priorities)})")
        out[tenant] = tf
    return out


class FlowRules:
    """Classification of requests (module header); `key_flows` may be replaced on a keys reload."""

    def __init__(self, cfg: FlowConfig, key_flows: Mapping[str, TenantFlow] | None = None) -> None:
        self.cfg = cfg
        self._key_flows: Mapping[str, TenantFlow] = key_flows or {}
        self._memo: dict[tuple[str, str | None], FlowClass] = {}  # (tenant id, header) -> class, without claims
        self.index = {p: i for i, p in enumerate(cfg.priorities)}
        self._conf = {t: TenantFlow(tc.weight, tc.priority,
                                    frozenset(tc.allowed_priorities) if tc.allowed_priorities is not None else None)
                      for t, tc in cfg.tenants.items()}

    @property
    def key_flows(self) -> Mapping[str, TenantFlow]:
        return self._key_flows

    @key_flows.setter
    def key_flows(self, flows: Mapping[str, TenantFlow]) -> None:
        self._key_flows = flows
        self._memo = {}

    def classify(self, identity: Identity, headers: Mapping[str, str]) -> FlowClass:
        if identity.claims:
            return self._classify(identity, headers)
        key = (identity.tenant_id, headers.get(self.cfg.priority_header))
        fc = self._memo.get(key)
        if fc is None:
            fc = self._classify(identity, headers)  # raises for a refused header: never memoized
            if len(self._memo) > 10_000:
                self._memo = {}
            self._memo[key] = fc
        return fc

    def _classify(self, identity: Identity, headers: Mapping[str, str]) -> FlowClass:
        cfg = self.cfg
        claimed = self._from_claims(identity.claims) if identity.claims else None
        tid = identity.tenant_id
        sources = [s for s in (claimed, self._key_flows.get(tid), self._conf.get(tid)) if s]
        weight = next((s.weight for s in sources if s.weight is not None), cfg.default_weight)
        own = next((s.priority for s in sources if s.priority is not None), cfg.default_priority)
        allowed = next((s.allowed_priorities for s in sources if s.allowed_priorities is not None), frozenset())
        name = own
        asked = headers.get(cfg.priority_header)
        if asked is not None:
            asked = asked.strip()
            if asked not in self.index:
                raise ApiError(400, f"{cfg.priority_header}: unknown priority class {asked!r} "
                                    f"(known: {', '.join(cfg.priorities)})", code="invalid_priority",
                               param=cfg.priority_header)
            if self.index[asked] < self.index[own] and asked not in allowed:
                raise ApiError(403, f"{cfg.priority_header}: this tenant may not ask for priority class {asked!r}",
                               code="priority_not_allowed", param=cfg.priority_header)
            name = asked
        return FlowClass(identity.tenant_hash, self.index[name], name, weight)

    def _from_claims(self, claims: Mapping[str, Any]) -> TenantFlow | None:
        cfg = self.cfg
        w, p, a = claims.get(cfg.weight_claim), claims.get(cfg.priority_claim), claims.get(cfg.allowed_priorities_claim)
        if w is None and p is None and a is None:
            return None
        try:
            tf = tenant_flow(w, p, a, where="JWT")
        except ValueError as exc:
            names = f"{cfg.weight_claim}, {cfg.priority_claim}, {cfg.allowed_priorities_claim}"
            raise ApiError(401, f"{exc} (claims {names})", code="invalid_token") from None
        for name in ([tf.priority] if tf.priority else []) + sorted(tf.allowed_priorities or ()):
            if name not in self.index:
                raise ApiError(401, f"JWT names unknown priority class {name!r} (known: {', '.join(cfg.priorities)})",
                               code="invalid_token")
        return tf


class SlotLedger:
    """Per replica, timed changes of this gateway's requests there (grants +sequences, finishes
    -sequences; the gateway keeps one ledger of each): `since(rid, ts)` is their sum after wall-clock time `ts`.
    Events at or before the newest `ts` asked about are dropped, and all after `horizon_s`, so each
    call is O(1) amortized."""

    def __init__(self, horizon_s: float = 30.0) -> None:
        self.horizon_s = horizon_s
        self._events: dict[str, deque[tuple[float, int]]] = {}
        self._sum: dict[str, int] = {}
        self._base: dict[str, float] = {}  # the newest report time applied

    def add(self, rid: str, t: float, delta: int) -> None:
        q = self._events.get(rid)
        if q is None:
            q = self._events[rid] = deque()
            self._sum[rid] = 0
        q.append((t, delta))
        self._sum[rid] += delta
        old = t - self.horizon_s
        while q and q[0][0] < old:
            self._sum[rid] -= q.popleft()[1]

    def since(self, rid: str, ts: float) -> int:
        q = self._events.get(rid)
        if q is None:
            return 0
        if ts > self._base.get(rid, -math.inf):
            self._base[rid] = ts
            while q and q[0][0] <= ts:
                self._sum[rid] -= q.popleft()[1]
        return self._sum[rid]

    def forget(self, rid: str) -> None:
        self._events.pop(rid, None)
        self._sum.pop(rid, None)
        self._base.pop(rid, None)


def occupancy_reqs(report, ledger_delta: int, *, own_active: int, own_inflight: int, others_open: int) -> int:
    """Requests an engine holds now, as best known (module header); `report`: a LoadReport or None."""
    floor = own_active + own_inflight + others_open
    if report is None:
        return floor
    return max(report.running_reqs + report.waiting_reqs + ledger_delta, floor)


def matched_blocks(v: ReplicaView | None) -> int:
    """The leading run of the request's blocks a replica holds, as the policies count it (0 for
    no view, or a replica whose index is not live: nothing known to lose there)."""
    return v.matched_blocks_cpu if v is not None and v.index_live else 0


def backlog_s(v: ReplicaView) -> float:
    """Seconds of prefill queued ahead of a new request on the replica (module header)."""
    return queued_prefill_tokens(v) * v.prefill_s_per_token


def has_room(v: ReplicaView, occupancy: int, *, slots: int, engine_queue_reqs: int, max_queue_penalty_s: float) -> bool:
    return v.healthy and occupancy < slots + engine_queue_reqs and backlog_s(v) <= max_queue_penalty_s


def retry_after_s(held: int, release_rps: float, max_wait_s: float) -> int:
    """Seconds a refused client should wait: the time to release `held` requests at the rate the
    tenant's requests are being released, at least 1, at most the queue's maximum wait."""
    cap = max(1, math.ceil(max_wait_s))
    if release_rps <= 0:
        return cap
    return max(1, min(cap, math.ceil(held / release_rps)))
