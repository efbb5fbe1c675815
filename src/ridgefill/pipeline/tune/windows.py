"""One filled window's tune (0: full attention) in its run folder: the search, the NLL check's step up, the points;
and the choice between windows."""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.pipeline.frontier import FlopModel, Point
from ridgefill.pipeline.search import search, step_up
from ridgefill.pipeline.tune.options import TuneConfig, window_dir, window_layers, window_of
from ridgefill.pipeline.tune.recipes import CHECK_FOLDER, recipes, record
from ridgefill.pipeline.tune.sweep import Sweep, merged_points
from ridgefill.pipeline.tune.verdict import best_choice
from ridgefill.runtime.console import note
from ridgefill.runtime.models import ModelIdentity


@dataclass
class WindowRun:
    """One filled window's tune (0: full attention) in its run folder: the search's sweep, each variant's NLL
    check, the search's RULER choices (`searched`), the choices after the check (`chosen`) and the points."""

    window: int
    sweep: Sweep
    checks: dict[str, Sweep]
    searched: dict[str, int | None]
    chosen: dict[str, int | None]
    points: list[Point]

    @property
    def best(self) -> Point | None:
        return best_choice(self.points, self.chosen)


def tune_window(c: TuneConfig, window: int, facts: ModelIdentity, candidates: list[int]) -> WindowRun:
    """Search the candidates with filled window `window` in its run folder, then check the choices."""
    if window:
        note(f"tune: filled window {window} (layers {window_layers(window, candidates)}) in {window_dir(c, window)}")
    search_recipe, check_recipes = recipes(c, candidates, window)
    for recipe in [search_recipe, *check_recipes.values()]:
        record(recipe)
    run_dir = window_dir(c, window)
    flops = window_flops(c, facts, window, candidates)
    sweep = Sweep(search_recipe, run_dir, facts, flops, c.fill_names, c.tolerance, c.max_distant_gap)
    searched = chosen = search(c.search, candidates, sweep.judge, c.fill_names)
    checks = {v: Sweep(r, run_dir / CHECK_FOLDER / v, facts, flops, [v], c.tolerance, c.max_distant_gap,
                       judged=("nll",), reuse=run_dir) for v, r in check_recipes.items()}
    if checks:
        chosen = step_up(candidates, chosen, sweep.judge, {v: check.judge for v, check in checks.items()},
                         sweep.speedup)
    return WindowRun(window, sweep, checks, searched, chosen, merged_points(sweep, checks))


def window_flops(c: TuneConfig, facts: ModelIdentity, window: int, candidates: list[int]) -> FlopModel:
    """The FLOP count of a window's points: every candidate split's filled rows windowed as window_of says."""
    found = window_of(window, candidates)
    return FlopModel(facts.shape, c.flop_length, c.keep_first,
                     windows={s: found for s in candidates} if found else {})


def best_window(runs: list[WindowRun]) -> tuple[WindowRun, Point] | None:
    """Of each window's best choice, the one with the highest FLOP-limit speedup; on a tie full attention, then
    the larger window (closer to exact)."""
    found = [(r, r.best) for r in runs if r.best is not None]
    if not found:
        return None
    return max(found, key=lambda pair: (pair[1].flop_speedup or 0.0, pair[0].window == 0, pair[0].window))
