"""`warmroute bench`: one workload, several policies (or targets), same seed, arrivals and prompts.

Self-contained by default: for each policy a fresh embedded system (sims with cold caches, agents,
gateway; loadtests.harness) serves the identical request stream, one policy after another, and
the report maps each policy to its figures (the JSON contract: requests, errors, throughput_rps,
ttft_ms p50/p90/p99/max, prompt_tokens, cached_tokens, hit_ratio; plus error_reasons, ITL,
end-to-end, per-replica requests, CPU and the sims' timer lateness). With `--target URL`
(repeatable) the same stream goes to anything that speaks the OpenAI API instead, with
`--api-key` (or WARMROUTE_BENCH_API_KEY) as the bearer key.

Wall-clock runs use the sims' slowed time model (prefill 1 ms/token, ~15 ms decode steps; see
loadtests/sim/scheduler.py) because this 2-core machine cannot drive GPU-speed replicas busy.
Workload sizes default smaller than the virtual-time ones for the same reason; `--param k=v`
overrides any workload parameter. Progress goes to stderr (loadtests.progress), the table to
stdout; a failed request's reason is counted (runner.error_reason) and printed under the table.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from loadtests.progress import Progress
from loadtests.workloads import render_messages
from loadtests.runner import BenchRequest, CpuMeter, Interrupted, Sample, run_interruptible, run_load, summarize

__all__ = ["WALLCLOCK_DEFAULTS", "bench_requests", "run_policies", "run_targets", "format_table", "format_errors",
           "write_outputs", "main_from_args"]

API_KEY_ENV = "WARMROUTE_BENCH_API_KEY"

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


def bench_requests(workload, model: str, api_keys: dict[str, str] | None, words_per_token: float = 1.0,
                   requests=None, words: dict[str, int] | None = None) -> list[BenchRequest]:
    """The workload's requests as HTTP bodies (`requests`: other WorkloadRequests, e.g. a warm-up;
    `words_per_token` and `words`: loadtests.workloads.render_messages)."""
    out = []
    last_turn: dict[str, int] = {}  # conversation -> index of its latest turn so far
    for r in workload.requests if requests is None else requests:
        body = {"model": model, "messages": render_messages(r, words_per_token, words),
                "max_tokens": r.max_output_tokens, "ignore_eos": True, "temperature": 0}
        after = last_turn.get(r.conversation, -1) if r.conversation and r.turn > 0 else -1
        if r.conversation:
            last_turn[r.conversation] = len(out)
        out.append(BenchRequest(r.arrival_s, "/v1/chat/completions", body,
                                api_key=(api_keys or {}).get(r.tenant), tag=r.request_id, after=after))
    return out


def _cpu_figures(cpu: CpuMeter, wall_s: float) -> dict[str, float]:
    proc_s = cpu.process_s()
    return {"machine_cpu_share": round(cpu.share(), 3), "process_cpu_s": round(proc_s, 2),
            "process_cpu_cores": round(proc_s / wall_s, 3) if wall_s > 0 else 0.0}


async def run_policies(workload, policies: list[str], spec_kwargs: dict, concurrency: int | None,
                       progress: Progress | None = None) -> tuple[dict[str, dict], dict[str, list[Sample]]]:
    """(report, samples) per policy, each on a fresh embedded system."""
    from loadtests.harness import EmbeddedSystem, SystemSpec

    progress = progress or Progress()
    tenants = tuple(sorted({r.tenant for r in workload.requests}))
    report: dict[str, dict] = {}
    runs: dict[str, list[Sample]] = {}
    for i, policy in enumerate(policies, 1):
        spec = SystemSpec(policy=policy, tenants=tenants, **spec_kwargs)
        progress.stage(f"[{i}/{len(policies)}] {policy}: starting {spec.replicas} simulated replicas, their agents "
                       "and a gateway (cold caches)")
        async with EmbeddedSystem(spec) as system:
            reqs = bench_requests(workload, spec.model, system.api_keys if spec.auth else None)
            cpu = CpuMeter()
            with progress.requests(policy, len(reqs)) as bar:
                samples, wall = await run_load(system.url, reqs, concurrency=concurrency, on_done=bar.update)
            cpu_figures = _cpu_figures(cpu, wall)
            sims = system.sim_stats()
        summary = summarize(samples, wall, policy=policy, workload=workload.name, workload_params=workload.params,
                            replicas=spec.replicas, num_blocks_per_replica=spec.num_blocks,
                            time_profile=spec.time_profile, rate_rps=workload.rate_rps, concurrency=concurrency)
        summary.update(cpu_figures)
        summary["sim_timer_lateness_ms_p99"] = round(max((s["lateness_s"]["p99"] for s in sims.values()), default=0.0) * 1000, 2)
        summary["sim_preemptions"] = sum(s["num_preemptions"] for s in sims.values())
        report[policy] = summary
        runs[policy] = samples
    return report, runs


async def run_targets(workload, targets: list[str], model: str, concurrency: int | None, api_key: str | None = None,
                      progress: Progress | None = None) -> tuple[dict[str, dict], dict[str, list[Sample]]]:
    """(report, samples) per target URL; `api_key` is sent as the bearer key of every request."""
    progress = progress or Progress()
    report: dict[str, dict] = {}
    runs: dict[str, list[Sample]] = {}
    for url in targets:
        reqs = [dataclasses.replace(r, api_key=api_key) for r in bench_requests(workload, model, None)]
        progress.stage(f"{url}: sending {len(reqs)} requests" + (" with an API key" if api_key else " without an API key"))
        cpu = CpuMeter()
        with progress.requests(url, len(reqs)) as bar:
            samples, wall = await run_load(url.rstrip("/"), reqs, concurrency=concurrency, on_done=bar.update)
        summary = summarize(samples, wall, target=url, workload=workload.name, workload_params=workload.params,
                            rate_rps=workload.rate_rps, concurrency=concurrency)
        summary.update(_cpu_figures(cpu, wall))
        report[url] = summary
        runs[url] = samples
    return report, runs


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:g}"  # nan (no successful request): a dash, the reason is printed below


def format_table(report: dict[str, dict], *, embedded: bool = True) -> str:
    own = "CPU, this process (cores)" if embedded else "CPU, load generator (cores)"
    cols = [("requests", lambda r: r["requests"]), ("errors", lambda r: r["errors"]),
            ("rps", lambda r: r["throughput_rps"]), ("TTFT p50 ms", lambda r: _ms(r["ttft_ms"]["p50"])),
            ("TTFT p90 ms", lambda r: _ms(r["ttft_ms"]["p90"])), ("TTFT p99 ms", lambda r: _ms(r["ttft_ms"]["p99"])),
            ("e2e p50 ms", lambda r: _ms(r["e2e_ms"]["p50"])), ("hit ratio (tokens)", lambda r: r["hit_ratio"]),
            ("cached/prompt tok", lambda r: f'{r["cached_tokens"]}/{r["prompt_tokens"]}'),
            ("requests per replica", lambda r: " ".join(str(v) for v in r["per_replica_requests"].values()) or "-"),
            (own, lambda r: r.get("process_cpu_cores", "")),
            ("CPU, whole machine (share)", lambda r: r.get("machine_cpu_share", ""))]
    names = list(report)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, get in cols:
        lines.append(f"| {label} | " + " | ".join(str(get(report[n])) for n in names) + " |")
    where = ("this process runs the sims, agents, gateway and load generator" if embedded
             else "this process is only the load generator")
    lines.append(f"\nCPU: '{own}' = CPU seconds of this process / wall seconds ({where}); 'whole machine' = busy "
                 f"share of all {os.cpu_count()} cores, other users' work included.")
    return "\n".join(lines)


def format_errors(report: dict[str, dict]) -> str:
    """Why requests failed, per policy/target: counts per reason, most frequent first."""
    lines = []
    for name, r in report.items():
        if not r["errors"]:
            continue
        reasons = r.get("error_reasons") or {}
        lines.append(f"{name}: {r['errors']} of {r['requests']} requests failed:")
        lines += [f"  {n} x {reason}" for reason, n in reasons.items()]
        if any(reason.startswith("HTTP 401") for reason in reasons):
            lines.append(f"  (the endpoint wants a credential: pass --api-key KEY or set {API_KEY_ENV})")
    return "\n".join(lines)


def write_outputs(report: dict, runs: dict, args, progress: Progress, context: dict) -> None:
    """The JSON report and the PNG plot, when asked for; says where each went."""
    if getattr(args, "json", None):
        path = Path(args.json)
        path.write_text(json.dumps(report, indent=2))
        progress.stage(f"JSON report written to {path.resolve()}")
    if getattr(args, "plot", None):
        from loadtests.bench_plot import save_plot

        path = Path(args.plot)
        save_plot(report, runs, context, path)
        progress.stage(f"plot written to {path.resolve()}")


def one_line_error(exc: BaseException, command: str) -> str | None:
    """A bench/demo start-up failure as one line, or None when it is a bug (keep the traceback)."""
    import zmq

    if isinstance(exc, zmq.ZMQError) or (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE):
        return (f"warmroute {command}: a port it picked for an embedded component was taken meanwhile "
                f"({exc}); run it again")
    if type(exc).__name__ == "ConfigError":
        return f"warmroute {command}: invalid embedded configuration: {exc}"
    return None


def main_from_args(args) -> int:
    from loadtests.workloads import WORKLOADS, build_workload

    if args.workload not in WORKLOADS:
        print(f"warmroute bench: unknown workload {args.workload!r} for --workload (valid: {', '.join(WORKLOADS)})",
              file=sys.stderr)
        return 2
    params = dict(WALLCLOCK_DEFAULTS.get(args.workload, {}))
    params.update(_parse_params(getattr(args, "param", [])))
    if args.concurrency:
        params.update(rate_rps=None, concurrency=args.concurrency)
    else:
        params.update(rate_rps=args.rate or 4.0, concurrency=None)
    try:
        workload = build_workload(args.workload, args.requests, seed=args.seed, **params)
    except TypeError as exc:  # an unknown --param name
        print(f"warmroute bench: --param: {exc}", file=sys.stderr)
        return 2
    progress = Progress(prefix="warmroute bench")
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    policies = args.policy or ["cache_aware", "round_robin"]
    how = f"{args.concurrency} clients" if args.concurrency else f"{params['rate_rps']:g}/s"
    try:
        if args.target:
            progress.stage(f"{args.workload}: {args.requests} requests at {how} to {len(args.target)} target(s)")
            report, runs = run_interruptible(run_targets(workload, args.target, args.model, args.concurrency, api_key, progress))
        else:
            progress.stage(f"{args.workload}: {args.requests} requests at {how} through {', '.join(policies)}, "
                           f"{args.replicas} simulated replicas each")
            spec = dict(replicas=args.replicas, num_blocks=args.num_blocks, model=args.model)
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass
            report, runs = run_interruptible(run_policies(workload, policies, spec, args.concurrency, progress))
    except Interrupted as exc:
        print(f"warmroute bench: stopped by {exc}; no report written", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:  # noqa: BLE001 - a one-line reason for what a user can fix, else the traceback
        line = one_line_error(exc, "bench")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    print(format_table(report, embedded=not args.target))
    errors = format_errors(report)
    if errors:
        print("\n" + errors)
    context = dict(workload=args.workload, requests=args.requests, rate=how,
                   replicas=None if args.target else args.replicas, seed=args.seed)
    write_outputs(report, runs, args, progress, context)
    failed = [n for n, r in report.items() if r["errors"] == r["requests"]]
    return 1 if failed else 0
