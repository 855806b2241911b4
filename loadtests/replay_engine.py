"""Replay a wall-clock run through the engine model alone: how much of each replica's measured
time to first token the engine's own queue explains.

What it does: `compare_peers --regime R --case C --seed S --samples FILE` records, per measured
request, its send time, the replica that served it, its TTFT and its prompt and cached tokens.
Here every replica's requests are fed, at their send times, to one `SimEngine` (the sims' own
engine core, loadtests/sim/scheduler.py) with the regime's settings, in virtual time, and each
request's engine-alone TTFT is printed beside the measured one: per replica, p50 and p99, long
misses (under half the prompt cached), and the median per window of the run. Where the two agree,
the engine's queue is the whole story and the routing is what made it; where the measured time is
longer, something outside the engine model added it (the gateway's holds, the HTTP path, the sims
falling behind their time model, or prompts heavier than the model's: the 2026-12-04 finding,
loadtests/results/busy_regime_log.md, "The token rendering's framing").

Rules: the prompt is the workload's token rendering (what virtual time runs); before the stream a
replica gets, one at a time, the regime's warm-up requests whose shared prefix its first request
of that prefix found cached in the run (a pre-warm, or a copy made early, is thus modelled; one
evicted before its first request is not). Not modelled: requests the samples do not hold (the
gateway's keep-alive refreshes, another router's traffic), and flow control (send time is used as
the engine's arrival). Pure apart from reading the samples file.

    python -m loadtests.replay_engine --samples FILE --regime busy --case shared_docs_zipf --seed 1 [--requests N]

(`--requests N` for a run made with `compare_peers --regime-requests N`; samples that are not
requests of the case as built are refused, never silently left out.)
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from loadtests.runner import percentiles
from loadtests.sim.scheduler import EngineConfig, SimEngine, SimRequest, TimeModel
from loadtests.vtime_regimes import REGIMES, build_case
from loadtests.workloads import render_token_ids

__all__ = ["Replayed", "replay", "main"]


@dataclass(frozen=True, slots=True)
class Replayed:
    """One measured request, replayed."""

    arrival_s: float  # send time, from the run's first send
    engine_ttft_s: float  # the engine model's TTFT for it, replayed
    measured_ttft_s: float
    engine_uncached: int  # prompt tokens the engine model computed
    measured_uncached: int  # prompt minus cached tokens the run's engine reported
    prompt_tokens: int  # as the run's engine counted them


def _engine(p) -> SimEngine:
    tm = TimeModel(step_overhead_s=p.step_overhead_s, prefill_s_per_token=p.prefill_s_per_token,
                   decode_s_per_seq=p.decode_s_per_seq)
    return SimEngine(EngineConfig(block_size=p.block_size, num_blocks=p.num_blocks, max_num_seqs=p.max_num_seqs,
                                  max_num_batched_tokens=p.max_batched_tokens, time=tm))


def _prefix(req, n_segments: int) -> tuple:
    return tuple(s.seg_id for s in req.segments[:n_segments])


def replay(samples: list[dict], case, params) -> dict[str, list[Replayed]]:
    """Per replica, its measured requests (samples of `case`'s stream) replayed (module rules)."""
    byid = {r.request_id: r for r in case.workload.requests}
    samples = sorted((s for s in samples if s.get("ok", True) and s["tag"] in byid), key=lambda s: s["start_s"])
    if not samples:
        return {}
    t0 = samples[0]["start_s"]
    out: dict[str, list[Replayed]] = {}
    for rid in sorted({s["replica"] for s in samples}):
        mine = [s for s in samples if s["replica"] == rid]
        e = _engine(params)
        for i, w in enumerate(case.warmup):  # the warm-ups whose prefix its first request found cached
            shared = len(w.segments) - 1
            first = next((s for s in mine if _prefix(byid[s["tag"]], shared) == _prefix(w, shared)), None)
            if first is None or 2 * first["cached_tokens"] < first["prompt_tokens"]:
                continue
            e.add_request(SimRequest(f"warm-{i}", render_token_ids(w), max_tokens=1))
            while e.has_work:
                e.step()
        t, k, firsts, reqs = 0.0, 0, {}, []
        while k < len(mine) or e.has_work:
            if not e.has_work:
                t = max(t, mine[k]["start_s"] - t0)
            while k < len(mine) and mine[k]["start_s"] - t0 <= t:
                s = mine[k]
                r = byid[s["tag"]]
                q = SimRequest(s["tag"], render_token_ids(r), max_tokens=r.max_output_tokens)
                reqs.append((s, e.add_request(q)))
                k += 1
            step = e.step()
            e.take_events()
            t += step.duration_s
            for q in step.tokens:
                if q.num_output_tokens == 1:
                    firsts[q.request_id] = t
        out[rid] = [Replayed(s["start_s"] - t0, firsts[s["tag"]] - (s["start_s"] - t0), s["ttft_s"],
                             q.num_prompt_tokens - q.num_cached_tokens, s["prompt_tokens"] - s["cached_tokens"],
                             s["prompt_tokens"])
                    for s, q in reqs]
    return out


def report(rows: dict[str, list[Replayed]], window_s: float = 5.0) -> str:
    lines = []
    for rid, rs in rows.items():
        eng = percentiles((r.engine_ttft_s for r in rs), (50, 99))
        mea = percentiles((r.measured_ttft_s for r in rs), (50, 99))
        lines.append(f"{rid}: {len(rs)} requests; TTFT p50 / p99 s: engine alone {eng['p50']:.2f} / "
                     f"{eng['p99']:.2f}, measured {mea['p50']:.2f} / {mea['p99']:.2f}; "
                     f"long misses "
                     f"{sum(2 * r.engine_uncached > r.prompt_tokens for r in rs)} / "
                     f"{sum(2 * r.measured_uncached > r.prompt_tokens for r in rs)}; prefill tokens "
                     f"{sum(r.engine_uncached for r in rs)} / {sum(r.measured_uncached for r in rs)}")
        end = max(r.arrival_s for r in rs)
        for label, pick in (("engine  ", lambda r: r.engine_ttft_s), ("measured", lambda r: r.measured_ttft_s)):
            cells = []
            w = 0.0
            while w <= end:
                xs = [pick(r) for r in rs if w <= r.arrival_s < w + window_s]
                cells.append(f"{statistics.median(xs):.1f}" if xs else "-")
                w += window_s
            lines.append(f"  {label} p50 per {window_s:g} s: {' '.join(cells)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.replay_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", required=True, help="compare_peers --samples file (JSON lines)")
    ap.add_argument("--regime", required=True, choices=sorted(REGIMES))
    ap.add_argument("--case", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--router", default=None, help="the samples' router label (default: the only one)")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="the run's request count when it was not the case's own (compare_peers --regime-requests N)")
    ap.add_argument("--window-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        ap.error("--requests takes a count >= 1")
    with open(args.samples) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    routers = sorted({s.get("router", "") for s in samples})
    if args.router is None and len(routers) > 1:
        ap.error(f"--router: the samples hold {', '.join(routers)}")
    samples = [s for s in samples if args.router is None or s.get("router") == args.router]
    reg = REGIMES[args.regime]
    if args.case not in reg.cases:
        ap.error(f"--case: {args.regime} has {', '.join(reg.cases)}")
    case = build_case(args.regime, args.case, args.seed, n_requests=args.requests)
    ids = {r.request_id for r in case.workload.requests}
    foreign = sum(1 for s in samples if s["tag"] not in ids)
    if foreign:  # another case, seed or length: replaying a part of the run would mislead
        ap.error(f"{foreign} of {len(samples)} samples are not requests of {args.case} at seed {args.seed} with "
                 f"{len(ids)} requests (a run with --regime-requests N needs --requests N)")
    print(report(replay(samples, case, reg.params), args.window_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
