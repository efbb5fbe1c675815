"""The serving config `ridgefill tune` writes: what a server needs to fill as tuned, what it should expect and
where it came from."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from ridgefill import __version__
from ridgefill.method.fill import FROM_MAPS, SERVING_KIND, FillSettings
from ridgefill.pipeline.frontier import Point
from ridgefill.pipeline.tune.options import TuneConfig, window_layers
from ridgefill.pipeline.tune.windows import WindowRun


def serving_config(c: TuneConfig, runs: list[WindowRun], served: WindowRun, best: Point,
                   candidates: list[int]) -> dict:
    """What a server needs to fill as tuned (split, tail, keep_first, variant, maps, filled window), what it should
    expect (quality with intervals, FLOP-limit speedup at a stated length) and where it came from (per_window)."""
    sweep = served.sweep
    manifest, results = sweep.results()
    check = served.checks.get(best.variant)
    maps = _maps_of(manifest, sweep.run_dir, best.split) if best.variant in FROM_MAPS else None
    fill = FillSettings(best.variant, best.split, maps, c.tail, c.keep_first,  # the default outlier factor, as measured
                        filled_window=served.window, filled_window_layers=window_layers(served.window, candidates))
    info = sweep.facts.info
    return {
        "kind": SERVING_KIND, "version": 2,  # what method/fill.load_serving reads
        "model": {"id": info["id"], "weights_hash": info["weights_hash"], "family": info.get("family"),
                  "layers": info["n_layers"]},
        **fill.to_serving(), "dtype": c.dtype,
        "expected_speedup": {"flop_limit": best.flop_speedup, "prompt_length": best.length or sweep.flops.length},
        "quality": {"ruler": ruler_quality(best, results, c),
                    "nll": None if check is None else nll_quality(best, check.results()[1], c)},
        "choices": per_window(runs, _choices),
        "tune": {"run_dir": str(c.run_dir.resolve()), "windows": [r.window for r in runs],
                 "recipe": per_window(runs, lambda r: str((r.sweep.run_dir / "recipe.toml").resolve())),
                 "search": c.search, "candidates": candidates,
                 "measured": per_window(runs, lambda r: r.sweep.measured),
                 "ruler_choices": per_window(runs, lambda r: r.searched),
                 "tolerance": c.tolerance, "max_distant_gap": c.max_distant_gap,
                 "verdicts": per_window(runs, _verdicts), "checks": per_window(runs, _checks)},
        "ridgefill_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def per_window(runs: list[WindowRun], value):
    """value(run) of the one window searched (the shape without --windows), or {"W": value(run)} per window when
    several were."""
    if len(runs) == 1:
        return value(runs[0])
    return {str(r.window): value(r) for r in runs}


def _choices(run: WindowRun) -> dict:
    """Per variant its chosen split and FLOP-limit speedup (None: none passed)."""
    return {v: None if s is None else {"split": s, "flop_limit_speedup": run.sweep.speedup(v, s)}
            for v, s in run.chosen.items()}


def _verdicts(run: WindowRun) -> list[dict]:
    return [{"variant": v, "split": s, "verdict": x} for (v, s), x in run.sweep.verdicts.items()]


def _checks(run: WindowRun) -> list[dict]:
    return [{"variant": v, "split": s, "verdict": x, "recipe": str(check.recipe.path.resolve())}
            for check in run.checks.values() for (v, s), x in check.verdicts.items()]


def _maps_of(manifest: dict, run_dir: Path, split: int) -> Path:
    step = next(s for s in manifest["steps"] if s["step"] == "fit" and s["split"] == split)
    return (run_dir / step["artifact"]).resolve()


def ruler_quality(point: Point, results: list, c: TuneConfig) -> dict:
    """The chosen point's filled-region RULER score beside exact's, with the paired 95% interval of the
    difference."""
    ruler = next(r for r in results if r.command == "ruler" and r.split == point.split)
    interval = ruler.doc.get("intervals", {}).get(point.variant, {})
    return {"score": point.retrieval, "exact": point.retrieval_exact, "difference": interval.get("score"),
            "tolerance": c.tolerance, "tasks": ruler.config.get("tasks"), "lengths": ruler.config.get("lengths"),
            "samples": len(ruler.doc.get("samples") or []), "region": "filled"}


def nll_quality(point: Point, results: list, c: TuneConfig) -> dict:
    """The chosen point's NLL check: distant-context NLL (tail NLL where none was found) beside exact's, the
    paired 95% intervals over passages, and what was scored."""
    loss = next(r for r in results if r.command == "loss" and r.split == point.split)
    metric = point.nll_metric or "distant"
    interval = loss.doc.get("intervals", {}).get(point.variant, {})
    exact = loss.doc["results"]["exact"]
    return {"metric": metric, "nll": point.distant_nll, "exact": point.distant_nll_exact,
            "difference": interval.get(f"{metric}_nll_nats"), "bound": c.max_distant_gap,
            "tokens": exact.get(f"{metric}_tokens"), "passages": loss.config.get("samples"),
            "context": loss.config.get("context"), "scored_tail": loss.config.get("tail"),
            "tail_nll_difference": interval.get("tail_nll_nats")}
