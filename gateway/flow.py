"""Flow control, the pipeline's admission stage (between plan and dispatch; gateway.pipeline):
when no replica has room, requests wait here, in a fair order, instead of in the engines'
first-come queues.

Rules:
- A request goes straight on when nothing is held and a replica it was ranked for has room
  (gateway.admission); it is then sent where the policy ranked it first, with room or not, or to
  the best-ranked replica with room that holds at least as much of its prefix (flow control
  decides when a request goes, the policy where: `_grant`). Nothing is awaited on that path.
- Headroom (`headroom_reqs`, per replica): a tenant is *light* while it has fewer requests
  granted (and not finished) through all gateways (the others' from the board's last exchange)
  than its weighted fair share of the pool's slots (slots x replicas, shared by weight among the
  tenants granted something or arrived here within HEADROOM_RECENT_S); while the board is away,
  this gateway's grants against its part (divided by the gateways last seen). While a light
  tenant other than the requester arrived within HEADROOM_RECENT_S (here, or at another gateway
  since the board's last exchange: its requests may come through any), a grant for a tenant that
  is not light needs room under slots - headroom_reqs, with none waiting in the engine; a light
  tenant's needs the normal room, and it goes straight on even while others are held. So a
  tenant sending under its share finds a free slot instead of waiting for the next one to free
  (the wait is the pool's time between completions, however fair the order); no slot is held
  back when every active tenant is at or over its share, or none other is active. While other
  gateways hold requests too (the board's last exchange), such a grant also needs this gateway's
  own open requests on the replica under its part of the slots under the headroom (`_my_part`:
  an equal split among the holding gateways, adding up to those slots): each gateway sees the
  others' grants only at the next exchange or report, and without parts two gateways granted
  into the same free slots within milliseconds of each other and filled the headroom together.
  A gateway's own open requests are exact, so no staleness can overfill its part.
- Light spill (`light_spill_s`, off at 0): a light tenant's request that goes straight on while
  another tenant is over its share, and whose first choice has no free sequence slot (room to
  wait in the engine only), goes to the best-ranked replica with a free slot where the prefill it
  loses (its first choice's cached blocks it would recompute there) costs at most `light_spill_s`
  seconds. Its own earlier requests may hold the headroom on the replica that has its prefix; a
  short miss elsewhere is cheaper than waiting there for the next finish.
- Engine priority (`engine_priority`, off: the engines must run `--scheduling-policy priority`):
  a request let on while its tenant is light carries vLLM's priority 0, any other 1, so the
  engine admits it first from its own queue (where requests wait when gateways together overfill
  a replica: each sees the others' grants only at the next exchange or report); and a light
  tenant's request beside another tenant is not held: without room it goes to its first choice
  and waits there, first in line, for the next free slot (bounded: at its share it is not light).
- Otherwise it is held in the fair queue (gateway.fairness: weighted shares between tenants,
  priority classes within a tenant, FIFO within a class). Held requests are released while a
  replica has room, checked when a request of this gateway gets its first token or finishes and
  every `release_interval_s`. At release its placement is decided again (late binding: the
  freshest index and load), so a held request goes where its prefix is now, not where it was.
- A request counts as the engine sequences it makes (a completions batch's prompts x `n`): in its
  grant, its tenant's share (lightness) and its cost in the fair queue, so `n` does not multiply a
  tenant's share. While headroom is kept for a light tenant, a grant needs room for all its
  sequences (up to the slots under the headroom), else those beyond the first would wait in the
  engine's queue ahead of the light tenant's next request; otherwise room for its first (asking
  for all would idle slots until that many free on one replica, with nobody to protect).
- Bounds, answered in OpenAI's error shape: a tenant with `max_queue_reqs_per_tenant` requests
  held (over all gateways) gets 429 `queue_full`; a request held `max_queue_wait_s` gets 429
  `queue_timeout`, both with `Retry-After` (the time the tenant's held requests take to drain at
  its current release rate); no replica healthy: 503, at once and for everything held; shutting
  down: 503 for everything held. A client that disconnects leaves the queue at once.
- Shared (gateway.flow_share, exchanged by gateway.background's `run_share_exchange` over the
  feed's backend): every `share_interval_s` (every `busy_exchange_s` while any of several gateways
  holds requests, `contended`, and the in-flight exchange too: on a saturated pool each gateway's
  grants must reach the others before they grant into the same free slots; with four gateways
  exchanging every 100 ms a light tenant's requests still found full engines) each gateway
  publishes per tenant what it released, holds, has active, was asked for and has granted, and
  reads the others': their releases are credited to the tenants here (fair shares over the pool),
  their held requests count against the per-tenant queue bound, their grants toward lightness,
  their arrivals as arrivals here (headroom), and the tenant limiter gets the others' active
  requests and this gateway's share of each tenant's rate. With the board away the gateway runs on its local share (divided by the
  gateways last seen), says so (`warmroute_gateway_flow_shared`, /readyz, the log) and shares
  again when the board returns.
- Visible: held requests and their wait per tenant hash and class, admissions (direct or
  released), sheds by reason (metrics below), and the request's class, weight, wait, path and
  whether its tenant was light as attributes of the decision span.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import zlib
from collections import OrderedDict
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from gateway.admission import (REPORT_SLACK_S, FlowClass, FlowRules, SlotLedger, has_room, load_tenant_flows,
                               matched_blocks, occupancy_reqs, retry_after_s)
from gateway.auth import TenantLimiter, file_mtime
from gateway.config import ConfigError, GatewayConfig
from gateway.context import RequestContext
from gateway.errors import ApiError
from gateway.fairness import FairQueue
from gateway.flow_share import IDLE_FORGET_S, PeerShares
from gateway.membership import Membership
from gateway.routing import RoutingState
from gateway.telemetry import LabelCache, TenantLabels
from policies.base import Decision
from replica_agent.feed import TenantShare

__all__ = ["FlowControl", "FlowMetrics", "Ticket"]


log = logging.getLogger("warmroute.gateway")

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FORGET_EVERY_S = 30.0  # how often long-idle tenants' state is dropped (_forget_idle)
_RATE_TAU_S = 5.0  # time constant of the per-tenant release rate (Retry-After estimates)
HEADROOM_RECENT_S = 1.0  # a light tenant that arrived this recently keeps the headroom (module rules)


class FlowMetrics(LabelCache):
    def __init__(self, registry, tenant_label: TenantLabels) -> None:
        super().__init__()
        self.tenant_label = tenant_label  # the gateway's, shared with its request metrics
        r = registry
        self.queued = Gauge("warmroute_gateway_flow_queued_requests", "Requests held by flow control",
                            ["tenant_hash", "priority"], registry=r, multiprocess_mode="livesum")
        self.wait = Histogram("warmroute_gateway_flow_queue_wait_seconds", "Time a request was held before release",
                              ["tenant_hash", "priority"], buckets=_WAIT_BUCKETS, registry=r)
        self.admissions = Counter("warmroute_gateway_flow_admissions",
                                  "Requests flow control let on: direct (room at arrival) or released (after being held)",
                                  ["tenant_hash", "priority", "path"], registry=r)
        self.sheds = Counter("warmroute_gateway_flow_sheds", "Held or refused requests by reason: queue_full, "
                             "queue_timeout, no_replica, shutting_down, client_gone",
                             ["tenant_hash", "priority", "reason"], registry=r)
        self.shared = Gauge("warmroute_gateway_flow_shared", "1 while fair shares and limits are exchanged with the "
                            "other gateways, 0 while this gateway runs on its local share", registry=r,
                            multiprocess_mode="min")

    def of_tenant(self, metric, tenant: str, *labels):
        """`metric`'s child for a tenant hash, under its capped label (telemetry.TenantLabels)."""
        return self.child(metric, self.tenant_label(tenant), *labels)


@dataclasses.dataclass(slots=True)
class Ticket:
    """One request's passage through flow control (ctx.flow)."""

    cls: FlowClass
    t_arrival: float  # monotonic
    seqs: int = 1  # sequences the engine runs for it (a batch's prompts x n): what its grant counts
    path: str = ""  # "direct" | "released" once let on
    wait_s: float = 0.0  # time held
    held_ahead: int = 0  # requests held when it was queued
    held: bool = False  # in the queue now (counted in the queued gauge)
    pending: bool = False  # released, its coroutine not yet back to dispatch it (counted on `replica`)
    replica: str | None = None  # where its grant counts (SlotLedger) until it finishes
    light: bool = True  # under its fair share when let on (flow.engine_priority: the engine's priority 0)

    def span_attrs(self) -> dict:
        return {"warmroute.flow.path": self.path, "warmroute.flow.wait_s": self.wait_s,
                "warmroute.flow.priority": self.cls.priority_name, "warmroute.flow.weight": self.cls.weight,
                "warmroute.flow.held_ahead": self.held_ahead, "warmroute.flow.light": self.light}


class _Waiter:
    __slots__ = ("ctx", "decide", "future", "ticket")

    def __init__(self, ctx: RequestContext, decide, future: asyncio.Future, ticket: Ticket) -> None:
        self.ctx, self.decide, self.future, self.ticket = ctx, decide, future, ticket


class FlowControl:
    """The admission stage and its queue (module rules)."""

    def __init__(self, cfg: GatewayConfig, *, routing: RoutingState, membership: Membership, limiter: TenantLimiter,
                 slots: int, registry, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, tenant_label: TenantLabels | None = None) -> None:
        f = self.cfg = cfg.flow
        self.enabled = f.enabled
        self.keys_file = cfg.auth.api_keys_file if cfg.auth.enabled else None
        self.keys_reload_s = cfg.auth.api_keys_reload_s
        try:
            key_flows = load_tenant_flows(self.keys_file, f.priorities) if self.keys_file else None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth.api_keys_file: {exc}") from None
        self.rules = FlowRules(f, key_flows)
        self.routing, self.membership, self.limiter = routing, membership, limiter
        self.slots = slots  # sequence slots per replica
        self.clock, self.wall = clock, wall
        self.queue = FairQueue(len(f.priorities))
        self.grants, self.finishes = SlotLedger(), SlotLedger()  # this gateway's, per replica, timed
        self.metrics = FlowMetrics(registry, tenant_label or TenantLabels())
        self.closed = False
        self.peers = PeerShares(limiter, self.metrics.shared)  # the other gateways, as of the last exchange
        self._rate: dict[str, tuple[float, float]] = {}  # tenant -> (releases/s EWMA, at)
        self._pending: dict[str, int] = {}  # replica -> released requests not yet dispatched
        self._granted: dict[str, int] = {}  # tenant -> requests granted here and not finished
        self._weights: dict[str, float] = {}  # tenant -> its weight at its last arrival
        self._next_forget = 0.0  # clock time of the next _forget_idle
        self._recent: OrderedDict[str, float] = OrderedDict()  # tenant -> its last arrival (clock), oldest first
        self._kicked = False
        self._wake: asyncio.Event | None = None
        self._keys_mtime = file_mtime(self.keys_file)

    # ------------------------------------------------------------------ the stage
    async def hold(self, ctx: RequestContext, decide: Callable[[RequestContext], None]) -> None:
        """Let `ctx` on now, or hold it until a replica has room (then `decide(ctx)` again); raises
        ApiError for the refusals of the module rules. Sets `ctx.flow`."""
        if not self.enabled:
            return
        fc = self.rules.classify(ctx.identity, ctx.headers)
        t = ctx.flow = Ticket(fc, self.clock(), ctx.request.sequences)
        self._weights[fc.tenant] = fc.weight
        self.peers.count_ask(fc.tenant, t.t_arrival)
        self._arrived(fc.tenant, t.t_arrival)
        light = (self._fairness(fc.tenant, t.t_arrival)  # not for a tenant alone: its questions are O(1)
                 if len(self.queue) or len(self._recent) > 1 or len(self._granted) > 1 else None)
        t.light = light is None or light(fc.tenant)
        direct = not len(self.queue) or (t.light and not self.queue.tenant_len(fc.tenant))
        if direct and (self._grant(ctx, t, self._reserve_for(fc.tenant, light), spill_s=self._spill_for(fc.tenant, light))
                       or self._jump(ctx, t, light)):
            t.path = "direct"
            self.metrics.of_tenant(self.metrics.admissions, fc.tenant, fc.priority_name, "direct").inc()
            return
        if self.closed:
            raise self._shed(t, "shutting_down")
        self._check_bound(t)
        loop = asyncio.get_running_loop()
        w = _Waiter(ctx, decide, loop.create_future(), t)
        t.held_ahead = len(self.queue)
        entry = self.queue.push(fc.tenant, w, now=t.t_arrival, cls=fc.priority, weight=fc.weight, cost=t.seqs)
        t.held = True
        self.metrics.of_tenant(self.metrics.queued, fc.tenant, fc.priority_name).inc()
        self._kick()
        if self._wake is not None:
            self._wake.set()
        try:
            await w.future  # from here to the dispatch's in-flight count nothing awaits
        except asyncio.CancelledError:
            if self.queue.remove(entry):  # the client left while held
                self._unhold(t)
                self.metrics.of_tenant(self.metrics.sheds, fc.tenant, fc.priority_name, "client_gone").inc()
            raise
        finally:
            if t.pending:
                t.pending = False
                self._pending[t.replica] -= t.seqs

    def first_token(self) -> None:
        """A request of this gateway got its first token: its prefill left the replica's backlog."""
        if len(self.queue):
            self._kick()

    def finished(self, ctx: RequestContext) -> None:
        """A request ended (any way): its slot is free."""
        self.release(ctx.flow)

    def release(self, t: "Ticket | None") -> None:
        """A grant's slot is free (its request ended, or a background response it held: gateway.background_holds)."""
        if t is None or t.replica is None:
            return
        self.finishes.add(t.replica, self.wall(), -t.seqs)
        t.replica = None
        n = self._granted.get(t.cls.tenant, 0) - t.seqs
        if n > 0:
            self._granted[t.cls.tenant] = n
        else:
            self._granted.pop(t.cls.tenant, None)
            if t.cls.tenant not in self._recent:
                self._weights.pop(t.cls.tenant, None)
        if len(self.queue):
            self._kick()

    def close(self) -> None:
        """Shutting down: answer everything held with 503 and hold nothing more."""
        self.closed = True
        for e in list(self.queue.entries()):
            self.queue.remove(e)
            self._fail(e.payload, "shutting_down")

    # ------------------------------------------------------------------ room and grants
    def _arrived(self, tenant: str, now: float) -> None:
        recent = self._recent
        recent[tenant] = now
        recent.move_to_end(tenant)
        while recent:
            oldest, at = next(iter(recent.items()))
            if now - at <= HEADROOM_RECENT_S:
                break
            del recent[oldest]
            if oldest not in self._granted:
                self._weights.pop(oldest, None)

    def _recently_arrived(self, now: float):
        """Tenants that arrived within HEADROOM_RECENT_S, newest first."""
        for tenant, at in reversed(self._recent.items()):
            if now - at > HEADROOM_RECENT_S:
                return
            yield tenant

    def _fair_slots(self, tenant: str, now: float) -> Callable[[str], bool]:
        """`light(u)`: u has fewer requests granted than its fair share of the pool's slots, among
        the tenants active (granted something here or at another gateway, or arrived here within
        HEADROOM_RECENT_S) and `tenant` (module rules: headroom; grants over every gateway while
        the board answers, else this gateway's against its part of the slots)."""
        others = self.peers.granted  # empty while the board is away: then this gateway's part only
        active = set(self._granted) | set(self._recently_arrived(now)) | {tenant} | set(others)
        w = self._weights
        parts = 1 if self.peers.shared else max(1, self.peers.n_gateways)
        per_weight = self.slots * max(1, len(self.membership.all())) / parts / sum(w.get(u, 1.0) for u in active)
        granted = self._granted
        return lambda u: granted.get(u, 0) + others.get(u, 0) < per_weight * w.get(u, 1.0)

    def _fairness(self, tenant: str, now: float) -> Callable[[str], bool]:
        """`_fair_slots(tenant, now)`, built on its first call only: one request's admission asks
        it up to three times (straight on? headroom? spill?) and often not at all."""
        built: list[Callable[[str], bool]] = []

        def light(u: str) -> bool:
            if not built:
                built.append(self._fair_slots(tenant, now))
            return built[0](u)
        return light

    def _reserve_for(self, tenant: str, light: Callable[[str], bool] | None = None) -> int:
        """Slots per replica a grant for `tenant` must leave free (module rules: headroom);
        `light`: `_fairness(tenant, now)` when the caller has it."""
        h = min(self.cfg.headroom_reqs, self.slots - 1)
        if h <= 0:
            return 0
        if len(self._recent) < 2:
            return 0  # nobody else arrived lately (pruned at each arrival): nothing to keep free, O(1)
        now = self.clock()
        light = light or self._fairness(tenant, now)
        if light(tenant):
            return 0
        return h if any(u != tenant and light(u) for u in self._recently_arrived(now)) else 0

    def _spill_for(self, tenant: str, light: Callable[[str], bool] | None = None) -> float:
        """Seconds of lost prefill a grant for `tenant` may spend for a free slot (module rules: light
        spill): light_spill_s while `tenant` is light and another tenant granted here is not, else 0."""
        spill = self.cfg.light_spill_s
        if spill <= 0.0 or all(u == tenant for u in self._granted):
            return 0.0  # off, or no other tenant granted here: O(1) for a tenant alone
        light = light or self._fairness(tenant, self.clock())
        if not light(tenant):
            return 0.0
        return spill if any(u != tenant and not light(u) for u in self._granted) else 0.0

    def _room(self, v, reserve: int = 0, *, free_slot: bool = False, need: int = 1) -> bool:
        """Room for one more request of `need` sequences on `v` (gateway.admission); `free_slot`: a
        sequence slot free now, nothing to wait for in the engine."""
        rid = v.replica_id
        ld = self.routing.load.get(rid)
        own_inflight = ld.inflight_reqs + self._pending.get(rid, 0)
        if reserve and self.peers.others_holding:  # gateways holding requests: each grants into its part only
            if ld.active_reqs + own_inflight >= self._my_part(rid, self.slots - reserve):
                return False
        rep = self.routing.index.last_load(rid)
        if rep is not None and self.wall() - rep.ts > self.grants.horizon_s:
            rep = None  # older than the ledgers remember: the floor alone
        delta = 0
        if rep is not None:
            delta = self.grants.since(rid, rep.ts) + self.finishes.since(rid, rep.ts - REPORT_SLACK_S)
        occ = occupancy_reqs(rep, delta, own_active=ld.active_reqs, own_inflight=own_inflight, others_open=ld.others_open) + need - 1
        f = self.cfg
        if reserve or free_slot:  # headroom for light tenants, or a free slot: none waiting in the engine
            return has_room(v, occ, slots=self.slots - reserve, engine_queue_reqs=0, max_queue_penalty_s=f.max_queue_penalty_s)
        return has_room(v, occ, slots=self.slots, engine_queue_reqs=f.engine_queue_reqs,
                        max_queue_penalty_s=f.max_queue_penalty_s)

    def _my_part(self, rid: str, slots: int) -> int:
        """This gateway's part of `slots` on replica `rid` while other gateways hold requests (module
        rules: headroom): an equal split among the holders, the remainder rotated by replica, so the
        parts add up to `slots` and no two gateways count the same free slot as theirs."""
        owners = sorted(set(self.peers.others_holding) | {self.peers.owner})
        k = len(owners)
        rank = (owners.index(self.peers.owner) + zlib.crc32(rid.encode())) % k
        return slots // k + (1 if rank < slots % k else 0)

    def _count_grant(self, t: Ticket, rid: str) -> None:
        self.grants.add(rid, self.wall(), t.seqs)
        t.replica = rid
        self._granted[t.cls.tenant] = self._granted.get(t.cls.tenant, 0) + t.seqs

    def _grant(self, ctx: RequestContext, t: Ticket, reserve: int = 0, *, spill_s: float = 0.0) -> bool:
        """If a ranked replica has room: count the grant on the policy's first choice, or on the
        best-ranked replica with room that holds at least as much of the request's prefix.

        Flow control decides when a request goes, the policy where: the first choice may be a
        replica without room (a prefix's holder with a queue), which the policy preferred to a
        miss elsewhere. Moving the request to any replica with room would overrule that: with long
        shared prefixes on busy replicas each such move is seconds of prefill and an eviction, and
        the moves feed the queues that cause more of them (on the busy regime it collapsed every
        run). A replica with room that holds as much loses nothing: the request goes there (with
        two gateways, each seeing the other's finishes late, that keeps slots from idling).
        `reserve`: slots per replica the grant must leave free (headroom); `spill_s`: lost prefill,
        in seconds, the request may pay to take a free slot instead of waiting (light spill)."""
        routing = ctx.routing
        ranked = routing.decision.ranked
        if not ranked:
            return False
        views = {v.replica_id: v for v in routing.views}
        first = views.get(ranked[0].replica_id)
        rid = ranked[0].replica_id
        moved: list = []
        need = self._need(t.seqs, reserve)
        if first is None or not self._room(first, reserve, need=need):
            roomy = [c for c in ranked[1:] if c.replica_id in views and self._room(views[c.replica_id], reserve, need=need)]
            if not roomy:
                return False
            moved = [c for c in roomy if matched_blocks(views[c.replica_id]) >= matched_blocks(first)]
        if not moved and spill_s > 0.0 and first is not None and not self._room(first, reserve, free_slot=True):
            bs = routing.request.block_size
            moved = [c for c in ranked[1:] if c.replica_id in views and self._room(views[c.replica_id], reserve, free_slot=True)
                     and (matched_blocks(first) - matched_blocks(views[c.replica_id])) * bs * views[c.replica_id].prefill_s_per_token <= spill_s]
        if moved:
            ids = {c.replica_id for c in moved}
            rest = [c for c in ranked if c.replica_id not in ids]
            ctx.routing = dataclasses.replace(routing, decision=Decision(routing.decision.policy, tuple(moved + rest)))
            rid = moved[0].replica_id
        self._count_grant(t, rid)
        return True

    def _jump(self, ctx: RequestContext, t: Ticket, light) -> bool:
        """With engine priority, a light tenant's request beside another tenant goes to its first
        choice even without room (module rules): the engine admits it first from its own queue."""
        ranked = ctx.routing.decision.ranked
        if not (self.cfg.engine_priority and t.light and light is not None and ranked):
            return False
        self._count_grant(t, ranked[0].replica_id)
        return True

    def _need(self, seqs: int, reserve: int) -> int:
        """Sequences a grant needs room for (module rules: all of them while headroom is kept)."""
        return min(seqs, self.slots - reserve) if reserve else 1

    def _pool_has_room(self, reserve: int = 0, need: int = 1) -> bool:
        now = self.membership.clock()
        available = {st.replica_id: st.available(now) for st in self.membership.all()}
        return any(self._room(v, reserve, need=need) for v in self.routing.views(list(available), (), available) if v.healthy)

    # ------------------------------------------------------------------ releases
    def _kick(self) -> None:
        if not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._release)

    def _release(self) -> None:
        """Release held requests while a replica has room (each re-decided: late binding)."""
        self._kicked = False
        while len(self.queue):
            head = self.queue.peek()
            reserve = self._reserve_for(head.tenant)
            if not self._pool_has_room(reserve, self._need(head.payload.ticket.seqs, reserve)):
                break
            e = self.queue.pop()
            w: _Waiter = e.payload
            t = w.ticket
            m = self.metrics
            self._unhold(t)
            self.peers.count_release(e.tenant, e.cost, self.clock())
            self._count_release(e.tenant)
            if w.future.done():
                continue
            try:
                w.decide(w.ctx)
            except Exception as exc:  # noqa: BLE001 - the request's own failure, not the queue's
                w.future.set_exception(exc)
                continue
            if not w.ctx.routing.decision.ranked:
                self._fail(w, "no_replica")
                continue
            t.light = self._fairness(t.cls.tenant, self.clock())(t.cls.tenant)
            if not self._grant(w.ctx, t, reserve):  # the pool view had room: trust it for the best-ranked
                self._count_grant(t, w.ctx.routing.decision.ranked[0].replica_id)
            t.pending = True
            self._pending[t.replica] = self._pending.get(t.replica, 0) + t.seqs
            t.path = "released"
            t.wait_s = self.clock() - t.t_arrival
            m.of_tenant(m.wait, t.cls.tenant, t.cls.priority_name).observe(t.wait_s)
            m.of_tenant(m.admissions, t.cls.tenant, t.cls.priority_name, "released").inc()
            w.future.set_result(None)

    async def run(self) -> None:
        """The timer: expiries, a pool without a healthy replica, releases the triggers missed,
        keys-file reloads of the weights and classes."""
        self._wake = asyncio.Event()
        next_keys = self.clock() + self.keys_reload_s
        while True:
            if not len(self.queue):
                self._wake.clear()
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
                    async with asyncio.timeout(self.keys_reload_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            await asyncio.sleep(self.cfg.release_interval_s)
            self.sweep()
            if self.keys_file and self.clock() >= next_keys:
                next_keys = self.clock() + self.keys_reload_s
                self._reload_keys()

    def sweep(self) -> None:
        now = self.clock()
        if now >= self._next_forget:
            self._next_forget = now + _FORGET_EVERY_S
            self._forget_idle(now)
        for e in self.queue.expired(now, self.cfg.max_queue_wait_s):
            self._fail(e.payload, "queue_timeout")
        if len(self.queue) and not self.membership.any_available():
            for e in list(self.queue.entries()):
                self.queue.remove(e)
                self._fail(e.payload, "no_replica")
        self._release()
        if not len(self.queue):
            self.queue.prune()

    def _reload_keys(self) -> None:
        mt = file_mtime(self.keys_file)
        if not mt or mt == self._keys_mtime:
            return
        try:
            self.rules.key_flows = load_tenant_flows(self.keys_file, self.cfg.priorities)
            self._keys_mtime = mt
        except (OSError, ValueError) as exc:
            log.error("api keys file: flow settings invalid, keeping the previous ones: %s", exc)

    # ------------------------------------------------------------------ refusals
    def _check_bound(self, t: Ticket) -> None:
        limit = self.cfg.max_queue_reqs_per_tenant
        mine = self.queue.tenant_len(t.cls.tenant)
        peers = self.peers
        if peers.shared:
            held, cap = mine + peers.queued.get(t.cls.tenant, 0), limit
        else:
            held, cap = mine, math.ceil(limit / peers.n_gateways) if limit else 0
        if held >= cap:
            raise self._shed(t, "queue_full", held=held)

    def _shed(self, t: Ticket, reason: str, held: int | None = None) -> ApiError:
        m = self.metrics
        m.of_tenant(m.sheds, t.cls.tenant, t.cls.priority_name, reason).inc()
        if reason in ("queue_full", "queue_timeout"):
            n = self.queue.tenant_len(t.cls.tenant) if held is None else held
            after = retry_after_s(max(1, n), self._rate_of(t.cls.tenant), self.cfg.max_queue_wait_s)
            msg = ("this tenant has too many requests waiting for capacity" if reason == "queue_full"
                   else f"no capacity freed up for this request within {self.cfg.max_queue_wait_s:g} s")
            return ApiError(429, msg, code=reason, headers={"Retry-After": str(after)})
        if reason == "no_replica":
            return ApiError(503, "no replica available", code="no_replica_available", headers={"Retry-After": "1"})
        return ApiError(503, "the gateway is shutting down", code="shutting_down", headers={"Retry-After": "1"})

    def _fail(self, w: _Waiter, reason: str) -> None:
        self._unhold(w.ticket)
        if not w.future.done():
            w.future.set_exception(self._shed(w.ticket, reason))

    def _unhold(self, t: Ticket) -> None:
        if t.held:
            t.held = False
            self.metrics.of_tenant(self.metrics.queued, t.cls.tenant, t.cls.priority_name).dec()

    def _count_release(self, tenant: str) -> None:
        now = self.clock()
        rate, at = self._rate.get(tenant, (0.0, now))
        self._rate[tenant] = (rate * math.exp(-(now - at) / _RATE_TAU_S) + 1.0 / _RATE_TAU_S, now)

    def _forget_idle(self, now: float) -> None:
        """Per-tenant state of tenants long idle (flow_share.IDLE_FORGET_S): bounded by the tenants
        active in that window, however many come and go."""
        busy = set(self._granted) | {tenant for tenant, _ in self.queue.counts()}
        self.peers.forget_idle(now, busy)
        for tenant in [t for t, (_, at) in self._rate.items() if now - at > IDLE_FORGET_S and t not in busy]:
            del self._rate[tenant]

    def _rate_of(self, tenant: str) -> float:
        rate, at = self._rate.get(tenant, (0.0, self.clock()))
        return rate * math.exp(-(self.clock() - at) / _RATE_TAU_S)

    # ------------------------------------------------------------------ sharing (gateway.flow_share)
    def share_row(self) -> dict[str, TenantShare]:
        """This gateway's row for the board."""
        held: dict[str, int] = {}
        for (tenant, _), n in self.queue.counts().items():
            held[tenant] = held.get(tenant, 0) + n
        return self.peers.row(held, self._granted)

    def apply_shares(self, others: dict[str, dict[str, TenantShare]]) -> None:
        """The other gateways' rows, read just now: their releases credited here, their arrivals
        recent here."""
        credits, arrived = self.peers.apply(others)
        for th, cost in credits.items():
            self.queue.credit(th, cost)
        now = self.clock()
        for th in arrived:
            self._arrived(th, now)

    def board_lost(self) -> None:
        """The board is away: run on this gateway's local share of the bounds and limits."""
        self.peers.lost()

    def readiness_note(self) -> str | None:
        return self.peers.readiness_note() if self.enabled else None

    def contended(self) -> bool:
        """Requests are held here or at another gateway (the board's last exchange), and there are
        other gateways (module rules: shared): the exchanges then run every `busy_exchange_s`."""
        return bool(self.peers.others_holding or (len(self.queue) and self.peers.n_gateways > 1))
