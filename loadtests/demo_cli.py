"""`warmroute demo`: an embedded, self-contained run (sims, agents, gateway in one process)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)

