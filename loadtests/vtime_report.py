"""The virtual-time comparison table: every policy on the same workloads, seeds and arrivals.

Rule: for each (workload, replica count) one workload is built (deterministic for --seed), its
keys and its oracle bound are computed once, its arrival times are scaled so the *offered load*
is `--util` (default 0.7), and then every policy runs on exactly those requests. Prints a
markdown table (and writes JSON with --json), headed by the command line that produced it.

Offered load (stated in the output): the work an ideal router would leave per replica-second,

    util = rate_rps x (mean_uncached_tokens_oracle x prefill_s_per_token
                       + max_output_tokens x (decode_s_per_seq + step_overhead_s / 32)) / replicas

with mean_uncached_tokens_oracle from the pooled-Belady oracle (KV capacity counted), i.e. the
least prefill any router could do; a router that misses more than the oracle runs hotter.
Arrival times are multiplied by one factor to reach it (Poisson stays Poisson; multi-turn think
times scale too).

Chats: a turn is never sent before the previous turn of its conversation finished (loadtests/
vtime.py), so a conversation lasts at least turns x (TTFT + answer) however much the scaling
compresses think times; chat workloads therefore get at least MIN_CHAT_RUN_S (30) virtual seconds
of arrivals so that conversations overlap at the offered rate instead of ramping up and down.

Collapse: a run whose queue grows without bound is stopped once any request has waited
COLLAPSE_TTFT_S (30 virtual s) for its first token and is marked "(collapsed)"; its TTFT figures
count every request routed so far (those still waiting with their wait at the stop, a lower bound)
and its hit ratio covers the finished requests. Deterministic for --seed (virtual time only).

    python -m loadtests.vtime_report --md loadtests/results/vtime.md   # full table (4, 16, 64 replicas)
    python -m loadtests.vtime_report --quick    # small table, well under a minute
    python -m loadtests.vtime_report --regime busy --md loadtests/results/vtime_busy.md

Named regimes (`--regime`, loadtests/vtime_regimes.py): fixed shapes, rates and replica models
instead of the scaled table, each with its own goals; `busy` is the busy-replica regime of the
wall-clock comparison (4 replicas, 3,000-token documents at 24 requests/s, the sim's wall-clock
time profile, KV for a third of the working set), its policies beside an emulation of the peer
routers' cache_aware, over several seeds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from loadtests.oracle import infinite_bound, pooled_belady_bound
from loadtests.vtime import SimParams, prepare_keys, simulate
from loadtests.vtime_keepalive import add_keep_alive_args, keep_alive_from_args
from loadtests.vtime_pacing import Pacing
from loadtests.workloads import Workload, build_workload
from policies.registry import POLICY_NAMES

__all__ = ["WORKLOAD_SETUPS", "run_table", "main"]

# per workload: builder kwargs as a function of replicas R, and the KV blocks per replica.
# KV is chosen so that one replica cannot hold the whole working set, but its share of it can.
WORKLOAD_SETUPS = {
    "shared_docs": (lambda R: dict(n_docs=10 * R, doc_tokens=3000, popularity="uniform"), 2500),
    "shared_docs_zipf": (lambda R: dict(n_docs=10 * R, doc_tokens=3000, popularity="zipf", zipf_s=1.1), 2500),
    "multi_turn": (lambda R: dict(turns=6, system_tokens=1500, user_tokens=300, answer_tokens=120, think_s=8.0), 6000),
    "rag": (lambda R: dict(n_topics=10 * R, chunks_per_topic=6, chunks_per_request=4, chunk_tokens=500), 2500),
    "multi_tenant": (lambda R: dict(n_docs=3 * R, doc_tokens=3000, n_tenants=4), 2500),
    "hot_prefix": (lambda R: dict(hot_share=0.5, n_docs=10 * R, doc_tokens=3000), 2500),
    "no_sharing": (lambda R: dict(prompt_tokens=1500), 2500),
}
DEFAULT_WORKLOADS = ["shared_docs", "multi_turn", "rag", "hot_prefix", "no_sharing"]
# a run stops, marked collapsed, once a request has waited this long (virtual s) for its first token:
# at 0.7 offered load a working router's p99 stays within a few seconds, so 30 s means the queue is
# growing without bound, and simulating the rest only burns CPU (a collapsed run costs O(queue) per step)
COLLAPSE_TTFT_S = 30.0
# chats (workloads with conversations) get at least this many virtual seconds of arrivals (see run_table)
MIN_CHAT_RUN_S = 30.0


def _scaled(w: Workload, factor: float, rate: float) -> Workload:
    reqs = tuple(dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in w.requests)
    return dataclasses.replace(w, requests=reqs, rate_rps=rate)


def _prepare(wl, kw, n_req, R, num_blocks, params, util, seed):
    """The workload at rate 1, its keys, both oracle bounds, and the rate that offers `util`."""
    w = build_workload(wl, n_req, seed=seed, rate_rps=1.0, **kw)
    keys = prepare_keys(w, params.block_size, params.model)
    pt = [r.prompt_tokens for r in w.requests]
    pk = [k.prompt for k in keys]
    ok = [k.output for k in keys]
    inf = infinite_bound(pt, pk, ok, params.block_size)
    bel = pooled_belady_bound(pt, pk, ok, params.block_size, R * num_blocks)
    mean_unc = (bel.prompt_tokens - bel.cached_tokens) / len(pt)
    mean_out = sum(r.max_output_tokens for r in w.requests) / len(pt)
    per_req_s = mean_unc * params.prefill_s_per_token + mean_out * (params.decode_s_per_seq + params.step_overhead_s / 32)
    return w, keys, inf, bel, util * R / per_req_s


def run_table(workloads, replicas, policies, n_requests_for, util: float, seed: int, progress=None, collapse_ttft_s: float | None = COLLAPSE_TTFT_S, policy_params: dict | None = None, gateways: int = 1) -> list[dict]:
    rows = []
    for wl in workloads:
        kw_of, num_blocks = WORKLOAD_SETUPS[wl]
        for R in replicas:
            n_req = n_requests_for(R)
            params = SimParams(num_blocks=num_blocks)
            for _attempt in range(2):
                w, keys, inf, bel, rate = _prepare(wl, kw_of(R), n_req, R, num_blocks, params, util, seed)
                # chats: a conversation lasts turns x (TTFT + answer) of virtual time however much
                # its think times are compressed, so the run must be long enough for conversations
                # to overlap at the offered rate rather than ramp up and down (MIN_CHAT_RUN_S)
                if not any(r.conversation for r in w.requests) or n_req >= rate * MIN_CHAT_RUN_S:
                    break
                n_req = int(rate * MIN_CHAT_RUN_S) + 1
            base_rate = len(w.requests) / w.requests[-1].arrival_s  # realised rate at rate_rps=1 (multi-turn differs)
            w = _scaled(w, base_rate / rate, rate)
            for pol in policies:
                res = simulate(w, pol, R, params, policy_params=(policy_params or {}).get(pol), seed=seed, keys=keys,
                               collapse_ttft_s=collapse_ttft_s, gateways=gateways)
                s = res.summary()
                s.update(
                    rate_rps=rate,
                    kv_blocks_per_replica=num_blocks,
                    oracle_hit_ratio=bel.hit_ratio,
                    oracle_inf_hit_ratio=inf.hit_ratio,
                    frac_of_oracle=(s["hit_ratio"] / bel.hit_ratio) if bel.hit_ratio > 0 else float("nan"),
                    policy_params=res.policy_params,
                )
                rows.append(s)
                if progress:
                    progress(s)
    return rows


def _fmt(x, nd=3):
    if isinstance(x, float):
        if x != x:
            return "-"
        return f"{x:.{nd}f}"
    return str(x)


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, checked on the table."""
    out = []
    by = {(r["workload"], r["replicas"], r["policy"]): r for r in rows}
    for (wl, R, pol), r in sorted(by.items()):
        if pol not in ("cache_aware", "cache_plan"):  # the product's policy and its candidate
            continue
        if wl in ("shared_docs", "shared_docs_zipf", "multi_turn") and (wl, R, "round_robin") in by:
            rr = by[(wl, R, "round_robin")]
            ok1 = r["ttft_p99_s"] <= rr["ttft_p99_s"] / 3
            ok2 = r["frac_of_oracle"] >= 0.9
            out.append(f"{wl} R={R} {pol}: p99 {r['ttft_p99_s']:.3f}s vs round_robin {rr['ttft_p99_s']:.3f}s (<=1/3: {'OK' if ok1 else 'MISS'}); hit {r['frac_of_oracle']:.2f} of oracle (>=0.9: {'OK' if ok2 else 'MISS'})")
        if wl == "no_sharing" and (wl, R, "least_loaded") in by:
            ll = by[(wl, R, "least_loaded")]
            ok = all(r[k] <= ll[k] * 1.05 + 1e-3 for k in ("ttft_p50_s", "ttft_p99_s"))
            out.append(f"{wl} R={R} {pol}: p50/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f}s vs least_loaded {ll['ttft_p50_s']:.3f}/{ll['ttft_p99_s']:.3f}s (within 5%: {'OK' if ok else 'MISS'})")
        if wl == "hot_prefix":
            ok = r["load_max_over_mean"] <= 1.5
            out.append(f"{wl} R={R} {pol}: max/mean requests per replica {r['load_max_over_mean']:.2f} (<=1.5: {'OK' if ok else 'MISS'})")
    return out


def markdown(rows: list[dict], command: str, util: float) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Offered load {util:.2f} of capacity under the pooled-Belady oracle's hits (see vtime_report header); "
        "TTFT in seconds; hit = engine cached / prompt tokens; oracle = pooled-Belady upper bound (KV of all replicas pooled); "
        "load = max/mean requests per replica.",
        "",
        "| workload | R | rate rps | policy | TTFT p50 | p90 | p99 | max | thr rps | hit | oracle | frac | load max/mean | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| " + " | ".join([
                r["workload"], str(r["replicas"]), _fmt(r["rate_rps"], 0), r["policy"] + (" (collapsed)" if r.get("collapsed") else ""),
                _fmt(r["ttft_p50_s"]), _fmt(r["ttft_p90_s"]), _fmt(r["ttft_p99_s"]), _fmt(r["ttft_max_s"]),
                _fmt(r["throughput_rps"], 1), _fmt(r["hit_ratio"]), _fmt(r["oracle_hit_ratio"]), _fmt(r["frac_of_oracle"], 2),
                _fmt(r["load_max_over_mean"], 2), _fmt(r["wall_s"], 1),
            ]) + " |"
        )
    lines += ["", "Goals:", ""] + [f"- {g}" for g in goals(rows)]
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    """`--seeds`: comma-separated seeds and inclusive ranges ("0,1,2", "0-19", "0-4,9"), in order,
    each seed once; ValueError on anything else (an empty list too)."""
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed (an integer >= 0) or a range a-b") from None
        if a < 0 or b < a:
            raise ValueError(f"--seeds: {part!r} is not a seed (an integer >= 0) or a range a-b with a <= b")
        out += [x for x in range(a, b + 1) if x not in out]
    if not out:
        raise ValueError("--seeds: no seed given")
    return out


def parse_engine(items: list[str]) -> dict:
    """`--engine FIELD=VALUE` items -> SimParams fields to replace: numeric fields only, an int
    field an integer, every value >= 0 (the KV and batch sizes >= 1); ValueError naming the item otherwise."""
    import dataclasses

    from loadtests.vtime import SimParams

    kinds = {f.name: f.type for f in dataclasses.fields(SimParams) if f.type in ("int", "float", "float | None")}
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in kinds:
            raise ValueError(f"{item!r} is not FIELD=VALUE with FIELD one of {', '.join(sorted(kinds))}")
        try:
            value = int(text) if kinds[name] == "int" else float(text)
        except ValueError:
            raise ValueError(f"{item!r}: {name} takes {'an integer' if kinds[name] == 'int' else 'a number'}") from None
        least = 1 if name in ("block_size", "num_blocks", "max_num_seqs", "max_batched_tokens") else 0
        if not value >= least:
            raise ValueError(f"{item!r}: {name} takes a value >= {least}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small table: 4 and 16 replicas, fewer requests")
    ap.add_argument("--regime", default=None, help="run a named regime of loadtests/vtime_regimes.py instead of the table (busy, busy_wallclock_cold)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of a --regime run: a comma list of seeds and ranges "
                                                       "(0,1,2; 0-19; 0-4,9; default 0,1,2)")
    ap.add_argument("--workload", action="append", default=[], choices=sorted(WORKLOAD_SETUPS), help="repeatable (default: the five of the issue)")
    ap.add_argument("--policy", action="append", default=[], help="repeatable (default: all; a --regime also takes sglang_cache_aware, static_plan, static_plan_blind[:STAY_TOL])")
    ap.add_argument("--replicas", type=int, action="append", default=[], help="repeatable (default 4 16 64; --quick: 4 16)")
    ap.add_argument("--requests-per-replica", type=int, default=None, help="requests per replica (default 125, at least 4000 in all; --quick: 100, at least 1500)")
    ap.add_argument("--util", type=float, default=0.7, help="offered load, 0..1 (default 0.7)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--pace-min", type=int, default=0, metavar="TOKENS",
                    help="with --regime: the paced-prefill design probe (loadtests/vtime_pacing.py; the gateway does not pace): "
                         "requests predicted to miss at least TOKENS are prefilled in chunks first (default 0: off)")
    ap.add_argument("--pace-chunk", type=int, default=512, metavar="TOKENS", help="tokens per chunk of --pace-min (default 512)")
    ap.add_argument("--pace-no-follow", action="store_true", help="with --pace-min: same-prefix requests do not wait for a chain")
    ap.add_argument("--copy-in-background", action="store_true",
                    help="with --regime: cache_plan's copy_in_background probe (loadtests/vtime_pacing.py; the gateway does not warm): "
                         "a new holder is warmed beside the traffic, in --pace-chunk pieces (a chunk as long as the document: whole); "
                         "the static plan warms its planned holders the same way")
    ap.add_argument("--long-prefill-threshold", type=int, default=0, metavar="TOKENS",
                    help="with --regime: the engines cap one request's prefill at TOKENS per step (vLLM's "
                         "--long-prefill-token-threshold; default 0: the regime's engines, no cap)")
    ap.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                    help="with --regime, repeatable: one engine or feed parameter of the regime replaced (a numeric "
                         "loadtests.vtime.SimParams field, e.g. step_overhead_s=0.0119 or report_interval_s=0.2): how "
                         "much a case's figures move when the model moves a little")
    add_keep_alive_args(ap)  # with --regime
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="with --regime: N requests per case instead of the case's own (1,500): does a policy hold "
                         "once its start is behind it (the summary's last-third columns)")
    ap.add_argument("--gateways", type=int, default=1, metavar="N",
                    help="N gateway processes (workers or pods), each with its own policy instance, index "
                         "and in-flight counts, each request routed by one at random (loadtests/vtime_router.SimGateways; "
                         "the peers' emulation and the static plan run as one; default 1)")
    ap.add_argument("--md", default=None, metavar="FILE", help="also write the markdown (with the total wall time) to FILE")
    args = ap.parse_args(argv)
    if args.pace_min < 0 or args.pace_chunk < 1:
        ap.error("--pace-min takes tokens >= 0 (0: off) and --pace-chunk tokens >= 1")
    if args.long_prefill_threshold < 0:
        ap.error("--long-prefill-threshold takes tokens >= 0 (0: no cap)")
    try:
        engine = parse_engine(args.engine)
    except ValueError as exc:
        ap.error(f"--engine: {exc}")
    if args.long_prefill_threshold:
        engine["long_prefill_token_threshold"] = args.long_prefill_threshold
    keep_alive = keep_alive_from_args(ap, args)
    if args.gateways < 1:
        ap.error("--gateways takes a count >= 1")
    if args.requests is not None and (args.requests < 1 or not args.regime):
        ap.error("--requests takes a count >= 1 and goes with --regime")
    if (args.pace_min or args.copy_in_background or engine or args.keep_alive) and not args.regime:
        ap.error("--pace-min, --copy-in-background, --long-prefill-threshold, --engine and --keep-alive go with --regime "
                 "(the probes run on the named regimes)")
    if args.regime:
        from loadtests.vtime_regimes import blind_stay_tol, regime_main

        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as exc:
            ap.error(str(exc))
        for pol in args.policy:
            try:
                blind_stay_tol(pol)
            except ValueError as exc:
                ap.error(f"--policy {exc}")

        command = "python -m loadtests.vtime_report " + " ".join(argv if argv is not None else sys.argv[1:])
        return regime_main(args.regime, seeds, args.workload, args.policy,
                           command.strip(), args.md, args.json,
                           Pacing(args.pace_min or None, args.pace_chunk, not args.pace_no_follow)
                           if args.pace_min > 0 or args.copy_in_background else None,
                           {"copy_in_background": True} if args.copy_in_background else None,
                           engine or None,
                           keep_alive,
                           refresh_first=args.keep_alive_priority, gateways=args.gateways, n_requests=args.requests)
    bad = [x for x in args.policy if x not in POLICY_NAMES]
    if bad:
        ap.error(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    wls = args.workload or DEFAULT_WORKLOADS
    pols = args.policy or list(POLICY_NAMES)
    reps = args.replicas or ([4, 16] if args.quick else [4, 16, 64])
    per = args.requests_per_replica or (100 if args.quick else 125)
    floor = 1500 if args.quick else 4000
    t0 = time.perf_counter()

    def progress(s):
        print(f"  {s['workload']:>14} R={s['replicas']:<3} {s['policy']:>12}: p99 {s['ttft_p99_s']:.3f}s hit {s['hit_ratio']:.3f} frac {s['frac_of_oracle']:.3f} load {s['load_max_over_mean']:.2f}{' COLLAPSED' if s['collapsed'] else ''} ({s['wall_s']:.1f}s)", file=sys.stderr, flush=True)

    rows = run_table(wls, reps, pols, lambda R: max(floor, per * R), args.util, args.seed, progress, gateways=args.gateways)
    command = "python -m loadtests.vtime_report " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command.strip(), args.util) + f"\n\n(total wall time {time.perf_counter() - t0:.0f} s)\n"
    print(text, end="")
    if args.md:
        import os

        os.makedirs(os.path.dirname(args.md) or ".", exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
