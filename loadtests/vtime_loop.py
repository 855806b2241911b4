"""The virtual-time simulator's event loop: one run's state and what each event does to it.

Rule: a heap of (time, sequence, kind, payload) events, popped in time order (ties in push order);
five kinds: a request ARRIVEs (routed by the gateway's code, queued at its replica), a replica's
STEP ends (first tokens and finished requests go back to the router, KV events go out, the next
step starts), a client's TIMEOUT (an unfinished request is aborted), the KV EVENTS of a step reach
the router after `event_delay_s`, and a load REPORT (the agents' scrape: the router's exchange,
keep-alive's refreshes, the collapse check). The run counts from the end of the warm-up; it ends
when every measured request has finished or been given up, or at a collapse. `loadtests.vtime`
builds the run (`simulate`) and turns the loop's state into a SimResult; the modules named in
`loadtests.vtime`'s header model the replicas, the gateways, pacing and keep-alive.
"""
from __future__ import annotations

import heapq
from collections import deque

from loadtests.vtime_keepalive import KEEPALIVE, queue_refresh, refresh_request
from loadtests.vtime_replica import SimReq

__all__ = ["EventLoop", "is_long_miss"]

STEP, REPORT, EVENTS, ARRIVE, TIMEOUT = 0, 1, 2, 3, 4


def is_long_miss(cached: int, prompt: int) -> bool:
    """A request that found under half its prompt cached (SimResult's misses)."""
    return 2 * cached < prompt


class EventLoop:
    """One simulation run (module rule). `wreqs` and `keys` hold the measured stream's `n_total`
    requests followed by the warm-up's; `router` is a vtime_router SimRouter or SimGateways."""

    def __init__(self, workload, wreqs, keys, n_total: int, warm: bool, p, router, reps, chains, retainer, clock, *,
                 refresh_first: bool, collapse_ttft_s: float | None, observe) -> None:
        self.wreqs, self.keys, self.n_total, self.p, self.clock = wreqs, keys, n_total, p, clock
        self.router, self.reps, self.chains, self.retainer = router, reps, chains, retainer
        self.refresh_first, self.collapse_ttft_s, self.observe = refresh_first, collapse_ttft_s, observe
        self.timeout = p.request_timeout_s
        self.concurrency = workload.concurrency
        self.closed = workload.concurrency is not None
        self.heap: list = []  # (time, seq, kind, payload)
        self.seq = 0
        # multi-turn: a user cannot send turn k+1 before reading answer k. A turn whose scheduled
        # arrival comes before its previous turn finished is sent when that turn finishes.
        self.prev_turn: dict = {}  # request index -> index of the previous turn of its conversation
        last_of: dict = {}
        for i, wr in enumerate(wreqs[:n_total]):
            if wr.conversation:
                j = last_of.get(wr.conversation)
                if j is not None and wr.turn > 0:
                    self.prev_turn[i] = j
                last_of[wr.conversation] = i
        self.finished_idx: set = set()
        self.deferred: dict = {}  # index of an unfinished turn -> index of the next turn waiting for it
        self.pending = deque(range(n_total))
        self.t_start = 0.0  # the measured stream's time origin (end of the warm-up)
        self.step_start = [0.0] * len(reps)
        self.held_elsewhere: set = set()  # measured requests routed away from a replica holding their prompt's middle block
        self.misses = [0, 0]  # long misses of the measured stream: prefix evicted everywhere, copies (SimResult)
        self.refresh_computed = 0  # prompt tokens the keep-alive refreshes computed (not cached)
        self.done: list = []
        self.n_done = 0
        self.n_unfinished = 0
        self.last_t = 0.0
        self.routed: deque = deque()  # routed requests in arrival order (head: oldest possibly without a first token)
        self.all_routed: list = []
        self.collapsed = False
        if warm:
            self.push(0.0, ARRIVE, n_total)
        else:
            self.start_stream(0.0)
        self.push(0.0, REPORT, None)

    def push(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def start_stream(self, t0: float) -> None:
        self.t_start = t0
        for rep in self.reps:  # figures count from here
            rep.busy_s = 0.0
            rep.n_requests = 0
            rep.prefill_tokens = 0
            rep.n_evicted = 0
            rep.n_preemptions = 0
            rep.n_lora_waits = 0
        if self.closed:
            for _ in range(min(self.concurrency, self.n_total)):
                self.push(t0, ARRIVE, self.pending.popleft())
        else:
            for i in range(self.n_total):
                self.push(t0 + self.wreqs[i].arrival_s, ARRIVE, i)

    def kick(self, ri: int, t: float) -> None:
        rep = self.reps[ri]
        dur = rep.start_step()
        if dur is None:
            rep.stepping = False
            return
        rep.stepping = True
        self.step_start[ri] = t
        self.push(t + dur, STEP, ri)

    def flush_events(self, ri: int, t: float) -> None:
        rep = self.reps[ri]
        if not rep.stored and not rep.removed:
            return
        st, rm = rep.stored, rep.removed
        rep.stored, rep.removed = [], []
        if self.p.event_delay_s <= 0:
            self.router.apply_events(ri, st, rm)
        else:
            self.push(t + self.p.event_delay_s, EVENTS, (ri, st, rm))

    def conversation_moves_on(self, i: int, t: float) -> None:
        """Request i is over (finished or given up): its conversation's next turn may go."""
        if self.prev_turn:
            self.finished_idx.add(i)
            nxt = self.deferred.pop(i, None)
            if nxt is not None:
                self.push(t, ARRIVE, nxt)
        if self.closed and self.pending:
            self.push(t, ARRIVE, self.pending.popleft())

    def run(self) -> None:
        handlers = {ARRIVE: self.on_arrive, STEP: self.on_step, TIMEOUT: self.on_timeout,
                    EVENTS: self.on_events, REPORT: self.on_report}
        clock = self.clock
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.last_t = clock.t = t
            if handlers[kind](t, payload):
                self.collapsed = True
                break
            if self.n_done + self.n_unfinished >= self.n_total and kind in (STEP, TIMEOUT):
                break

    def on_arrive(self, t: float, i: int) -> None:
        pj = self.prev_turn.get(i)
        if pj is not None and pj not in self.finished_idx:
            self.deferred[pj] = i
            return
        reps, router = self.reps, self.router
        r = SimReq(i, self.wreqs[i], self.keys[i], t)
        r.warmup = i >= self.n_total
        if self.collapse_ttft_s is not None and not r.warmup:
            self.routed.append(r)
            self.all_routed.append(r)
        ri = router.route(t, r)
        r.rep = ri
        if r.keys and not r.warmup:
            mid = r.keys[len(r.keys) // 2]
            if any(mid in o.ref for j, o in enumerate(reps) if j != ri):
                self.held_elsewhere.add(i)
        rep = reps[ri]
        rep.n_requests += 1
        if self.retainer is not None:
            self.retainer.used(ri, r.keys, router.root_blocks, t, lambda: r.lora)  # a refresh runs the root's adapter
        if r.warmup:
            rep.waiting.append(r)
        else:
            rep.waiting.extend(self.chains.admit(r, ri))
            if router.warm is not None:
                wi, prefix = router.warm
                reps[wi].waiting.append(self.chains.warm(prefix, wi, t, router.warm_dispatched(wi, prefix)))
                if not reps[wi].stepping:
                    self.kick(wi, t)
        if self.timeout is not None and not r.warmup:
            self.push(t + self.timeout, TIMEOUT, r)
        if not rep.stepping:
            self.kick(ri, t)

    def on_step(self, t: float, ri: int) -> None:
        rep, router = self.reps[ri], self.router
        rep.busy_s += t - self.step_start[ri]
        firsts: list = []
        fin: list = []
        rep.end_step(t, firsts, fin)
        for r in firsts:
            if r.pace is None:
                router.first_token(r)
        for r in fin:
            if r.pace is KEEPALIVE:
                self.refresh_computed += r.prompt - r.cached
                self.retainer.done(r.wr.refresh)
                continue
            if r.pace is not None:  # a paced request's chunk: the chain's next part joins the queue
                rep.waiting.extend(self.chains.chunk_done(r))
                continue
            self.finished(r, t)
        self.flush_events(ri, t)  # the step's KV events go out when it ends (the sim publishes then)
        self.kick(ri, t)

    def finished(self, r, t: float) -> None:
        """A request's last token (not a refresh's, not a paced chunk's)."""
        self.router.finished(r)
        if not r.warmup and is_long_miss(r.cached, r.prompt):
            self.misses[r.i in self.held_elsewhere] += 1
        if self.observe is not None and not r.warmup:
            self.observe(r, r.i in self.held_elsewhere)
        if r.warmup:
            if r.i + 1 < len(self.wreqs):
                self.push(t, ARRIVE, r.i + 1)
            else:
                self.start_stream(t)
            return
        self.done.append(r)
        self.n_done += 1
        self.conversation_moves_on(r.i, t)

    def on_timeout(self, t: float, r) -> None:
        if r.state != SimReq.DONE:
            self.reps[r.rep].abort(r)
            self.router.aborted(r)
            self.n_unfinished += 1
            self.conversation_moves_on(r.i, t)

    def on_events(self, t: float, payload) -> None:
        ri, st, rm = payload
        self.router.apply_events(ri, st, rm)

    def on_report(self, t: float, _payload) -> bool:
        """The agents' scrape; True when the run has collapsed (simulate's `collapse_ttft_s`)."""
        if self.collapse_ttft_s is not None:
            routed = self.routed
            while routed and (routed[0].first_s >= 0.0 or routed[0].aborted):
                routed.popleft()
            if routed and t - routed[0].arrival > self.collapse_ttft_s:
                return True
        self.router.report(self.reps, t)
        if self.retainer is not None:
            self.refresh(t)
        if self.n_done + self.n_unfinished < self.n_total:
            self.push(t + self.p.report_interval_s, REPORT, None)
        return False

    def refresh(self, t: float) -> None:
        """Keep-alive's refreshes due now, queued at their replicas."""
        index, rids, p = self.router.routing.index, self.router.rids, self.p
        due = self.retainer.due(t, lambda ri, prefix: index.gpu_run(rids[ri], prefix), lambda ri: p.num_blocks,
                                lambda ri: index.waiting_reqs(rids[ri]))
        for j, rf in enumerate(due, self.retainer.sent - len(due) + 1):
            ka = refresh_request(rf, j, p.block_size, t)
            queue_refresh(self.reps[ka.rep].waiting, ka, first=self.refresh_first)
            if not self.reps[ka.rep].stepping:
                self.kick(ka.rep, t)
