"""LoRA-slot benchmark (not a test): the same pool and the same request stream, with the engines'
LoRA slots visible to the gateway and hidden from it, side by side in one run.

Each simulated replica serves `--adapters` LoRA adapters and batches at most `--max-loras` of them
(vLLM's `--max-loras`: its scheduler skips a waiting request whose adapter is not among the
running ones while they fill the slots). "visible": the sims export vllm:lora_requests_info, the
agents carry it to the gateway and `cache_aware` prices a replica whose slots other adapters hold
(`lora_wait_s`); "hidden": the same sims without the metric (an engine a router cannot see into),
so the gateway routes by queue and cache alone. Everything runs embedded in this process
(loadtests/harness.py: sims on the wall-clock time model, their agents, the gateway, the load),
each variant from cold caches, `--rounds` times, alternating which goes first.

Stream: Poisson arrivals at `--rate`, each request for an adapter drawn uniformly (or with Zipf
`--zipf-s` > 0), a prompt of its own (`--prompt-words` words, nothing shared), `--output-tokens`
tokens out. Reported per variant: TTFT and end-to-end p50/p99, errors, the requests that waited
in an engine for a LoRA slot (the sims' count) and the requests per replica.

`--vtime SEEDS` runs the same comparison in virtual time instead (loadtests/vtime.py: the
gateway's routing over the engine model, which `tests/test_vtime_sim.py` checks against these
sims request by request, LoRA slots included), one run per seed and variant, each seed its own
stream (the no_sharing workload with adapters: prompts of the same mean length, +-50%), and prints
each seed's figures and their medians. `--gateways N` puts N gateways in front (in either mode;
each sees the engines' reports, its own requests' adapters and, through the gateways' exchange,
the others'; on the wall clock they are instances in this process on one feed, the requests sent
to each in turn).

Run:  python -m loadtests.bench_lora [--requests 360] [--rate 6] [--json FILE]
      python -m loadtests.bench_lora --vtime 0-19 [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np

from loadtests.harness import EmbeddedSystem, SystemSpec
from loadtests.runner import BenchRequest, run_interruptible, run_load, summarize
from loadtests.vtime import SimParams, simulate
from loadtests.vtime_report import parse_seeds
from loadtests.workloads import build_workload

MODEL = "lora-bench"


def stream(args) -> list[BenchRequest]:
    """The request stream both variants get (deterministic for `--seed`)."""
    rng = random.Random(args.seed)
    names = [f"adapter-{i}" for i in range(args.adapters)]
    weights = [1.0 / (k + 1) ** args.zipf_s for k in range(args.adapters)] if args.zipf_s > 0 else None
    out, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        adapter = rng.choices(names, weights)[0]
        prompt = " ".join(f"w{rng.randrange(100_000)}" for _ in range(args.prompt_words))
        out.append(BenchRequest(t, "/v1/completions", {"model": adapter, "prompt": f"Request {i}: {prompt}",
                                                       "max_tokens": args.output_tokens, "ignore_eos": True},
                                tag=adapter))
    return out


async def run_variant(args, visible: bool, reqs: list[BenchRequest]) -> dict:
    spec = SystemSpec(replicas=args.replicas, policy=args.policy, model=MODEL, num_blocks=args.num_blocks,
                      max_num_seqs=args.max_num_seqs, auth=False,
                      lora_modules=tuple(f"adapter-{i}" for i in range(args.adapters)), max_loras=args.max_loras,
                      lora_metrics=visible, agent_load_interval_s=args.report_interval, gateways=args.gateways)
    async with EmbeddedSystem(spec) as system:
        samples, wall = await run_load(system.urls, reqs, timeout_s=args.timeout)
        stats = system.sim_stats()
        seen = {rid: (r.max_lora if (r := system.gateway.gateway.routing.index.last_load(rid)) is not None else None)
                for rid in stats}
    out = summarize(samples, wall)
    out["lora_waits"] = sum(s["num_lora_waits"] for s in stats.values())
    out["lora_waits_per_replica"] = {rid: s["num_lora_waits"] for rid, s in sorted(stats.items())}
    out["gateway_saw_max_lora"] = seen
    out["sim_lateness_p99_s"] = max(s["lateness_s"]["p99"] for s in stats.values())
    return out


def _row(name: str, r: dict) -> str:
    t, e = r["ttft_ms"], r["e2e_ms"]
    return (f"| {name} | {t.get('p50', float('nan')):,.0f} / {t.get('p99', float('nan')):,.0f} | "
            f"{e.get('p50', float('nan')):,.0f} / {e.get('p99', float('nan')):,.0f} | {r['errors']} | {r['lora_waits']} of "
            f"{r['requests']} | {' / '.join(str(v) for v in r['per_replica_requests'].values())} |")


async def main_async(args) -> dict:
    reqs = stream(args)
    runs: dict[str, list[dict]] = {"visible": [], "hidden": []}
    for rnd in range(args.rounds):
        order = ("visible", "hidden") if rnd % 2 == 0 else ("hidden", "visible")
        for name in order:
            print(f"round {rnd} {name}: {len(reqs)} requests at {args.rate}/s", file=sys.stderr)
            r = await run_variant(args, name == "visible", reqs)
            runs[name].append(r)
            print(_row(name, r), file=sys.stderr)
    print("| LoRA slots | TTFT p50 / p99 ms | e2e p50 / p99 ms | errors | requests that waited for a slot | requests per replica |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        for r in rs:
            print(_row(name, r))
    return {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}


def vtime_variant(args, seed: int, visible: bool) -> dict:
    """One seed's run in virtual time: the same pool and stream shape as the wall-clock variant."""
    w = build_workload("no_sharing", args.requests, seed=seed, rate_rps=args.rate, prompt_tokens=6 * args.prompt_words,
                       output_tokens=args.output_tokens, adapters=args.adapters, zipf_s=args.zipf_s)
    params = SimParams.wallclock(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, max_batched_tokens=8192,
                                 report_interval_s=args.report_interval, request_timeout_s=args.timeout, max_loras=args.max_loras,
                                 lora_metrics=visible)
    r = simulate(w, args.policy, args.replicas, params, seed=seed, gateways=args.gateways)
    pct = (lambda a, q: float(np.percentile(a, q)) * 1000 if len(a) else float("nan"))
    return {"seed": seed, "ttft_ms": {"p50": pct(r.ttft_s, 50), "p99": pct(r.ttft_s, 99)},
            "e2e_ms": {"p50": pct(r.e2e_s, 50), "p99": pct(r.e2e_s, 99)}, "errors": r.unfinished,
            "lora_waits": r.lora_waits, "requests": r.requests,
            "per_replica_requests": {f"r{i}": n for i, n in enumerate(r.per_replica_requests)}}


def _medians(rs: list[dict]) -> dict:
    """Medians over the seeds of each per-seed figure."""
    out = {f"{m}_{q}": float(np.median([r[m][q] for r in rs])) for m in ("ttft_ms", "e2e_ms") for q in ("p50", "p99")}
    out["lora_waits"] = float(np.median([r["lora_waits"] for r in rs]))
    return out


def vtime_main(args) -> dict:
    runs: dict[str, list[dict]] = {"visible": [], "hidden": []}
    print("| LoRA slots, seed | TTFT p50 / p99 ms | e2e p50 / p99 ms | unfinished | requests that waited for a slot | requests per replica |")
    print("|---|---|---|---|---|---|")
    for seed in parse_seeds(args.vtime):
        for name in runs:
            r = vtime_variant(args, seed, name == "visible")
            runs[name].append(r)
            print(_row(f"{name}, {seed}", r))
    med = {name: _medians(rs) for name, rs in runs.items()}
    print("\nMedians over the seeds (per-seed figures):")
    for name, m in med.items():
        print(f"- {name}: TTFT p50 / p99 {m['ttft_ms_p50']:,.0f} / {m['ttft_ms_p99']:,.0f} ms, e2e p50 / p99 "
              f"{m['e2e_ms_p50']:,.0f} / {m['e2e_ms_p99']:,.0f} ms, {m['lora_waits']:.0f} waited for a slot")
    return {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"), "mode": "vtime", "runs": runs, "medians": med}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--adapters", type=int, default=8, help="LoRA adapters every replica serves")
    p.add_argument("--max-loras", type=int, default=2, help="adapters one engine batch may run (vLLM --max-loras)")
    p.add_argument("--requests", type=int, default=360)
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    p.add_argument("--zipf-s", type=float, default=0.0, help="adapter popularity: Zipf exponent (0: uniform)")
    p.add_argument("--prompt-words", type=int, default=40, help="words of each prompt (about 6 tokens each)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per replica")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating which goes first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="a client's total timeout per request (s)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--vtime", metavar="SEEDS", default=None,
                   help="run in virtual time over these seeds (0-19, 0,3,5) instead of the wall clock (default: wall clock)")
    p.add_argument("--report-interval", type=float, default=0.25,
                   help="seconds between the agents' scrapes of the engines' /metrics, the LoRA slots' source "
                        "(default 0.25; the chart's agents: 1.0)")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateways in front of the pool, sharing what gateways share through the feed; on the wall "
                        "clock instances in this process, the requests spread over them in turn (default 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = vtime_main(args) if args.vtime else run_interruptible(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
