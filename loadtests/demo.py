"""`warmroute demo`: the embedded default. Starts simulated replicas (wall-clock time model),
their agents and a gateway in this process, sends the same shared-document workload through
cache-aware and then round-robin routing (fresh, cold replicas for each), and prints the two side
by side. No external services. Progress on stderr (a bar on a terminal, plain lines otherwise);
SIGTERM/SIGINT stop it at once, closing the embedded system."""
from __future__ import annotations

import sys

from loadtests.bench import format_errors, format_table, one_line_error, run_policies, write_outputs
from loadtests.progress import Progress
from loadtests.runner import Interrupted, run_interruptible


def main_from_args(args) -> int:
    from loadtests.workloads import build_workload

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # 6 documents of ~500 tokens, 3 replicas with room for about 2 documents each: enough to show
    # the difference in ~30 s per policy on a 2-core machine.
    workload = build_workload("shared_docs", args.requests, seed=args.seed, rate_rps=4.0, n_docs=6,
                              doc_tokens=500, question_tokens=30, system_tokens=20, output_tokens=16)
    spec = dict(replicas=args.replicas, num_blocks=100)
    progress = Progress(prefix="warmroute demo")
    print(f"warmroute demo: {args.requests} requests over {workload.params['n_docs']} shared documents, "
          f"{args.replicas} simulated replicas (slowed time model: 1 ms per prefill token), "
          f"through cache_aware and then round_robin", flush=True)
    try:
        report, runs = run_interruptible(run_policies(workload, ["cache_aware", "round_robin"], spec, None, progress))
    except Interrupted as exc:
        print(f"warmroute demo: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:  # noqa: BLE001 - one line for what a user can fix, else the traceback
        line = one_line_error(exc, "demo")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    print(format_table(report))
    ca, rr = report["cache_aware"], report["round_robin"]
    if ca["ttft_ms"]["p50"] and rr["ttft_ms"]["p50"]:
        print(f"\ncache_aware: TTFT p50 {ca['ttft_ms']['p50']:.0f} ms vs {rr['ttft_ms']['p50']:.0f} ms, "
              f"p99 {ca['ttft_ms']['p99']:.0f} ms vs {rr['ttft_ms']['p99']:.0f} ms; "
              f"hit ratio {ca['hit_ratio']:.2f} vs {rr['hit_ratio']:.2f}")
    write_outputs(report, runs, args, progress, dict(command="demo", workload="shared_docs", requests=args.requests, rate="4/s",
                                                     replicas=args.replicas, seed=args.seed))
    errors = ca["errors"] + rr["errors"]
    if errors:
        print(format_errors(report), file=sys.stderr)
        return 1
    return 0
