"""The busy-regime comparison over seeds: one table, the goals checked, one plot.

    python -m loadtests.peers_summary FILE.json [FILE.json ...] [--md OUT.md] [--png OUT.png]

Rule: every FILE is the `--json` of one `loadtests/compare_peers.py --regime R --case C --seed S`
run (case and seed are read back from its command). Per case and router: the mean over seeds of
TTFT p50 / p99, e2e p50, the client's hit ratio, the failed requests (unfinished: timeouts and
errors) and the router's CPU per request, with each seed's figures beside it. The goals (the
busy regime's, as loadtests/vtime_regimes.py states them), on the means over seeds, per the
warmroute router named `--ours` (default the first warmroute router of each file):
- shared_docs (uniform): our p50 and p99 both at least 10% below the best peer's;
- shared_docs_zipf: nothing unfinished, p50 and p99 within 1.5x of our own uniform figures, hit
  ratio within 0.03 of our uniform one;
- multi_turn: p50 and p99 at least 10% below the best peer's;
- no_sharing: p50 and p99 within 5% of warmroute least_loaded's;
- router CPU per request at most 1.2x sglang-router's, on every case both ran and finished
  every request (one whose requests time out did less work per request: n/a).
A peer is a router that is not warmroute's. The plot: per case, TTFT p50 and p99 per router (bars:
mean over seeds; dots: each seed), log axis, unfinished requests in the labels.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cell", "collect", "check_goals", "markdown", "save_plot", "main"]

CASE_ORDER = ("shared_docs", "shared_docs_zipf", "multi_turn", "no_sharing")


@dataclass
class Cell:
    """One router on one case: its per-seed figures."""

    router: str
    case: str
    seeds: list = field(default_factory=list)
    p50_ms: list = field(default_factory=list)
    p99_ms: list = field(default_factory=list)
    e2e_p50_ms: list = field(default_factory=list)
    hit: list = field(default_factory=list)
    unfinished: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    cpu_ms_per_req: list = field(default_factory=list)

    def mean(self, name: str) -> float:
        return statistics.fmean(getattr(self, name))


def _case_and_seed(command: str) -> tuple[str, int]:
    argv = shlex.split(command)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--case", default="shared_docs")
    p.add_argument("--seed", type=int, default=0)
    known, _ = p.parse_known_args(argv)
    return known.case, known.seed


def collect(runs: list[dict]) -> dict[tuple[str, str], Cell]:
    """(case, router) -> Cell, from compare_peers JSON documents; unavailable routers are left out."""
    cells: dict[tuple[str, str], Cell] = {}
    for run in runs:
        case, seed = _case_and_seed(run["command"])
        for router, r in run["report"].items():
            if not r.get("available", True):
                continue
            c = cells.setdefault((case, router), Cell(router, case))
            c.seeds.append(seed)
            c.p50_ms.append(r["ttft_ms"]["p50"])
            c.p99_ms.append(r["ttft_ms"]["p99"])
            c.e2e_p50_ms.append(r["e2e_ms"]["p50"])
            c.hit.append(r["hit_ratio"])
            c.unfinished.append(r["errors"])
            c.requests.append(r["requests"])
            c.cpu_ms_per_req.append(1000.0 * r["cpu_s"]["router"] / max(1, r["requests"]))
    return cells


def _is_peer(router: str) -> bool:
    return not router.startswith("warmroute")


def _ours(cells: dict, case: str, ours: str | None) -> Cell | None:
    if ours:
        return cells.get((case, ours))
    mine = [c for (k, _), c in cells.items() if k == case and not _is_peer(c.router) and "least_loaded" not in c.router]
    return mine[0] if mine else None


def check_goals(cells: dict, ours: str | None = None) -> list[tuple[str, bool | None, str]]:
    """(goal, met (None: the runs cannot decide it), the figures behind it) for every goal."""
    out: list[tuple[str, bool, str]] = []

    def vs_best_peer(case: str, label: str) -> None:
        us = _ours(cells, case, ours)
        peers = [c for (k, _), c in cells.items() if k == case and _is_peer(c.router)]
        if not us or not peers:
            return
        for q in ("p50_ms", "p99_ms"):
            best = min(peers, key=lambda c: c.mean(q))
            ok = us.mean(q) <= 0.9 * best.mean(q)
            out.append((f"{label}: TTFT {q[:3]} at least 10% below the best peer's", ok,
                        f"{us.mean(q):.0f} ms vs {best.router} {best.mean(q):.0f} ms ({us.mean(q) / best.mean(q):.2g}x)"))

    vs_best_peer("shared_docs", "uniform")
    uni, zipf = _ours(cells, "shared_docs", ours), _ours(cells, "shared_docs_zipf", ours)
    if uni and zipf:
        out.append(("Zipf: nothing unfinished", sum(zipf.unfinished) == 0,
                    f"{sum(zipf.unfinished)} of {sum(zipf.requests)} over {len(zipf.seeds)} seeds"))
        for q in ("p50_ms", "p99_ms"):
            r = zipf.mean(q) / uni.mean(q)
            out.append((f"Zipf: TTFT {q[:3]} within 1.5x of our uniform", r <= 1.5,
                        f"{zipf.mean(q):.0f} vs {uni.mean(q):.0f} ms ({r:.2f}x)"))
        d = uni.mean("hit") - zipf.mean("hit")
        out.append(("Zipf: hit ratio within 0.03 of our uniform", d <= 0.03,
                    f"{zipf.mean('hit'):.3f} vs {uni.mean('hit'):.3f}"))
    vs_best_peer("multi_turn", "multi-turn")
    us = _ours(cells, "no_sharing", ours)
    ll = next((c for (k, _), c in cells.items() if k == "no_sharing" and "least_loaded" in c.router), None)
    if us and ll:
        for q in ("p50_ms", "p99_ms"):
            r = us.mean(q) / ll.mean(q)
            out.append((f"no_sharing: TTFT {q[:3]} within 5% of least_loaded", r <= 1.05,
                        f"{us.mean(q):.0f} vs {ll.mean(q):.0f} ms ({r:.2f}x)"))
    for case in CASE_ORDER:
        us = _ours(cells, case, ours)
        sg = next((c for (k, _), c in cells.items() if k == case and c.router.startswith("sglang")), None)
        if us and sg:
            r = us.mean("cpu_ms_per_req") / sg.mean("cpu_ms_per_req")
            failed = sum(us.unfinished) + sum(sg.unfinished)
            # a router whose requests time out does less work per request: no comparison then
            out.append((f"{case}: router CPU per request at most 1.2x sglang-router's", None if failed else r <= 1.2,
                        f"{us.mean('cpu_ms_per_req'):.2f} vs {sg.mean('cpu_ms_per_req'):.2f} CPU-ms ({r:.2f}x)"
                        + (f"; not comparable: {failed} requests unfinished" if failed else "")))
    return out


def _ordered(cells: dict) -> list[Cell]:
    rank = {c: i for i, c in enumerate(CASE_ORDER)}
    return sorted(cells.values(), key=lambda c: (rank.get(c.case, 99), c.case, _is_peer(c.router), c.router))


def markdown(cells: dict, goals: list) -> str:
    head = ["case", "router", "seeds", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "hit ratio", "unfinished",
            "router CPU-ms / req", "p50 per seed", "p99 per seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in _ordered(cells):
        lines.append("| " + " | ".join([
            c.case, c.router, " ".join(map(str, c.seeds)), f"{c.mean('p50_ms'):.0f}", f"{c.mean('p99_ms'):.0f}",
            f"{c.mean('e2e_p50_ms'):.0f}", f"{c.mean('hit'):.3f}", f"{sum(c.unfinished)} / {sum(c.requests)}",
            f"{c.mean('cpu_ms_per_req'):.2f}", " ".join(f"{v:.0f}" for v in c.p50_ms),
            " ".join(f"{v:.0f}" for v in c.p99_ms)]) + " |")
    lines += ["", "| goal | met | figures (means over seeds) |", "|---|---|---|"]
    lines += [f"| {g} | {'n/a' if ok is None else 'yes' if ok else '**no**'} | {why} |" for g, ok, why in goals]
    return "\n".join(lines) + "\n"


def save_plot(cells: dict, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [k for k in CASE_ORDER if any(c.case == k for c in cells.values())]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4.2), squeeze=False)
    for ax, case in zip(axes[0], cases):
        row = [c for c in _ordered(cells) if c.case == case]
        for i, c in enumerate(row):
            for j, (q, colour) in enumerate((("p50_ms", "tab:blue"), ("p99_ms", "tab:red"))):
                x = i + (j - 0.5) * 0.38
                ax.bar(x, c.mean(q), width=0.36, color=colour, alpha=0.55, label=("TTFT " + q[:3]) if i == 0 else None)
                ax.scatter([x] * len(getattr(c, q)), getattr(c, q), color=colour, s=10, zorder=3)
        ax.set_yscale("log")
        ax.set_xticks(range(len(row)))
        ax.set_xticklabels([c.router.replace(" ", "\n") + (f"\n{sum(c.unfinished)} unfinished" if sum(c.unfinished) else "")
                            for c in row], fontsize=7)
        ax.set_title(case, fontsize=10)
        ax.set_ylabel("TTFT ms (bars: mean of seeds; dots: seeds)", fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Title": title})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.peers_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="compare_peers --json files")
    p.add_argument("--ours", default=None, help="the warmroute router the goals are for (default: the first warmroute one)")
    p.add_argument("--md", default=None, help="write the table and the goals here")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--title", default="busy regime: 4 replicas, 75% load, wall clock")
    args = p.parse_args(argv)
    cells = collect([json.loads(Path(f).read_text()) for f in args.files])
    text = markdown(cells, check_goals(cells, args.ours))
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.png:
        save_plot(cells, args.png, args.title)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
