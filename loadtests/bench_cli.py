"""Flags of `warmroute bench` (DESIGN.md "Operating it"); the runner lives in loadtests.bench."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="shared_docs")
    p.add_argument("--policy", action="append", default=[], help="policy to measure (repeatable; same seed for each)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the JSON report here")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG plot here")
    p.add_argument("--target", action="append", default=[], metavar="URL", help="measure an OpenAI-compatible endpoint instead")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="override a workload parameter (repeatable)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV capacity per simulated replica, in blocks")
    p.add_argument("--model", default="warmroute-sim", help="model name sent in requests")

