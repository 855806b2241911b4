"""A timeline of one virtual-time run of a named regime's case: what each replica served, window
by window, and every long miss. For finding out where a case's tail comes from (a replica that
holds too much of the demand, or misses and what they were), which the report's per-seed rows
cannot show.

    python -m loadtests.vtime_trace --regime busy --case shared_docs_zipf --seed 14 --keep-alive 2

Prints, per window of `--window` virtual seconds (by arrival, from the earliest finished request's),
each replica's finished requests, their TTFT p90 and the prefixes they were for; then each replica's
share of the run's requests and the prefixes it served most; then every request that found under
half its prompt cached, with its kind as the report counts it (copy: another replica held its
prompt when it was routed; evicted: none did). A prefix is named by its popularity rank in the
run (#0: the most requested): a request's document, else its system prompt, else its first
segment. Same seed, same run as `loadtests.vtime_report --regime ...` (deterministic).
"""
from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import dataclass, field

import numpy as np

from loadtests.vtime import is_long_miss, simulate
from loadtests.vtime_keepalive import KeepAlive, add_keep_alive_args, keep_alive_from_args
from loadtests.vtime_pacing import Pacing
from loadtests.vtime_regimes import REGIMES, build_case, policy_with_params

__all__ = ["Served", "Trace", "format_trace", "main", "trace"]

_PREFIX_KINDS = ("document", "system")


@dataclass(frozen=True, slots=True)
class Served:
    """One finished measured request."""

    arrival_s: float  # virtual seconds from the earliest arrival among the finished requests
    replica: int
    prefix: str  # segment id of its document / system prompt / first segment
    ttft_s: float
    cached: int  # engine-reported cached prompt tokens
    prompt: int
    copy: bool  # another replica held its prompt when it was routed


@dataclass
class Trace:
    summary: dict  # the run's SimResult.summary()
    per_replica_requests: list  # routed, per replica (SimResult)
    served: list = field(default_factory=list)  # Served, in arrival order
    rank: dict = field(default_factory=dict)  # prefix -> popularity rank (0: most requested)

    def misses(self) -> list:
        """Requests that found under half their prompt cached (the report's misses)."""
        return [s for s in self.served if is_long_miss(s.cached, s.prompt)]


def _prefix_of(wr) -> str:
    for kind in _PREFIX_KINDS:
        seg = next((s for s in wr.segments if s.kind == kind), None)
        if seg is not None:
            return seg.seg_id
    return wr.segments[0].seg_id if wr.segments else ""


def trace(regime: str, case: str, seed: int, policy: str = "cache_plan", keep_alive: KeepAlive | None = None,
          n_requests: int | None = None, warm_chunk: int | None = None, refresh_first: bool = False) -> Trace:
    """Run one case at one seed (as loadtests.vtime_regimes.run_regime does) and record every
    finished measured request. `warm_chunk`: the copy-in-background probe (`vtime_report
    --copy-in-background --pace-chunk N`), new holders warmed in chunks of that many tokens;
    `refresh_first`: keep-alive's refreshes wait ahead of every request (`--keep-alive-priority`)."""
    reg = REGIMES[regime]
    c = build_case(regime, case, seed, n_requests)
    rows: list = []

    def observe(r, copy: bool) -> None:
        rows.append((r.arrival, r.rep, _prefix_of(r.wr), r.first_s - r.arrival, max(0, r.cached), r.prompt, copy))

    bg = warm_chunk is not None
    obj, pp = policy_with_params(policy, c.workload, c.keys, reg.replicas, {"copy_in_background": True} if bg else None)
    res = simulate(c.workload, obj, reg.replicas, reg.params, policy_params=pp, seed=seed, keys=c.keys,
                   warmup=c.warmup or None, keep_alive=keep_alive, refresh_first=refresh_first, observe=observe,
                   pacing=Pacing(None, warm_chunk) if bg else None)
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    served = [Served(a - t0, ri, pre, ttft, cached, prompt, copy) for a, ri, pre, ttft, cached, prompt, copy in rows]
    counts = collections.Counter(s.prefix for s in served)
    rank = {p: i for i, (p, _) in enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}
    return Trace(res.summary(), list(res.per_replica_requests), served, rank)


def _window_lines(tr: Trace, window_s: float) -> list[str]:
    n_rep = len(tr.per_replica_requests)
    by_win: dict = collections.defaultdict(list)
    for s in tr.served:
        by_win[int(s.arrival_s // window_s)].append(s)
    lines = []
    for w in sorted(by_win):
        cells = []
        for ri in range(n_rep):
            mine = [s for s in by_win[w] if s.replica == ri]
            p90 = float(np.percentile([s.ttft_s for s in mine], 90)) if mine else 0.0
            ranks = sorted({tr.rank[s.prefix] for s in mine})
            cells.append(f"r{ri} {len(mine):3d} p90 {p90:5.2f}: {','.join(map(str, ranks))}")
        lines.append(f"{w * window_s:6.0f}s | " + " | ".join(cells))
    return lines


def _replica_lines(tr: Trace) -> list[str]:
    total = max(1, len(tr.served))
    lines = []
    for ri, routed in enumerate(tr.per_replica_requests):
        per = collections.Counter(tr.rank[s.prefix] for s in tr.served if s.replica == ri)
        n = sum(per.values())
        top = ", ".join(f"#{k} {v / total:.1%}" for k, v in sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:6])
        lines.append(f"r{ri}: {n} finished ({n / total:.1%}), {routed} routed; most served: {top}")
    return lines


def format_trace(tr: Trace, window_s: float = 10.0) -> str:
    s = tr.summary
    head = (f"TTFT p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s; hit {s['hit_ratio']:.3f}; misses copy / "
            f"evicted {s['misses_copy']} / {s['misses_evicted']}; preemptions {s['preemptions']}; unfinished "
            f"{s['unfinished']}")
    out = [head, "", f"per {window_s:g} s window (by arrival): finished requests, TTFT p90 s, prefixes (popularity rank)"]
    out += _window_lines(tr, window_s)
    out += ["", "per replica (share of the finished requests):"] + _replica_lines(tr)
    out += ["", "long misses (under half the prompt cached):"]
    out += [f"{m.arrival_s:7.2f}s r{m.replica} #{tr.rank[m.prefix]} cached {m.cached}/{m.prompt} TTFT {m.ttft_s:.2f} s "
            f"{'copy' if m.copy else 'evicted'}" for m in tr.misses()] or ["none"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", default="busy", choices=sorted(REGIMES))
    ap.add_argument("--case", default="shared_docs_zipf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="cache_plan")
    add_keep_alive_args(ap)
    ap.add_argument("--copy-in-background", type=int, default=0, metavar="CHUNK",
                    help="the copy-in-background probe (as vtime_report --copy-in-background --pace-chunk CHUNK): "
                         "new holders warmed beside the traffic in CHUNK-token pieces (default 0: off)")
    ap.add_argument("--window", type=float, default=10.0, metavar="S", help="window length, virtual seconds")
    ap.add_argument("--requests", type=int, default=None, help="fewer (or more) requests than the case states")
    args = ap.parse_args(argv)
    if args.case not in REGIMES[args.regime].cases:
        ap.error(f"--case: one of {', '.join(REGIMES[args.regime].cases)}")
    if args.window <= 0 or (args.requests is not None and args.requests < 1) or args.copy_in_background < 0:
        ap.error("--window takes seconds > 0, --requests a count >= 1, --copy-in-background tokens >= 0")
    ka = keep_alive_from_args(ap, args)
    tr = trace(args.regime, args.case, args.seed, args.policy, ka, args.requests, args.copy_in_background or None,
               refresh_first=args.keep_alive_priority)
    print(format_trace(tr, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
