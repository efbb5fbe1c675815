"""`ridgefill tune`: the split to serve with, measured. Calibrate once for a range of candidate splits, then fit
and measure splits one at a time on filled-region RULER (niah tasks) until, for each fill variant (identity,
ridge), the split with the fewest exact layers whose RULER stays within `tolerance` points of exact is found; then
check distant-context NLL from those choices up, fastest first, and serve the first that passes; print the frontier
(FLOP-limit speedup vs quality per split and variant), write the reports and a serving config JSON.

Two stages, because the two measures cost very differently. RULER (a few dozen short prompts) decides the search.
Distant-context NLL needs hundreds of LongPPL key tokens to judge a bound of a few tenths of a nat, and only
scored tail tokens can be key tokens: at the serving tail (256 tokens) that is ~100 passages per split. So the
NLL *check* scores its own, longer tail (--nll-tail, 1,024 of each 4,096-token passage: 333 key tokens in 20
passages on SmolLM2) and runs only where the answer is decided: from the variants' RULER choices upward, fastest
(variant, split) first, until one keeps the distant-context NLL within `max_distant_gap` nats of exact's (its
RULER measured first where the search skipped it): that one is served, and nothing slower is checked.
--no-nll-check judges RULER alone and serves the faster RULER choice.

The work is recipes run through the recipe pipeline's pieces (pipeline.run.run_tasks), built in memory from
these options (pipeline.recipe.recipe_from; their TOML is written into the run folder as the record) and each
task cached under its key, so a rerun or an interrupted tune reuses every finished step: the search's recipe (one
calibration for all candidates, then per measured split its fit and ruler tasks; `ridgefill run` on its
recipe.toml would measure every candidate) and one check recipe per variant in check/<variant>/ (its loss tasks,
the ridge check's calibration and fits linked from the run folder, exact NLLs shared in check/exact). The model's
identity is read without its weights (runtime.models.model_identity); the searches are pipeline/search.py's.

--windows W,...: the same search and check once per filled window, W = 0 (full attention) in the run folder itself,
W > 0 in window-W/ below it, where the filled rows of layers 0..min(candidates)-1 attend only to the kept first rows
and the W rows before them (torchfill/window.py: every candidate's maps share those windowed layers) and the FLOP
count is the windowed one; exact results are shared across windows. Of the windows' served points, the one with the
highest FLOP-limit speedup is served (on a tie full attention, then the larger window).

The package, one job a module: options.py (TuneConfig and what it names), recipes.py (the recipes, built in
memory), verdict.py (judging a point), sweep.py (a recipe run split by split), windows.py (one window's search and
check, the choice between windows), frontier_table.py (the printed frontier), serving_config.py (serving.json).
"""

from __future__ import annotations

from ridgefill.commands import Command
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.tune.frontier_table import print_frontier
from ridgefill.pipeline.tune.options import TuneConfig, candidate_splits, describe_windows, split_values, window_dir
from ridgefill.pipeline.tune.recipes import check_fits, local, recipes
from ridgefill.pipeline.tune.serving_config import serving_config
from ridgefill.pipeline.tune.verdict import distant_warning
from ridgefill.pipeline.tune.windows import best_window, tune_window
from ridgefill.runtime.console import note
from ridgefill.runtime.models import model_identity
from ridgefill.runtime.paths import write_json


def run(c: TuneConfig) -> dict:
    """Per window, search the splits and check the choices; print the frontier, write the reports and the serving
    config; returns the config. No split within bounds for any variant and window: the reports are written, then
    a one-line error says what to change."""
    from ridgefill.pipeline.report import write_report

    for window in c.window_sizes:  # the steps' checks, no model
        recipes(c, split_values(c.splits) if c.splits is not None else [1], window)
    facts = model_identity(local(c.model))  # the model's identity, without its weights
    check_fits(c, facts.context_length)
    candidates = candidate_splits(c.splits, facts.n_layers)
    runs = [tune_window(c, window, facts, candidates) for window in c.window_sizes]
    served = best_window(runs)
    print_frontier(runs, served, c.tail)
    checks = [check for r in runs for check in r.checks.values()]
    warning = distant_warning([res for check in checks for res in check.results()[1]]) if checks else (
        "tune: --no-nll-check: the split was judged on RULER alone; the distant-context NLL was not measured")
    if warning:
        note(warning)
    for folder in [r.sweep.run_dir for r in runs] + [check.run_dir for check in checks if check.measured]:
        write_report(folder)
    if served is None:
        raise nothing_passes(c, candidates)
    doc = serving_config(c, runs, *served, candidates)
    path = c.config_out or c.run_dir / "serving.json"
    write_json(path, doc)
    print(path)
    return doc


COMMAND = Command("tune", TuneConfig, run)


def nothing_passes(c: TuneConfig, candidates: list[int]) -> RidgefillError:
    """The one-line error when no (window, variant, split) is within bounds: what was asked, what to change."""
    bound = f" and the distant-context NLL within {c.max_distant_gap:g} nats" if c.nll_check else ""
    wider = ", a wider --windows" if any(c.window_sizes) else ""
    reports = " and ".join(str(window_dir(c, w) / "report.md") for w in c.window_sizes)
    return RidgefillError(f"no split of {candidates[0]}..{candidates[-1]} keeps filled-region RULER within "
                          f"{c.tolerance:g} points{bound} of exact ({', '.join(c.fill_names)}; "
                          f"{describe_windows(c.window_sizes)}): try higher --splits, a longer --tail{wider} or "
                          f"looser bounds; the measurements are in {reports}")
