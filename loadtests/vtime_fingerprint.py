"""Fingerprints of the virtual-time simulator over varied runs, to show a refactoring changed nothing.

    python -m loadtests.vtime_fingerprint OUT.json      # on the tree before, then after; then cmp

Each run's SimResult summary (less its wall time) and hashes of its per-request arrays (TTFT,
end-to-end, arrivals, paced TTFT), plus for the busy cases a hash of the `observe` stream (which
request finished where, in order). The runs cover the paths of loadtests/vtime_loop.py: the busy
regime's uniform, Zipf and multi-turn cases with their pre-warm, keep-alive, two and four gateways,
cache_plan and cache_aware, a collapse, pacing, LoRA slots with two gateways, client timeouts and
a closed loop. The simulator is deterministic for a seed, so two trees that route alike give
identical files; a deliberate change of behaviour shows up as different ones (not a test: the
figures are not checked against anything).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

from loadtests.vtime import SimParams, simulate
from loadtests.vtime_keepalive import KeepAlive
from loadtests.vtime_pacing import Pacing
from loadtests.vtime_regimes import REGIMES, build_case
from loadtests.workloads import build_workload

__all__ = ["fingerprints"]

_ARRAYS = ("ttft_s", "e2e_s", "arrival_s", "paced_ttft_s")


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()[:12]


def _fingerprint(res, observed: list | None = None) -> dict:
    summary = res.summary()
    summary.pop("wall_s", None)
    out = {"summary": summary, "arrays": {k: _digest(np.asarray(getattr(res, k)).tobytes()) for k in _ARRAYS}}
    if observed is not None:
        out["observed"] = _digest(repr(observed).encode())
    return out


def fingerprints(n_requests: int = 300) -> dict[str, dict]:
    """Every run's fingerprint, by a name saying what it covers."""
    out: dict[str, dict] = {}
    reg = REGIMES["busy"]
    for case, policy, keep_alive, gateways in [("shared_docs", "cache_aware", None, 1),
                                                ("shared_docs_zipf", "cache_plan", KeepAlive(idle_s=2.0), 1),
                                                ("shared_docs_zipf", "cache_plan", None, 2),
                                                ("multi_turn", "cache_aware", None, 4),
                                                ("multi_turn", "cache_plan", None, 1)]:
        cr = build_case("busy", case, 1, n_requests=n_requests)
        seen: list = []
        res = simulate(cr.workload, policy, reg.replicas, reg.params, seed=1, keys=cr.keys, warmup=cr.warmup or None,
                       keep_alive=keep_alive, gateways=gateways, observe=lambda r, copy: seen.append((r.i, r.rep, copy)))
        out[f"busy {case} {policy}{' keep-alive' if keep_alive else ''} gateways={gateways}"] = _fingerprint(res, seen)
    w = build_workload("shared_docs", n_requests, seed=2, rate_rps=60.0, n_docs=16, doc_tokens=3000)
    out["collapse"] = _fingerprint(simulate(w, "round_robin", 2, SimParams(num_blocks=1200), seed=2, collapse_ttft_s=3.0))
    out["pacing"] = _fingerprint(simulate(w, "cache_aware", 3, SimParams(num_blocks=3000), seed=2, pacing=Pacing()))
    w = build_workload("no_sharing", 2 * n_requests // 3, seed=3, rate_rps=20.0, prompt_tokens=240, output_tokens=32,
                       adapters=6)
    lora = SimParams.wallclock(num_blocks=3000, max_num_seqs=16, report_interval_s=0.25, max_loras=2)
    out["lora gateways=2"] = _fingerprint(simulate(w, "cache_aware", 4, lora, seed=3, gateways=2))
    timeouts = SimParams(num_blocks=3000, max_num_seqs=1, request_timeout_s=0.3)
    out["client timeouts"] = _fingerprint(simulate(w, "random", 2, timeouts, seed=3))
    w = build_workload("shared_docs", n_requests // 2, seed=4, rate_rps=None, concurrency=8, n_docs=6)
    out["closed loop"] = _fingerprint(simulate(w, "cache_aware", 3, SimParams(num_blocks=3000), seed=4))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.vtime_fingerprint", description=__doc__.split("\n\n")[0])
    p.add_argument("out", metavar="OUT.json", help="where to write the fingerprints")
    p.add_argument("--requests", type=int, default=300, help="requests per busy-regime run (default 300)")
    args = p.parse_args(argv)
    fps = fingerprints(args.requests)
    with open(args.out, "w") as f:
        json.dump(fps, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    print(f"{len(fps)} runs fingerprinted into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
