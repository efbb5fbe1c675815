"""`ridgefill report RUN_DIR`: report.md and PNG plots (RUN_DIR/plots) from whatever results a run folder holds.

Sections whose results are absent are skipped. Every number comes from the result documents the commands wrote
(and manifest.json when the folder is a `ridgefill run` folder: then only the artifacts it lists are read, so
stale artifacts from earlier recipe versions never mix in).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import atomic_path
from ridgefill.evals.stats import format_interval

COMMANDS = ("calibrate", "fit", "ruler", "loss", "splice", "longbench", "bench-ttft")
COLORS = {"exact": "#444444", "identity": "#d95f02", "ridge": "#1b9e77", "fill": "#7570b3"}


@dataclass
class Result:
    path: Path
    doc: dict

    @property
    def command(self) -> str:
        return self.doc["command"].replace("_", "-")

    @property
    def split(self) -> int | None:
        maps = self.doc.get("maps")
        return (maps or {}).get("split") or self.doc.get("split") or self.config.get("split")

    @property
    def tail(self) -> int | None:
        return self.config.get("tail")

    @property
    def seed(self) -> int | None:
        return self.doc.get("seed")

    @property
    def config(self) -> dict:
        return self.doc.get("config") or {}

    @property
    def label(self) -> str:
        parts = [f"split {self.split}" if self.split is not None else None,
                 f"tail {self.tail}" if self.tail is not None else None,
                 f"seed {self.seed}" if self.seed is not None else None]
        return ", ".join(p for p in parts if p) or self.path.stem

    @property
    def slug(self) -> str:
        return "-".join(f"{k}{v}" for k, v in (("s", self.split), ("t", self.tail), ("seed", self.seed))
                        if v is not None) or self.path.stem


def collect(run_dir: Path) -> tuple[dict | None, list[Result]]:
    """(manifest or None, result documents in task order). With a manifest only its artifacts are read."""
    manifest_path = run_dir / "manifest.json"
    manifest = _read(manifest_path) if manifest_path.is_file() else None
    if manifest is not None:
        paths = [run_dir / name for step in manifest.get("steps", []) for name in step.get("hashes", {})
                 if name.endswith(".json")]
    else:
        paths = sorted(p for p in run_dir.rglob("*.json") if p.name != "manifest.json")
    results = []
    for path in paths:
        doc = _read(path) if path.is_file() else None
        if isinstance(doc, dict) and str(doc.get("command", "")).replace("_", "-") in COMMANDS:
            results.append(Result(path, doc))
    return manifest, results


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_report(run_dir: str | Path, tolerance: float | None = None) -> Path:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.png; returns the report's path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RidgefillError(f"{run_dir} is not a folder: pass a run folder (from ridgefill run)")
    manifest, results = collect(run_dir)
    if not results:
        raise RidgefillError(f"{run_dir} holds no ridgefill result documents: run a recipe (ridgefill run) or a "
                             "command that writes JSON into it first")
    if tolerance is None:
        tolerance = ((manifest or {}).get("settings") or {}).get("tolerance", 5.0)
    by = {c: [r for r in results if r.command == c] for c in COMMANDS}
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    from ridgefill.report import frontier as sweep

    frontier = sweep.frontier(by["ruler"], by["loss"], by["bench-ttft"], tolerance)
    sections = [_header(run_dir, manifest, results), _glance(by, frontier, tolerance), _fit(by["fit"], plots),
                _loss(by["loss"], plots), _ruler(by["ruler"], plots), _splice(by["splice"], plots),
                _longbench(by["longbench"], plots), _ttft(by["bench-ttft"], plots),
                _sweep(frontier, tolerance, plots), _steps(manifest)]
    path = run_dir / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n\n".join(s for s in sections if s) + "\n")
    return path


# --- text helpers -----------------------------------------------------------------------------------------
def _table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _nan(v) -> float:
    """JSON null (a NaN the command could not store) back to NaN for plotting."""
    return math.nan if v is None else v


def _image(plots: Path, name: str, alt: str) -> str:
    return f"![{alt}]({plots.name}/{name})"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    _pyplot().close(fig)


def _variants(doc: dict) -> list[str]:
    return list(doc.get("variants") or doc.get("results", {}))


# --- header, at a glance, steps -------------------------------------------------------------------------
def _header(run_dir: Path, manifest: dict | None, results: list[Result]) -> str:
    m = manifest or {}
    name = (m.get("recipe") or {}).get("name") or run_dir.name
    model = m.get("model") or next((r.doc["model"] for r in results if isinstance(r.doc.get("model"), dict)), {})
    lines = [f"# ridgefill report: {name}", ""]
    if model:
        layers = model.get("n_layers") or model.get("layers")
        lines.append(f"- model: `{model.get('id')}`" + (f" ({model.get('family')}, {layers} layers)" if layers else "")
                     + f", weights `{model.get('weights_hash')}`")
    if m:
        device = m.get("device") or {}
        versions = m.get("versions") or {}
        git = m.get("git") or {}
        lines.append(f"- device: {device.get('kind')} ({device.get('name')}), {m.get('settings', {}).get('dtype')}; "
                     f"load average at start {m.get('load_average')}")
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())
                     + (f"; commit `{git.get('commit', '')[:12]}`{' (uncommitted changes)' if git.get('dirty') else ''}"
                        if git else ""))
        lines.append(f"- run: {m.get('status')}, started {m.get('started_at')}, {_cell(m.get('duration_s'))} s")
    return "\n".join(lines)


def _glance(by: dict, frontier, tolerance: float) -> str:
    lines = []
    for r in by["fit"]:
        lines.append(f"- held-out error of the late layers' inputs (split {r.doc['split']}, mean over layers): "
                     f"identity fill {_cell(r.doc.get('mean_error_identity'))} → {r.doc.get('kind', 'ridge')} map "
                     f"{_cell(r.doc.get('mean_error_map'))}")
    for r in by["loss"]:
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        for metric, what in (("distant", "distant-context NLL"), ("tail", "tail NLL")):
            if "exact" not in res or res["exact"].get(f"{metric}_nll") is None:
                continue
            parts = [f"exact {res['exact'][f'{metric}_nll']:.4g}"]
            parts += [f"{v} {res[v][f'{metric}_nll']:.4g} ({format_interval(iv.get(v, {}).get(f'{metric}_nll_nats'))})"
                      for v in res if v != "exact"]
            lines.append(f"- {what} ({r.label}; {res['exact'].get(f'{metric}_tokens')} tokens): " + ", ".join(parts))
    for r in by["ruler"]:
        res = r.doc["results"]
        lines.append(f"- RULER score, needles in {r.config.get('region', '?')} rows ({r.label}): "
                     + ", ".join(f"{v} {res[v]['score']:.1f}" for v in res))
    for r in by["bench-ttft"]:
        line = _ttft_glance(r)
        if line:
            lines.append(line)
    for variant, tail, point in frontier.useful:
        lines.append(f"- useful split ({variant}, tail {tail}): " + (
            f"{point.split} (retrieval {point.retrieval:.1f} vs exact {point.retrieval_exact:.1f}"
            + (f", FLOP-limit speedup {point.flop_speedup:.2f}x" if point.flop_speedup else "")
            + (f", measured {point.measured_speedup:.2f}x" if point.measured_speedup else "") + ")"
            if point else f"none within {tolerance:g} points of exact"))
    return "## At a glance\n\n" + "\n".join(lines) if lines else ""


def _steps(manifest: dict | None) -> str:
    if not manifest or not manifest.get("steps"):
        return ""
    rows = [[s["label"], "cached" if s["cached"] else "computed", s["duration_s"], s["artifact"]]
            for s in manifest["steps"]]
    return "## Steps\n\n" + _table(["task", "cache", "time (s)", "artifact"], rows)


# --- calibration and fit --------------------------------------------------------------------------------
def _fit(fits: list[Result], plots: Path) -> str:
    if not fits:
        return ""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = []
    for i, r in enumerate(fits):
        layers = r.doc["layers"]
        color = f"C{i}"
        xs = [x["layer"] for x in layers]
        ax.plot(xs, [_nan(x["error_identity"]) for x in layers], "--o", color=color, ms=3,
                label=f"identity, split {r.doc['split']}")
        ax.plot(xs, [_nan(x["error_map"]) for x in layers], "-o", color=color, ms=3,
                label=f"{r.doc.get('kind', 'ridge')} map, split {r.doc['split']}")
        rows += [[r.doc["split"], x["layer"], x["lam"], x["error_identity"], x["error_map"]] for x in layers]
    ax.set(xlabel="layer", ylabel="held-out relative error ‖Ŷ−Y‖²/‖Y−Ȳ‖²",
           title="late layers' input predicted from the split state")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, plots / "fit.png")
    summary = _table(["split", "kind", "mean error, identity fill", "mean error, map"],
                     [[r.doc["split"], r.doc["kind"], r.doc["mean_error_identity"], r.doc["mean_error_map"]]
                      for r in fits])
    detail = _table(["split", "layer", "λ (relative)", "identity fill", "ridge map"], rows)
    return ("## Fit: held-out error per layer\n\nHow well each late layer's input is predicted from the split "
            "state on held-out calibration rows (0 = perfect, 1 = no better than the mean).\n\n"
            f"{summary}\n\n{_image(plots, 'fit.png', 'held-out error per layer')}\n\n"
            f"<details><summary>per layer</summary>\n\n{detail}\n\n</details>")


# --- loss -----------------------------------------------------------------------------------------------
def _loss(results: list[Result], plots: Path) -> str:
    if not results:
        return ""
    plt = _pyplot()
    metrics = [m for m in ("distant", "tail")
               if any(r.doc["results"].get("exact", {}).get(f"{m}_nll") is not None for r in results)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(1.5 + (2.2 + 0.9 * len(results)) * len(metrics), 3.8),
                             squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for g, r in enumerate(results):
            iv = r.doc.get("intervals", {})
            names = [v for v in _variants(r.doc) if v != "exact"]
            width = 0.8 / max(1, len(names))
            for k, v in enumerate(names):
                diff = iv.get(v, {}).get(f"{metric}_nll_nats")
                if not diff or diff.get("estimate") is None:
                    continue
                e = diff["estimate"]
                err = [[e - diff["low"]], [diff["high"] - e]] if diff.get("low") is not None else None
                ax.bar(g + (k - (len(names) - 1) / 2) * width, e, width, yerr=err, capsize=3,
                       color=COLORS.get(v, "C9"), label=v if g == 0 else None)
        ax.axhline(0, color=COLORS["exact"], lw=1, label="exact")
        ax.set_xticks(range(len(results)), [r.label.replace(", ", "\n") for r in results], fontsize=7)
        ax.set(ylabel="Δ mean NLL vs exact (nats)", title=f"{metric}-context tokens" if metric == "distant"
               else "all tail tokens")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("NLL of each fill minus exact's, 95% paired bootstrap interval over passages", fontsize=9)
    _save(fig, plots / "loss.png")
    rows = []
    for r in results:
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        for v in _variants(r.doc):
            x = res[v]
            rows.append([r.label, v, x.get("distant_nll"), format_interval(iv.get(v, {}).get("distant_nll_nats")),
                         x.get("distant_tokens"), x.get("tail_nll"),
                         format_interval(iv.get(v, {}).get("tail_nll_nats"))])
    first = results[0].config
    return (f"## Distant-context NLL (loss)\n\nTeacher-forced NLL on the tail of {first.get('context')}-token "
            f"passages of `{first.get('data')}`; distant-context tokens are those whose exact full-context "
            "log-prob beats a short window's (LongPPL's key tokens). Δ: paired difference to exact, 95% bootstrap "
            "interval over passages.\n\n"
            + _table(["config", "variant", "distant NLL", "Δ distant", "distant tokens", "tail NLL", "Δ tail"], rows)
            + f"\n\n{_image(plots, 'loss.png', 'NLL per variant')}")


# --- RULER ----------------------------------------------------------------------------------------------
def _ruler(results: list[Result], plots: Path) -> str:
    if not results:
        return ""
    groups: dict[tuple, list[Result]] = {}
    for r in results:  # seeds of one (split, tail) pool their samples
        groups.setdefault((r.split, r.tail, r.config.get("region")), []).append(r)
    text = ["## RULER: retrieval by needle depth and length"]
    for (split, tail, region), members in groups.items():
        first = members[0]
        names = _variants(first.doc)
        name = "ruler-" + "-".join(f"{k}{v}" for k, v in (("s", split), ("t", tail)) if v is not None) + ".png"
        lengths, buckets, cells = _ruler_cells(members, names)
        plt = _pyplot()
        fig, axes = plt.subplots(1, len(names), figsize=(1.5 + len(names) * (1.2 + 0.8 * len(lengths)),
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
        fig.suptitle(f"RULER score, needles in {region} rows, split {split}, tail {tail}", fontsize=9, y=1.04)
        _save(fig, plots / name)
        rows = []
        for m in members:
            res, iv = m.doc["results"], m.doc.get("intervals", {})
            rows += [[m.label, v, res[v]["score"], format_interval(iv.get(v, {}).get("score"))] +
                     [res[v]["lengths"].get(str(n)) for n in lengths] for v in names]
        text.append(f"### split {split}, tail {tail} (needles in {region} rows)\n\n"
                    + _table(["config", "variant", "score", "Δ vs exact"] + [f"{n} tokens" for n in lengths], rows)
                    + f"\n\n{_image(plots, name, 'RULER heatmap')}")
    return "\n\n".join(text)


def _ruler_cells(members: list[Result], names: list[str]) -> tuple[list[int], list[str], dict]:
    """Lengths, depth buckets and per variant the mean score of each (bucket, length) cell, over all samples."""
    from ridgefill.evals.ruler import depth_bucket

    sums: dict = {v: {} for v in names}
    for m in members:
        for s in m.doc.get("samples", []):
            key = (depth_bucket(math.nan if s.get("depth") is None else s["depth"]), s["length"])
            for v in names:
                sums[v].setdefault(key, []).append(s["scores"][v])
    keys = {k for v in names for k in sums[v]}
    lengths = sorted({k[1] for k in keys})
    buckets = sorted({k[0] for k in keys})
    return lengths, buckets, {v: {k: sum(x) / len(x) for k, x in sums[v].items()} for v in names}


# --- splice ---------------------------------------------------------------------------------------------
SPLICE_METRICS = ("distant", "tail", "retrieval")


def _splice(results: list[Result], plots: Path) -> str:
    if not results:
        return ""
    text = ["## Splice: which cache component carries the fill's error\n\nEach bar: the share of the fill's gap "
            "to exact that swapping in the exact component closes (1 = all of it), 95% bootstrap interval."]
    plt = _pyplot()
    for r in results:
        fill, res, iv = r.doc.get("fill", "fill"), r.doc["results"], r.doc.get("intervals", {})
        splices = [k for k in res if k not in ("exact", fill)]
        metrics = [m for m in SPLICE_METRICS if any(f"gap_closed_{m}" in iv.get(k, {}) for k in splices)]
        if not splices or not metrics:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(splices)))
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
        name = f"splice-{r.slug}.png"
        _save(fig, plots / name)
        rows = [[k] + [format_interval(iv.get(k, {}).get(f"gap_closed_{m}"), percent=True) for m in metrics]
                for k in splices]
        text.append(f"### {r.label}\n\n" + _table(["swapped@layers"] + [f"gap closed, {m}" for m in metrics], rows)
                    + f"\n\n{_image(plots, name, 'splice attribution')}")
    return "\n\n".join(text) if len(text) > 1 else ""


# --- LongBench ------------------------------------------------------------------------------------------
def _longbench(results: list[Result], plots: Path) -> str:
    if not results:
        return ""
    text = ["## LongBench v2 accuracy"]
    plt = _pyplot()
    for r in results:
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        names = _variants(r.doc)
        categories = [c for c in res[names[0]]["accuracy"] if res[names[0]]["accuracy"][c] is not None]
        fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(categories), 3.5))
        width = 0.8 / len(names)
        for k, v in enumerate(names):
            ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(categories))],
                   [res[v]["accuracy"][c] for c in categories], width, color=COLORS.get(v, "C9"), label=v)
        ax.set_xticks(range(len(categories)), categories)
        ax.set(ylabel="accuracy (%)", title=f"LongBench v2 ({r.config.get('mode')}), {r.label}")
        ax.legend(fontsize=7)
        name = f"longbench-{r.slug}.png"
        _save(fig, plots / name)
        rows = [[v] + [res[v]["accuracy"][c] for c in categories] + [format_interval(iv.get(v, {}).get("overall"))]
                for v in names]
        text.append(f"### {r.label} ({r.config.get('questions')} questions)\n\n"
                    + _table(["variant"] + categories + ["Δ overall vs exact (points)"], rows)
                    + f"\n\n{_image(plots, name, 'LongBench accuracy')}")
    return "\n\n".join(text)


# --- bench-ttft -----------------------------------------------------------------------------------------
def _ttft(results: list[Result], plots: Path) -> str:
    if not results:
        return ""
    text = ["## Time to first token\n\nMedian wall time from prompt ids to the first token (prefill, caches "
            "written, first greedy token). FLOP limit: the fill's TTFT if its speedup over exact reached the "
            "ratio of FLOPs (exact TTFT / FLOP-limit speedup)."]
    plt = _pyplot()
    for r in results:
        entries = sorted(r.doc.get("results", []), key=lambda e: e["length"])
        if not entries:
            continue
        fills = [v for v in _variants(r.doc) if v != "exact"]
        lengths = [e["length"] for e in entries]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        exact_ms = [1000 * e["timings"]["exact"]["median_s"] for e in entries]
        ax.plot(lengths, exact_ms, "-o", color=COLORS["exact"], label="exact")
        hf = [1000 * e["timings"]["transformers"]["median_s"] for e in entries if "transformers" in e["timings"]]
        if len(hf) == len(entries):
            ax.plot(lengths, hf, ":", color=COLORS["exact"], alpha=0.6, label="transformers forward")
        rows = []
        for v in fills:
            color = COLORS.get(v, "C9")
            ax.plot(lengths, [1000 * e["timings"][v]["median_s"] for e in entries], "-o", color=color, label=v)
            limits = [e["fill"][v].get("limit_speedup") for e in entries]
            if all(limits):
                ax.plot(lengths, [x / lim for x, lim in zip(exact_ms, limits)], "--", color=color,
                        label=f"{v}: FLOP limit")
            rows += [[e["length"], v, 1000 * e["timings"]["exact"]["median_s"], 1000 * e["timings"][v]["median_s"],
                      format_interval(e["fill"][v].get("speedup_interval"), spec=".2f", suffix="x"),
                      e["fill"][v].get("limit_speedup"), e["fill"][v].get("achieved_over_limit")] for e in entries]
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
        name = f"ttft-{r.slug}.png"
        _save(fig, plots / name)
        text.append(f"### {r.label}\n\n" + _table(["length", "variant", "exact ms", "fill ms", "speedup [95% CI]",
                                                     "FLOP-limit speedup", "achieved / limit"], rows)
                    + f"\n\n{_image(plots, name, 'TTFT vs length')}")
    return "\n\n".join(text) if len(text) > 1 else ""


def _plain():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def _ttft_glance(r: Result) -> str:
    entries = r.doc.get("results") or []
    if not entries:
        return ""
    e = max(entries, key=lambda e: e["length"])
    parts = [f"exact {1000 * e['timings']['exact']['median_s']:.0f} ms"]
    for v, f in e.get("fill", {}).items():
        limit = f" (FLOP limit {f['limit_speedup']:.2f}x)" if f.get("limit_speedup") else ""
        parts.append(f"{v} {1000 * e['timings'][v]['median_s']:.0f} ms, "
                     f"{format_interval(f.get('speedup_interval'), spec='.2f', suffix='x')}{limit}")
    return f"- time to first token at {e['length']} tokens ({r.label}): " + "; ".join(parts)


# --- sweep ----------------------------------------------------------------------------------------------
def _sweep(frontier, tolerance: float, plots: Path) -> str:
    points = [p for p in frontier.points if p.retrieval is not None or p.distant_nll is not None]
    if len(frontier.splits) < 2 or not points:
        return ""
    speeds = [(k, label) for k, label in (("flop_speedup", "FLOP-limit speedup"),
                                          ("measured_speedup", "measured speedup"))
              if any(getattr(p, k) for p in points)] or [("split", "split (no speed measured)")]
    qualities = [(k, label) for k, label in (("retrieval", "filled-region retrieval (RULER, 0-100)"),
                                             ("distant_nll", "distant-context NLL (nats)"))
                 if any(getattr(p, k) is not None for p in points)]
    plt = _pyplot()
    fig, axes = plt.subplots(len(qualities), len(speeds), figsize=(5.5 * len(speeds), 3.8 * len(qualities)),
                             squeeze=False)
    useful = {(v, t): p for v, t, p in frontier.useful if p}
    for i, (qk, qlabel) in enumerate(qualities):
        for j, (sk, slabel) in enumerate(speeds):
            ax = axes[i][j]
            for (v, tail), line in _lines(points).items():
                line = [p for p in line if getattr(p, qk) is not None and getattr(p, sk) is not None]
                if not line:
                    continue
                style = "-o" if tail == min(p.tail for p in points) else "--s"
                xs, ys = [getattr(p, sk) for p in line], [getattr(p, qk) for p in line]
                ax.plot(xs, ys, style, color=COLORS.get(v, "C9"), ms=4, label=f"{v}, tail {tail}")
                for p, x, y in zip(line, xs, ys):
                    ax.annotate(f"S{p.split}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
                best = useful.get((v, tail))
                if best is not None and qk == "retrieval" and getattr(best, sk) is not None:
                    ax.plot([getattr(best, sk)], [best.retrieval], "*", color=COLORS.get(v, "C9"), ms=14)
            exact = [getattr(p, f"{qk}_exact") for p in points if getattr(p, f"{qk}_exact") is not None]
            if exact:
                ref = sum(exact) / len(exact)
                ax.axhline(ref, color=COLORS["exact"], lw=1, label="exact")
                if qk == "retrieval":
                    ax.axhspan(ref - tolerance, ref, color=COLORS["exact"], alpha=0.08,
                               label=f"within {tolerance:g} points")
            ax.set(xlabel=slabel, ylabel=qlabel)
            if sk == "split":
                ax.set_xticks(frontier.splits)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("speed–quality frontier (★ useful split: smallest within tolerance of exact)", fontsize=9)
    _save(fig, plots / "frontier.png")
    rows = [[p.variant, p.tail, p.split, p.flop_speedup, p.measured_speedup, p.length, p.retrieval,
             p.retrieval_exact, p.distant_nll, p.distant_nll_exact,
             "yes" if useful.get((p.variant, p.tail)) is p else ""] for p in points]
    verdicts = [f"- {v}, tail {t}: " + (f"**split {p.split}**" + (f", {p.flop_speedup:.2f}x FLOP-limit" if
                                                                    p.flop_speedup else "")
                                         + (f", {p.measured_speedup:.2f}x measured" if p.measured_speedup else "")
                                         if p else f"no split within {tolerance:g} points of exact")
                for v, t, p in frontier.useful]
    return (f"## Sweep: speed–quality frontier and the useful split\n\nUseful split: the smallest split whose "
            f"filled-region retrieval stays within {tolerance:g} points of exact.\n\n" + "\n".join(verdicts)
            + "\n\n" + _table(["variant", "tail", "split", "FLOP-limit speedup", "measured speedup", "at length",
                                "retrieval", "exact retrieval", "distant NLL", "exact distant NLL", "useful"], rows)
            + f"\n\n{_image(plots, 'frontier.png', 'speed-quality frontier')}")


def _lines(points) -> dict[tuple, list]:
    out: dict[tuple, list] = {}
    for p in sorted(points, key=lambda p: p.split):
        out.setdefault((p.variant, p.tail), []).append(p)
    return out
