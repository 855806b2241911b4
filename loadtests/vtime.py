"""Virtual-time simulator: the real policy code against modelled vLLM replicas, no wall clock.

Rule: a discrete-event simulation, deterministic for a seed, that decides with the gateway's own
code (the same index, load tracker, views, policy and learning) against a lean model of a vLLM
replica. Nothing sleeps and nothing does I/O; 100k requests on 4-256 replicas run in minutes.
Blocks are keyed with `hashing.keys.chain_keys` (xxh3, memoised per shared segment prefix), the
gateway's own keys, so the index needs no translation.

Replica model: `loadtests/vtime_replica.py`, the same scheduler, KV and time model as the
wall-clock simulator's engine (loadtests/sim/scheduler.py: continuous batching, chunked prefill
with a per-step token budget, blocks taken as tokens are scheduled, recompute preemption, one LRU
free queue), computed faster. Time model: step_s = step_overhead_s + prefill_tokens x
prefill_s_per_token + decoding_seqs x decode_s_per_seq. `SimParams()` defaults are a GPU-like
profile (4 ms, 5e-5 s/token = 20k tokens/s, 0.2 ms/seq; the sim's own GPU profile is 8 ms and
0.25 ms/seq); `SimParams.wallclock()` is exactly the sim's `--time-profile wallclock` (12 ms,
1 ms/token, 0.1 ms/seq), what the wall-clock comparison runs.

Clients (`SimParams.request_timeout_s`): a request without its last token that long after it was
sent is aborted (the client's total timeout, as loadtests/runner.py's): it leaves its replica's
queue or frees its blocks, the router forgets it, and it counts as unfinished.

Warm-up (`simulate(warmup=...)`): requests sent through the router one after another (each when
the previous finished) before the measured stream, which then starts; they are left out of every
figure (pre-warming the replicas with one request per document: workloads.warmup_requests).

Multi-turn: a turn is never sent before the previous turn of its conversation has finished (a
user reads the answer first): a turn scheduled earlier is sent at that finish. Without this,
compressed think times let turn k+1 arrive while answer k is still decoding, a miss for every
router but a hit for the oracle.

Collapse: with `collapse_ttft_s`, a run stops early (SimResult.collapsed) once a routed request
has waited that long for its first token; see `simulate`.

Router (loadtests/vtime_router.py): the gateway's own `gateway.routing.RoutingState` (KV index,
load tracker, view assembly, in-flight accounting) and `gateway.learn` on virtual time, fed as a
gateway is: KV events after `event_delay_s`, load reports every `report_interval_s` (the agent's
scrape, so load is up to one interval stale), speculative keys for `spec_ttl_s`; in-flight
counts exact and immediate. cache_aware's and cache_plan's `max_num_seqs` default to the modelled
replicas' (an operator sets it to the engines' --max-num-seqs) unless policy_params give one.

Events (arrivals, replica steps, client timeouts, KV events, load reports) and what each does:
`loadtests/vtime_loop.py`; `simulate` builds a run, runs that loop and reports its figures.

API: `simulate(workload, policy, n_replicas, params=SimParams(), policy_params={}, seed=0,
keys=None, collapse_ttft_s=None, warmup=None) -> SimResult` (`policy`: a registry name or a policy
object); `prepare_keys(workload, block_size)` computes every request's keys once
so several policies can share them. `SimResult.summary()` is a flat dict for reports.
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gateway.config import FeedConfig
from hashing.keys import block_extras, chain_keys, root_key
from loadtests.vtime_replica import ReplicaModel, SimReq
from loadtests.vtime_keepalive import KeepAlive, Retainer
from loadtests.vtime_loop import EventLoop, is_long_miss
from loadtests.workloads import (_END_IDS, _JOIN_IDS, _ROLE_IDS, Workload, WorkloadRequest, last_third_start,
                                 segment_token_ids)
from loadtests.vtime_pacing import PaceChains, Pacing
from loadtests.vtime_router import SimGateways, SimRouter, VClock
from policies.registry import get_policy

__all__ = ["SimParams", "SimResult", "simulate", "is_long_miss", "prepare_keys", "RequestKeys"]


@dataclass(frozen=True, slots=True)
class SimParams:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 8192  # KV blocks per replica
    max_num_seqs: int = 256  # running requests per replica
    max_batched_tokens: int = 8192  # token budget per step (chunked prefill)
    step_overhead_s: float = 0.004  # fixed cost of one engine step
    prefill_s_per_token: float = 5e-5  # cost of one prefilled token (20k tokens/s)
    decode_s_per_seq: float = 2e-4  # cost of one decoding sequence in a step
    report_interval_s: float = 0.1  # agent load scrape period (router's view staleness)
    event_delay_s: float = 0.005  # KV event delivery delay to the router
    spec_ttl_s: float = FeedConfig().speculative_ttl_s  # lifetime of speculative index entries (the gateway's default)
    prior_prefill_s_per_token: float = 5e-5  # calibration prior
    prior_decode_step_s: float = 0.02  # calibration prior
    model: str = "vtime-model"  # root of the key chain
    request_timeout_s: float | None = None  # client's total timeout: abort and count unfinished (None: wait forever)
    cache_answers: bool = True  # quoted answers (multi-turn) cached at finish; False = the wall-clock sim (filler output)
    long_prefill_token_threshold: int = 0  # vLLM's: at most this many prefill tokens per request per step (0: the budget)
    max_loras: int = 0  # vLLM's --max-loras: adapters one batch may run (0: no limit)
    lora_metrics: bool = True  # the engines export their LoRA slots (vllm:lora_requests_info) to the router

    @classmethod
    def wallclock(cls, **kw) -> "SimParams":
        """The wall-clock simulator's time profile (`warmroute sim --time-profile wallclock`) and the
        calibration priors compare_peers gives the gateway; `kw` overrides any field."""
        from loadtests.sim.scheduler import TimeModel

        tm = TimeModel.wallclock()
        base = dict(step_overhead_s=tm.step_overhead_s, prefill_s_per_token=tm.prefill_s_per_token,
                    decode_s_per_seq=tm.decode_s_per_seq, prior_prefill_s_per_token=1e-3, prior_decode_step_s=0.012)
        base.update(kw)
        return cls(**base)


@dataclass(slots=True)
class RequestKeys:
    prompt: list  # keys of the prompt's full blocks
    output: list | None  # keys continuing the chain over the generated answer (multi-turn), else None


# ------------------------------------------------------------------------------------------ keys


class _KeyMemo:
    """Chained keys per request, memoised per (salt, piece prefix): exact, and fast when shared."""

    def __init__(self, model: str, block_size: int, max_entries: int = 50000) -> None:
        self.root = root_key(model)
        self.bs = block_size
        self.memo: OrderedDict = OrderedDict()  # prefix id -> (keys tuple, leftover token list)
        self.max_entries = max_entries

    def _extend(self, keys: tuple, leftover: list, toks, salt: str, lora: str | None) -> tuple[tuple, list]:
        buf = leftover + list(toks)
        n_full = len(buf) // self.bs
        if n_full == 0:
            return keys, buf
        first, rest = block_extras(salt or None, lora)
        parent = keys[-1] if keys else self.root
        new = chain_keys(parent, buf[: n_full * self.bs], self.bs, first if not keys else rest, rest)
        return keys + tuple(new), buf[n_full * self.bs :]

    def keys(self, req: WorkloadRequest) -> RequestKeys:
        pieces: list = []  # the token rendering's (loadtests.workloads.render_token_ids), piece by piece
        prev_role = None
        for s in req.segments:
            if s.role != prev_role:
                if prev_role is not None:
                    pieces.append(("e",))
                pieces.append(("h", s.role))
                prev_role = s.role
            else:
                pieces.append(("j",))
            pieces.append(("s", s.seg_id, s.n_tokens))
        if prev_role is not None:
            pieces.append(("e",))
        pieces.append(("h", "assistant"))
        state: tuple = ((), [])
        tag = (req.salt, req.lora)  # a prefix's keys differ by cache salt and LoRA adapter
        # longest memoised prefix (all but the last two pieces are worth memoising)
        start = 0
        for i in range(len(pieces) - 1, 0, -1):
            hit = self.memo.get((tag, tuple(pieces[:i])))
            if hit is not None:
                state, start = hit, i
                self.memo.move_to_end((tag, tuple(pieces[:i])))
                break
        keys, left = state
        for i in range(start, len(pieces)):
            p = pieces[i]
            toks = (_ROLE_IDS[p[1]] if p[0] == "h" else _END_IDS if p[0] == "e" else _JOIN_IDS if p[0] == "j"
                    else segment_token_ids_by_id(p[1], p[2]))
            keys, left = self._extend(keys, left, toks, req.salt, req.lora)
            if i < len(pieces) - 2:
                mk = (tag, tuple(pieces[: i + 1]))
                if mk not in self.memo:
                    self.memo[mk] = (keys, left)
                    if len(self.memo) > self.max_entries:
                        self.memo.popitem(last=False)
        out = None
        if req.output is not None:
            okeys, oleft = self._extend(keys, left, segment_token_ids(req.output), req.salt, req.lora)
            out = list(okeys[len(keys) :])
            # the next turn continues from here: memoise prompt+answer as a prefix
            self.memo[(tag, tuple(pieces[:-1]) + (("h", "assistant"), ("s", req.output.seg_id, req.output.n_tokens)))] = (okeys, oleft)
        return RequestKeys(list(keys), out)


def segment_token_ids_by_id(seg_id: str, n_tokens: int):
    from loadtests.workloads import _segment_ids_cached

    return _segment_ids_cached(seg_id, n_tokens)


def prepare_keys(workload: Workload, block_size: int = 16, model: str = "vtime-model") -> list[RequestKeys]:
    """Every request's prompt (and quoted-output) keys, in workload order."""
    memo = _KeyMemo(model, block_size)
    return [memo.keys(r) for r in workload.requests]


# -------------------------------------------------------------------------------- replica model

_Req = SimReq  # the replica model lives in loadtests/vtime_replica.py
_Replica = ReplicaModel


# ------------------------------------------------------------------------------------ the router


# ------------------------------------------------------------------------------------- results


@dataclass
class SimResult:
    workload: str
    policy: str
    n_replicas: int
    requests: int
    completed: int
    duration_s: float  # virtual: first arrival to last finish
    ttft_s: np.ndarray  # per completed request
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    per_replica_requests: list
    per_replica_busy_s: list
    wall_s: float  # real seconds the simulation took
    calibration: dict = field(default_factory=dict)
    policy_params: dict = field(default_factory=dict)
    collapsed: bool = False  # stopped early: a request waited longer than `collapse_ttft_s` for its first token
    stopped_at_s: float = 0.0  # virtual time of the stop (collapsed runs only)
    unfinished: int = 0  # measured requests aborted by the client timeout (SimParams.request_timeout_s)
    e2e_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per completed request: arrival to last token
    evicted_blocks: int = 0  # cached blocks evicted during the measured stream, all replicas
    preemptions: int = 0  # requests preempted during the measured stream, all replicas
    lora_waits: int = 0  # requests an engine skipped at least once for want of a LoRA slot (SimParams.max_loras)
    per_replica_prefill_tokens: list = field(default_factory=list)  # tokens prefilled, measured stream
    # long misses: measured requests that found under half their prompt cached, by whether another
    # replica held the prompt's middle block when the request was routed (the router made a copy,
    # or moved the prefix) or none did (the engines had evicted it, or it was never computed)
    misses_copy: int = 0
    misses_evicted: int = 0
    paced_ttft_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per finished paced request (pacing probe)
    warms: int = 0  # background warms of new holders (cache_plan copy_in_background probe)
    refreshes: int = 0  # keep-alive refreshes sent (keep-alive probe)
    refresh_computed_tokens: int = 0  # prompt tokens the refreshes made the replicas compute (uncached)
    arrival_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per completed request, as ttft_s (not for collapsed runs)

    def late_ttft_s(self) -> np.ndarray:
        """TTFT of the completed requests that arrived in the last third (by count, as the wall
        clock's: `workloads.last_third_start`): a run's state once its start is behind it (a plan
        that holds at the start can still drift)."""
        a = self.arrival_s
        if len(a) != len(self.ttft_s) or not len(a):
            return np.zeros(0)
        return self.ttft_s[np.argsort(a, kind="stable")[last_third_start(len(a)):]]

    def summary(self) -> dict:
        t = self.ttft_s
        e = self.e2e_s
        pr = np.asarray(self.per_replica_requests, dtype=float)
        mean = pr.mean() if len(pr) else 0.0
        busy = self.per_replica_busy_s
        late = self.late_ttft_s()
        return {
            "workload": self.workload,
            "policy": self.policy,
            "replicas": self.n_replicas,
            "requests": self.requests,
            "completed": self.completed,
            "unfinished": self.unfinished,
            "duration_s": self.duration_s,
            "throughput_rps": self.completed / self.duration_s if self.duration_s > 0 else 0.0,
            "output_tok_s": self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "ttft_p50_s": float(np.percentile(t, 50)) if len(t) else float("nan"),
            "ttft_p90_s": float(np.percentile(t, 90)) if len(t) else float("nan"),
            "ttft_p99_s": float(np.percentile(t, 99)) if len(t) else float("nan"),
            "ttft_max_s": float(t.max()) if len(t) else float("nan"),
            # None (not nan: a summary compares equal to itself) when unknown: a collapsed run's
            "ttft_p50_late_s": float(np.percentile(late, 50)) if len(late) else None,
            "ttft_p99_late_s": float(np.percentile(late, 99)) if len(late) else None,
            "e2e_p50_s": float(np.percentile(e, 50)) if len(e) else float("nan"),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "load_max_over_mean": float(pr.max() / mean) if mean > 0 else 0.0,
            "busy_frac_mean": float(np.mean(busy) / self.duration_s) if self.duration_s > 0 else 0.0,
            "busy_max_over_mean": float(max(busy) / np.mean(busy)) if np.mean(busy) > 0 else 0.0,
            "evicted_blocks": self.evicted_blocks,
            "preemptions": self.preemptions,
            "lora_waits": self.lora_waits,
            "misses_copy": self.misses_copy,
            "misses_evicted": self.misses_evicted,
            "paced": len(self.paced_ttft_s),
            "warms": self.warms,
            "refreshes": self.refreshes,
            "refresh_computed_tokens": self.refresh_computed_tokens,
            "paced_ttft_p50_s": float(np.percentile(self.paced_ttft_s, 50)) if len(self.paced_ttft_s) else None,
            "collapsed": self.collapsed,
            "wall_s": self.wall_s,
        }


# ---------------------------------------------------------------------------------- simulation


def simulate(
    workload: Workload,
    policy_name,
    n_replicas: int,
    params: SimParams = SimParams(),
    policy_params: dict | None = None,
    seed: int = 0,
    keys: list[RequestKeys] | None = None,
    collapse_ttft_s: float | None = None,
    warmup: list[WorkloadRequest] | None = None,
    pacing: Pacing | None = None,
    keep_alive: KeepAlive | None = None,
    refresh_first: bool = False,
    gateways: int = 1,
    observe=None,
) -> SimResult:
    """Run `workload` through `policy_name` on `n_replicas` modelled replicas (module header).

    `policy_name`: a registry name (built with `policy_params`) or a ready policy object (its
    `name` labels the result). `collapse_ttft_s`: stop early, marked `collapsed`, once a routed
    request has waited that long (virtual seconds) without its first token (checked at every load
    report). The figures then cover the requests routed so far, and every request still waiting
    counts with the wait it had at the stop (a lower bound of its TTFT), so a collapsed policy's
    percentiles are lower bounds. Deterministic: the check runs on virtual time only.
    `warmup`: requests sent one at a time before the stream (module header); the stream's arrival
    times then count from the end of the warm-up.
    `pacing`: the paced-prefill design probe (loadtests/vtime_pacing.py), measured requests only.
    `keep_alive`: the keep-alive design probe (loadtests/vtime_keepalive.py); `refresh_first`: its
    refreshes wait ahead of every request (the gateway's keep_alive.engine_priority on engines run
    with vLLM's priority policy), else at the back of the queue.
    `gateways`: that many gateway processes, each with its own policy instance (built from
    `policy_name`, which must then be a registry name), index and in-flight counts, each request
    routed by one of them at random (loadtests/vtime_router.SimGateways: what is modelled).
    `observe`: called as observe(r, copy) for each measured request that finishes (r: its
    vtime_replica.SimReq; copy: another replica held its prompt when it was routed), in finishing
    order (loadtests/vtime_trace.py).
    """
    if n_replicas < 1:
        raise ValueError("n_replicas must be >= 1")
    if gateways < 1:
        raise ValueError("gateways must be >= 1")
    wall0 = time.perf_counter()
    p = params
    wreqs = workload.requests
    warm = list(warmup or ())
    if keys is None:
        keys = prepare_keys(workload, p.block_size, p.model)
    if len(keys) != len(wreqs):
        raise ValueError("keys do not belong to this workload (lengths differ)")
    cap_tokens = p.num_blocks * p.block_size
    for wr in list(wreqs) + warm:
        if wr.prompt_tokens + max(1, wr.max_output_tokens) > cap_tokens:
            raise ValueError(f"request {wr.request_id} needs {wr.prompt_tokens + wr.max_output_tokens} tokens of KV but a "
                             f"replica holds {cap_tokens}; raise num_blocks")
    n_total = len(wreqs)
    if warm:
        memo = _KeyMemo(p.model, p.block_size)
        keys = list(keys) + [memo.keys(r) for r in warm]
        wreqs = tuple(wreqs) + tuple(warm)
    if isinstance(policy_name, str):
        pp = dict(policy_params or {})
        if policy_name in ("cache_aware", "cache_plan"):
            pp.setdefault("max_num_seqs", p.max_num_seqs)  # the operator's setting mirrors the engines'
        policies = [get_policy(policy_name, **pp) for _ in range(gateways)]
    else:
        if policy_params:
            raise ValueError("policy_params go with a policy name, not a policy object")
        if gateways > 1:
            raise ValueError("several gateways need a policy name (one instance each), not a policy object")
        policies = [policy_name]
        policy_name = getattr(policy_name, "name", type(policy_name).__name__)
    policy = policies[0]
    clock = VClock()
    if gateways == 1:
        router = SimRouter(n_replicas, p, policy, random.Random(seed), clock)
    else:
        router = SimGateways([SimRouter(n_replicas, p, pol, random.Random(seed * 1000 + i), clock)
                              for i, pol in enumerate(policies)], random.Random(seed + 7))
    reps = [ReplicaModel(i, p, p.cache_answers) for i in range(n_replicas)]
    chains = PaceChains(pacing, p.block_size)  # paced requests (pacing) and background warms (cache_plan)
    retainer = Retainer(keep_alive) if keep_alive is not None else None
    run = EventLoop(workload, wreqs, keys, n_total, bool(warm), p, router, reps, chains, retainer, clock,
                    refresh_first=refresh_first, collapse_ttft_s=collapse_ttft_s, observe=observe)
    run.run()
    return _result(run, workload, policy_name, policy, n_replicas, wall0)


def _result(run: EventLoop, workload: Workload, policy_name: str, policy, n_replicas: int, wall0: float) -> SimResult:
    """The run's figures (simulate's `collapse_ttft_s` says what a collapsed run's TTFTs are)."""
    done, reps, wreqs, n_total, last_t = run.done, run.reps, run.wreqs, run.n_total, run.last_t
    collapsed, chains, retainer = run.collapsed, run.chains, run.retainer
    if collapsed:
        # TTFT: every routed request, those without a first token with their wait so far (lower
        # bounds); tokens and hits: the finished requests
        ttft = np.array([(r.first_s if r.first_s >= 0.0 else last_t) - r.arrival for r in run.all_routed if not r.aborted], dtype=float)
    else:
        ttft = np.array([r.first_s - r.arrival for r in done], dtype=float)
    first_arrival = run.t_start + (wreqs[0].arrival_s if n_total and not run.closed else 0.0)
    return SimResult(
        workload=workload.name,
        policy=policy_name,
        n_replicas=n_replicas,
        requests=n_total,
        completed=run.n_done,
        duration_s=max(1e-9, last_t - first_arrival),
        ttft_s=ttft,
        arrival_s=np.zeros(0) if collapsed else np.array([r.arrival for r in done], dtype=float),
        prompt_tokens=sum(r.prompt for r in done),
        cached_tokens=sum(r.cached for r in done),
        output_tokens=sum(r.max_out for r in done),
        per_replica_requests=[rep.n_requests for rep in reps],
        per_replica_busy_s=[rep.busy_s for rep in reps],
        wall_s=time.perf_counter() - wall0,
        calibration=run.router.cal.snapshot(),
        policy_params=getattr(policy, "params", lambda: {})(),
        collapsed=collapsed,
        stopped_at_s=last_t if collapsed else 0.0,
        unfinished=run.n_unfinished,
        e2e_s=np.array([r.finish_s - r.arrival for r in done], dtype=float),
        evicted_blocks=sum(rep.n_evicted for rep in reps),
        preemptions=sum(rep.n_preemptions for rep in reps),
        lora_waits=sum(rep.n_lora_waits for rep in reps),
        per_replica_prefill_tokens=[rep.prefill_tokens for rep in reps],
        misses_copy=run.misses[1],
        misses_evicted=run.misses[0],
        paced_ttft_s=np.array([r.first_s - r.arrival for r in chains.paced if r.first_s >= 0.0], dtype=float),
        warms=chains.warms,
        refreshes=retainer.sent if retainer is not None else 0,
        refresh_computed_tokens=run.refresh_computed,
    )
