"""Conversations about images benchmark (not a test): the same pool and the same conversations,
with the gateway's keys for a chat's blocks past its first image (`feed.media_history_ttl_s`,
hashing.history_keys) and without them (0: each turn routed by the text before the image alone),
side by side in one run.

Each conversation sends an image with its first question, then `--turns` - 1 follow-ups, each
with the whole history (the image, the earlier questions and the answers), a turn sent
`--think-s` after the previous one's answer; conversations start as Poisson arrivals at
`--rate`. With `--images K` the conversations share K images, the first K times as likely as the
K-th (a catalogue's popular pictures), each asked about with a question of its own. The sims are
multi-modal (an image is a placeholder keyed by its content, as vLLM's processor and prefix cache
key it) and expand each image into `--image-tokens` tokens, as a vision model's processor does.
Everything runs embedded in this process (loadtests/harness.py: sims on the wall-clock time
model, their agents, the gateway, the load), each variant from cold caches, `--rounds` times,
alternating which goes first. Reported per variant: TTFT and end-to-end
p50 / p99 of the follow-ups, of the first turns and of every turn, the cached share of the prompt
tokens (all turns, and the first turns'), and how many follow-ups went to the replica of their
conversation's previous turn.

Run:  python -m loadtests.bench_media [--conversations 48] [--turns 4] [--rate 1.5] [--images K] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from loadtests.harness import EmbeddedSystem, SystemSpec
from loadtests.runner import BenchRequest, run_interruptible, run_load, summarize

MODEL = "media-bench"


def stream(args) -> list[BenchRequest]:
    """The conversations both variants get (deterministic for `--seed`): one request per turn, each
    after its previous turn (`after`), tagged "c<conversation>t<turn>"."""
    rng = random.Random(args.seed)
    out: list[BenchRequest] = []
    t = 0.0
    shared = [_image(rng) for _ in range(args.images)]
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        image = rng.choices(shared, weights=[1 / (i + 1) for i in range(len(shared))])[0] if shared else _image(rng)
        history = [{"role": "system", "content": "You describe photographs for a catalogue, briefly."}]
        prev = -1
        for k in range(args.turns):
            words = " ".join(f"w{rng.randrange(100_000)}" for _ in range(args.question_words))
            question = {"type": "text", "text": f"Question {k}: {words}"}
            history = history + [{"role": "user", "content": [question, image] if k == 0 else [question]}]
            out.append(BenchRequest(t + k * args.think_s, "/v1/chat/completions",
                                    {"model": MODEL, "messages": history, "max_tokens": args.output_tokens,
                                     "ignore_eos": True}, tag=f"c{c}t{k}", after=prev))
            prev = len(out) - 1
            answer = " ".join(f"a{rng.randrange(100_000)}" for _ in range(args.output_tokens // 2))
            history = history + [{"role": "assistant", "content": answer}]
    return out


def _image(rng: random.Random) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{rng.getrandbits(128):032x}"}}


async def run_variant(args, ttl_s: float, reqs: list[BenchRequest]) -> dict:
    spec = SystemSpec(replicas=args.replicas, policy=args.policy, model=MODEL, num_blocks=args.num_blocks,
                      max_num_seqs=args.max_num_seqs, auth=False, media_tokens=args.image_tokens,
                      media_history_ttl_s=ttl_s)
    async with EmbeddedSystem(spec) as system:
        samples, wall = await run_load(system.urls, reqs, timeout_s=args.timeout)
    follow = [i for i, r in enumerate(reqs) if r.after >= 0]  # samples are in request order
    out = {"media_history_ttl_s": ttl_s, **summarize(samples, wall)}
    part = summarize([samples[i] for i in follow], wall)
    first = summarize([s for s, r in zip(samples, reqs) if r.after < 0], wall)
    out.update(first_turn_ttft_ms=first["ttft_ms"], first_turn_hit_ratio=first["hit_ratio"],
               follow_up_ttft_ms=part["ttft_ms"], follow_up_e2e_ms=part["e2e_ms"], follow_ups=len(follow) - part["errors"],
               follow_ups_back_home=sum(1 for i in follow if samples[i].ok and samples[reqs[i].after].ok
                                        and samples[i].replica == samples[reqs[i].after].replica))
    return out


def _row(r: dict) -> str:
    def pair(ms: dict) -> str:
        return f"{ms.get('p50', float('nan')):,.0f} / {ms.get('p99', float('nan')):,.0f}"
    return (f"| {r['media_history_ttl_s']:g} | {pair(r['follow_up_ttft_ms'])} | {pair(r['first_turn_ttft_ms'])} | "
            f"{pair(r['ttft_ms'])} | {r['hit_ratio']:.3f} ({r['first_turn_hit_ratio']:.3f}) | "
            f"{r['follow_ups_back_home']} of {r['follow_ups']} | {r['errors']} |")


async def main_async(args) -> dict:
    reqs = stream(args)
    variants = (args.ttl_s, 0.0)
    runs: dict[str, list[dict]] = {str(v): [] for v in variants}
    for rnd in range(args.rounds):
        for ttl in (variants if rnd % 2 == 0 else variants[::-1]):
            print(f"round {rnd}, media_history_ttl_s {ttl:g}: {len(reqs)} requests", file=sys.stderr)
            r = await run_variant(args, ttl, reqs)
            runs[str(ttl)].append(r)
            print(_row(r), file=sys.stderr)
    print("| media_history_ttl_s | follow-ups' TTFT p50 / p99 ms | first turns' TTFT p50 / p99 ms "
          "| every turn's TTFT p50 / p99 ms | hit ratio (first turns') | follow-ups to their previous turn's replica | errors |")
    print("|---|---|---|---|---|---|---|")
    for rs in runs.values():
        for r in rs:
            print(_row(r))
    return {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_media", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (the first with the image)")
    p.add_argument("--rate", type=float, default=1.5, help="conversations started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=2.0, help="seconds from an answer to the next turn")
    p.add_argument("--images", type=int, default=0,
                   help="images the conversations share, the i-th with weight 1/i (default 0: one of its own each)")
    p.add_argument("--image-tokens", type=int, default=576, help="tokens the sims' processor makes of an image")
    p.add_argument("--question-words", type=int, default=30, help="words of each question (about 3 tokens each)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--ttl-s", type=float, default=120.0, help="feed.media_history_ttl_s of the variant with it")
    p.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating which goes first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="a client's total timeout per request (s)")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_interruptible(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
