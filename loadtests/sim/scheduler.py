"""The simulated engine core: vLLM v1-style continuous batching over a BlockPool, with a time model.
Pure: no asyncio, no sockets, no clock. The caller owns time; `step()` says how long the step took.

API (what the async server and the virtual-time simulator drive):

    engine = SimEngine(EngineConfig(...))
    req = engine.add_request(SimRequest("id", prompt_token_ids, max_tokens=16, cache_salt=None))
    while engine.has_work:
        out = engine.step()            # StepOutcome
        now += out.duration_s          # modelled step time: tokens below exist at now + duration_s
        for r in out.tokens: ...       # got one new token: r.output_token_ids[-1]; first if r.num_output_tokens == 1
        for r in out.finished: ...     # done: r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens
        engine.take_events()           # KV events (blockpool.PoolEvent) of the step, for the publisher
    engine.abort("id")                 # client went away: frees its blocks

No per-token objects: a step hands back lists of the requests concerned, the tokens live in each
request's own list.

Scheduling per step (vLLM v1 `Scheduler.schedule`, FCFS):
1. Running requests, decodes first, then partial prefills (chunked prefill), each taking
   min(tokens it still needs, remaining budget) from `max_num_batched_tokens`. A request that
   cannot get the blocks for its tokens preempts the most recently admitted running request
   (recompute style: its blocks are freed, it goes back to the head of the waiting queue with
   num_computed_tokens = 0, and later re-prefills prompt + output so far, hitting whatever of
   its blocks stayed cached), possibly itself.
   With `scheduling_policy` "priority" (vLLM's `--scheduling-policy priority`) the waiting queue
   is ordered by (request priority, arrival), lower first, and the victim is the running request
   of the lowest priority (latest admitted among them); no request is preempted to free a slot.
2. If nothing was preempted: waiting requests in queue order while a sequence slot
   (`max_num_seqs`) and budget remain. With `max_loras`, a request for a LoRA adapter that is not
   among the running requests' adapters while they fill the `max_loras` slots is skipped (it
   stays at its place in the queue) and the next one is tried, as vLLM's scheduler does. On first
   scheduling, the longest run of cached leading blocks within the first num_tokens - 1 tokens is
   a hit (a fully cached prompt still computes its last token); only the rest is prefilled.
3. Blocks that became full in this step are cached and reported (BlockStored); hit blocks are
   re-reported only for requests with report mode "full".
A request whose computed tokens reach its known tokens samples one output token (deterministic
filler); at `max_tokens` it finishes and its blocks are freed (tail first), staying cached.

Time model (per step):
    duration_s = time_scale x (step_overhead_s + prefill_s_per_token x prefill_tokens
                               + decode_s_per_seq x decoding_seqs)
Only scheduled, i.e. uncached, prompt tokens cost prefill time, so a warm prefix cuts TTFT.
Defaults (GPU profile): Llama-3-8B fp16 on one A100-80GB under vLLM (published vLLM benchmarks and
the roofline: 16 GB of weights read per step at ~2 TB/s is ~8 ms; prefill ~20k tokens/s):
    step_overhead_s = 0.008, prefill_s_per_token = 5e-5 (20k tok/s), decode_s_per_seq = 2.5e-4
so a decode step of 32 sequences takes 16 ms and of 64 takes 24 ms (vLLM's reported 15-25 ms ITL
range for 8B models at moderate batch). The wall-clock profile (`TimeModel.wallclock()`, what a
2-core machine can drive; README "Results") is prefill 1 ms/token (20x) with ~15 ms decode
steps (12 ms overhead + 0.1 ms per sequence): the decode step is NOT scaled 20x, which would make
it 300+ ms. `time_scale` multiplies whichever profile uniformly.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hashing import vllm_hash
from loadtests.sim.blockpool import (
    DEFAULT_KV_BUDGET_BYTES,
    LLAMA3_8B,
    BlockPool,
    KVBlock,
    ModelShape,
    PoolEvent,
    num_blocks_for_budget,
)

__all__ = ["TimeModel", "EngineConfig", "SimRequest", "StepOutcome", "SimEngine", "WAITING", "RUNNING", "FINISHED", "ABORTED"]

WAITING, RUNNING, FINISHED, ABORTED = 0, 1, 2, 3
# Deterministic output tokens when the owner gives none (the server passes ids of real words).
_DEFAULT_FILLER = tuple(range(1000, 1016))


@dataclass(slots=True)
class TimeModel:
    step_overhead_s: float = 0.008  # fixed cost of any step (weights read, scheduling, sampling)
    prefill_s_per_token: float = 5e-5  # per scheduled (uncached) prefill token
    decode_s_per_seq: float = 2.5e-4  # per sequence decoding one token in the step
    time_scale: float = 1.0  # uniform multiplier (faults multiply on top)

    @classmethod
    def wallclock(cls, time_scale: float = 1.0) -> "TimeModel":
        """The profile wall-clock benchmarks on a small machine use: 2 cores cannot drive GPU-speed replicas busy."""
        return cls(step_overhead_s=0.012, prefill_s_per_token=1e-3, decode_s_per_seq=1e-4, time_scale=time_scale)

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.time_scale * (
            self.step_overhead_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs
        )


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV capacity; None: from model_shape and kv_budget_bytes
    model_shape: ModelShape = LLAMA3_8B  # for capacity when num_blocks is None
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES  # for capacity when num_blocks is None
    max_num_seqs: int = 256  # running sequences at most (vLLM default on GPUs)
    max_num_batched_tokens: int = 8192  # tokens scheduled per step at most (chunked prefill budget)
    max_model_len: int = 32768  # prompt + output tokens at most (enforced by the server)
    hash_algo: str = "sha256_cbor"  # "sha256" | "sha256_cbor" (engine-exact, hashing.vllm_hash)
    hash_seed: str | None = None  # None: $PYTHONHASHSEED else "vllm-none-hash"
    enable_prefix_caching: bool = True  # vLLM's --enable-prefix-caching
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: "fcfs" or "priority" (lower first)
    max_loras: int = 0  # LoRA adapters one batch may run (vLLM --max-loras); 0: no limit (LoRA off)
    time: TimeModel = field(default_factory=TimeModel)  # step-time model
    filler_token_ids: tuple[int, ...] = _DEFAULT_FILLER  # output tokens, cycled

    def resolved_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return num_blocks_for_budget(self.block_size, self.kv_budget_bytes, self.model_shape)


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str  # unique among live requests
    prompt_token_ids: list[int]  # the prompt (not copied: the engine appends outputs to its own list)
    max_tokens: int = 16  # output tokens to generate (ignore_eos: always all of them)
    cache_salt: str | None = None  # block 0's extra key; isolates tenants
    report_full_hits: bool = False  # vllm_xargs.kv_cache_report_mode == "full": re-report hit blocks
    arrival_s: float = 0.0  # caller's clock at add_request (for the caller's own bookkeeping)
    priority: int = 0  # vLLM's request priority (policy "priority": lower goes first)
    lora: str | None = None  # the LoRA adapter it runs (None: the base model)
    # -- state owned by the engine --
    lora_waited: bool = False  # skipped at least once for want of a LoRA slot
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs so far
    num_prompt_tokens: int = 0  # len(prompt_token_ids)
    num_computed_tokens: int = 0  # tokens whose KV exists (hits count)
    num_output_tokens: int = 0  # tokens sampled so far
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling, whole blocks; -1 until then
    num_created_cache_tokens: int = 0  # prompt tokens this request stored as new full blocks
    num_preemptions: int = 0  # times preempted
    status: int = WAITING  # WAITING / RUNNING / FINISHED / ABORTED
    blocks: list[KVBlock] = field(default_factory=list)  # KV blocks held, in token order
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the full blocks of token_ids
    num_cached_blocks: int = 0  # leading blocks already cached (hit or stored) in this residency
    user: object = None  # the owner's handle (e.g. the server's stream); the engine never reads it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class StepOutcome:
    duration_s: float  # modelled duration of the step (time_scale applied)
    num_prefill_tokens: int  # scheduled tokens of requests in prefill (or recompute)
    num_decode_seqs: int  # requests decoding one token
    tokens: list[SimRequest]  # requests that sampled one token at the end of this step
    finished: list[SimRequest]  # requests that finished in this step (also in tokens)
    preempted: list[SimRequest]  # requests preempted in this step


class SimEngine:
    """One simulated vLLM engine core (see the module header)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.hash_algo not in vllm_hash.HASH_ALGOS:
            raise ValueError(f"hash_algo {cfg.hash_algo!r} not supported; choose one of {sorted(vllm_hash.HASH_ALGOS)}")
        self.block_size = cfg.block_size
        self.pool = BlockPool(cfg.resolved_num_blocks(), cfg.block_size, cfg.enable_prefix_caching)
        self.time = cfg.time
        self.slow_factor = 1.0  # fault injection: multiplies step durations
        self._none_hash = vllm_hash.none_hash(cfg.hash_algo, cfg.hash_seed)
        self._filler = cfg.filler_token_ids or _DEFAULT_FILLER
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        # lifetime counters (Prometheus counters)
        self.num_preemptions_total = 0
        self.num_lora_waits_total = 0  # requests skipped at least once for want of a LoRA slot
        self.prefix_cache_queries_tokens_total = 0
        self.prefix_cache_hits_tokens_total = 0
        self.num_steps_total = 0
        self.num_finished_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> SimRequest:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live; ids must be unique")
        if not req.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        capacity_tokens = self.pool.num_blocks * self.block_size
        if len(req.prompt_token_ids) + max(1, req.max_tokens) > capacity_tokens:
            # it could never be scheduled (vLLM refuses such a max_model_len at start-up)
            raise ValueError(
                f"request needs {len(req.prompt_token_ids) + req.max_tokens} tokens of KV but the pool holds {capacity_tokens}"
            )
        req.token_ids = list(req.prompt_token_ids)
        req.num_prompt_tokens = len(req.token_ids)
        req.max_tokens = max(1, req.max_tokens)
        req.status = WAITING
        self.requests[req.request_id] = req
        self._enqueue(req, ahead=False)
        return req

    def _enqueue(self, req: SimRequest, *, ahead: bool) -> None:
        """Into the waiting queue: FCFS at the back (`ahead`: a preempted request, at the front);
        with the priority policy behind every request of its priority or better (`ahead`: in front
        of its own priority), as vLLM orders its waiting requests by (priority, arrival)."""
        w = self.waiting
        if self.config.scheduling_policy != "priority":
            w.appendleft(req) if ahead else w.append(req)
            return
        w.insert(next((i for i, o in enumerate(w) if o.priority > req.priority or (ahead and o.priority == req.priority)),
                      len(w)), req)

    def abort(self, request_id: str) -> bool:
        """Drop a live request and free its blocks; False if it is not live."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:  # pragma: no cover
                pass
        self._release(req)
        req.status = ABORTED
        return True

    def abort_all(self) -> list[SimRequest]:
        out = list(self.requests.values())
        for r in out:
            self.abort(r.request_id)
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(adapters with a running request, adapters with a waiting one), each in first-seen order
        (vLLM's vllm:lora_requests_info labels)."""
        return (list(dict.fromkeys(r.lora for r in self.running if r.lora is not None)),
                list(dict.fromkeys(r.lora for r in self.waiting if r.lora is not None)))

    def take_events(self) -> list[PoolEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        # live requests keep their blocks but nothing counts as cached any more
        for r in self.running:
            r.num_cached_blocks = 0

    # -- internals -----------------------------------------------------------------------------
    def _release(self, req: SimRequest) -> None:
        if req.blocks:
            self.pool.free(req.blocks[::-1])
            req.blocks = []
        req.num_cached_blocks = 0

    def _ensure_hashes(self, req: SimRequest, num_full_blocks: int) -> None:
        have = len(req.block_hashes)
        if have >= num_full_blocks:
            return
        bs = self.block_size
        parent = req.block_hashes[-1] if have else self._none_hash
        req.block_hashes.extend(
            vllm_hash.block_hashes(
                req.token_ids[have * bs : num_full_blocks * bs],
                bs,
                self.config.hash_algo,
                cache_salt=req.cache_salt,
                parent=parent,
                start_block=have,
                lora=req.lora,
            )
        )

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.status = WAITING
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(victim, ahead=True)

    def _cache_new_full(self, req: SimRequest, upto_tokens: int) -> None:
        full = upto_tokens // self.block_size
        if full > req.num_cached_blocks:
            self._ensure_hashes(req, full)
            start = req.num_cached_blocks
            self.pool.cache_full_blocks(req.blocks, req.block_hashes, start, full, req.token_ids, req.cache_salt, lora=req.lora)
            if req.num_output_tokens == 0 and req.num_cached_tokens >= 0 and req.num_preemptions == 0:
                # prompt blocks this request created (vLLM's created_cache_tokens)
                prompt_full = min(full, req.num_prompt_tokens // self.block_size)
                if prompt_full > start:
                    req.num_created_cache_tokens += (prompt_full - start) * self.block_size
            req.num_cached_blocks = full

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """Schedule one batch, apply it, and return what happened and how long it took."""
        cfg = self.config
        bs = self.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted: list[SimRequest] = []

        decoding = [r for r in self.running if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) != len(self.running):
            dset = set(decoding)
            order = decoding + [r for r in self.running if r not in dset]
        else:
            order = decoding
        for req in order:
            if budget <= 0:
                break
            if req.status != RUNNING:  # preempted earlier in this step
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            need = -(-(req.num_computed_tokens + num_new) // bs) - len(req.blocks)
            ok = True
            while need > pool.num_free_blocks:
                # the latest admitted; with the priority policy the lowest priority's, latest first
                victim = (self.running[-1] if cfg.scheduling_policy != "priority"
                          else max(reversed(self.running), key=lambda r: r.priority))
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    ok = False
                    break
            if not ok:
                continue
            if need > 0:
                req.blocks.extend(pool.allocate(need))  # type: ignore[arg-type]
            self._cache_new_full(req, req.num_computed_tokens + num_new)
            scheduled[req] = num_new
            budget -= num_new

        if not preempted:
            waiting = self.waiting
            loras = {r.lora for r in self.running if r.lora is not None} if cfg.max_loras else None
            skipped: list[SimRequest] = []  # their adapter has no LoRA slot this step
            while waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = waiting[0]
                if loras is not None and req.lora is not None and req.lora not in loras and len(loras) >= cfg.max_loras:
                    skipped.append(waiting.popleft())
                    if not req.lora_waited:
                        req.lora_waited = True
                        self.num_lora_waits_total += 1
                    continue
                hits: list[KVBlock] = []
                if cfg.enable_prefix_caching:
                    max_hit_blocks = (req.num_tokens - 1) // bs
                    self._ensure_hashes(req, max_hit_blocks)
                    hits = pool.find_prefix(req.block_hashes, max_hit_blocks)
                hit_tokens = len(hits) * bs
                num_new = min(req.num_tokens - hit_tokens, budget)
                need = -(-(hit_tokens + num_new) // bs) - len(hits)
                free_hits = sum(1 for b in hits if b.ref_cnt == 0)
                if need + free_hits > pool.num_free_blocks:
                    break  # wait for blocks to be freed (vLLM stops admitting here too)
                waiting.popleft()
                pool.touch(hits)
                new_blocks = pool.allocate(need) if need > 0 else []
                req.blocks = hits + new_blocks  # type: ignore[operator]
                req.num_cached_blocks = len(hits)
                req.num_computed_tokens = hit_tokens
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit_tokens
                    self.prefix_cache_queries_tokens_total += req.num_tokens
                    self.prefix_cache_hits_tokens_total += hit_tokens
                if hits and req.report_full_hits:
                    pool.record(pool.stored_event(req.block_hashes, 0, len(hits), req.token_ids, req.cache_salt, req.lora))
                req.status = RUNNING
                self.running.append(req)
                if loras is not None and req.lora is not None:
                    loras.add(req.lora)
                self._cache_new_full(req, hit_tokens + num_new)
                scheduled[req] = num_new
                budget -= num_new
            waiting.extendleft(reversed(skipped))  # back at the head, in their order

        # -- apply: computed tokens advance; caught-up requests sample one token ----------------
        prefill_tokens = 0
        decode_seqs = 0
        tokens: list[SimRequest] = []
        finished: list[SimRequest] = []
        filler = self._filler
        nf = len(filler)
        for req, n in scheduled.items():
            if n == 1 and req.num_output_tokens > 0 and req.num_tokens - req.num_computed_tokens == 1:
                decode_seqs += 1
            else:
                prefill_tokens += n
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.token_ids.append(filler[req.num_output_tokens % nf])
                req.num_output_tokens += 1
                tokens.append(req)
                if req.num_output_tokens >= req.max_tokens:
                    finished.append(req)
        if finished:
            for req in finished:
                req.status = FINISHED
                self._release(req)
                self.requests.pop(req.request_id, None)
            self.running = [r for r in self.running if r.status == RUNNING]
            self.num_finished_total += len(finished)
        self.num_steps_total += 1
        self.num_prompt_tokens_total += prefill_tokens
        self.num_generation_tokens_total += len(tokens)
        duration = self.time.step_s(prefill_tokens, decode_seqs) * self.slow_factor if scheduled else 0.0
        return StepOutcome(duration, prefill_tokens, decode_seqs, tokens, finished, preempted)
