"""`warmroute bench`: one workload, several policies (or targets), same seed, arrivals and prompts.

Self-contained by default: for each policy a fresh embedded system (sims with cold caches, agents,
gateway; loadtests.harness) serves the identical request stream, one policy after another, and
the report maps each policy to its figures (DESIGN.md "Operating it": requests, errors,
throughput_rps, ttft_ms p50/p90/p99/max, prompt_tokens, cached_tokens, hit_ratio, plus ITL,
end-to-end, per-replica requests, machine CPU share and the sims' timer lateness). With
`--target URL` (repeatable) the same stream goes to anything that speaks the OpenAI API instead.

Wall-clock runs use the sims' slowed time model (prefill 1 ms/token, ~15 ms decode steps; see
loadtests/sim/scheduler.py) because this 2-core machine cannot drive GPU-speed replicas busy.
Workload sizes default smaller than the virtual-time ones for the same reason; `--param k=v`
overrides any workload parameter.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from loadtests.runner import BenchRequest, CpuMeter, run_load, summarize

__all__ = ["WALLCLOCK_DEFAULTS", "bench_requests", "run_policies", "run_targets", "format_table", "main_from_args"]

# Workload shapes sized for a wall-clock run on this machine (tokens cost 1 ms of prefill each).
WALLCLOCK_DEFAULTS: dict[str, dict[str, Any]] = {
    "shared_docs": dict(n_docs=8, doc_tokens=600, question_tokens=30, system_tokens=20, output_tokens=16),
    "shared_docs_zipf": dict(n_docs=8, doc_tokens=600, question_tokens=30, system_tokens=20, output_tokens=16),
    "multi_tenant": dict(n_docs=4, doc_tokens=600, question_tokens=30, system_tokens=20, output_tokens=16, n_tenants=3),
}


def _parse_params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def bench_requests(workload, model: str, api_keys: dict[str, str] | None) -> list[BenchRequest]:
    from loadtests.workloads import render_messages

    out = []
    for r in workload.requests:
        body = {"model": model, "messages": render_messages(r), "max_tokens": r.max_output_tokens,
                "ignore_eos": True, "temperature": 0}
        out.append(BenchRequest(r.arrival_s, "/v1/chat/completions", body,
                                api_key=(api_keys or {}).get(r.tenant), tag=r.request_id))
    return out


async def run_policies(workload, policies: list[str], spec_kwargs: dict, concurrency: int | None) -> dict[str, dict]:
    from loadtests.harness import EmbeddedSystem, SystemSpec

    tenants = tuple(sorted({r.tenant for r in workload.requests}))
    report: dict[str, dict] = {}
    for policy in policies:
        spec = SystemSpec(policy=policy, tenants=tenants, **spec_kwargs)
        async with EmbeddedSystem(spec) as system:
            reqs = bench_requests(workload, spec.model, system.api_keys if spec.auth else None)
            cpu = CpuMeter()
            samples, wall = await run_load(system.url, reqs, concurrency=concurrency)
            share = cpu.share()
            sims = system.sim_stats()
        summary = summarize(samples, wall, policy=policy, workload=workload.name, workload_params=workload.params,
                            replicas=spec.replicas, num_blocks_per_replica=spec.num_blocks,
                            time_profile=spec.time_profile, rate_rps=workload.rate_rps, concurrency=concurrency)
        summary["machine_cpu_share"] = round(share, 3)
        summary["sim_timer_lateness_ms_p99"] = round(max((s["lateness_s"]["p99"] for s in sims.values()), default=0.0) * 1000, 2)
        summary["sim_preemptions"] = sum(s["num_preemptions"] for s in sims.values())
        report[policy] = summary
    return report


async def run_targets(workload, targets: list[str], model: str, concurrency: int | None) -> dict[str, dict]:
    key = os.environ.get("WARMROUTE_BENCH_API_KEY")
    report = {}
    for url in targets:
        reqs = bench_requests(workload, model, None)
        if key:
            reqs = [BenchRequest(r.arrival_s, r.route, r.body, key, r.tag) for r in reqs]
        cpu = CpuMeter()
        samples, wall = await run_load(url.rstrip("/"), reqs, concurrency=concurrency)
        summary = summarize(samples, wall, target=url, workload=workload.name, workload_params=workload.params)
        summary["machine_cpu_share"] = round(cpu.share(), 3)
        report[url] = summary
    return report


def format_table(report: dict[str, dict]) -> str:
    cols = [("requests", lambda r: r["requests"]), ("errors", lambda r: r["errors"]),
            ("rps", lambda r: r["throughput_rps"]), ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
            ("TTFT p90 ms", lambda r: r["ttft_ms"]["p90"]), ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
            ("e2e p50 ms", lambda r: r["e2e_ms"]["p50"]), ("hit ratio", lambda r: r["hit_ratio"]),
            ("cached/prompt tok", lambda r: f'{r["cached_tokens"]}/{r["prompt_tokens"]}'),
            ("per replica", lambda r: " ".join(str(v) for v in r["per_replica_requests"].values())),
            ("cpu", lambda r: r.get("machine_cpu_share", ""))]
    names = list(report)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, get in cols:
        lines.append(f"| {label} | " + " | ".join(str(get(report[n])) for n in names) + " |")
    return "\n".join(lines)


def _plot(report: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for q in ("p50", "p90", "p99"):
        axes[0].plot(names, [report[n]["ttft_ms"][q] for n in names], marker="o", label=f"TTFT {q}")
    axes[0].set_ylabel("ms")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[1].bar(names, [report[n]["hit_ratio"] for n in names])
    axes[1].set_ylabel("prompt-token hit ratio")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path)


def main_from_args(args) -> int:
    from loadtests.workloads import WORKLOADS, build_workload

    if args.workload not in WORKLOADS:
        print(f"unknown workload {args.workload!r}; choose one of {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    params = dict(WALLCLOCK_DEFAULTS.get(args.workload, {}))
    params.update(_parse_params(getattr(args, "param", [])))
    if args.concurrency:
        params.update(rate_rps=None, concurrency=args.concurrency)
    else:
        params.update(rate_rps=args.rate or 4.0, concurrency=None)
    workload = build_workload(args.workload, args.requests, seed=args.seed, **params)
    if args.target:
        report = asyncio.run(run_targets(workload, args.target, args.model, args.concurrency))
    else:
        policies = args.policy or ["cache_aware", "round_robin"]
        spec = dict(replicas=args.replicas, num_blocks=args.num_blocks, model=args.model)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        report = asyncio.run(run_policies(workload, policies, spec, args.concurrency))
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        _plot(report, args.plot)
    failed = [n for n, r in report.items() if r["errors"] == r["requests"]]
    return 1 if failed else 0
