"""The virtual-time simulator's replica: loadtests/sim's engine core, re-cut for speed.

Rule: the same scheduling, KV and time model as `loadtests.sim.scheduler.SimEngine` (what the
wall-clock comparison runs), so a vtime run predicts the wall-clock one; tests/test_vtime_sim.py
replays one request stream through both and checks they agree request by request. What differs is
only how it is computed: decoding requests sit in a heap keyed by the step they finish (and by
the step they next need a KV block) instead of being visited every step, and blocks are counted,
not objects, so 100k requests on 64 replicas stay cheap.

The model (vLLM v1, as SimEngine has it)
- KV: `num_blocks` blocks of `block_size` tokens. One free queue in eviction order: never-used
  blocks first, then every freed block at the tail (a request's blocks tail first, so its last
  blocks are evicted before the prefix they extend). A full prompt block is cached under its
  chained key when it is *scheduled* (BlockStored, published at the end of the step); allocating a
  free cached block evicts it (BlockRemoved). A block a request computes while another copy is
  cached stays anonymous here (SimEngine stores a second copy; no routing signal differs).
- Admission (FCFS, while a sequence slot and step budget remain): the leading run of cached
  blocks within the first prompt - 1 tokens is a hit; the request takes blocks for its first
  chunk only, and stops admission when the free queue lacks them. With `max_loras`, a request
  for a LoRA adapter that is not among the running requests' adapters while they fill the slots
  is skipped this step (it keeps its place in the queue), as SimEngine and vLLM do.
- Each step, in order: decoding requests take one token each (and a block when they cross a
  block boundary), running prefills take chunks from the remaining `max_batched_tokens`, then
  waiting requests are admitted. A request that cannot get its blocks preempts the most recently
  admitted running request (recompute: its blocks are freed, it goes back to the head of the
  queue and later re-prefills prompt + output so far, hitting what stayed cached); a step with a
  preemption admits nobody.
- Time: step_s = step_overhead_s + prefill_tokens x prefill_s_per_token + decoding_seqs x
  decode_s_per_seq. The first token comes at the end of the step that completes the prefill,
  then one token per step.
- Answers a later prompt quotes (multi-turn) are cached at finish under the workload's answer keys
  when `cache_answers`; SimEngine generates filler tokens instead, so on the wall clock a quoted
  answer always misses (`cache_answers=False` models that).
- Abort (a client's timeout): the request leaves the queue or frees its blocks.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque

__all__ = ["SimReq", "ReplicaModel"]

_PRIVATE_KEY_BASE = 1 << 64  # keys from here on are a request's own output blocks (never shared, never reported)


class SimReq:
    __slots__ = (
        "i", "wr", "keys", "out_keys", "prompt", "max_out", "arrival", "rep", "cached", "computed", "total",
        "held", "anon", "registered", "first_s", "finish_s", "pred_uncached", "backlog", "running_at",
        "chunk", "gen", "epoch", "adm", "state", "finish_step", "preemptions", "warmup", "aborted", "scan", "pace",
        "lora", "lora_waited",
    )
    WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3

    def __init__(self, i: int, wr, rk, arrival: float) -> None:
        self.i = i
        self.wr = wr
        self.keys = rk.prompt
        self.out_keys = rk.output
        self.prompt = wr.prompt_tokens
        self.max_out = max(1, wr.max_output_tokens)
        self.arrival = arrival
        self.rep = -1
        self.cached = -1  # engine-reported cached tokens (first admission); -1 before
        self.computed = 0  # tokens whose KV exists in this residency
        self.total = self.prompt  # tokens to compute at (re)admission: prompt + outputs so far
        self.held: list = []  # cached keys this request references, in chain order
        self.anon = 0  # blocks it holds that carry no key
        self.registered = 0  # leading prompt blocks hit or stored in this residency
        self.first_s = -1.0
        self.finish_s = -1.0
        self.pred_uncached = 0
        self.backlog = 0.0
        self.running_at = 0
        self.chunk = 0  # tokens scheduled in the current step
        self.gen = 0  # output tokens sampled so far
        self.epoch = 0  # bumped on preemption/abort: stale heap entries are skipped
        self.adm = 0  # admission sequence number (preemption picks the latest)
        self.state = SimReq.WAITING
        self.finish_step = 0
        self.preemptions = 0
        self.warmup = False
        self.aborted = False
        self.pace = None  # a paced request's chunk: id of its chain (loadtests/vtime_pacing.py)
        self.scan = rk.prompt  # keys a (re)admission looks up: the prompt's, plus its output blocks after a preemption
        self.lora = wr.lora  # its LoRA adapter (None: the base model)
        self.lora_waited = False  # skipped at least once for want of a LoRA slot

    @property
    def nblocks(self) -> int:
        return len(self.held) + self.anon


class ReplicaModel:
    """One modelled vLLM replica (module header); `start_step` schedules, `end_step` applies."""

    __slots__ = (
        "idx", "rid", "p", "bs", "ref", "freeq", "fresh", "anon_id", "waiting", "running", "prefilling",
        "decode_heap", "block_heap", "n_decoding", "step_no", "stepping", "stored", "removed", "n_requests",
        "busy_s", "prefill_tokens", "seq", "adm_seq", "n_evicted", "n_preemptions", "n_aborted", "cache_answers", "budget",
        "n_lora_waits",
    )

    def __init__(self, idx: int, p, cache_answers: bool = True) -> None:
        self.idx = idx
        self.rid = f"r{idx}"
        self.p = p
        self.bs = p.block_size
        self.ref: dict = {}  # cached key -> references (0: free, in freeq)
        self.freeq: OrderedDict = OrderedDict()  # free blocks in eviction order: keys (>= 0), anonymous (< 0)
        self.fresh = p.num_blocks  # never-used free blocks, ahead of freeq
        self.anon_id = 0
        self.waiting: deque = deque()
        self.running: dict = {}  # admitted requests in admission order (dict keeps insertion order)
        self.prefilling: list = []  # running requests still computing their tokens, admission order
        self.decode_heap: list = []  # (finish step, adm, epoch, req)
        self.block_heap: list = []  # (step that needs a new block, adm, epoch, req)
        self.n_decoding = 0
        self.step_no = 0
        self.stepping = False
        self.stored: list = []
        self.removed: list = []
        self.n_requests = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.seq = 0
        self.adm_seq = 0
        self.n_evicted = 0
        self.n_preemptions = 0
        self.n_aborted = 0
        self.cache_answers = cache_answers
        self.budget = 0  # tokens left in the step being scheduled
        self.n_lora_waits = 0  # requests skipped at least once for want of a LoRA slot

    # -- views -----------------------------------------------------------------------------------
    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_free(self) -> int:
        return self.fresh + len(self.freeq)

    def lora_adapters(self) -> tuple[tuple, tuple]:
        """(running adapters, waiting adapters), first seen first (vllm:lora_requests_info's labels)."""
        return (tuple(dict.fromkeys(r.lora for r in self.running if r.lora is not None)),
                tuple(dict.fromkeys(r.lora for r in self.waiting if r.lora is not None)))

    def kv_usage(self) -> float:
        return 1.0 - self.n_free / self.p.num_blocks

    def cached_blocks(self) -> int:
        return len(self.ref)

    # -- blocks ------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> None:
        """Take n blocks (caller checked n <= n_free) from the head of the free queue."""
        take = n if n <= self.fresh else self.fresh
        self.fresh -= take
        freeq, ref, removed = self.freeq, self.ref, self.removed
        for _ in range(n - take):
            k, _ = freeq.popitem(last=False)
            if k >= 0:
                del ref[k]
                if k < _PRIVATE_KEY_BASE:
                    removed.append(k)
                self.n_evicted += 1

    def _block_key(self, r: SimReq, j: int) -> int:
        """Key of r's block j: the prompt's, then its output blocks': the quoted answer's keys when
        `cache_answers`, else keys of its own (>= 2**64: they never match another request and the
        router is not told about them, as a generated answer nobody quotes)."""
        keys = r.keys
        if j < len(keys):
            return keys[j]
        o = j - len(keys)
        if self.cache_answers and r.out_keys and o < len(r.out_keys):
            return r.out_keys[o]
        return _PRIVATE_KEY_BASE + (r.i << 20) + j

    def _register(self, r: SimReq, upto: int) -> None:
        """Cache r's full blocks below `upto` (at schedule time, as vLLM; outputs when they fill)."""
        ref = self.ref
        for j in range(r.registered, upto):
            k = self._block_key(r, j)
            if k not in ref:
                ref[k] = 1
                r.held.append(k)
                r.anon -= 1
                if k < _PRIVATE_KEY_BASE:
                    self.stored.append(k)
        if upto > r.registered:
            r.registered = upto

    def _free_blocks(self, r: SimReq) -> None:
        """Return r's blocks to the tail of the free queue, its tail first."""
        freeq, ref = self.freeq, self.ref
        for _ in range(r.anon):
            self.anon_id -= 1
            freeq[self.anon_id] = None
        for k in reversed(r.held):
            c = ref[k] - 1
            ref[k] = c
            if c == 0:
                freeq[k] = None
        r.held = []
        r.anon = 0
        r.registered = 0

    def _release_finished(self, r: SimReq) -> None:
        self._register(r, (r.prompt + r.max_out - 1) // self.bs)  # its output blocks that filled
        self._free_blocks(r)

    def _unrun(self, r: SimReq) -> None:
        """Take r out of the running set (it is preempted or aborted)."""
        del self.running[r]
        if r.state == SimReq.DECODE:
            self.n_decoding -= 1
        elif r.state == SimReq.PREFILL:
            self.prefilling.remove(r)
        r.epoch += 1
        self._free_blocks(r)
        r.computed = 0

    def _preempt(self, victim: SimReq) -> None:
        if victim.state == SimReq.DECODE:
            victim.gen = victim.max_out - (victim.finish_step - self.step_no)
            upto = (victim.prompt + victim.gen - 1) // self.bs  # full blocks of what it computed
            self._register(victim, upto)
            victim.scan = [self._block_key(victim, j) for j in range(upto)]
        self._unrun(victim)
        victim.total = victim.prompt + victim.gen
        victim.state = SimReq.WAITING
        victim.preemptions += 1
        self.n_preemptions += 1
        self.waiting.appendleft(victim)

    def abort(self, r: SimReq) -> None:
        """The client went away: drop r wherever it is (no-op once finished)."""
        if r.state == SimReq.DONE or r.aborted:
            return
        r.aborted = True
        self.n_aborted += 1
        if r in self.running:
            self._unrun(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:  # pragma: no cover - not queued here
                pass
        r.state = SimReq.DONE

    def _push_block_need(self, r: SimReq, from_step: int, rem: int, computed: int) -> None:
        """The first of r's `rem` decode steps after `from_step` that crosses into a new block."""
        bs = self.bs
        i0 = (-computed) % bs + 1  # decode step i computes position computed + i - 1
        if i0 <= rem:
            heapq.heappush(self.block_heap, (from_step + i0, r.adm, r.epoch, r))

    def _need_blocks(self, r: SimReq, need: int, scheduled: dict) -> bool:
        """Make `need` blocks free for r, preempting the latest admitted; False if r itself went."""
        while need > self.n_free:
            victim = next(reversed(self.running))
            got = scheduled.pop(victim, None)
            if got is not None:
                self.budget += got
                victim.chunk = 0
            elif victim.state == SimReq.DECODE:
                self.budget += 1  # its decode token
            self._preempt(victim)
            if victim is r:
                return False
        return True

    # -- the step ------------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        """Schedule one step (SimEngine.step's order); return its duration, None when idle."""
        p, bs = self.p, self.bs
        step = self.step_no + 1
        sched: dict = {}  # request -> tokens scheduled in this step (prefills)
        self.budget = p.max_batched_tokens - self.n_decoding
        # vLLM's long_prefill_token_threshold: one request's prefill takes at most this much of a
        # step, so waiting requests are admitted beside a long prefill (0: no cap)
        cap = p.long_prefill_token_threshold or p.max_batched_tokens
        preempted_before = self.n_preemptions
        # 1. decoders that cross into a new block in this step (the others need nothing)
        bh = self.block_heap
        due = []
        while bh and bh[0][0] <= step:
            e = heapq.heappop(bh)
            if e[2] == e[3].epoch and e[3].state == SimReq.DECODE:
                due.append(e)
        for _, _, ep, r in due:  # admission order (heap order within a step is by adm)
            if r.epoch != ep or r.state != SimReq.DECODE:
                continue  # preempted by an earlier one in this step
            if self._need_blocks(r, 1, sched):
                self._alloc(1)
                r.anon += 1
                nxt = step + bs
                if nxt <= r.finish_step:
                    heapq.heappush(bh, (nxt, r.adm, r.epoch, r))
        # 2. running prefills, oldest first
        for r in list(self.prefilling):
            if r.state != SimReq.PREFILL or r in sched:
                continue
            if self.budget <= 0:
                break
            n = min(r.total - r.computed, self.budget, cap)
            need = -(-(r.computed + n) // bs) - r.nblocks
            if need > 0:
                if not self._need_blocks(r, need, sched):
                    continue
                self._alloc(need)
                r.anon += need
            self._register(r, (r.computed + n) // bs)
            r.chunk = n
            sched[r] = n
            self.budget -= n
        # 3. admissions, only when nothing was preempted
        if self.n_preemptions == preempted_before:
            ref, waiting = self.ref, self.waiting
            loras = {x.lora for x in self.running if x.lora is not None} if p.max_loras else None
            skipped: list = []  # their adapter has no LoRA slot this step
            while waiting and self.budget > 0 and len(self.running) < p.max_num_seqs:
                r = waiting[0]
                if loras is not None and r.lora is not None and r.lora not in loras and len(loras) >= p.max_loras:
                    skipped.append(waiting.popleft())
                    if not r.lora_waited:
                        r.lora_waited = True
                        self.n_lora_waits += 1
                    continue
                keys = r.scan
                lim = min(len(keys), (r.total - 1) // bs)
                m = 0
                free_hits = 0
                while m < lim:
                    c = ref.get(keys[m])
                    if c is None:
                        break
                    if c == 0:
                        free_hits += 1
                    m += 1
                hit = m * bs
                n = min(r.total - hit, self.budget, cap)
                need = -(-(hit + n) // bs) - m
                if need + free_hits > self.n_free:
                    if not self.running and self.fresh + len(self.freeq) == p.num_blocks:
                        raise ValueError(f"request {r.wr.request_id} needs more KV blocks than a replica has ({p.num_blocks}); raise num_blocks")
                    break
                waiting.popleft()
                freeq = self.freeq
                for k in keys[:m]:
                    c = ref[k]
                    if c == 0:
                        del freeq[k]
                    ref[k] = c + 1
                r.held = list(keys[:m])
                r.registered = m
                self._alloc(need)
                r.anon = need
                r.computed = hit
                if r.cached < 0:
                    r.cached = hit
                self.adm_seq += 1
                r.adm = self.adm_seq
                r.state = SimReq.PREFILL
                self.running[r] = None
                self.prefilling.append(r)
                self._register(r, (hit + n) // bs)
                r.chunk = n
                sched[r] = n
                self.budget -= n
                if loras is not None and r.lora is not None:
                    loras.add(r.lora)
            waiting.extendleft(reversed(skipped))  # back at the head, in their order
        prefill = 0
        decodes = self.n_decoding
        for r, n in sched.items():
            if n == 1 and r.gen > 0 and r.total - r.computed == 1:
                decodes += 1  # a resumed request with one token left: the engine counts it a decode
            else:
                prefill += n
        if prefill == 0 and decodes == 0:
            return None
        self.prefill_tokens += prefill
        return p.step_overhead_s + prefill * p.prefill_s_per_token + decodes * p.decode_s_per_seq

    def end_step(self, t: float, first_tokens: list, finished: list) -> None:
        """Apply the step scheduled by start_step, ending at virtual time t."""
        self.step_no += 1
        step = self.step_no
        heap = self.decode_heap
        while heap and heap[0][0] <= step:
            _, _, ep, r = heapq.heappop(heap)
            if ep != r.epoch or r.state != SimReq.DECODE:
                continue
            self.n_decoding -= 1
            del self.running[r]
            r.gen = r.max_out
            r.finish_s = t
            r.state = SimReq.DONE
            self._release_finished(r)
            finished.append(r)
        still = []
        for r in self.prefilling:
            if r.chunk:
                r.computed += r.chunk
                r.chunk = 0
            if r.computed >= r.total:
                if r.gen == 0:
                    r.first_s = t
                    first_tokens.append(r)
                r.gen += 1
                rem = r.max_out - r.gen
                if rem <= 0:
                    del self.running[r]
                    r.finish_s = t
                    r.state = SimReq.DONE
                    self._release_finished(r)
                    finished.append(r)
                else:
                    r.state = SimReq.DECODE
                    r.finish_step = step + rem
                    heapq.heappush(heap, (r.finish_step, r.adm, r.epoch, r))
                    self.n_decoding += 1
                    self._push_block_need(r, step, rem, r.computed)
                    r.total = r.prompt + r.gen
            else:
                still.append(r)
        self.prefilling = still
