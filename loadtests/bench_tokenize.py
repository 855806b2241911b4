"""Benchmark: request body (JSON bytes) -> token ids -> block keys. Not a test; prints a table.

    taskset -c 1 python -m loadtests.bench_tokenize [--quick]

Compares, interleaved in one process on the same requests:
  warmroute   json.loads + TokenizerService.encode_chat / encode_prompt + KeyChain.request_keys
  tiktoken    json.loads + the same template rendering + raw tiktoken.encode(allowed_special="all")
              + keys: the fastest exact tokenizer, no cache (the floor for first-seen text)
  hf          json.loads + plain AutoTokenizer.apply_chat_template(tokenize=True) / __call__ + keys

Cases per size (1k, 8k, 32k prompt tokens):
  chat repeated-doc   the same long system document with a new short question each time (warm)
  chat first-seen     a document never seen before, every request
  completion first-seen
Goals: repeated 8k chat < 2 ms p50 on one core; first-seen within 1.5x of raw tiktoken.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which not have but all "
    "router cache block replica prefix token engine latency throughput request queue tenant salt index "
    "def return class import self None True False if else for while yield async await lambda "
    "naïve café résumé 数据 模型 缓存 число данные 😀 ✓ → ≥"
).split()
PUNCT = [" ", " ", " ", " ", " ", ", ", ". ", "\n", "\n\n", "    ", ": ", "(", ") ", " = ", " 42 ", " 3.14 ", " 2026 "]


def make_doc(rng: random.Random, n_tokens: int, count) -> str:
    parts: list[str] = []
    text = ""
    while True:
        for _ in range(512):
            parts.append(rng.choice(WORDS))
            parts.append(rng.choice(PUNCT))
        text = "".join(parts)
        if count(text) >= n_tokens:
            break
    # trim to about n_tokens by proportion
    n = count(text)
    return text[: max(1, int(len(text) * n_tokens / n))]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from gateway.tokenization import TokenizerService
    from hashing.keys import KeyChain

    svc = TokenizerService()
    if svc.backend_name != "tiktoken":
        raise SystemExit(f"expected the tiktoken backend, got {svc.backend_name}")
    hf = AutoTokenizer.from_pretrained(str(svc.tokenizer_dir))
    enc = svc._tt  # the same tiktoken Encoding, used raw
    kc = KeyChain("m", args.block_size)
    count = lambda t: len(enc.encode_ordinary(t))  # noqa: E731
    rng = random.Random(7)

    def run_warmroute(body: bytes) -> list:
        req = json.loads(body)
        if "messages" in req:
            ids = svc.encode_chat(req["messages"], add_generation_prompt=req.get("add_generation_prompt", True))
        else:
            ids = svc.encode_prompt(req["prompt"])
        return kc.request_keys(ids)

    def run_tiktoken(body: bytes) -> list:
        req = json.loads(body)
        if "messages" in req:
            text = hf.apply_chat_template(req["messages"], add_generation_prompt=True, tokenize=False)
        else:
            text = req["prompt"]
        return kc.request_keys(enc.encode(text, allowed_special="all"))

    def run_hf(body: bytes) -> list:
        req = json.loads(body)
        if "messages" in req:
            ids = hf.apply_chat_template(req["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = hf(req["prompt"], add_special_tokens=True)["input_ids"]
        return kc.request_keys(ids)

    methods = [("warmroute", run_warmroute), ("tiktoken", run_tiktoken), ("hf", run_hf)]
    sizes = [(1024, 300), (8192, 120), (32768, 40)]
    if args.quick:
        sizes = [(n, max(10, it // 4)) for n, it in sizes]

    rows = []
    for n_tokens, iters in sizes:
        shared_doc = make_doc(rng, n_tokens, count)
        fresh_docs = [make_doc(random.Random(1000 * n_tokens + i), n_tokens, count) for i in range(iters)]
        question = lambda i: f"Question {i}: what does section {rng.randint(1, 99)} say about routing?"  # noqa: E731
        cases = {
            "chat repeated-doc": [
                json.dumps({"model": "m", "messages": [{"role": "system", "content": shared_doc},
                                                       {"role": "user", "content": question(i)}]}).encode()
                for i in range(iters)
            ],
            "chat first-seen": [
                json.dumps({"model": "m", "messages": [{"role": "system", "content": d},
                                                       {"role": "user", "content": question(i)}]}).encode()
                for i, d in enumerate(fresh_docs)
            ],
            "completion first-seen": [
                json.dumps({"model": "m", "prompt": d + f" {i}"}).encode() for i, d in enumerate(fresh_docs)
            ],
        }
        # warm the repeated document once (its first sight is the first-seen case)
        run_warmroute(json.dumps({"model": "m", "messages": [{"role": "system", "content": shared_doc},
                                                             {"role": "user", "content": "warm-up"}]}).encode())
        for case, bodies in cases.items():
            # correctness guard: all three agree on every body
            for b in bodies[:3]:
                svc.segment_cache.clear() if case != "chat repeated-doc" else None
                assert run_warmroute(b) == run_tiktoken(b) == run_hf(b), case
            if case != "chat repeated-doc":
                svc.segment_cache.clear()
            times: dict[str, list[float]] = {m: [] for m, _ in methods}
            n_prompt = len(svc.encode_chat(json.loads(bodies[0])["messages"])) if "chat" in case else len(
                svc.encode_prompt(json.loads(bodies[0])["prompt"]))
            if case != "chat repeated-doc":
                svc.segment_cache.clear()
            gc.collect()
            for i, body in enumerate(bodies):
                order = methods if i % 2 == 0 else methods[::-1]  # interleave, alternate order
                for name, fn in order:
                    t0 = time.perf_counter()
                    fn(body)
                    times[name].append(time.perf_counter() - t0)
            p50 = {m: statistics.median(ts) * 1e3 for m, ts in times.items()}
            for m, ts in times.items():
                rows.append((n_tokens, n_prompt, case, m, p50[m], pct(ts, 99) * 1e3,
                             p50["hf"] / p50[m], p50[m] / p50["tiktoken"]))

    print(f"\nrequest body -> block keys (KeyChain block {args.block_size}); backend={svc.backend_name}; "
          f"times in ms; {'quick' if args.quick else 'full'} run")
    hdr = f"{'size':>6} {'tokens':>7}  {'case':<22} {'method':<10} {'p50':>8} {'p99':>8} {'vs hf':>7} {'/tiktoken':>9}"
    print(hdr)
    print("-" * len(hdr))
    last = None
    for n, nt, case, m, p50, p99, vs_hf, vs_tt in rows:
        if last is not None and (n, case) != last:
            print()
        last = (n, case)
        print(f"{n:>6} {nt:>7}  {case:<22} {m:<10} {p50:>8.3f} {p99:>8.3f} {vs_hf:>6.1f}x {vs_tt:>8.2f}x")
    c = svc.segment_cache
    print(f"\nsegment cache: {len(c)} entries, {c.bytes / 2**20:.1f} MiB, hits {c.hits}, misses {c.misses}")
    svc.close()


if __name__ == "__main__":
    main()
