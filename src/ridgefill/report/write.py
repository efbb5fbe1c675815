"""report.md and PNG plots (RUN_DIR/plots) from whatever results a run folder holds, and the frontier the pipeline
decided from them (pipeline/frontier.py; `ridgefill report` is pipeline/report.py): this module renders, it
decides nothing.

Sections whose results are absent are skipped. Every number comes from the result documents the commands wrote
(and manifest.json when the folder is a `ridgefill run` folder: then only the artifacts it lists are read, so
stale artifacts from earlier recipe versions never mix in).
"""

from __future__ import annotations

import math
from pathlib import Path

from ridgefill.report import plots
from ridgefill.report.results import Result
from ridgefill.runtime.console import cell
from ridgefill.runtime.paths import atomic_path
from ridgefill.runtime.stats import describe_spread, distant_spread, format_interval


def render(run_dir: Path, manifest: dict | None, results: list[Result], frontier, tolerance: float) -> Path:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.png from `results` (report.results.collect) and `frontier` (its
    points and useful splits at `tolerance`, pipeline.frontier.frontier); returns the report's path."""
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    sections = [_header(run_dir, manifest, results), _glance(results, frontier, tolerance),
                _fit(_of(results, "fit"), plots_dir), _loss(_of(results, "loss"), plots_dir),
                _ruler(_of(results, "ruler"), plots_dir), _splice(_of(results, "splice"), plots_dir),
                _longbench(_of(results, "longbench"), plots_dir), _ttft(_of(results, "bench-ttft"), plots_dir),
                _sweep(frontier, tolerance, plots_dir), _steps(manifest)]
    path = run_dir / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n\n".join(s for s in sections if s) + "\n")
    return path


# --- text helpers -----------------------------------------------------------------------------------------
def _table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _of(results: list[Result], command: str) -> list[Result]:
    return [r for r in results if r.command == command]


def _image(plots_dir: Path, name: str, alt: str) -> str:
    return f"![{alt}]({plots_dir.name}/{name})"


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
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)
                     + (f"; commit `{git.get('commit', '')[:12]}`{' (uncommitted changes)' if git.get('dirty') else ''}"
                        if git else ""))
        lines.append(f"- run: {m.get('status')}, started {m.get('started_at')}, {cell(m.get('duration_s'))} s")
    return "\n".join(lines)


def _glance(results: list[Result], frontier, tolerance: float) -> str:
    lines = []
    for r in _of(results, "fit"):
        lines.append(f"- held-out error of the late layers' inputs (split {r.doc['split']}, mean over layers): "
                     f"identity fill {cell(r.doc.get('mean_error_identity'))} → {r.doc.get('kind', 'ridge')} map "
                     f"{cell(r.doc.get('mean_error_map'))}")
    for r in _of(results, "loss"):
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        for metric, what in (("distant", "distant-context NLL"), ("tail", "tail NLL")):
            if "exact" not in res or res["exact"].get(f"{metric}_nll") is None:
                continue
            parts = [f"exact {res['exact'][f'{metric}_nll']:.4g}"]
            parts += [f"{v} {res[v][f'{metric}_nll']:.4g} ({format_interval(iv.get(v, {}).get(f'{metric}_nll_nats'))})"
                      for v in res if v != "exact"]
            lines.append(f"- {what} ({r.label}; {res['exact'].get(f'{metric}_tokens')} tokens): " + ", ".join(parts))
    for r in _of(results, "ruler"):
        res = r.doc["results"]
        lines.append(f"- RULER score, needles in {r.config.get('region', '?')} rows ({r.label}): "
                     + ", ".join(f"{v} {res[v]['score']:.1f}" for v in res))
    for r in _of(results, "bench-ttft"):
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
def _fit(fits: list[Result], plots_dir: Path) -> str:
    if not fits:
        return ""
    plots.fit(fits, plots_dir / "fit.png")
    summary = _table(["split", "kind", "mean error, identity fill", "mean error, map"],
                     [[r.doc["split"], r.doc["kind"], r.doc["mean_error_identity"], r.doc["mean_error_map"]]
                      for r in fits])
    detail = _table(["split", "layer", "λ (relative)", "identity fill", "ridge map"],
                    [[r.doc["split"], x["layer"], x["lam"], x["error_identity"], x["error_map"]]
                     for r in fits for x in r.doc["layers"]])
    return ("## Fit: held-out error per layer\n\nHow well each late layer's input is predicted from the split "
            "state on held-out calibration rows (0 = perfect, 1 = no better than the mean).\n\n"
            f"{summary}\n\n{_image(plots_dir, 'fit.png', 'held-out error per layer')}\n\n"
            f"<details><summary>per layer</summary>\n\n{detail}\n\n</details>")


# --- loss -----------------------------------------------------------------------------------------------
def _loss(results: list[Result], plots_dir: Path) -> str:
    if not results:
        return ""
    plots.loss(results, plots_dir / "loss.png")
    rows = []
    for r in results:
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        for v in r.variants:
            x = res[v]
            rows.append([r.label, v, x.get("distant_nll"), format_interval(iv.get(v, {}).get("distant_nll_nats")),
                         x.get("distant_tokens"), _spread_cell(r.doc, x), x.get("tail_nll"),
                         format_interval(iv.get(v, {}).get("tail_nll_nats"))])
    first = results[0].config
    return (f"## Distant-context NLL (loss)\n\nTeacher-forced NLL on the tail of {first.get('context')}-token "
            f"passages of `{first.get('data')}`; distant-context tokens are those whose exact full-context "
            "log-prob beats a short window's (LongPPL's key tokens). Δ: paired difference to exact, 95% bootstrap "
            "interval over passages.\n\n"
            + _table(["config", "variant", "distant NLL", "Δ distant", "distant tokens",
                      "passages with any (min/median/max)", "tail NLL", "Δ tail"], rows)
            + f"\n\n{_image(plots_dir, 'loss.png', 'NLL per variant')}")


def _spread_cell(doc: dict, result: dict) -> str:
    """'11 of 12 (0/25/70)': how the distant-context tokens spread over the passages (from the per-passage counts
    where an older document has no `distant_spread`)."""
    spread = doc.get("distant_spread") or distant_spread(result.get("per_passage", {}).get("distant_tokens", []))
    if not spread["passages"]:
        return "–"
    return (f"{spread['passages_with_tokens']} of {spread['passages']} ({spread['per_passage_min']}/"
            f"{spread['per_passage_median']:g}/{spread['per_passage_max']})")


# --- RULER ----------------------------------------------------------------------------------------------
def _ruler(results: list[Result], plots_dir: Path) -> str:
    if not results:
        return ""
    groups: dict[tuple, list[Result]] = {}
    for r in results:  # seeds of one (split, tail) pool their samples
        groups.setdefault((r.split, r.tail, r.config.get("region")), []).append(r)
    text = ["## RULER: retrieval by needle depth and length"]
    for (split, tail, region), members in groups.items():
        names = members[0].variants
        name = "ruler-" + "-".join(f"{k}{v}" for k, v in (("s", split), ("t", tail)) if v is not None) + ".png"
        lengths, buckets, cells = _ruler_cells(members, names)
        plots.ruler(names, lengths, buckets, cells, f"RULER score, needles in {region} rows, split {split}, tail "
                    f"{tail}", plots_dir / name)
        rows = []
        for m in members:
            res, iv = m.doc["results"], m.doc.get("intervals", {})
            rows += [[m.label, v, res[v]["score"], format_interval(iv.get(v, {}).get("score"))] +
                     [res[v]["lengths"].get(str(n)) for n in lengths] for v in names]
        text.append(f"### split {split}, tail {tail} (needles in {region} rows)\n\n"
                    + _table(["config", "variant", "score", "Δ vs exact"] + [f"{n} tokens" for n in lengths], rows)
                    + f"\n\n{_image(plots_dir, name, 'RULER heatmap')}")
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


def _splice(results: list[Result], plots_dir: Path) -> str:
    if not results:
        return ""
    text = ["## Splice: which cache component carries the fill's error\n\nEach bar: the share of the fill's gap "
            "to exact that swapping in the exact component closes (1 = all of it), 95% bootstrap interval."]
    for r in results:
        fill, res, iv = r.doc.get("fill", "fill"), r.doc["results"], r.doc.get("intervals", {})
        splices = [k for k in res if k not in ("exact", fill)]
        metrics = [m for m in SPLICE_METRICS if any(f"gap_closed_{m}" in iv.get(k, {}) for k in splices)]
        if not splices or not metrics:
            continue
        name = f"splice-{r.slug}.png"
        plots.splice(r, splices, metrics, plots_dir / name)
        rows = [[k] + [format_interval(iv.get(k, {}).get(f"gap_closed_{m}"), percent=True) for m in metrics]
                for k in splices]
        spread = r.doc.get("distant_spread") or distant_spread(
            res.get("exact", {}).get("per_passage", {}).get("distant_tokens", []))
        counted = f"{describe_spread(spread)}.\n\n" if spread["passages"] else ""
        text.append(f"### {r.label}\n\n{counted}" + _table(["swapped@layers"] + [f"gap closed, {m}" for m in metrics], rows)
                    + f"\n\n{_image(plots_dir, name, 'splice attribution')}")
    return "\n\n".join(text) if len(text) > 1 else ""


# --- LongBench ------------------------------------------------------------------------------------------
def _longbench(results: list[Result], plots_dir: Path) -> str:
    if not results:
        return ""
    text = ["## LongBench v2 accuracy"]
    for r in results:
        res, iv = r.doc["results"], r.doc.get("intervals", {})
        names = r.variants
        categories = [c for c in res[names[0]]["accuracy"] if res[names[0]]["accuracy"][c] is not None]
        name = f"longbench-{r.slug}.png"
        plots.longbench(r, names, categories, plots_dir / name)
        rows = [[v] + [res[v]["accuracy"][c] for c in categories] + [format_interval(iv.get(v, {}).get("overall"))]
                for v in names]
        text.append(f"### {r.label} ({r.config.get('questions')} questions)\n\n"
                    + _table(["variant"] + categories + ["Δ overall vs exact (points)"], rows)
                    + f"\n\n{_image(plots_dir, name, 'LongBench accuracy')}")
    return "\n\n".join(text)


# --- bench-ttft -----------------------------------------------------------------------------------------
def _ttft(results: list[Result], plots_dir: Path) -> str:
    if not results:
        return ""
    text = ["## Time to first token\n\nMedian wall time from prompt ids to the first token (prefill, caches "
            "written, first greedy token). FLOP limit: the fill's TTFT if its speedup over exact reached the "
            "ratio of FLOPs (exact TTFT / FLOP-limit speedup)."]
    for r in results:
        entries = sorted(r.doc.get("results", []), key=lambda e: e["length"])
        if not entries:
            continue
        fills = [v for v in r.variants if v != "exact"]
        name = f"ttft-{r.slug}.png"
        plots.ttft(r, entries, fills, plots_dir / name)
        rows = [[e["length"], v, 1000 * e["timings"]["exact"]["median_s"], 1000 * e["timings"][v]["median_s"],
                 format_interval(e["fill"][v].get("speedup_interval"), spec=".2f", suffix="x"),
                 e["fill"][v].get("limit_speedup"), e["fill"][v].get("achieved_over_limit")]
                for v in fills for e in entries]
        text.append(f"### {r.label}\n\n" + _table(["length", "variant", "exact ms", "fill ms", "speedup [95% CI]",
                                                     "FLOP-limit speedup", "achieved / limit"], rows)
                    + f"\n\n{_image(plots_dir, name, 'TTFT vs length')}")
    return "\n\n".join(text) if len(text) > 1 else ""


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
def _sweep(frontier, tolerance: float, plots_dir: Path) -> str:
    points = [p for p in frontier.points if p.retrieval is not None or p.distant_nll is not None]
    if len(frontier.splits) < 2 or not points:
        return ""
    useful = {(v, t): p for v, t, p in frontier.useful if p}
    plots.frontier(points, frontier.splits, useful, tolerance, plots_dir / "frontier.png")
    rows = [[p.variant, p.tail, p.split, p.flop_speedup, p.measured_speedup, p.length, p.retrieval,
             p.retrieval_exact, p.distant_nll, p.distant_nll_exact,
             "yes" if useful.get((p.variant, p.tail)) is p else ""] for p in points]
    verdicts = [f"- {v}, tail {t}: " + (_verdict(p) if p else f"no split within {tolerance:g} points of exact")
                for v, t, p in frontier.useful]
    return (f"## Sweep: speed–quality frontier and the useful split\n\nUseful split: the smallest split whose "
            f"filled-region retrieval stays within {tolerance:g} points of exact.\n\n" + "\n".join(verdicts)
            + "\n\n" + _table(["variant", "tail", "split", "FLOP-limit speedup", "measured speedup", "at length",
                                "retrieval", "exact retrieval", "distant NLL", "exact distant NLL", "useful"], rows)
            + f"\n\n{_image(plots_dir, 'frontier.png', 'speed-quality frontier')}")


def _verdict(p) -> str:
    return (f"**split {p.split}**" + (f", {p.flop_speedup:.2f}x FLOP-limit" if p.flop_speedup else "")
            + (f", {p.measured_speedup:.2f}x measured" if p.measured_speedup else ""))
