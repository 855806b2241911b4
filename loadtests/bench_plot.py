"""The bench plot: which policy wins, and by how much, at a glance.

Rule: one figure per run, titled with the run's context (workload, replicas, requests, rate, seed)
and the headline (lowest TTFT p50 and its ratio to the worst); top row: the TTFT distribution per
policy as an ECDF on a log axis (share of requests whose first token came within x ms; failed
requests are counted in the legend, not drawn) and the prompt-token hit ratio per policy as bars;
bottom row: requests in flight per replica over time, one panel per policy (from the client's own
samples: start to end of each successful request, by the replica the gateway named). The PNG
carries the title and the axes' labels as text metadata, so a test can read them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["BenchFigure", "build_figure", "save_plot", "in_flight_series", "png_info"]


@dataclass
class BenchFigure:
    fig: object  # matplotlib Figure
    title: str
    ax_ttft: object
    ax_hit: object
    ax_load: list  # one Axes per policy, in report order


def in_flight_series(samples: Sequence) -> dict[str, tuple[list[float], list[int]]]:
    """replica -> (times s, requests in flight just after each time), from successful samples."""
    events: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        if not s.ok or not s.replica or s.e2e_s != s.e2e_s:
            continue
        ev = events.setdefault(s.replica, [])
        ev.append((s.start_s, 1))
        ev.append((s.start_s + s.e2e_s, -1))
    out = {}
    for rid in sorted(events):
        t, n, cur = [0.0], [0], 0
        for when, d in sorted(events[rid], key=lambda x: (x[0], x[1])):
            cur += d
            t.append(when)
            n.append(cur)
        out[rid] = (t, n)
    return out


def _title(report: dict, context: dict) -> str:
    parts = [f"workload {context.get('workload', '?')}"]
    if context.get("replicas"):
        parts.append(f"{context['replicas']} replicas")
    parts.append(f"{context.get('requests', '?')} requests at {context.get('rate', '?')}")
    if context.get("seed") is not None:
        parts.append(f"seed {context['seed']}")
    head = f"warmroute {context.get('command', 'bench')}: " + ", ".join(parts)
    p50 = {n: r["ttft_ms"]["p50"] for n, r in report.items() if r["ttft_ms"]["p50"] == r["ttft_ms"]["p50"]}
    if len(p50) >= 2:
        best, worst = min(p50, key=p50.get), max(p50, key=p50.get)
        ratio = p50[worst] / p50[best] if p50[best] > 0 else float("inf")
        head += f"\nlowest TTFT p50: {best} {p50[best]:.0f} ms; {worst} {p50[worst]:.0f} ms ({ratio:.1f}x)"
    return head


def build_figure(report: dict[str, dict], runs: dict[str, Sequence], context: dict) -> BenchFigure:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    names = list(report)
    fig = Figure(figsize=(max(10.0, 3.6 * len(names)), 8.0), layout="constrained")
    title = _title(report, context)
    fig.suptitle(title)
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.15, 1.0])
    ax_ttft, ax_hit = top.subplots(1, 2, width_ratios=[2.2, 1.0])
    for name in names:
        ok = sorted(s.ttft_s * 1000.0 for s in runs.get(name, ()) if s.ok and s.ttft_s == s.ttft_s)
        r = report[name]
        failed = f", {r['errors']} failed" if r["errors"] else ""
        label = (f"{name} (p50 {r['ttft_ms']['p50']:.0f} ms, p99 {r['ttft_ms']['p99']:.0f} ms{failed})" if ok
                 else f"{name} (no successful request{failed})")
        if ok:
            n = len(runs.get(name, ())) or len(ok)  # failed requests never reach the curve
            ax_ttft.step(ok, [(i + 1) / n for i in range(len(ok))], where="post", label=label)
        else:
            ax_ttft.plot([], [], label=label)
    ax_ttft.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax_ttft.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 100, not 10^2
    # minor ticks: label only 2x and 5x (20, 50, 200, 500 ...) so the labels never overlap
    ax_ttft.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax_ttft.set_ylim(0, 1.0)
    ax_ttft.set_xlabel("time to first token (ms, log scale)")
    ax_ttft.set_ylabel("share of requests with TTFT <= x")
    ax_ttft.set_title("TTFT distribution per policy (ECDF)")
    ax_ttft.grid(True, which="both", alpha=0.3)
    ax_ttft.legend(loc="best", fontsize="small")
    hits = [report[n]["hit_ratio"] for n in names]
    bars = ax_hit.bar(names, hits, color=[f"C{i}" for i in range(len(names))])
    ax_hit.bar_label(bars, labels=[f"{h:.2f}" for h in hits])
    ax_hit.set_ylim(0, 1.05)
    ax_hit.set_ylabel("cached / prompt tokens")
    ax_hit.set_title("prompt-token cache hit ratio")
    ax_hit.tick_params(axis="x", rotation=20)
    ax_load = list(bottom.subplots(1, len(names), sharey=True, squeeze=False)[0])
    for i, (ax, name) in enumerate(zip(ax_load, names)):
        for rid, (t, n) in in_flight_series(runs.get(name, ())).items():
            ax.step(t, n, where="post", label=rid, linewidth=1)
        ax.set_title(f"{name}: requests in flight per replica", fontsize="medium")
        ax.set_xlabel("time since start (s)")
        if i == 0:
            ax.set_ylabel("requests in flight")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small", loc="upper right")
    return BenchFigure(fig, title, ax_ttft, ax_hit, ax_load)


def save_plot(report: dict[str, dict], runs: dict[str, Sequence], context: dict, path: str | Path, dpi: int = 100) -> BenchFigure:
    bf = build_figure(report, runs, context)
    axes = [bf.ax_ttft, bf.ax_hit, *bf.ax_load]
    desc = "; ".join(f"{a.get_title()} [x: {a.get_xlabel()}; y: {a.get_ylabel()}]" for a in axes)
    bf.fig.savefig(path, dpi=dpi, metadata={"Title": bf.title, "Description": desc})
    return bf


def png_info(path: str | Path) -> dict:
    """Read a PNG back: width, height and its tEXt metadata (keyword -> text); raises ValueError
    when the file is not a PNG."""
    import struct
    import zlib

    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos, info, text = 8, {}, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            raise ValueError(f"{path}: bad CRC in chunk {kind!r}")
        if kind == b"IHDR":
            info["width"], info["height"] = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            text[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"iTXt":
            k, _, rest = body.partition(b"\0")
            comp, _method, rest = rest[0], rest[1], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _tkey, _, v = rest.partition(b"\0")
            text[k.decode("latin-1")] = (zlib.decompress(v) if comp else v).decode("utf-8")
        elif kind == b"IEND":
            break
        pos += 12 + length
    info["text"] = text
    return info
