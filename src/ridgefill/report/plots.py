"""The report's PNG figures, one function per section of report.md (write.py writes the text beside them). Each
takes its section's result documents (report.results.Result: .doc, .config, .label, .variants) and the file to
write. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

import math
from pathlib import Path

from ridgefill.runtime.figures import COLORS, pyplot as _pyplot, save_figure as _save  # noqa: F401


def _nan(v) -> float:
    """JSON null (a NaN the command could not store) back to NaN for plotting."""
    return math.nan if v is None else v


def _plain():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


# --- fit ------------------------------------------------------------------------------------------------
def fit(fits: list, path: Path) -> None:
    """Held-out error per late layer, identity fill (dashed) against the map (solid), one colour per split."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for i, r in enumerate(fits):
        layers = r.doc["layers"]
        xs = [x["layer"] for x in layers]
        ax.plot(xs, [_nan(x["error_identity"]) for x in layers], "--o", color=f"C{i}", ms=3,
                label=f"identity, split {r.doc['split']}")
        ax.plot(xs, [_nan(x["error_map"]) for x in layers], "-o", color=f"C{i}", ms=3,
                label=f"{r.doc.get('kind', 'ridge')} map, split {r.doc['split']}")
    ax.set(xlabel="layer", ylabel="held-out relative error ‖Ŷ−Y‖²/‖Y−Ȳ‖²",
           title="late layers' input predicted from the split state")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


# --- loss -----------------------------------------------------------------------------------------------
def loss(results: list, path: Path) -> None:
    """Each fill's NLL minus exact's with its interval, per result, for distant-context and all tail tokens."""
    _save(loss_figure(results), path)


def loss_figure(results: list):
    """The loss figure: one panel per metric. Exact is the dashed zero line, kept clear of the frame (bars start
    at 0, so without a margin below it the line would sit on the bottom spine and show as nothing); the panels
    share one y label, on the first, and a constrained layout keeps it off the panel beside it."""
    metrics = [m for m in ("distant", "tail")
               if any(r.doc["results"].get("exact", {}).get(f"{m}_nll") is not None for r in results)]
    fig, axes = _pyplot().subplots(1, len(metrics), figsize=(1.5 + (2.2 + 0.9 * len(results)) * len(metrics), 3.8),
                                   squeeze=False, layout="constrained")
    for ax, metric in zip(axes[0], metrics):
        for g, r in enumerate(results):
            _loss_bars(ax, g, r, metric)
        ax.use_sticky_edges = False
        ax.margins(y=0.08)
        ax.axhline(0, color=COLORS["exact"], lw=1.2, ls="--", label="exact (Δ = 0)")
        ax.set_xticks(range(len(results)), [r.label.replace(", ", "\n") for r in results], fontsize=7)
        ax.set_title(f"{metric}-context tokens" if metric == "distant" else "all tail tokens")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("Δ mean NLL vs exact (nats)")
    fig.suptitle("NLL of each fill minus exact's, 95% paired bootstrap interval over passages", fontsize=9)
    return fig


def _loss_bars(ax, g: int, r, metric: str) -> None:
    iv = r.doc.get("intervals", {})
    names = [v for v in r.variants if v != "exact"]
    width = 0.8 / max(1, len(names))
    for k, v in enumerate(names):
        diff = iv.get(v, {}).get(f"{metric}_nll_nats")
        if not diff or diff.get("estimate") is None:
            continue
        e = diff["estimate"]
        err = [[e - diff["low"]], [diff["high"] - e]] if diff.get("low") is not None else None
        ax.bar(g + (k - (len(names) - 1) / 2) * width, e, width, yerr=err, capsize=3, color=COLORS.get(v, "C9"),
               label=None if v in ax.get_legend_handles_labels()[1] else v)  # once, where first drawn


# --- RULER ----------------------------------------------------------------------------------------------
def ruler(names: list[str], lengths: list[int], buckets: list[str], cells: dict, title: str, path: Path) -> None:
    """One heatmap per variant: mean score by needle-depth bucket (rows) and length (columns)."""
    fig, axes = _pyplot().subplots(1, len(names), figsize=(1.5 + len(names) * (1.2 + 0.8 * len(lengths)),
                                                            1.2 + 0.45 * len(buckets)), squeeze=False, sharey=True)
    for ax, v in zip(axes[0], names):
        grid = [[cells[v].get((b, n), math.nan) for n in lengths] for b in buckets]
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if value < 60 else "black")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(buckets)), buckets)
        ax.set(title=v, xlabel="length (tokens)")
    axes[0][0].set_ylabel("needle depth (first needle)")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="score (0-100)")
    fig.suptitle(title, fontsize=9, y=1.04)
    _save(fig, path)


# --- splice ---------------------------------------------------------------------------------------------
def splice(r, splices: list[str], metrics: list[str], path: Path) -> None:
    """Per splice, the share of the fill's gap to exact it closes, one bar per metric, with its interval."""
    fill, iv = r.doc.get("fill", "fill"), r.doc.get("intervals", {})
    fig, ax = _pyplot().subplots(figsize=(7, 0.5 + 0.45 * len(splices)))
    height = 0.8 / len(metrics)
    for k, metric in enumerate(metrics):
        est, low, high = [], [], []
        for name in splices:
            d = iv.get(name, {}).get(f"gap_closed_{metric}") or {}
            e = d.get("estimate")
            est.append(e if e is not None else math.nan)
            low.append(e - d["low"] if e is not None and d.get("low") is not None else 0)
            high.append(d["high"] - e if e is not None and d.get("high") is not None else 0)
        ys = [i + (k - (len(metrics) - 1) / 2) * height for i in range(len(splices))]
        ax.barh(ys, est, height, xerr=[low, high], capsize=2, label=f"{metric} NLL" if metric != "retrieval"
                else "retrieval", color=f"C{k}")
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(1, color="gray", lw=0.8, ls="--")
    ax.set_yticks(range(len(splices)), splices, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel=f"share of the {fill} fill's gap to exact closed", title=f"splice into {fill} fill, {r.label}")
    ax.legend(fontsize=7)
    _save(fig, path)


# --- LongBench ------------------------------------------------------------------------------------------
def longbench(r, names: list[str], categories: list[str], path: Path) -> None:
    """Accuracy per category, one bar per variant."""
    res = r.doc["results"]
    fig, ax = _pyplot().subplots(figsize=(1.5 + 1.1 * len(categories), 3.5))
    width = 0.8 / len(names)
    for k, v in enumerate(names):
        ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(categories))],
               [res[v]["accuracy"][c] for c in categories], width, color=COLORS.get(v, "C9"), label=v)
    ax.set_xticks(range(len(categories)), categories)
    ax.set(ylabel="accuracy (%)", title=f"LongBench v2 ({r.config.get('mode')}), {r.label}")
    ax.legend(fontsize=7)
    _save(fig, path)


# --- bench-ttft -----------------------------------------------------------------------------------------
def ttft(r, entries: list[dict], fills: list[str], path: Path) -> None:
    """Median TTFT against prompt length (log-log): exact, transformers, each fill and its FLOP limit."""
    lengths = [e["length"] for e in entries]
    fig, ax = _pyplot().subplots(figsize=(6.5, 4))
    exact_ms = [1000 * e["timings"]["exact"]["median_s"] for e in entries]
    ax.plot(lengths, exact_ms, "-o", color=COLORS["exact"], label="exact")
    hf = [1000 * e["timings"]["transformers"]["median_s"] for e in entries if e["timings"].get("transformers")]
    if len(hf) == len(entries):
        ax.plot(lengths, hf, ":", color=COLORS["exact"], alpha=0.6, label="transformers forward")
    for v in fills:
        color = COLORS.get(v, "C9")
        ax.plot(lengths, [1000 * e["timings"][v]["median_s"] for e in entries], "-o", color=color, label=v)
        limits = [e["fill"][v].get("limit_speedup") for e in entries]
        if all(limits):
            ax.plot(lengths, [x / lim for x, lim in zip(exact_ms, limits)], "--", color=color,
                    label=f"{v}: FLOP limit")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_plain())
    ax.yaxis.set_minor_formatter(_plain())
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set(xlabel="prompt length (tokens)", ylabel="time to first token (ms, median)",
           title=f"TTFT, {r.label} ({r.config.get('repeats')} repeats, {r.config.get('dtype')} on "
                 f"{(r.doc.get('device') or {}).get('device', r.config.get('device'))})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save(fig, path)


# --- sweep ----------------------------------------------------------------------------------------------
SPEEDS = (("flop_speedup", "FLOP-limit speedup"), ("measured_speedup", "measured speedup"))
QUALITIES = (("retrieval", "filled-region retrieval (RULER, 0-100)"), ("distant_nll", "distant-context NLL (nats)"))


def frontier(points: list, splits: list[int], useful: dict, tolerance: float, path: Path) -> None:
    """Quality against speed per (variant, tail), one panel per measured quality and speed; ★ the useful split.
    useful: (variant, tail) -> its useful point."""
    speeds = [(k, label) for k, label in SPEEDS if any(getattr(p, k) for p in points)] or \
        [("split", "split (no speed measured)")]
    qualities = [(k, label) for k, label in QUALITIES if any(getattr(p, k) is not None for p in points)]
    fig, axes = _pyplot().subplots(len(qualities), len(speeds), figsize=(5.5 * len(speeds), 3.8 * len(qualities)),
                                   squeeze=False)
    for i, (qk, qlabel) in enumerate(qualities):
        for j, (sk, slabel) in enumerate(speeds):
            ax = axes[i][j]
            _frontier_lines(ax, points, useful, qk, sk)
            _exact_band(ax, points, qk, tolerance)
            ax.set(xlabel=slabel, ylabel=qlabel)
            if sk == "split":
                ax.set_xticks(splits)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("speed–quality frontier (★ useful split: smallest within tolerance of exact)", fontsize=9)
    _save(fig, path)


def _frontier_lines(ax, points: list, useful: dict, qk: str, sk: str) -> None:
    shortest = min(p.tail for p in points)
    for (v, tail), line in _lines(points).items():
        line = [p for p in line if getattr(p, qk) is not None and getattr(p, sk) is not None]
        if not line:
            continue
        xs, ys = [getattr(p, sk) for p in line], [getattr(p, qk) for p in line]
        ax.plot(xs, ys, "-o" if tail == shortest else "--s", color=COLORS.get(v, "C9"), ms=4, label=f"{v}, tail {tail}")
        for p, x, y in zip(line, xs, ys):
            ax.annotate(f"S{p.split}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        best = useful.get((v, tail))
        if best is not None and qk == "retrieval" and getattr(best, sk) is not None:
            ax.plot([getattr(best, sk)], [best.retrieval], "*", color=COLORS.get(v, "C9"), ms=14)


def _exact_band(ax, points: list, qk: str, tolerance: float) -> None:
    """Exact's level (mean over points) and, for retrieval, the band within tolerance of it."""
    from ridgefill.runtime.stats import mean

    ref = mean([getattr(p, f"{qk}_exact") for p in points])
    if ref is None:
        return
    ax.axhline(ref, color=COLORS["exact"], lw=1, label="exact")
    if qk == "retrieval":
        ax.axhspan(ref - tolerance, ref, color=COLORS["exact"], alpha=0.08, label=f"within {tolerance:g} points")


def _lines(points) -> dict[tuple, list]:
    out: dict[tuple, list] = {}
    for p in sorted(points, key=lambda p: p.split):
        out.setdefault((p.variant, p.tail), []).append(p)
    return out
