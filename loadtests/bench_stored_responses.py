"""What a stored response's follow-up costs the gateway (a benchmark, not a test).

    python -m loadtests.bench_stored_responses [--turns 4,16,64] [--conversations 20] [--repeat 3]

A follow-up (`previous_response_id`, gateway.stored_responses) is planned like any request once
its history is put in; what it adds is finding that history: the chain of records walked from the
process's memory, or read from Redis in one script when another gateway process wrote it, and,
for the answer of each stored response, the record's writes. Side by side in one process, over
the same conversations (each turn ~60 words in, ~40 words answered), against a private
redis-server, per request, CPU (time.process_time) and wall microseconds:
  whole         the conversation sent whole in `input` (what a client without the store sends):
                parse and tokenize, the baseline
  in memory     parse, the history from this process's records, tokenize
  from Redis    parse, the history read from Redis by a process that holds none of it, tokenize
  writes        the record of one response and its answer, written to Redis (awaited)
Each row's ratio is to `whole` at the same length, measured interleaved in one run (the machine
may be shared: the absolute figures move with its load, the ratios much less).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from gateway.context import RESPONSES
from gateway.encode import tokenize
from gateway.parse import parse_request
from gateway.responses_api import with_history
from gateway.stored_responses import StoredResponses, Turn
from gateway.tokenization import TokenizerService
from loadtests.processes import private_redis
from replica_agent.feed import open_feed, stored_turn_board

WORDS = ("lease rent clause tenant landlord deposit repair notice term renewal payment late fee pet parking "
         "utility inspection damage insurance sublet quiet enjoyment access keys move out").split()
INSTRUCTIONS = "You answer questions on the lease, briefly."


def _text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversation(turns: int, rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) per turn."""
    return [(f"Question {i}: " + _text(60, rng) + "?", f"Answer {i}: " + _text(40, rng) + ".") for i in range(turns)]


def _whole_body(conv: list[tuple[str, str]]) -> dict:
    """The last turn sent with its history in `input`."""
    items: list[dict] = []
    for q, a in conv[:-1]:
        items += [{"role": "user", "content": q},
                  {"type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": a, "annotations": []}]}]
    items.append({"role": "user", "content": conv[-1][0]})
    return {"model": "m", "instructions": INSTRUCTIONS, "input": items}


async def _recorded(store: StoredResponses, conv: list[tuple[str, str]]) -> str:
    """Every turn but the last recorded and answered; the id the last one follows."""
    prev = None
    for q, a in conv[:-1]:
        rid = store.new_id()
        await store.record(rid, Turn("r0", "tenant", prev, [{"role": "user", "content": q}]))
        store.answered(rid, {"status": "completed", "output": [{"type": "message", "content": [{"type": "output_text",
                                                                                                 "text": a}]}]})
        prev = rid
    await asyncio.gather(*store._writes)  # noqa: SLF001 - the answers' background writes, done before timing
    return prev


async def _plan(tok: TokenizerService, body: dict, store: StoredResponses | None) -> int:
    req = parse_request(RESPONSES, body, "m", stored_responses=store is not None)
    if store is not None:
        _, history = await store.history(req.previous_response_id, "tenant")
        req = with_history(req, body, history)
    prompt = await tokenize(tok, req, inline_max_chars=8192, max_model_len=None)
    return prompt.total_tokens


async def _timed(fn) -> tuple[float, float, object]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = await fn()
    return (time.process_time() - c0) * 1e6, (time.perf_counter() - w0) * 1e6, out


async def _run(url: str, args) -> list[tuple]:
    rng = random.Random(args.seed)
    tok = TokenizerService()
    rows = []
    feed = open_feed(url)
    board = stored_turn_board(feed, ttl_s=3600)
    try:
        for turns in args.turns:
            convs = [_conversation(turns, rng) for _ in range(args.conversations)]
            writer = StoredResponses(board, _no_fetch, max_turns=1_000_000)
            prevs = [await _recorded(writer, c) for c in convs]
            follow = [{"model": "m", "instructions": INSTRUCTIONS, "previous_response_id": p, "input": c[-1][0]}
                      for p, c in zip(prevs, convs)]
            whole = [_whole_body(c) for c in convs]
            got: dict[str, list[tuple[float, float]]] = {k: [] for k in ("whole", "in memory", "from Redis", "writes")}
            for _ in range(args.repeat):  # interleaved: each variant once per conversation, in turn
                for i in range(len(convs)):
                    c, w, n_whole = await _timed(lambda: _plan(tok, dict(whole[i]), None))
                    got["whole"].append((c, w))
                    c, w, n_mem = await _timed(lambda: _plan(tok, dict(follow[i]), writer))
                    got["in memory"].append((c, w))
                    reader = StoredResponses(board, _no_fetch, max_turns=1_000_000)  # holds none of it
                    c, w, n_redis = await _timed(lambda: _plan(tok, dict(follow[i]), reader))
                    got["from Redis"].append((c, w))
                    assert n_whole == n_mem == n_redis, (n_whole, n_mem, n_redis)  # the same prompt, three ways
                    c, w, _ = await _timed(lambda: _write_one(writer, prevs[i]))
                    got["writes"].append((c, w))
            base_c = statistics.median(c for c, _ in got["whole"])
            base_w = statistics.median(w for _, w in got["whole"])
            for label, xs in got.items():
                cpu, wall = statistics.median(c for c, _ in xs), statistics.median(w for _, w in xs)
                rows.append((turns, n_whole, label, cpu, wall, cpu / base_c, wall / base_w))
    finally:
        await feed.close()
        tok.close()
    return rows


async def _write_one(store: StoredResponses, prev: str) -> None:
    rid = store.new_id()
    await store.record(rid, Turn("r0", "tenant", prev, [{"role": "user", "content": "one more"}]))
    store.answered(rid, {"status": "completed", "output": [{"type": "message", "content": [{"type": "output_text",
                                                                                             "text": "done"}]}]})
    await asyncio.gather(*store._writes)  # noqa: SLF001


async def _no_fetch(replica_id: str, response_id: str):
    raise AssertionError("every answer is recorded here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_stored_responses", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", default="4,16,64", help="turns per conversation, comma-separated (default 4,16,64)")
    p.add_argument("--conversations", type=int, default=20, help="conversations per length (default 20)")
    p.add_argument("--repeat", type=int, default=3, help="passes over them (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the conversations' text (default 0)")
    args = p.parse_args(argv)
    args.turns = [int(t) for t in args.turns.split(",") if t]
    with private_redis("wr-bench-stored-") as url:
        rows = asyncio.run(_run(url, args))
    print("| turns | prompt tokens | request | CPU-us | wall-us | CPU / whole | wall / whole |\n|---|---|---|---|---|---|---|")
    for turns, n, label, cpu, wall, rc, rw in rows:
        print(f"| {turns} | {n} | {label} | {cpu:.0f} | {wall:.0f} | {rc:.2f} | {rw:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
