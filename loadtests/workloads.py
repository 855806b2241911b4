"""Workloads: deterministic request streams made of named segments, renderable two ways.

Rule: a request is a tuple of `Segment`s (each with a role) plus a tenant, a salt, an arrival time
and max output tokens. A segment's content is a pure function of its `seg_id`, so equal ids mean
equal content in both renderings and requests that start with the same segments share their
leading KV blocks. Everything is deterministic for a seed; nothing here does I/O.

Renderings
- TEXT, for the wall-clock HTTP benchmark: `render_messages(req)` -> OpenAI chat messages; each
  segment becomes `n_tokens` pseudo-words (1-3 syllables from a fixed list, about 1-2 tokens each
  with common BPE tokenizers, so token counts are APPROXIMATE), or as many as
  `text_words_per_token` (on average) or `exact_word_counts` (per segment, within a token) say;
  consecutive segments of one role form one message, joined by a blank line.
- TOKEN IDS, for the virtual-time simulator: `render_token_ids(req)` -> a stream framed as the
  sims' (and Qwen's) ChatML template frames the text rendering, token for token in count: for each
  message a 3-token role header (`<|im_start|>role\n`), its segments' synthetic ids (exactly
  `n_tokens` each, drawn in [1000, 150000) from a generator seeded by xxh3(seg_id)) with one
  token between two segments (the blank line), and a 2-token end (`<|im_end|>\n`); then the
  3-token assistant header (the generation prompt). Why the count must match: on the busy regime
  four framing tokens more per request (+4% prefill) multiply the Zipf TTFT p50 several times, so
  a virtual-time run with lighter framing than the wall clock's predicts a different regime. The
  salt is not in the tokens: it is `req.salt` (block 0's extras, as the gateway passes it).
  `output_token_ids(req)` are the ids a simulated engine "generates" (the assistant answer that a
  multi-turn follow-up quotes), so a sim can cache them.

Workloads (`WORKLOADS` maps names to builders; every builder takes `n_requests`, `seed`, `rate_rps`
or `concurrency`, and its own shape parameters with defaults):
- shared_docs: long shared documents (uniform or Zipf popularity), one question each;
- multi_turn: chats whose prompt is the whole growing history (system, user, assistant, ...);
- rag: a system prompt, then k retrieved chunks of a topic in a random order, then a question;
- multi_tenant: shared_docs where several tenants send the same documents (salts differ, so no
  cross-tenant sharing is possible);
- hot_prefix: one document carries `hot_share` of the traffic, the rest spread over many;
- no_sharing: every prompt unique.
Arrivals: Poisson at `rate_rps` (open loop), or all at 0 with `concurrency` set (closed loop; the
runner keeps that many in flight, multi-turn follow-ups after their predecessor). A stream's
"last third" (`last_third_start`: the last n // 3 of n requests in arrival order) is where both
clocks measure a run once its start is behind it.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import xxhash

__all__ = [
    "Segment",
    "WorkloadRequest",
    "Workload",
    "WORKLOADS",
    "build_workload",
    "render_messages",
    "render_token_ids",
    "output_token_ids",
    "segment_token_ids",
    "segment_text",
    "text_words_per_token",
    "exact_word_counts",
    "warmup_requests",
    "last_third_start",
    "ROLE_HEADER_TOKENS",
    "MESSAGE_END_TOKENS",
    "JOIN_TOKENS",
]

ROLE_HEADER_TOKENS = 3  # tokens of a ChatML role header (`<|im_start|>role\n`) in the token rendering
MESSAGE_END_TOKENS = 2  # tokens closing a message (`<|im_end|>\n`)
JOIN_TOKENS = 1  # tokens between two segments of one message (the text rendering's blank line)
_ROLE_IDS = {"system": (1, 2, 3), "user": (1, 4, 3), "assistant": (1, 5, 3)}
_END_IDS = (6, 3)
_JOIN_IDS = (7,)
_SYLLABLES = (
    "ka ri to me lo sa nu fe di po ba ze mi ru te no ga vi so la pe ko du ti ma ne ho bu ra fi "
    "go le si wa "
).split()


@dataclass(frozen=True, slots=True)
class Segment:
    seg_id: str  # identity of the content: equal ids => equal text and token ids
    role: str  # "system" | "user" | "assistant"
    n_tokens: int  # exact token count of the token rendering; approximate for the text one
    kind: str = ""  # document, question, system, chunk, history_user, history_assistant, ...


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str  # unique within the workload
    arrival_s: float  # seconds from the start (Poisson); 0 for closed loop
    tenant: str  # tenant id
    salt: str  # cache salt of the tenant (block 0 extras); "" for none
    segments: tuple[Segment, ...]  # the prompt, in order
    max_output_tokens: int  # max_tokens of the request; sims generate exactly this many
    output: Segment | None = None  # the answer a later turn quotes (multi-turn); None otherwise
    conversation: str = ""  # multi-turn: conversation id ("" otherwise)
    turn: int = 0  # multi-turn: 0-based turn number
    prompt_tokens: int = 0  # tokens of render_token_ids(self) (filled by the builders)
    lora: str | None = None  # the LoRA adapter it asks for (None: the base model)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[WorkloadRequest, ...]  # sorted by arrival_s
    rate_rps: float | None  # Poisson rate, or None for closed loop
    concurrency: int | None  # closed-loop clients, or None
    params: dict = field(default_factory=dict)  # the builder's parameters, for reports


# ---------------------------------------------------------------- rendering


def _seed_of(seg_id: str) -> int:
    return xxhash.xxh3_64_intdigest(seg_id.encode())


@lru_cache(maxsize=4096)
def _segment_ids_cached(seg_id: str, n_tokens: int) -> tuple[int, ...]:
    g = np.random.default_rng(_seed_of(seg_id))
    return tuple(g.integers(1000, 150000, n_tokens).tolist())


def segment_token_ids(seg: Segment) -> tuple[int, ...]:
    """The segment's synthetic token ids (exactly `n_tokens`, pure function of seg_id)."""
    return _segment_ids_cached(seg.seg_id, seg.n_tokens)


def segment_text(seg: Segment, words_per_token: float = 1.0, n_words: int | None = None) -> str:
    """The segment as `n_tokens x words_per_token` pseudo-words (or exactly `n_words`). A
    pseudo-word is about 1.5 tokens of the default (Qwen) vocabulary, so words_per_token = 1 makes
    ~1.5x `n_tokens` real tokens; `text_words_per_token()` measures the factor that makes the text
    `n_tokens` long on average, `exact_word_counts()` the count that makes one segment so. The
    words are a stream drawn from the segment's seed: fewer words are a prefix of more."""
    g = random.Random(_seed_of(seg.seg_id))
    words = []
    for _ in range(max(1, n_words if n_words is not None else round(seg.n_tokens * words_per_token))):
        n = 1 + (g.random() < 0.4) + (g.random() < 0.15)
        words.append("".join(g.choice(_SYLLABLES) for _ in range(n)))
    return " ".join(words)


def _messages(req: WorkloadRequest) -> list[tuple[str, list[Segment]]]:
    out: list[tuple[str, list[Segment]]] = []
    for s in req.segments:
        if out and out[-1][0] == s.role:
            out[-1][1].append(s)
        else:
            out.append((s.role, [s]))
    return out


def render_messages(req: WorkloadRequest, words_per_token: float = 1.0,
                    words: dict[str, int] | None = None) -> list[dict]:
    """OpenAI chat messages for the HTTP benchmark (text; see segment_text for the token count);
    `words`: seg_id -> word count (exact_word_counts), for the segments it names."""
    words = words or {}
    return [{"role": role,
             "content": "\n\n".join(segment_text(s, words_per_token, words.get(s.seg_id)) for s in segs)}
            for role, segs in _messages(req)]


def exact_word_counts(requests, encode, words_per_token: float) -> dict[str, int]:
    """seg_id -> the word count whose text `encode(text) -> ids` makes closest to the segment's
    `n_tokens` (a search over prefixes of its word stream), for every segment of `requests`. The
    average factor alone leaves each segment tens of tokens off (a 3,000-token document by -44 to
    +42 with the default tokenizer); exact counts make the wall clock's prompts the virtual-time
    rendering's, token for token in length."""
    out: dict[str, int] = {}
    for r in requests:
        for seg in r.segments:
            if seg.seg_id in out:
                continue
            n, seen = seg.n_tokens, {}

            def count(k: int, seg=seg, seen=seen) -> int:  # tokens of the first k words, each k encoded once
                if k not in seen:
                    seen[k] = len(encode(segment_text(seg, n_words=k)))
                return seen[k]
            lo, hi = 1, max(2, 2 * round(n * words_per_token) + 8)
            while lo < hi:  # the fewest words reaching n tokens (token counts grow with the prefix)
                mid = (lo + hi) // 2
                if count(mid) >= n:
                    hi = mid
                else:
                    lo = mid + 1
            out[seg.seg_id] = lo if lo == 1 or count(lo) - n <= n - count(lo - 1) else lo - 1
    return out


def text_words_per_token(encode, sample_tokens: int = 20_000) -> float:
    """The words_per_token at which segment_text is as many real tokens as it is nominal ones,
    measured with `encode(text) -> token ids` (e.g. the default tokenizer's encode_prompt) on a
    sample of segments (the ratio is stable: pseudo-words are drawn from one syllable table)."""
    segs = [Segment(f"calibration/{i}", "user", 1000, "document") for i in range(max(1, sample_tokens // 1000))]
    words = sum(max(1, round(s.n_tokens)) for s in segs)
    tokens = sum(len(encode(segment_text(s))) for s in segs)
    return words / tokens


def render_token_ids(req: WorkloadRequest) -> list[int]:
    """The prompt as token ids for the virtual-time simulator (see module header)."""
    out: list[int] = []
    for role, segs in _messages(req):
        out.extend(_ROLE_IDS[role])
        for i, s in enumerate(segs):
            if i:
                out.extend(_JOIN_IDS)
            out.extend(segment_token_ids(s))
        out.extend(_END_IDS)
    out.extend(_ROLE_IDS["assistant"])
    return out


def output_token_ids(req: WorkloadRequest) -> list[int]:
    """Ids a simulated engine generates for `req` (its quoted answer when multi-turn)."""
    if req.output is not None:
        return list(segment_token_ids(req.output))
    return list(segment_token_ids(Segment(f"out/{req.request_id}", "assistant", req.max_output_tokens)))


def _count_tokens(segs: tuple[Segment, ...]) -> int:
    n_msgs = 0
    prev = None
    for s in segs:
        if s.role != prev:
            n_msgs += 1
            prev = s.role
    return (sum(s.n_tokens for s in segs) + (ROLE_HEADER_TOKENS + MESSAGE_END_TOKENS) * n_msgs + ROLE_HEADER_TOKENS
            + JOIN_TOKENS * (len(segs) - n_msgs))


# ---------------------------------------------------------------- arrivals and helpers


def _arrivals(n: int, rate_rps: float | None, rng: random.Random) -> list[float]:
    if rate_rps is None:
        return [0.0] * n
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be positive, got {rate_rps}")
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        out.append(t)
    return out


def _zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (i + 1) ** s for i in range(n)]
    tot = sum(w)
    return [x / tot for x in w]


def _jitter(rng: random.Random, n: int, rel: float = 0.25) -> int:
    return max(1, int(round(n * (1 + rel * (2 * rng.random() - 1)))))


def _salt(tenant: str) -> str:
    return f"salt-{tenant}"


def _finish(name: str, reqs: list[WorkloadRequest], rate_rps, concurrency, params) -> Workload:
    reqs.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Workload(name, tuple(reqs), rate_rps, concurrency, params)


def _req(rid, t, tenant, segs, out_tokens, **kw) -> WorkloadRequest:
    segs = tuple(segs)
    return WorkloadRequest(rid, t, tenant, _salt(tenant), segs, out_tokens, prompt_tokens=_count_tokens(segs), **kw)


def _check_load(rate_rps, concurrency):
    if (rate_rps is None) == (concurrency is None):
        raise ValueError("give exactly one of rate_rps (open loop) or concurrency (closed loop)")


# ---------------------------------------------------------------- builders


def shared_docs(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    rate_rps: float | None = 10.0,
    concurrency: int | None = None,
    n_docs: int = 40,
    doc_tokens: int = 3000,
    question_tokens: int = 60,
    system_tokens: int = 40,
    output_tokens: int = 64,
    popularity: str = "uniform",
    zipf_s: float = 1.1,
    n_tenants: int = 1,
    doc_jitter: float = 0.25,
    name: str = "shared_docs",
) -> Workload:
    """Long documents with many questions: [system+document] [question]. popularity: uniform|zipf.

    Document lengths are doc_tokens x (1 +- doc_jitter) (uniform; 0: every document exactly
    doc_tokens); questions question_tokens +- 25%."""
    _check_load(rate_rps, concurrency)
    if popularity not in ("uniform", "zipf"):
        raise ValueError(f"popularity must be 'uniform' or 'zipf', got {popularity!r}")
    if not 0.0 <= doc_jitter < 1.0:
        raise ValueError(f"doc_jitter must be in [0, 1), got {doc_jitter!r}")
    rng = random.Random(f"{name}/{seed}")
    weights = _zipf_weights(n_docs, zipf_s) if popularity == "zipf" else [1.0 / n_docs] * n_docs
    doc_len = [_jitter(rng, doc_tokens, doc_jitter) for _ in range(n_docs)]
    times = _arrivals(n_requests, rate_rps, rng)
    docs = rng.choices(range(n_docs), weights=weights, k=n_requests)
    system = Segment("sys/shared", "system", system_tokens, "system")
    reqs = []
    for i, (t, d) in enumerate(zip(times, docs)):
        tenant = f"t{rng.randrange(n_tenants)}" if n_tenants > 1 else "t0"
        segs = (system, Segment(f"doc/{d}", "system", doc_len[d], "document"), Segment(f"q/{name}/{seed}/{i}", "user", _jitter(rng, question_tokens), "question"))
        reqs.append(_req(f"{name}-{i}", t, tenant, segs, output_tokens))
    params = dict(n_docs=n_docs, doc_tokens=doc_tokens, question_tokens=question_tokens, output_tokens=output_tokens, popularity=popularity, zipf_s=zipf_s, n_tenants=n_tenants, doc_jitter=doc_jitter)
    return _finish(name, reqs, rate_rps, concurrency, params)


def multi_tenant(n_requests: int = 1000, *, n_tenants: int = 4, **kw) -> Workload:
    """shared_docs with several tenants sending the same documents (no cross-tenant sharing)."""
    return shared_docs(n_requests, n_tenants=n_tenants, name="multi_tenant", **kw)


def hot_prefix(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    rate_rps: float | None = 10.0,
    concurrency: int | None = None,
    hot_share: float = 0.5,
    n_docs: int = 40,
    doc_tokens: int = 3000,
    question_tokens: int = 60,
    output_tokens: int = 64,
) -> Workload:
    """One very hot document: `hot_share` of requests use doc 0; the rest spread uniformly."""
    _check_load(rate_rps, concurrency)
    rng = random.Random(f"hot_prefix/{seed}")
    times = _arrivals(n_requests, rate_rps, rng)
    system = Segment("sys/shared", "system", 40, "system")
    reqs = []
    for i, t in enumerate(times):
        d = 0 if rng.random() < hot_share else 1 + rng.randrange(max(1, n_docs - 1))
        segs = (system, Segment(f"doc/{d}", "system", doc_tokens, "document"), Segment(f"q/hot/{seed}/{i}", "user", _jitter(rng, question_tokens), "question"))
        reqs.append(_req(f"hot_prefix-{i}", t, "t0", segs, output_tokens))
    params = dict(hot_share=hot_share, n_docs=n_docs, doc_tokens=doc_tokens, question_tokens=question_tokens, output_tokens=output_tokens)
    return _finish("hot_prefix", reqs, rate_rps, concurrency, params)


def no_sharing(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    rate_rps: float | None = 10.0,
    concurrency: int | None = None,
    prompt_tokens: int = 1500,
    output_tokens: int = 64,
    adapters: int = 0,
    zipf_s: float = 0.0,
) -> Workload:
    """Every prompt unique (no system prompt either): caching cannot help; routing must not hurt.
    `adapters` > 0: each request asks for one of that many LoRA adapters ("adapter-K"), drawn
    uniformly or with Zipf `zipf_s` (from a draw of its own: the prompts and arrivals are the same)."""
    _check_load(rate_rps, concurrency)
    rng = random.Random(f"no_sharing/{seed}")
    lora_rng = random.Random(f"no_sharing/lora/{seed}")
    names = [f"adapter-{k}" for k in range(adapters)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(adapters)]
    times = _arrivals(n_requests, rate_rps, rng)
    reqs = []
    for i, t in enumerate(times):
        segs = (Segment(f"uniq/{seed}/{i}", "user", _jitter(rng, prompt_tokens, 0.5), "question"),)
        lora = lora_rng.choices(names, weights)[0] if names else None
        reqs.append(_req(f"no_sharing-{i}", t, "t0", segs, output_tokens, lora=lora))
    params = dict(prompt_tokens=prompt_tokens, output_tokens=output_tokens, **(dict(adapters=adapters, zipf_s=zipf_s) if adapters else {}))
    return _finish("no_sharing", reqs, rate_rps, concurrency, params)


def multi_turn(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    rate_rps: float | None = 10.0,
    concurrency: int | None = None,
    turns: int = 6,
    system_tokens: int = 400,
    user_tokens: int = 150,
    answer_tokens: int = 200,
    think_s: float = 8.0,
    sessions: int | None = None,
) -> Workload:
    """Chats with growing histories: turn k's prompt = system, (user, assistant) x k, user.

    Conversations start as a Poisson process at rate_rps / turns; turn k+1 arrives an exponential
    think time (mean `think_s`) after turn k. Each turn generates exactly `answer_tokens` (its
    `output` segment), which the next turn quotes, so a replica that cached the answer hits it.

    Steady sessions (`sessions` set, open loop): `sessions` conversations are live at any time,
    each of `turns` turns; a session's first conversation starts uniformly within one think time,
    and its next conversation starts one think time after its previous one's last turn (the
    session whose next conversation starts first goes next, until n_requests); the think time's
    mean is sessions / rate_rps (`think_s` is ignored), so arrivals run at about rate_rps for the
    whole run instead of ramping up and down.
    """
    _check_load(rate_rps, concurrency)
    rng = random.Random(f"multi_turn/{seed}")
    n_conv = max(1, math.ceil(n_requests / turns))
    if sessions is not None:
        if sessions < 1 or rate_rps is None:
            raise ValueError("sessions needs open-loop arrivals (rate_rps) and must be >= 1")
        think_s = sessions / rate_rps
        slots = [(rng.uniform(0.0, think_s), i) for i in range(sessions)]  # (next conversation's start, session)
        heapq.heapify(slots)
    else:
        starts = _arrivals(n_conv, None if rate_rps is None else rate_rps / turns, rng)
    reqs = []
    for c in range(n_conv):
        system = Segment(f"sys/chat/{seed}/{c % 8}", "system", system_tokens, "system")  # 8 shared system prompts
        hist: list[Segment] = [system]
        t = heapq.heappop(slots)[0] if sessions is not None else starts[c]
        for k in range(turns):
            if len(reqs) >= n_requests:
                break
            user = Segment(f"u/{seed}/{c}/{k}", "user", _jitter(rng, user_tokens), "history_user")
            ans = Segment(f"a/{seed}/{c}/{k}", "assistant", answer_tokens, "history_assistant")
            segs = tuple(hist) + (user,)
            reqs.append(_req(f"multi_turn-{c}-{k}", t, "t0", segs, answer_tokens, output=ans, conversation=f"c{c}", turn=k))
            hist += [user, ans]
            if rate_rps is not None:
                t += rng.expovariate(1.0 / think_s)
        if sessions is not None:
            heapq.heappush(slots, (t, c))
    params = dict(turns=turns, system_tokens=system_tokens, user_tokens=user_tokens, answer_tokens=answer_tokens, think_s=think_s, sessions=sessions)
    return _finish("multi_turn", reqs, rate_rps, concurrency, params)


def rag(
    n_requests: int = 1000,
    *,
    seed: int = 0,
    rate_rps: float | None = 10.0,
    concurrency: int | None = None,
    n_topics: int = 40,
    chunks_per_topic: int = 6,
    chunks_per_request: int = 4,
    chunk_tokens: int = 500,
    system_tokens: int = 200,
    question_tokens: int = 60,
    output_tokens: int = 64,
    zipf_s: float = 0.8,
) -> Workload:
    """RAG: system prompt, then `chunks_per_request` chunks of one topic in a random order, then a
    question. Only requests whose chunk order agrees share more than the system prompt."""
    _check_load(rate_rps, concurrency)
    rng = random.Random(f"rag/{seed}")
    weights = _zipf_weights(n_topics, zipf_s)
    times = _arrivals(n_requests, rate_rps, rng)
    system = Segment("sys/rag", "system", system_tokens, "system")
    reqs = []
    for i, t in enumerate(times):
        topic = rng.choices(range(n_topics), weights=weights)[0]
        picks = rng.sample(range(chunks_per_topic), chunks_per_request)
        segs = [system] + [Segment(f"chunk/{topic}/{c}", "user", chunk_tokens, "chunk") for c in picks]
        segs.append(Segment(f"q/rag/{seed}/{i}", "user", _jitter(rng, question_tokens), "question"))
        reqs.append(_req(f"rag-{i}", t, "t0", segs, output_tokens))
    params = dict(n_topics=n_topics, chunks_per_topic=chunks_per_topic, chunks_per_request=chunks_per_request, chunk_tokens=chunk_tokens, output_tokens=output_tokens, zipf_s=zipf_s)
    return _finish("rag", reqs, rate_rps, concurrency, params)


def shared_docs_zipf(n_requests: int = 1000, **kw) -> Workload:
    kw.setdefault("popularity", "zipf")
    return shared_docs(n_requests, name="shared_docs_zipf", **kw)


def warmup_requests(w: Workload) -> list[WorkloadRequest]:
    """One request per distinct shared prefix of `w` (all segments but the last; e.g. one per
    document of shared_docs), in order of first appearance, with its own question and arrival 0:
    what pre-warming the replicas with one request per document sends. Workloads whose prompts
    share nothing but single segments (no_sharing) or whose prefixes are conversations
    (multi_turn) get none."""
    out: list[WorkloadRequest] = []
    seen: set = set()
    for r in w.requests:
        if r.conversation or len(r.segments) < 2:
            continue
        prefix = tuple(s.seg_id for s in r.segments[:-1])
        if prefix in seen:
            continue
        seen.add(prefix)
        last = r.segments[-1]
        q = Segment(f"warmup/{len(out)}/{last.seg_id}", last.role, last.n_tokens, last.kind)
        out.append(_req(f"warmup-{len(out)}", 0.0, r.tenant, r.segments[:-1] + (q,), r.max_output_tokens))
    return out


WORKLOADS = {
    "shared_docs": shared_docs,
    "shared_docs_zipf": shared_docs_zipf,
    "multi_turn": multi_turn,
    "rag": rag,
    "multi_tenant": multi_tenant,
    "hot_prefix": hot_prefix,
    "no_sharing": no_sharing,
}


def last_third_start(n: int) -> int:
    """Where the last third of n requests in arrival order begins: the last n // 3 (none under 3).
    One rule for the wall clock's answered requests (loadtests.runner.last_third) and virtual
    time's finished ones (loadtests.vtime.SimResult.late_ttft_s)."""
    return n - n // 3 if n >= 3 else n


def build_workload(name: str, n_requests: int, **kw) -> Workload:
    """`WORKLOADS[name](n_requests, **kw)` with a clear error for an unknown name."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return fn(n_requests, **kw)
