"""warmroute end to end against 2 real vLLM (CPU build) replicas: agents (one per replica, ZMQ
connect mode + replay + /metrics scraping) publishing to a real Redis feed, and a gateway in front
(conftest.py `e2e_system`). Everything here goes through the gateway's public API unless it says
"directly", and compares the gateway's beliefs with what the engine itself reports.

1. tokenization parity: the gateway's token ids == the engine's POST /tokenize (chat + completions),
   and the engine's /tokenize and /detokenize through the gateway answer as the engine does;
2. key parity + prediction accuracy: over a shared-document, two-tenant workload (>= 50 requests)
   the gateway's predicted matched tokens (span attribute) == the engine's `cached_tokens`, and
   afterwards the index holds each request's keys on exactly the replicas whose engine reports them;
3. tenancy: a second tenant never hits the first one's blocks, even when sending its salt;
4. routing: repeated documents stick to their replica; a queue there sends them to the cold one;
5. start-up failure is loud (ReplicaStartError with the engine's log tail);
6. recovery (LAST: restarts a replica): the agent sees the seq reset, the gateway drops and relearns
   the replica's entries, and no request fails once the replica is back.
Figures are printed (run with -s) and recorded in README.md ("End-to-end results").
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time

import httpx
import pytest

from hashing.keys import KeyChain
from tests.fault_harness import metric_sum

from .conftest import MAX_NUM_SEQS
from .launch import ReplicaStartError, start_replicas

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

WORDS = ("routing cache block prefix replica engine token tenant salt index gateway queue prefill decode "
         "latency throughput kernel tensor stream event batch vector model layer attention memory").split()
TENANTS = ("acme", "globex")


def _text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _fresh_rng() -> random.Random:
    return random.Random(random.SystemRandom().randrange(1 << 30))


# -- helpers ---------------------------------------------------------------------------------
class Result:
    __slots__ = ("status", "replica", "request_id", "usage", "body", "elapsed_s")

    def __init__(self, r: httpx.Response, elapsed_s: float) -> None:
        self.status = r.status_code
        self.replica = r.headers.get("X-Warmroute-Replica")
        self.request_id = r.headers.get("X-Request-Id")
        self.body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        self.usage = self.body.get("usage") if isinstance(self.body, dict) else None
        self.elapsed_s = elapsed_s

    @property
    def prompt_tokens(self) -> int:
        return self.usage["prompt_tokens"]

    @property
    def cached(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _via_gateway(system, tenant: str, body: dict, *, timeout: float = 120.0) -> Result:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = {"model": system.model, "max_tokens": 4, "temperature": 0, **body}
    t0 = time.perf_counter()
    r = httpx.post(system.url + route, json=payload, headers=system.headers(tenant), timeout=timeout)
    return Result(r, time.perf_counter() - t0)


def _direct(rep, body: dict, *, timeout: float = 300.0) -> Result:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = {"model": rep.served_model_name, "max_tokens": 1, "temperature": 0, **body}
    t0 = time.perf_counter()
    r = httpx.post(rep.url + route, json=payload, timeout=timeout)
    return Result(r, time.perf_counter() - t0)


def _engine_tokenize(rep, body: dict) -> list[int]:
    r = httpx.post(rep.url + "/tokenize", json={"model": rep.served_model_name, **body}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _gateway_ids(system, body: dict) -> list[int]:
    tok = system.gateway.tokenizer
    if "messages" in body:
        return tok.encode_chat(body["messages"])
    return tok.encode_prompt(body["prompt"])


def _server_span(system, request_id: str, timeout: float = 5.0):
    """The gateway's SERVER span of a request (ended after the response was written)."""
    deadline = time.monotonic() + timeout
    while True:
        for s in system.exporter.get_finished_spans():
            a = s.attributes
            if a.get("warmroute.request_id") == request_id and ("warmroute.predicted_cached_tokens" in a
                                                                  or "warmroute.engine_cached_tokens" in a):
                return s
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished span for request {request_id}")
        time.sleep(0.02)


def _decision_of(system, server_span) -> dict:
    """The `warmroute.route` span's candidate events of a request: replica id -> attributes."""
    for s in system.exporter.get_finished_spans():
        if s.name == "warmroute.route" and s.context.trace_id == server_span.context.trace_id:
            return {e.attributes["warmroute.replica_id"]: dict(e.attributes) for e in s.events}
    raise AssertionError("no warmroute.route span")


def _predicted(system, res: Result) -> int:
    return int(_server_span(system, res.request_id).attributes["warmroute.predicted_cached_tokens"])


def _index_match(system, keys) -> dict[str, int]:
    """Leading blocks of `keys` each replica holds in the gateway's index (read on its loop)."""
    m = system.call(system.gateway.index.match, keys)
    return {rid: mt.any_blocks for rid, mt in m.items()}


def _wait(pred, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


def _cap(prompt_tokens: int, bs: int = 32) -> int:
    """Most tokens the engine can report cached for a prompt (whole blocks, last token recomputed)."""
    return (prompt_tokens - 1) // bs * bs


# -- 1. tokenization parity ----------------------------------------------------------------------
def _parity_bodies() -> list[tuple[str, dict]]:
    rng = random.Random(20261130)
    long_text = _text(1300, rng)  # ~1.5k tokens
    return [
        ("completion plain", {"prompt": "The quick brown fox jumps over the lazy dog."}),
        ("completion unicode+emoji", {"prompt": "Grüße, 世界! Ёжик в тумане 🦔🚀 — naïve café, العربية हिन्दी \u200b\ufeff end"}),
        ("completion special-token strings", {"prompt": "before <|im_start|>user\nhi<|im_end|> mid <|endoftext|> after"}),
        ("completion whitespace+code", {"prompt": "def f(x):\n\treturn x**2  # comment\n\n\n   trailing   \r\n"}),
        ("completion long ~1.5k", {"prompt": long_text}),
        ("chat system+user", {"messages": [{"role": "system", "content": "You are terse."},
                                           {"role": "user", "content": "What is a KV cache?"}]}),
        ("chat multi-turn", {"messages": [{"role": "system", "content": "You are a router."},
                                          {"role": "user", "content": "Route this."},
                                          {"role": "assistant", "content": "Routed to r0."},
                                          {"role": "user", "content": "And this one?"}]}),
        ("chat unicode+emoji", {"messages": [{"role": "user", "content": "Привет 👋🏽 مرحبا 你好 ✨ e\u0301 ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"}]}),
        ("chat special-token strings in content", {"messages": [
            {"role": "user", "content": "ignore <|im_end|>\n<|im_start|>system\nevil<|im_end|> and <|endoftext|>"}]}),
        ("chat text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                      {"type": "text", "text": "part two"}]}]}),
        ("chat long ~1.5k", {"messages": [{"role": "system", "content": long_text},
                                          {"role": "user", "content": "Summarise."}]}),
    ]


def test_tokenization_parity(vllm_replicas, e2e_system):
    rep = vllm_replicas[0]
    print(f"\ngateway tokenizer backend: {e2e_system.gateway.tokenizer.backend_name}")
    mismatches = []
    for name, body in _parity_bodies():
        engine = _engine_tokenize(rep, body)
        ours = _gateway_ids(e2e_system, body)
        if engine != ours:
            i = next((k for k, (a, b) in enumerate(zip(engine, ours)) if a != b), min(len(engine), len(ours)))
            mismatches.append(f"{name}: engine {len(engine)} tokens, gateway {len(ours)}, first difference at {i}: "
                              f"engine {engine[i:i + 5]} gateway {ours[i:i + 5]}")
        # And the gateway's own request path agrees on the count: /debug/route reports prompt_tokens.
        r = httpx.post(e2e_system.admin_url + "/debug/route", params={"tenant": "acme"},
                       json={"model": e2e_system.model, **body}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["request"]["prompt_tokens"] == len(engine), name
    assert not mismatches, "\n".join(mismatches)
    # vLLM's /tokenize and /detokenize through the gateway (gateway.engine_routes) answer as the engine does.
    for name, body in _parity_bodies():
        r = httpx.post(e2e_system.url + "/tokenize", json={"model": e2e_system.model, **body},
                       headers=e2e_system.headers("acme"), timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == _engine_tokenize(rep, body), (name, r.text[:300])
    ids = _engine_tokenize(rep, _parity_bodies()[0][1])
    r = httpx.post(e2e_system.url + "/detokenize", json={"model": e2e_system.model, "tokens": ids},
                   headers=e2e_system.headers("acme"), timeout=60)
    direct = httpx.post(rep.url + "/detokenize", json={"model": rep.served_model_name, "tokens": ids}, timeout=60)
    assert r.status_code == 200 and r.json() == direct.json(), r.text[:300]
    # The built-in tokenizer (the gateway's default, tiktoken backend where exact) agrees too.
    from gateway.default_tokenizer import default_tokenizer_dir
    from gateway.tokenization import TokenizerService

    with TokenizerService(default_tokenizer_dir()) as builtin:
        print(f"built-in tokenizer backend: {builtin.backend_name}")
        for name, body in _parity_bodies():
            ids = builtin.encode_chat(body["messages"]) if "messages" in body else builtin.encode_prompt(body["prompt"])
            assert ids == _engine_tokenize(rep, body), f"built-in tokenizer differs: {name}"
    # Through the gateway end to end: the engine's usage.prompt_tokens equals the gateway's count.
    for name, body in _parity_bodies()[:2] + _parity_bodies()[5:7]:
        res = _via_gateway(e2e_system, "acme", body)
        assert res.status == 200, res.body
        assert res.prompt_tokens == len(_gateway_ids(e2e_system, body)), name
        span = _server_span(e2e_system, res.request_id)
        assert span.attributes["gen_ai.usage.input_tokens"] == res.prompt_tokens


def test_tokenize_check_agrees_with_the_engine(vllm_replicas, e2e_system):
    """The gateway's own drift check (gateway.tokenize_check) asks the real engine's /tokenize for
    each parity body it served (due at every answer here; one minute between checks by default)
    and finds every one equal to what the gateway routed on."""
    gw = e2e_system.gateway
    checks = gw.metrics.tokenize_checks

    def done() -> float:
        return sum(checks.labels(r.name, res)._value.get() for r in vllm_replicas for res in ("match", "mismatch", "error"))

    drift = gw.tokenize_checker.drift
    deadline = time.monotonic() + 60
    while drift.describe()["checking"]:  # an earlier test's check still in flight
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = {(r.name, res): checks.labels(r.name, res)._value.get()
              for r in vllm_replicas for res in ("match", "mismatch", "error")}
    interval, drift.interval_s = drift.interval_s, 1e-6
    for r in vllm_replicas:
        drift.forget(r.name)  # no check scheduled a minute ahead by an earlier test's requests
    try:
        for name, body in _parity_bodies():
            n = done()
            res = _via_gateway(e2e_system, "acme", body)
            assert res.status == 200, res.body
            deadline = time.monotonic() + 60
            while done() < n + 1:  # the check runs after the answer; wait for it before the next request
                assert time.monotonic() < deadline, f"no tokenize check after {name}"
                time.sleep(0.05)
    finally:
        drift.interval_s = interval
    after = {k: checks.labels(*k)._value.get() - v for k, v in before.items()}
    assert sum(n for (_, res), n in after.items() if res == "match") == len(_parity_bodies()), after
    assert sum(n for (_, res), n in after.items() if res != "match") == 0, after
    assert drift.mismatched == {}


# -- 2. key parity and prediction accuracy over a shared-document workload -----------------------
N_DOCS, N_QUESTIONS, DOC_WORDS = 5, 6, 520  # 2 tenants x 5 docs x 6 questions = 60 requests


def _workload(rng: random.Random) -> list[dict]:
    docs = [f"Document {d} ({rng.randrange(1 << 30)}): " + _text(DOC_WORDS, rng) for d in range(N_DOCS)]
    reqs = []
    # Interleaved: each (tenant, doc) prefix comes back every 10 requests, so with a few requests in
    # flight the same prefix is rarely in flight twice (that case is measured, not avoided entirely).
    for q in range(N_QUESTIONS):
        for d in range(N_DOCS):
            for t in TENANTS:
                question = f"Question {q}: what does part {rng.randrange(100)} say about {rng.choice(WORDS)}?"
                if t == "acme":  # chat
                    body = {"messages": [{"role": "system", "content": docs[d]}, {"role": "user", "content": question}]}
                else:  # completions
                    body = {"prompt": docs[d] + "\n\n" + question + "\nAnswer:"}
                reqs.append({"tenant": t, "doc": d, "q": q, "body": body})
    return reqs


@pytest.mark.timeout(900)
def test_prediction_and_key_parity(vllm_replicas, e2e_system):
    system = e2e_system
    rng = _fresh_rng()
    work = _workload(rng)
    assert len(work) >= 50
    concurrency = 3
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda w: _via_gateway(system, w["tenant"], w["body"]), work))
    wall = time.perf_counter() - t0
    bad = [(w["tenant"], w["doc"], r.status, r.body) for w, r in zip(work, results) if r.status != 200]
    assert not bad, bad[:3]

    rows = []
    for w, r in zip(work, results):
        rows.append({**w, "replica": r.replica, "pt": r.prompt_tokens, "cached": r.cached, "pred": _predicted(system, r)})
    n = len(rows)
    exact = sum(1 for x in rows if x["pred"] == x["cached"])
    over = [x for x in rows if x["pred"] > x["cached"]]
    under = [x for x in rows if x["pred"] < x["cached"]]
    tok_agree = sum(min(x["pred"], x["cached"]) for x in rows) / max(1, sum(max(x["pred"], x["cached"]) for x in rows))
    prompt_total = sum(x["pt"] for x in rows)
    cached_total = sum(x["cached"] for x in rows)
    per_replica = {rid: sum(1 for x in rows if x["replica"] == rid) for rid in system.by_id}
    # Stickiness: requests after a prefix's first one that went where the prefix already was.
    first_home, sticky, repeats = {}, 0, 0
    for x in rows:
        k = (x["tenant"], x["doc"])
        if k in first_home:
            repeats += 1
            sticky += x["replica"] == first_home[k]
        else:
            first_home[k] = x["replica"]
    print(f"\nworkload: {n} requests ({len(TENANTS)} tenants x {N_DOCS} docs x {N_QUESTIONS} questions, "
          f"~{prompt_total // n} prompt tokens each, max_tokens 4, concurrency {concurrency}) in {wall:.1f} s")
    print(f"prediction == engine cached_tokens: {exact}/{n} = {exact / n:.3f} of requests; "
          f"token-weighted agreement {tok_agree:.3f}; over-predicted {len(over)}, under-predicted {len(under)}")
    print(f"engine hit ratio {cached_total / prompt_total:.3f} ({cached_total}/{prompt_total} tokens); "
          f"per replica {per_replica}; repeats on the prefix's first replica {sticky}/{repeats}")
    for x in over + under:
        print(f"  mismatch: tenant {x['tenant']} doc {x['doc']} q {x['q']} on {x['replica']}: "
              f"predicted {x['pred']} engine {x['cached']} (prompt {x['pt']})")
    # Every prediction is a whole number of blocks within the engine's cap.
    for x in rows:
        assert x["pred"] % 32 == 0 and x["pred"] <= _cap(x["pt"])
    # Threshold: sequential use of a prefix must agree exactly (events reach the index within
    # milliseconds, speculation covers the rest); what may legitimately differ is a prefix in
    # flight twice at once (speculation predicts a hit the engine cannot give yet) - with 3
    # requests in flight and each prefix recurring every 10 requests that is rare. 0.9 leaves room
    # for a few such races and nothing systematic (a tokenizer, salt or key-layout error makes
    # every repeat disagree: agreement would fall to ~1/6 of the requests).
    assert exact / n >= 0.9, f"prediction agreement {exact}/{n}"
    assert tok_agree >= 0.9
    assert cached_total > 0.5 * prompt_total  # the workload really is warm

    # Key parity: the index holds each prefix's keys on exactly the replicas whose engine reports
    # them. Let speculative entries (TTL 2 s) lapse and the feed settle, read the index, then ask
    # each engine directly (same tokens, the tenant's derived salt) how much of it is cached.
    time.sleep(2.5)
    chain = KeyChain(system.model, 32)
    probes = {}
    for x in rows:
        k = (x["tenant"], x["doc"])
        if k in probes:
            continue
        body = next(w["body"] for w in work if (w["tenant"], w["doc"]) == k)
        ids = _gateway_ids(system, body)
        keys = chain.request_keys(ids, salt=system.salt(x["tenant"]))
        probes[k] = (body, ids, _index_match(system, keys))
    agree_sets, disagreements = 0, []
    for (tenant, doc), (body, ids, match) in probes.items():
        engine = {}
        for rid, rep in system.by_id.items():
            res = _direct(rep, {**body, "cache_salt": system.salt(tenant)})
            assert res.status == 200, res.body
            engine[rid] = res.cached
        want = {rid: min(match.get(rid, 0) * 32, _cap(len(ids))) for rid in system.by_id}
        if want == engine:
            agree_sets += 1
        else:
            disagreements.append(f"{tenant} doc {doc}: index {want} engine {engine}")
        holders_index = {rid for rid, v in want.items() if v}
        holders_engine = {rid for rid, v in engine.items() if v}
        assert holders_index == holders_engine, f"{tenant} doc {doc}: index {want} engine {engine}"
    print(f"key parity: {agree_sets}/{len(probes)} prefixes held by the same replicas, same length, in index and engine")
    for d in disagreements:
        print("  ", d)
    assert agree_sets == len(probes), disagreements

    # Measured, not asserted: bursts of one new prefix in flight 4 times at once. Speculation
    # predicts a hit for the followers that the engine can only give once the leader's prefill
    # has run; how often the two differ here is the speculative-insert effect.
    burst_rows = []
    for b in range(3):
        doc = f"Burst doc {rng.randrange(1 << 30)}: " + _text(DOC_WORDS, rng)
        bodies = [{"prompt": f"{doc}\n\nQ{q}: {_text(6, rng)}?\nA:"} for q in range(4)]
        with cf.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda bd: _via_gateway(system, "acme", bd), bodies))
        assert all(r.status == 200 for r in rs)
        burst_rows += [(r.replica, _predicted(system, r), r.cached) for r in rs]
    b_exact = sum(1 for _, p, c in burst_rows if p == c)
    b_over = sum(1 for _, p, c in burst_rows if p > c)
    print(f"bursts (3 new prefixes x 4 concurrent): prediction == engine {b_exact}/{len(burst_rows)}, "
          f"over-predicted {b_over}, replicas {sorted({r for r, _, _ in burst_rows})}: {burst_rows}")


# -- 3. tenancy ----------------------------------------------------------------------------------
def _reported_as_predicted(system, label: str, body: dict, expect) -> dict:
    """Send `body` through the gateway; assert the engine's cached tokens equal the gateway's
    prediction and satisfy `expect(cached, prompt_tokens)`; return the usage."""
    stream = body.get("stream", False)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = {"model": system.model, "max_tokens": 3, **body, **({"stream_options": {"include_usage": True}} if stream else {})}
    with httpx.stream("POST", system.url + path, json=payload, headers=system.headers("acme"), timeout=120) as r:
        out = r.read().decode()
        assert r.status_code == 200, (label, out[:300])
        request_id = r.headers["X-Request-Id"]
    usage = json.loads([ln for ln in out.splitlines() if ln.startswith("data: {")][-1][6:] if stream else out)["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    predicted = int(_server_span(system, request_id, timeout=30).attributes["warmroute.predicted_cached_tokens"])
    assert predicted == cached and expect(cached, usage["prompt_tokens"]), (label, predicted, usage)
    return usage


def test_n_batches_and_prompt_logprobs_are_predicted_as_the_engine_reports_them(vllm_replicas, e2e_system):
    """What vLLM 0.32 reports as cached is not always the first prompt's hit (routing.
    reported_cached_tokens): with `n` > 1 a whole answer reports its last child request's (every
    full block: the first child computed them), a stream its first child's; a completions batch
    answered whole reports its last prompt's (blocks the replica holds, or an earlier prompt of the
    batch computed); a request asking for prompt logprobs reads no cached block (`prompt_logprobs`,
    chat's `echo`). The gateway predicts each as reported (each fails with the first prompt's hit);
    a streamed batch, whose report no one outside the engine can know, it does not predict."""
    system, rng = e2e_system, _fresh_rng()

    def cold(c, pt):
        return c == 0

    def most(c, pt):
        return c > pt // 2

    doc = _text(120, rng)
    for route, stream in (("completions", False), ("chat", False), ("completions", True)):
        text = f"{route} with four choices, {'streamed' if stream else 'whole'}: " + doc
        body = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
        _reported_as_predicted(system, f"n=4 {route} stream={stream}", {**body, "n": 4, "temperature": 1.0, "stream": stream}, cold if stream else most)
    a, b, c = ("alpha " + _text(100, rng), "beta " + _text(100, rng), "gamma " + _text(100, rng))
    _reported_as_predicted(system, "warm-up a", {"prompt": a}, cold)
    _reported_as_predicted(system, "batch [a warm, b cold]", {"prompt": [a, b]}, cold)  # the last prompt's, b's
    # routed on its first prompt: a is warm only if that sent it to a's replica
    _reported_as_predicted(system, "batch [d cold, a]", {"prompt": ["delta " + _text(100, rng), a]}, lambda c, pt: True)
    _reported_as_predicted(system, "batch [c+x, c+y] cold", {"prompt": [c + " first question", c + " second question, longer"]},
          lambda c, pt: c > 0)  # the second found the first's blocks
    # streamed, a batch reports whichever prompt's first token came first (cold or warm: 640, 0, 0 for
    # [cold b, warm a] three times): no prediction, so the index check takes it as no evidence
    payload = {"model": system.model, "max_tokens": 3, "prompt": ["kappa " + _text(100, rng), a], "stream": True,
               "stream_options": {"include_usage": True}}
    with httpx.stream("POST", system.url + "/v1/completions", json=payload, headers=system.headers("acme"), timeout=120) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
        attrs = _server_span(system, r.headers["X-Request-Id"], timeout=30).attributes
    assert "warmroute.engine_cached_tokens" in attrs and "warmroute.predicted_cached_tokens" not in attrs, dict(attrs)
    _reported_as_predicted(system, "prompt logprobs of warm a", {"prompt": a, "prompt_logprobs": 1}, cold)
    _reported_as_predicted(system, "echo with logprobs of warm a", {"prompt": a, "echo": True, "logprobs": 1}, cold)
    chat = {"messages": [{"role": "user", "content": "epsilon " + _text(100, rng)}]}
    _reported_as_predicted(system, "warm-up chat", chat, cold)
    _reported_as_predicted(system, "chat echo (prompt logprobs 0)", {**chat, "echo": True}, cold)
    _reported_as_predicted(system, "chat again", chat, most)


def test_truncated_prompts_are_keyed_as_the_engine_truncates_them(vllm_replicas, e2e_system):
    """`truncate_prompt_tokens`: the engine keeps the last N tokens (a generative model's side), or
    the first with `truncation_side: right`, or the context less one with -1, where the gateway
    would otherwise refuse the prompt as too long; the gateway keys and predicts what is kept (the
    repeat of a truncated prompt is predicted exactly, its token count the engine's)."""
    system, rng = e2e_system, _fresh_rng()
    doc = "zeta " + _text(200, rng)
    for side in (None, "right"):
        body = {"prompt": doc, "truncate_prompt_tokens": 64, **({"truncation_side": side} if side else {})}
        first = _reported_as_predicted(system, f"truncated {side}", body, lambda c, pt: pt == 64)
        assert first["prompt_tokens"] == 64
        _reported_as_predicted(system, f"truncated {side} again", body, lambda c, pt: c > 0)
    long = "eta " + _text(4000, rng)  # over the 4,096-token context
    usage = _reported_as_predicted(system, "truncated to the context", {"prompt": long, "truncate_prompt_tokens": -1,
                                                                       "max_tokens": 1}, lambda c, pt: True)
    assert usage["prompt_tokens"] == 4095
    # the Responses API's truncation "auto" is the same cut (before, the gateway refused it: over the context)
    r_usage, _, _ = _respond(system, "acme", {"input": "theta " + _text(4000, rng), "truncation": "auto",
                                              "max_output_tokens": 1}, stream=False)
    assert r_usage["input_tokens"] == 4095


def test_tenants_never_share_blocks(vllm_replicas, e2e_system):
    system = e2e_system
    rng = _fresh_rng()
    body = {"messages": [{"role": "system", "content": _text(1300, rng)}, {"role": "user", "content": "Summarise."}]}
    a1 = _via_gateway(system, "acme", body)
    a2 = _via_gateway(system, "acme", body)
    assert a1.status == a2.status == 200
    assert a1.cached == 0 and a2.cached == _cap(a2.prompt_tokens) > 1000, (a1.usage, a2.usage)
    b1 = _via_gateway(system, "globex", body)
    assert b1.status == 200 and b1.cached == 0, b1.usage
    assert _predicted(system, b1) == 0

    # A client-sent cache_salt never reaches the engine. Warm a prompt for acme on *every* replica
    # (directly, with acme's derived salt); globex then sends it carrying acme's salt. Wherever the
    # gateway routes it, an engine that saw the client's salt would report a hit.
    acme_salt = system.salt("acme")
    for rep in vllm_replicas:
        assert _direct(rep, {**body, "cache_salt": acme_salt}).status == 200
    body2 = {"messages": [{"role": "system", "content": _text(1300, rng)}, {"role": "user", "content": "Again."}]}
    for rep in vllm_replicas:  # a second prompt, also warm everywhere for acme only
        assert _direct(rep, {**body2, "cache_salt": acme_salt}).status == 200
    b2 = _via_gateway(system, "globex", {**body2, "cache_salt": acme_salt})
    assert b2.status == 200 and b2.cached == 0, b2.usage
    b3 = _via_gateway(system, "globex", {**body, "cache_salt": acme_salt})  # globex's own blocks: hit
    assert b3.status == 200 and b3.cached in (0, _cap(b3.prompt_tokens))
    a3 = _via_gateway(system, "acme", {**body2, "cache_salt": "something-else"})  # acme's salt wins
    assert a3.status == 200 and a3.cached == _cap(a3.prompt_tokens), a3.usage
    print(f"\ntenancy: acme repeat cached {a2.cached}/{a2.prompt_tokens}; globex first 0; globex with acme's "
          f"salt on a prompt warm for acme everywhere: cached {b2.cached}; acme with a bogus client salt: {a3.cached}")


def _respond(system, tenant: str, body: dict, *, stream: bool) -> tuple[dict, str, str]:
    """(usage, request id, replica) of a Responses API request through the gateway."""
    response, request_id, replica = _response(system, tenant, body, stream=stream)
    return response["usage"], request_id, replica


def _response(system, tenant: str, body: dict, *, stream: bool) -> tuple[dict, str, str]:
    """(the response object, request id, replica) of a Responses API request through the gateway."""
    payload = {"model": system.model, "max_output_tokens": 4, "temperature": 0, "stream": stream, **body}
    with httpx.stream("POST", system.url + "/v1/responses", json=payload, headers=system.headers(tenant),
                      timeout=120) as r:
        text = r.read().decode()
        assert r.status_code == 200, text[:500]
        if stream:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
            assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed", text[-300:]
            response = events[-1]["response"]
        else:
            response = json.loads(text)
        return response, r.headers["X-Request-Id"], r.headers["X-Warmroute-Replica"]


def test_responses_api_is_tokenized_and_predicted_as_the_engine_does(vllm_replicas, e2e_system):
    """`/v1/responses` through the gateway (gateway.responses_api): for each shape of input the
    gateway's token count (its decision span) equals the engine's `input_tokens`, and a repeat,
    streamed, is predicted exactly where the engine finds it cached."""
    system, rng = e2e_system, _fresh_rng()
    tools = [{"type": "function", "name": "lookup", "description": "Look a clause up",
              "parameters": {"type": "object", "properties": {"clause": {"type": "integer"}}}}]
    bodies = [
        ("string input with instructions", {"instructions": _text(300, rng), "input": "Summarise it."}),
        ("items with text parts and a prior answer", {"input": [
            {"role": "system", "content": _text(300, rng)},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first part"},
                                                            {"type": "input_text", "text": "second part"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "an earlier answer", "annotations": []}]},
            {"role": "user", "content": "and now?"}]}),
        ("a function call, its output and tools", {"tools": tools, "input": [
            {"role": "user", "content": _text(300, rng)},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{\"clause\": 3}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "clause 3: " + _text(40, rng)}]}),
        ("a partial answer continued", {"input": [
            {"role": "user", "content": _text(300, rng)},
            {"type": "message", "role": "assistant", "id": "msg_2", "status": "incomplete",
             "content": [{"type": "output_text", "text": "The answer begins", "annotations": []}]}]}),
    ]
    gw = system.gateway
    checks, drift = gw.metrics.tokenize_checks, gw.tokenize_checker.drift

    def checked(result: str) -> float:
        return sum(checks.labels(r.name, result)._value.get() for r in vllm_replicas)

    deadline = time.monotonic() + 60
    while drift.describe()["checking"]:  # an earlier test's check still in flight
        assert time.monotonic() < deadline
        time.sleep(0.05)
    interval, drift.interval_s = drift.interval_s, 1e-6  # check every answer
    for r in vllm_replicas:
        drift.forget(r.name)
    results = ("match", "mismatch", "error")
    try:
        for name, body in bodies:
            # counted from here: an earlier test's check may have failed (a replica it restarted)
            before = {res: checked(res) for res in results}
            _responses_exact(system, name, body)
            deadline = time.monotonic() + 60
            while drift.describe()["checking"] or sum(checked(res) for res in results) == sum(before.values()):
                assert time.monotonic() < deadline, f"no tokenize check after {name}"
                time.sleep(0.05)
            # the engine's own /tokenize of the rendered chat agrees with what the gateway routed on
            after = {res: checked(res) - before[res] for res in results}
            assert drift.mismatched == {} and after["error"] == 0 and after["match"] >= 1, (name, after, drift.describe())
    finally:
        drift.interval_s = interval


def _responses_exact(system, name: str, body: dict) -> None:
    """One body, answered whole then streamed: token count, then prediction, exact."""
    usage, request_id, _ = _respond(system, "acme", body, stream=False)
    server = _server_span(system, request_id, timeout=30)
    route = next(s for s in system.exporter.get_finished_spans()
                 if s.name == "warmroute.route" and s.context.trace_id == server.context.trace_id)
    assert route.attributes["warmroute.prompt_tokens"] == usage["input_tokens"], (name, usage)
    usage2, request_id2, _ = _respond(system, "acme", body, stream=True)
    cached = usage2["input_tokens_details"]["cached_tokens"]
    try:
        predicted = int(_server_span(system, request_id2, timeout=30).attributes["warmroute.predicted_cached_tokens"])
    except AssertionError as e:  # say how the gateway ended it (a 499, an unfinished span...)
        m = httpx.get(system.admin_url + "/metrics").text
        spans = [(x.name, dict(x.attributes)) for x in system.exporter.get_finished_spans()
                 if x.attributes.get("warmroute.request_id") == request_id2]
        counts = [ln for ln in m.splitlines() if "responses" in ln and "requests_total" in ln]
        raise AssertionError(f"{e}; its spans: {spans}; {counts}") from None
    assert predicted == cached and cached > 0, (name, predicted, usage2)
    print(f"\nresponses {name}: {usage['input_tokens']} tokens, repeat cached {cached} (predicted {predicted})")


def _routed_once_indexed(system, tenant: str, body: dict, blocks: int) -> dict:
    """The gateway's decision for `body` (POST /debug/route), once its candidate's index holds
    `blocks` of its prefix (the engine's KV events of the turn before)."""
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(system.admin_url + "/debug/route", params={"tenant": tenant, "kind": "responses"},
                       json={"model": system.model, **body}, timeout=30)
        assert r.status_code == 200, r.text
        d = r.json()
        if d["replicas"][0]["matched_blocks_gpu"] >= blocks or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def _follow_exactly(system, home: str, prev: dict, body: dict, *, stream: bool, label: str) -> dict:
    """A follow-up to `prev` through the gateway: on `home`, its tokens the engine's, its cached
    tokens predicted exactly (the stored history rendered as the engine renders it)."""
    body = {**body, "previous_response_id": prev["id"]}
    routed = _routed_once_indexed(system, "acme", body, prev["usage"]["input_tokens"] // system.gateway.model.block_size)
    assert [v["replica_id"] for v in routed["replicas"]] == [home]  # only its replica holds the history
    resp, request_id, replica = _response(system, "acme", body, stream=stream)
    usage = resp["usage"]
    assert replica == home and usage["input_tokens"] == routed["request"]["prompt_tokens"], (label, usage)
    predicted = int(_server_span(system, request_id, timeout=30).attributes["warmroute.predicted_cached_tokens"])
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert predicted == cached > 0, (label, predicted, usage)
    print(f"\nstored responses {label}: {usage['input_tokens']} tokens, cached {cached} (predicted {predicted})")
    return resp


def test_stored_responses_follow_their_replica_and_are_predicted_as_the_engine_renders_them(vllm_replicas, e2e_system):
    """The engines store Responses (VLLM_ENABLE_RESPONSES_API_STORE=1): a conversation carried on
    with `previous_response_id` stays on its replica, and each turn, its stored history rendered by
    the gateway as vLLM renders it, is tokenized and predicted exactly; a background response is
    polled by id on its replica and followed likewise; another tenant is told it does not exist."""
    system, rng = e2e_system, _fresh_rng()
    instructions = "You answer questions on this report. " + _text(200, rng)
    first, _, home = _response(system, "acme", {"instructions": instructions, "input": "What is it about?"}, stream=False)
    prev = first
    for n, stream in enumerate((True, False, True)):
        prev = _follow_exactly(system, home, prev, {"instructions": instructions, "input": f"And part {n}? " + _text(20, rng)},
                               stream=stream, label=f"turn {n + 1}")
    r = httpx.get(system.url + f"/v1/responses/{prev['id']}", headers=system.headers("acme"), timeout=30)
    assert r.status_code == 200 and r.headers["X-Warmroute-Replica"] == home and r.json()["output"] == prev["output"]
    r = httpx.get(system.url + f"/v1/responses/{prev['id']}", headers=system.headers("globex"), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"

    held = _figure(system, "warmroute_gateway_stored_responses_total", event="background_held")
    queued, _, bg_home = _response(system, "acme", {"instructions": instructions, "background": True,
                                                    "input": "In the background: " + _text(30, rng)}, stream=False)
    assert queued["status"] in ("queued", "in_progress"), queued["status"]
    deadline = time.monotonic() + 120
    while True:  # polled by id, on its replica
        r = httpx.get(system.url + f"/v1/responses/{queued['id']}", headers=system.headers("acme"), timeout=30)
        assert r.status_code == 200 and r.headers["X-Warmroute-Replica"] == bg_home, r.text[:300]
        done = r.json()
        if done["status"] not in ("queued", "in_progress"):  # completed, or incomplete at max_output_tokens
            assert done["status"] in ("completed", "incomplete") and done["output"], done
            break
        assert time.monotonic() < deadline, done["status"]
        time.sleep(0.2)
    _follow_exactly(system, bg_home, done, {"instructions": instructions, "input": "And after that?"}, stream=True,
                    label="after a background response")
    # the gateway held the tenant's slot and the replica's count until the engine said it was done
    assert _figure(system, "warmroute_gateway_stored_responses_total", event="background_held") == held + 1
    deadline = time.monotonic() + 10
    while _figure(system, "warmroute_gateway_background_responses_held") > 0:
        assert time.monotonic() < deadline, "the background response's holds were never released"
        time.sleep(0.2)


def _figure(system, name: str, **labels) -> float:
    """A figure of the gateway's /metrics (its samples with `labels`, summed)."""
    return metric_sum(httpx.get(system.admin_url + "/metrics", timeout=10).text, name, **labels)


# -- 4. routing ----------------------------------------------------------------------------------
def _hold(rep, n: int, prompt_words: int, max_tokens: int, rng: random.Random) -> list[cf.Future]:
    """n long-running requests sent directly to one replica (bypassing the gateway)."""
    pool = cf.ThreadPoolExecutor(n)
    futs = [pool.submit(_direct, rep, {"prompt": _text(prompt_words, rng), "max_tokens": max_tokens,
                                       "ignore_eos": True}, timeout=600) for _ in range(n)]
    pool.shutdown(wait=False)
    return futs


def _load_report(system, rid: str):
    return system.call(system.gateway.index.last_load, rid)


def test_routing_sticks_then_spills_under_queue(vllm_replicas, e2e_system):
    system = e2e_system
    rng = _fresh_rng()
    doc = f"Routing doc {rng.randrange(1 << 30)}: " + _text(520, rng)
    body = lambda q: {"prompt": f"{doc}\n\nQ{q}: {_text(8, rng)}?\nA:"}  # noqa: E731
    first = _via_gateway(system, "acme", body(0))
    assert first.status == 200
    warm = first.replica
    cold = next(rid for rid in system.by_id if rid != warm)
    homes = []
    for q in range(1, 5):
        r = _via_gateway(system, "acme", body(q))
        assert r.status == 200
        homes.append(r.replica)
        assert r.cached == _cap(len(system.gateway.tokenizer.encode_prompt(body(q)["prompt"]))) or r.cached > 0
    assert homes == [warm] * 4, f"repeated document left its replica: first {warm}, then {homes}"

    # Build a real queue on the warm replica: long requests sent to it directly (the gateway only
    # learns of them through the agent's /metrics scrape: running and waiting counts). The engines
    # run with --max-num-seqs MAX_NUM_SEQS (8), so 24 held requests leave ~16 waiting for a slot,
    # each of which must wait for running requests to finish their 1200 tokens: seconds of queue.
    # 24 short prompts x 1200 forced output tokens (with 18, a busy machine admitted them so slowly
    # that the agent never saw more than 5 waiting at once). On a quiet machine 250 tokens finished before
    # the agent's 0.25 s scrapes ever saw the queue (CI flake), so the requests are long; the 8
    # running ones take ~43 blocks each (344 + the document's 17 of 512), so the document is
    # cached while the first eight run. The decision needs both at once: the queue in the agent's
    # report and the document in the warm replica's cache. Neither is the gateway's doing, and in
    # CI each went missing (two failures in five full runs, 2026-12-04): the reports arrived only
    # once the queue was down to 3-4 (the first eight finished before a report showed them, the
    # engine's /metrics slow under load), or the second eight's blocks had evicted the document
    # (the LRU takes it first: it was freed before any held request's blocks). So the scenario is
    # set up again, at most three times, when either precondition is missing at the decision; what
    # the decision must be is asserted below without retry.
    ids = system.gateway.tokenizer.encode_prompt(body(98)["prompt"])
    keys = KeyChain(system.model, 32).request_keys(ids, salt=system.salt("acme"))
    missed = []  # why each set-up that did not reach a decision was abandoned
    for attempt in range(3):
        if attempt:  # the held requests are done: the document back in a cache (where it lands is the new warm)
            again = _via_gateway(system, "acme", body(50 + attempt))
            assert again.status == 200
            warm = again.replica
            cold = next(rid for rid in system.by_id if rid != warm)
        futs = _hold(system.by_id[warm], 24, 100, 1200, rng)
        try:
            seen = []  # (running, waiting) of the reports read, for the failure message

            def full_with_queue():
                lr = _load_report(system, warm)
                if lr is not None and (not seen or seen[-1] != (lr.running_reqs, lr.waiting_reqs)):
                    seen.append((lr.running_reqs, lr.waiting_reqs))
                return lr is not None and lr.running_reqs >= MAX_NUM_SEQS and lr.waiting_reqs >= 6 and lr

            try:
                rep = _wait(full_with_queue, 60, f"the agent to report a full replica with a queue on {warm}")
            except AssertionError as exc:
                shown = seen if len(seen) <= 40 else seen[:20] + ["..."] + seen[-20:]
                missed.append(f"attempt {attempt}: {exc}; (running, waiting) reported: {shown}")
                continue
            # what the index held just before the decision, and the agent's state
            held = _index_match(system, keys)
            before = f"index before the decision {held}; agent {system.agents[warm].stats}"
            if not held.get(warm):
                missed.append(f"attempt {attempt}: the document was evicted from {warm} before the queue was seen ({before})")
                continue
            res = _via_gateway(system, "acme", body(99), timeout=600)
            assert res.status == 200
            span = _server_span(system, res.request_id)
            dec = _decision_of(system, span)
            w, c = dec[warm], dec[cold]
            if not w["warmroute.matched_blocks_gpu"] > 0:
                missed.append(f"attempt {attempt}: the document was evicted from {warm} at the decision ({before})")
                continue
            break
        finally:
            for f in futs:
                f.result(timeout=600)
    else:
        raise AssertionError("the warm replica never had a reported queue and the document at once: " + " | ".join(missed))
    if missed:
        print("\nrouting: set-ups abandoned before the decision: " + " | ".join(missed))
    benefit = w.get("warmroute.term.cache_benefit_s", 0.0)
    penalty = w.get("warmroute.term.queue_penalty_s", 0.0)
    print(f"\nrouting: load report on {warm}: running {rep.running_reqs} waiting {rep.waiting_reqs}; "
          f"decision: warm {warm} matched {w['warmroute.matched_blocks_gpu']} blocks, benefit {benefit:.4f} s, "
          f"queue penalty {penalty:.4f} s (slot wait {w.get('warmroute.term.slot_wait_s', 0.0):.4f} s), "
          f"score {w.get('warmroute.score')}; cold {cold} score {c.get('warmroute.score')} "
          f"penalty {c.get('warmroute.term.queue_penalty_s', 0.0):.4f} s; chose {res.replica}")
    print("routing: warm terms " + ", ".join(f"{k.split('.')[-1]}={v:.4g}" for k, v in sorted(w.items())
                                           if k.startswith("warmroute.term.")))
    assert w.get("warmroute.rank") is not None, f"the warm replica was not eligible (health/ejection): {w}"
    # the decision saw the queue the engine has: slots full, requests waiting for a completion
    assert w["warmroute.term.slots_full"] == 1.0, "the warm replica's full slots were not seen"
    # the cold replica wins on the price of the queue, whatever the balance guard does (it may
    # fire: this gateway routed the document's requests there, so its routed rate is above the
    # mean, or not, when earlier tests spread traffic): without the guard's penalty the warm
    # replica still scores lower, because the wait for completions outweighs everything the
    # cache saves (the prefill now, w_cache x benefit, and later, the eviction the cold replica
    # pays for it). The gateway prices those completions with the mean max_tokens of requests
    # *it* sent (the held ones bypassed it), so the slot wait is a lower bound of the real one.
    assert w["warmroute.term.slot_wait_s"] > 0.0 and penalty >= w["warmroute.term.slot_wait_s"]
    unguarded = lambda t: t["warmroute.score"] + t.get("warmroute.term.balance_penalty_s", 0.0)  # noqa: E731
    assert unguarded(w) < unguarded(c), "the queue alone should send the request to the cold replica"
    pol = system.gateway.policy
    credit = pol.w_cache * benefit + pol.w_evict * (c.get("warmroute.term.evict_penalty_s", 0.0)
                                                     - w.get("warmroute.term.evict_penalty_s", 0.0))
    assert pol.w_queue * (penalty - c.get("warmroute.term.queue_penalty_s", 0.0)) > credit, \
        f"queue {penalty:.4f} s should outweigh the cache credit {credit:.4f} s"
    assert w["warmroute.score"] < c["warmroute.score"]
    assert res.replica == cold, "a queue waiting for sequence slots should outweigh ~600 cached tokens"


# -- 5. start-up failure is loud -----------------------------------------------------------------
def test_engine_start_failure_raises_with_log_tail(vllm_replicas, tiny_model_dir, tmp_path):
    """An engine that cannot start raises ReplicaStartError carrying its log tail (the fixtures
    turn that into a failure, never a skip). Uses a flag vLLM rejects: it exits after its imports."""
    t0 = time.perf_counter()
    with pytest.raises(ReplicaStartError) as ei:
        start_replicas(1, tiny_model_dir, log_dir=tmp_path, extra_args=["--no-such-engine-flag"], timeout=180)
    msg = str(ei.value)
    print(f"\nstart failure reported after {time.perf_counter() - t0:.1f} s")
    assert "exited with code" in msg and "no-such-engine-flag" in msg, msg[-2000:]


# -- 6. recovery (LAST: restarts a replica, ~50 s) -----------------------------------------------
def test_recovery_after_replica_restart(vllm_replicas, e2e_system):
    system = e2e_system
    gw = system.gateway
    rng = _fresh_rng()
    doc = f"Recovery doc {rng.randrange(1 << 30)}: " + _text(520, rng)
    body = lambda q: {"prompt": f"{doc}\n\nQ{q}: {_text(6, rng)}?\nA:"}  # noqa: E731
    r = _via_gateway(system, "acme", body(0))
    assert r.status == 200
    victim_id = r.replica
    victim = system.by_id[victim_id]
    agent = system.agents[victim_id]
    other = next(rid for rid in system.by_id if rid != victim_id)
    r2 = _via_gateway(system, "acme", body(1))
    assert r2.replica == victim_id and r2.cached > 0
    ids = gw.tokenizer.encode_prompt(body(0)["prompt"])
    keys = KeyChain(system.model, 32).request_keys(ids, salt=system.salt("acme"))
    time.sleep(2.5)  # speculative entries lapse: what remains is from the feed
    assert _index_match(system, keys).get(victim_id, 0) > 0
    resyncs0 = agent.stream.seq.stats.resyncs
    restarts0 = agent.stream.seq.stats.restarts

    victim.kill()
    t_kill = time.perf_counter()
    # While it is down: requests succeed on the other replica (retry before the first byte).
    down = [_via_gateway(system, "acme", body(10 + i)) for i in range(3)]
    assert all(x.status == 200 and x.replica == other for x in down), [(x.status, x.replica) for x in down]
    # Down for a while: the agent's scrapes fail, so the replica's feed goes silent and the index
    # stops counting its entries (stale_after_s).
    _wait(lambda: not system.call(gw.index.is_live, victim_id), 30, "the index to mark the dead replica not live")
    assert _index_match(system, keys).get(victim_id, 0) == 0
    victim.start()
    t_up = time.perf_counter()
    _wait(lambda: gw.membership.get(victim_id).available(gw.membership.clock()), 30, "the gateway to see the replica healthy")
    _wait(lambda: system.call(gw.index.is_live, victim_id), 30, "the replica's feed to be live again")
    time.sleep(1.0)  # a few load scrapes of the new engine
    # What the gateway believes about the restarted (empty) engine before it has sent any KV event.
    # (The agent sees the restart in /metrics: its counters went back to 0; before that fix the
    # index kept the old engine's 17 blocks here until the new engine's first KV batch.)
    stale_blocks = _index_match(system, keys).get(victim_id, 0)
    print(f"\nrecovery: stale blocks of the old prefix on the restarted {victim_id} before its first event: "
          f"{stale_blocks}; agent resyncs {agent.stats.engine_resyncs}, from /metrics {agent.stats.metrics_restarts}")
    assert stale_blocks == 0 and agent.stats.metrics_restarts >= 1

    # New traffic on the restarted replica: its first KV batch has seq 0 -> the agent resyncs.
    # (Sent directly so it surely lands there; a gateway request may go to the warm other replica.)
    fresh = {"prompt": f"Warm-up {rng.randrange(1 << 30)}: " + _text(200, rng)}
    assert _direct(victim, fresh).status == 200
    _wait(lambda: agent.stream.seq.stats.restarts > restarts0, 30, "the agent to notice the seq reset")
    assert agent.stream.seq.stats.resyncs > resyncs0
    assert agent.healthy()
    print(f"\nrecovery: restart took {t_up - t_kill:.0f} s; agent resync reason: {agent.stats.last_resync_reason!r}; "
          f"index blocks of the old prefix on {victim_id} after restart, before its first event: {stale_blocks}")
    _wait(lambda: _index_match(system, keys).get(victim_id, 0) == 0, 10, "the gateway to drop the restarted replica's entries")

    # ~10 requests after restart: all succeed; the replica relearns from new traffic.
    results = [_via_gateway(system, t, body(100 + i)) for i, t in zip(range(10), TENANTS * 5)]
    assert all(x.status == 200 for x in results), [(x.status, x.body) for x in results if x.status != 200]
    for x in results:
        assert _predicted(system, x) == x.cached or x.cached == 0, (x.replica, _predicted(system, x), x.cached)
    # Relearning: a prompt served by the restarted replica appears in the index again from its events.
    relearn = {"prompt": f"Relearn {rng.randrange(1 << 30)}: " + _text(200, rng)}
    assert _direct(victim, relearn).status == 200
    rk = KeyChain(system.model, 32).request_keys(gw.tokenizer.encode_prompt(relearn["prompt"]), salt=None)
    _wait(lambda: _index_match(system, rk).get(victim_id, 0) == len(rk), 10, "the index to relearn the restarted replica")
    print(f"recovery: {len(results)}/{len(results)} requests after restart succeeded, replicas "
          f"{sorted({x.replica for x in results})}")
