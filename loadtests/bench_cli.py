"""Flags of `warmroute bench`; the runner lives in loadtests.bench."""
from __future__ import annotations

import argparse

from loadtests.workloads import WORKLOADS
from policies.registry import POLICY_NAMES

API_KEY_ENV = "WARMROUTE_BENCH_API_KEY"

DESCRIPTION = """\
Run one workload against several routing policies, same seed, arrivals and prompts for each, and
print a table (and optionally write a JSON report and a PNG plot). Self-contained by default: for
each policy it starts fresh simulated replicas, their agents and a gateway in this process. With
--target URL the same requests go to anything that speaks the OpenAI API instead (a running
warmroute gateway, a peer router, vLLM itself)."""

_WORKLOAD_HELP = {
    "shared_docs": "long shared documents, one question each (uniform popularity)",
    "shared_docs_zipf": "the same with Zipf popularity (a few hot documents)",
    "multi_turn": "chats whose prompt is the whole growing history",
    "rag": "a system prompt, k retrieved chunks in random order, a question",
    "multi_tenant": "several tenants send the same documents (salts keep them apart)",
    "hot_prefix": "one document carries most of the traffic",
    "no_sharing": "every prompt unique (nothing to reuse)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(f"{n} ({_WORKLOAD_HELP.get(n, '')})" if _WORKLOAD_HELP.get(n) else n for n in WORKLOADS)
    p.add_argument("--workload", default="shared_docs", choices=list(WORKLOADS), metavar="NAME",
                   help=f"request stream to send; one of: {names}")
    p.add_argument("--policy", action="append", default=[], choices=list(POLICY_NAMES), metavar="NAME",
                   help=f"routing policy to measure, repeatable (one of: {', '.join(POLICY_NAMES)}; "
                        "default: cache_aware and round_robin)")
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas per policy")
    p.add_argument("--requests", type=int, default=200, help="requests per policy")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second (default: 4)")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients (default: open loop, --rate)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals (same for every policy)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the JSON report here (default: not written)")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG plot here (default: not drawn)")
    p.add_argument("--target", action="append", default=[], metavar="URL",
                   help="measure this OpenAI-compatible endpoint instead of embedded systems, repeatable (default: none)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"bearer key sent to every --target (default: the {API_KEY_ENV} environment variable; "
                        "none if unset)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload parameter, repeatable, e.g. n_docs=4 (default: sized for a 2-core machine)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV capacity per simulated replica, in blocks")
    p.add_argument("--model", default="warmroute-sim", help="model name sent in requests")

