"""`warmroute demo`: the embedded default. Starts simulated replicas (wall-clock time model),
their agents and a gateway in this process, sends the same shared-document workload through
cache-aware and then round-robin routing (fresh, cold replicas for each), and prints the two side
by side. No external services."""
from __future__ import annotations

import asyncio
import sys

from loadtests.bench import format_table, run_policies


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
    print(f"warmroute demo: {args.requests} requests over {workload.params['n_docs']} shared documents, "
          f"{args.replicas} simulated replicas (slowed time model: 1 ms per prefill token)", flush=True)
    report = asyncio.run(run_policies(workload, ["cache_aware", "round_robin"], spec, None))
    print(format_table(report))
    ca, rr = report["cache_aware"], report["round_robin"]
    if ca["ttft_ms"]["p50"] and rr["ttft_ms"]["p50"]:
        print(f"\ncache_aware: TTFT p50 {ca['ttft_ms']['p50']:.0f} ms vs {rr['ttft_ms']['p50']:.0f} ms, "
              f"p99 {ca['ttft_ms']['p99']:.0f} ms vs {rr['ttft_ms']['p99']:.0f} ms; "
              f"hit ratio {ca['hit_ratio']:.2f} vs {rr['hit_ratio']:.2f}")
    errors = ca["errors"] + rr["errors"]
    if errors:
        print(f"{errors} requests failed: {ca['error_examples'] or rr['error_examples']}", file=sys.stderr)
        return 1
    return 0
