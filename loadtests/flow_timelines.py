"""Per-request timelines of a flow-control run (a diagnostic, not a benchmark): where the quiet
tenant's time to first token went, from a `python -m loadtests.bench_flow ... --trace DIR` file.

Each request's TTFT splits into: before an engine (the client's send to the engine's arrival:
the gateway, including any wait in flow control's queue), in the engine's queue (arrival to the
first step that scheduled it: no free sequence slot, or no KV room), and its prefill (that step
to the first token: the steps it shared, and their prefill tokens). The engines' clocks and the
client's are the same CLOCK_MONOTONIC (one Linux machine). Each request also gets a `cause`, the
first that applies: "held" (over 20 ms before an engine), "full engine" (every sequence slot
taken or spoken for when it arrived: running + waiting >= max_num_seqs), "shared step" (its
first step carried more prefill than its own), else "none".

Run:  python -m loadtests.flow_timelines DIR/2gw_on_h1_noisy.json [--tag quiet] [--after-s 8] [--slowest 10]
"""
from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_left


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def timelines(trace: dict, tag: str, after_s: float) -> list[dict]:
    """The tagged requests sent `after_s` or later into the run, each with its TTFT's parts and
    its engine's state: requests running and waiting at its arrival (of its tag, and all), and the
    steps between its first scheduling and its first token."""
    client = trace["client"]
    t0 = min(c["sent_at"] for c in client)
    by_id = {}
    for replica, eng in trace["engines"].items():
        steps = eng["steps"]
        starts = [s[0] for s in steps]
        for r in eng["requests"]:
            by_id[r["id"]] = (replica, r, steps, starts)
    eng_slots = {replica: eng.get("max_num_seqs") for replica, eng in trace["engines"].items()}
    # what each engine held at a moment: requests with arrival <= t < done, by tag
    live: dict[str, list[tuple[float, float, str]]] = {}
    for replica, eng in trace["engines"].items():
        live[replica] = [(r["t_arrival"], r.get("t_done", float("inf")), r["id"].split("-")[0]) for r in eng["requests"]]
    out = []
    for c in client:
        if c["tag"] != tag or c["ttft_s"] is None or c["sent_at"] - t0 < after_s or c["id"] not in by_id:
            continue
        replica, r, steps, starts = by_id[c["id"]]
        ta, ts, tf = r["t_arrival"], r["t_sched"] or r["t_first"], r["t_first"]
        there = [x for x in live[replica] if x[0] < ta < x[1]]
        i, j = bisect_left(starts, ts - 1e-9), bisect_left(starts, tf - 1e-9)
        shared = steps[i:j]
        gateway_s, slots = ta - c["sent_at"], eng_slots.get(replica)
        own_prefill = r["prompt"] - (r.get("cached") or 0)
        if gateway_s > 0.020:
            cause = "held"
        elif slots is not None and r["running_at_arrival"] + r["waiting_at_arrival"] >= slots:
            cause = "full engine"
        elif shared and shared[0][2] > own_prefill:
            cause = "shared step"
        else:
            cause = "none"
        out.append({
            "id": c["id"], "at_s": round(c["sent_at"] - t0, 2), "replica": replica, "ttft_ms": round(c["ttft_s"] * 1000, 1),
            "gateway_ms": round(gateway_s * 1000, 1), "engine_queue_ms": round((ts - ta) * 1000, 1),
            "prefill_ms": round((tf - ts) * 1000, 1), "cached": r.get("cached"), "prompt": r["prompt"],
            "running_at_arrival": r["running_at_arrival"], "waiting_at_arrival": r["waiting_at_arrival"],
            "own_open_at_arrival": sum(1 for x in there if x[2] == tag),
            "steps_to_first_token": len(shared),
            "step_ms": [round((s[1] - s[0]) * 1000, 1) for s in shared],
            "step_prefill_tokens": [s[2] for s in shared], "cause": cause,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="+", help="bench_flow --trace files")
    ap.add_argument("--tag", default="quiet")
    ap.add_argument("--after-s", type=float, default=8.0, help="only requests sent this long after the run's start (warm-up)")
    ap.add_argument("--slowest", type=int, default=8)
    args = ap.parse_args(argv)
    for path in args.trace:
        with open(path) as f:
            rows = timelines(json.load(f), args.tag, args.after_s)
        print(f"{path}: {len(rows)} {args.tag} requests after {args.after_s:g} s")
        if not rows:
            continue
        for k in ("ttft_ms", "gateway_ms", "engine_queue_ms", "prefill_ms", "steps_to_first_token", "own_open_at_arrival"):
            xs = [r[k] for r in rows]
            print(f"  {k:22s} p50 {_pct(xs, 0.5):8.1f}  p90 {_pct(xs, 0.9):8.1f}  p99 {_pct(xs, 0.99):8.1f}  max {max(xs):8.1f}")
        causes: dict[str, list[float]] = {}
        for r in rows:
            causes.setdefault(r["cause"], []).append(r["ttft_ms"])
        print("  causes: " + ", ".join(f"{c} {len(v)} (max {max(v):.0f} ms)" for c, v in sorted(causes.items(), key=lambda kv: -max(kv[1]))))
        for r in sorted(rows, key=lambda r: -r["ttft_ms"])[:args.slowest]:
            print("  " + json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
