"""Flags of `warmroute demo`; the run itself lives in loadtests.demo."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
A self-contained run in this process, no external services: simulated vLLM replicas (slowed time
model, 1 ms per prefill token), their sidecar agents and a gateway. The same shared-document
requests go through cache-aware and then round-robin routing (cold replicas for each), and the two
are printed side by side. About a minute on a 2-core machine."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=120, help="requests per policy (4 per second)")
    p.add_argument("--replicas", type=int, default=3, help="simulated replicas")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON report here (default: not written)")
    p.add_argument("--plot", default=None, metavar="FILE", help="also write a PNG plot here (default: not drawn)")

