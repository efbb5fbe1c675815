"""`ridgefill tune`: the split to serve with, measured. Calibrate once for a range of candidate splits, then fit
and measure splits one at a time on filled-region RULER (niah tasks) until, for each fill variant (identity,
ridge), the split with the fewest exact layers whose RULER stays within `tolerance` points of exact is found; then
check distant-context NLL from those choices up, fastest first, and serve the first that passes; print the frontier (FLOP-limit speedup vs
quality per split and variant), write the reports and a serving config JSON.

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
and the W rows before them (engine/window.py: every candidate's maps share those windowed layers) and the FLOP
count is the windowed one; exact results are shared across windows. Of the windows' served points, the one with the
highest FLOP-limit speedup is served (on a tie full attention, then the larger window).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill import __version__
from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import parse_lengths
from ridgefill.method.fill import (DEFAULT_KEEP_FIRST, DEFAULT_TAIL, FILLS, FROM_MAPS, SERVING_KIND, FillSettings,
                                   check_fill_values)
from ridgefill.method.statistics import OUTLIER_FACTOR
from ridgefill.pipeline.search import SEARCHES, search, step_up
from ridgefill.report.frontier import FlopModel, Point, frontier
from ridgefill.runtime.console import note, table
from ridgefill.runtime.models import ModelIdentity, model_identity
from ridgefill.runtime.paths import atomic_path, check_output, write_json
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.session import ModelConfig, check_length

if TYPE_CHECKING:
    from ridgefill.pipeline.recipe import Recipe

PASS = "pass"
MIN_DISTANT_TOKENS = 300  # fewer give no interval that separates fills (docs/quality.md, issue #13)


# --- options ------------------------------------------------------------------------------------------------
@dataclass
class TuneConfig(ModelConfig):
    data: str = option("wiki-leads", "Calibration text: .txt/.jsonl file or folder, Hub dataset, or 'wiki-leads' / "
                       "'shakespeare'.")
    splits: str | None = option(None, "Candidate splits: values and ranges, e.g. 14-20 or 14,16,18 (default: the "
                                "upper half, L/2..L-2).")
    tail: int = option(DEFAULT_TAIL, "Last prompt rows that run the full model (the served fill's tail).")
    keep_first: int = option(DEFAULT_KEEP_FIRST, "Leading rows run in full (the attention sink).")
    tolerance: float = option(5.0, "Filled-region RULER points below exact that still count as equal quality.")
    max_distant_gap: float = option(0.25, "Distant-context NLL above exact (nats) that still counts as equal "
                                    "quality.")
    variants: str = option("identity,ridge", "Fill variants to tune: identity, ridge, or the null controls drop and "
                           "mean (comma-separated).",
                           listed=str)
    search: str = option("bisect", "bisect (halve each variant's interval), descend (from the highest split down "
                         "to the first failure) or all (every candidate).")
    tokens: int = option(32768, "Calibration tokens (one pass for every candidate split).")
    seq_len: int = option(1024, "Tokens per calibration sequence.")
    holdout: float = option(0.1, "Share of calibration sequences held out (λ is chosen on them per layer).")
    lengths: str = option("1024", "RULER prompt + answer lengths (tokens), comma-separated.", listed=int)
    tasks: str = option("niah_single_1,niah_multikey_1", "RULER tasks (needles in filled rows), comma-separated.",
                        listed=str)
    samples: int = option(10, "RULER samples per task and length.")
    max_new_tokens: int = option(16, "Cap on RULER's answer budget (a niah answer is a 7-digit number).")
    nll_check: bool = option(True, "Check distant-context NLL from the RULER choices up, fastest split first, "
                             "until one is within --max-distant-gap (--no-nll-check: judge RULER alone).",
                             negatable=True)
    eval_data: str = option("shakespeare", "Text whose evaluation passages the NLL check scores.")
    context: int = option(4096, "Tokens per passage of the NLL check.")
    nll_tail: int = option(1024, "Last tokens of each check passage that run in full and are scored (the check's "
                           "own tail, not the serving --tail: only scored tokens can be distant-context tokens).")
    short: int = option(256, "Short window (tokens) whose loss marks distant-context tokens.")
    short_stride: int = option(64, "Scored tokens per short window of the check's exact pass (1: one window per "
                               "token, exact but slow).")
    passages: int = option(20, "Passages the NLL check scores per split (SmolLM2: 333 distant-context tokens in "
                           "20).")
    windows: str = option("0", "Filled windows W to search (comma-separated; 0: full attention): each runs the "
                          "search and the check in its own run folder (W > 0: <out-dir>/window-W), its filled rows "
                          "attending only to the kept first rows and the W rows before them below the lowest "
                          "candidate split; the fastest passing (window, variant, split) is served.", listed=int)
    length: int | None = option(None, "Prompt length the expected FLOP-limit speedup is stated at (default: the "
                                "longest measured prompt: a RULER length, or --context with the check).")
    seed: int = option(0, "Sample and bootstrap seed.")
    out_dir: Path | None = option(None, "Run folder (default runs/tune-<model>); a rerun reuses its finished steps.")
    config_out: Path | None = option(None, "Serving config JSON to write (default <out-dir>/serving.json).")

    def check(self) -> None:
        check_fill_values(self.tail, self.keep_first, OUTLIER_FACTOR)
        if not self.tolerance >= 0 or not self.max_distant_gap >= 0:
            raise RidgefillError(f"--tolerance {self.tolerance:g} and --max-distant-gap {self.max_distant_gap:g} "
                                 "must be 0 or more (points and nats above exact that still count as equal)")
        if self.search not in SEARCHES:
            raise RidgefillError(f"unknown --search '{self.search}': use {', '.join(SEARCHES)}")
        fills(self.variants)
        parse_lengths(self.lengths)
        parse_windows(self.windows)
        if self.splits is not None and split_values(self.splits)[0] < 1:
            raise RidgefillError(f"--splits {self.splits}: split 0 is out of range: a split is 1 or more")
        if self.nll_check and self.nll_tail + self.keep_first >= self.context:
            raise RidgefillError(f"--nll-tail {self.nll_tail} plus --keep-first {self.keep_first} leave no filled row "
                                 f"in a --context {self.context} passage: the NLL check would compare exact with "
                                 f"exact; use a --nll-tail below {self.context - self.keep_first}")
        for flag, value in (("--samples", self.samples), ("--passages", self.passages), ("--tokens", self.tokens),
                            ("--length", self.length), ("--nll-tail", self.nll_tail),
                            ("--short-stride", self.short_stride)):
            if value is not None and value < 1:
                raise RidgefillError(f"{flag} {value} must be at least 1")
        check_output(self, "config_out")

    @property
    def fill_names(self) -> list[str]:
        return fills(self.variants)

    @property
    def ruler_lengths(self) -> list[int]:
        return parse_lengths(self.lengths)

    @property
    def window_sizes(self) -> list[int]:
        return parse_windows(self.windows)

    @property
    def flop_length(self) -> int:
        return self.length or max(self.ruler_lengths + ([self.context] if self.nll_check else []))

    @property
    def run_dir(self) -> Path:
        return self.out_dir if self.out_dir is not None else Path("runs") / f"tune-{_slug(self.model)}"


def fills(text: str) -> list[str]:
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    if not names or any(v not in FILLS for v in names):
        raise RidgefillError(f"--variants '{text}': tune any of {', '.join(FILLS)} (exact is always measured)")
    return [v for v in FILLS if v in names]


def parse_windows(text: str) -> list[int]:
    """--windows: comma-separated filled windows W >= 0 (0: full attention), sorted, without repeats."""
    try:
        values = sorted({int(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise RidgefillError(f"--windows '{text}' is not a comma-separated list of filled windows of at least 0 "
                             "(0: full attention), e.g. --windows 0,256")
    return values


def window_dir(c: TuneConfig, window: int) -> Path:
    """A window's run folder: the run folder itself for full attention (0), else window-W below it."""
    return c.run_dir if not window else c.run_dir / f"window-{window}"


def window_of(window: int, candidates: list[int]) -> dict | None:
    """Filled window `window` as tune runs it, {size, first, last}: in layers 0..min(candidates)-1, below every
    candidate split (so one windowed calibration serves them all); None for 0 (full attention)."""
    return {"size": window, "first": 0, "last": min(candidates) - 1} if window else None


def window_layers(window: int, candidates: list[int]) -> str | None:
    """The --filled-window-layers text of window_of (None for full attention)."""
    found = window_of(window, candidates)
    return None if found is None else f"{found['first']}-{found['last']}"


def describe_windows(windows: list[int]) -> str:
    """The windows in words, e.g. 'full attention, window 256'."""
    return ", ".join("full attention" if not w else f"window {w}" for w in windows)


def split_values(text: str) -> list[int]:
    ranges = parse_ranges(text, "--splits", "split", "14-20")
    return sorted({s for lo, hi in ranges for s in range(lo, hi + 1)})


def candidate_splits(text: str | None, n_layers: int) -> list[int]:
    """The candidates: --splits, or the upper half of the layers; each in 1..L-2 (at L-1 nothing is filled but
    the last layer, whose input is the split state itself: there is nothing to fit)."""
    top = n_layers - 2
    if top < 1:
        raise RidgefillError(f"a {n_layers}-layer model has no split to tune: it needs at least 3 layers")
    splits = split_values(text) if text is not None else list(range(max(1, n_layers // 2), top + 1))
    bad = [s for s in splits if not 1 <= s <= top]
    if bad:
        raise RidgefillError(f"--splits {text}: split {bad[0]} is out of range: use 1..{top} for this {n_layers}-layer "
                             f"model (at {n_layers - 1} nothing is left to fit)")
    return splits


def _slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name) or "model"


# --- the recipes, built in memory ---------------------------------------------------------------------------
CHECK_FOLDER = "check"  # under the run folder: check/<variant>/ per variant, check/exact the exact NLLs they share


def search_tables(c: TuneConfig, splits: list[int], window: int = 0) -> dict:
    """The search's recipe: top-level settings, then [calibrate] and [fit] (for ridge) and [ruler], with filled
    window `window` (0: full attention)."""
    variants = ["exact", *c.fill_names]
    tables = _fit_tables(c, splits, window) if any(v in FROM_MAPS for v in variants) else {}
    tables["ruler"] = {"lengths": c.ruler_lengths,
                       "tasks": [t.strip() for t in str(c.tasks).split(",") if t.strip()], "samples": c.samples,
                       "max-new-tokens": c.max_new_tokens, "region": "filled", "keep-first": c.keep_first,
                       "variants": variants, **_window_keys(splits, window), **_shared_answers(c, window)}
    return _tables(c, _name(c, window), f"ridgefill tune: splits {splits[0]}..{splits[-1]}, tail {c.tail}"
                   f"{_window_note(window)}", splits, c.tail, tables)


def check_tables(c: TuneConfig, splits: list[int], variant: str, window: int = 0) -> dict:
    """A variant's NLL check: for ridge the search's [calibrate] and [fit] (the same tasks, so the same
    artifacts), then [loss] on the check's passages at the check's own tail (exact NLLs in the run folder's
    check/exact, whatever the window)."""
    tables = _fit_tables(c, splits, window) if variant in FROM_MAPS else {}
    tables["loss"] = {"data": _local(c.eval_data), "context": c.context, "short": c.short,
                      "short-stride": c.short_stride, "samples": c.passages, "keep-first": c.keep_first,
                      "variants": ["exact", variant],
                      "exact-cache": str((c.run_dir / CHECK_FOLDER / "exact").resolve()),
                      **_window_keys(splits, window)}
    return _tables(c, f"{_name(c, window)}-check-{variant}", f"ridgefill tune: the NLL check of {variant} fill, "
                   f"tail {c.nll_tail}{_window_note(window)}", splits, c.nll_tail, tables)


def _fit_tables(c: TuneConfig, splits: list[int], window: int) -> dict:
    calibrate = {"tokens": c.tokens, "seq-len": c.seq_len, "holdout": c.holdout}
    if window:  # the windowed forward's sinks are the kept first rows, as when the maps fill
        calibrate["skip-first"] = c.keep_first
    return {"calibrate": {**calibrate, **_window_keys(splits, window)}, "fit": {}}


def _window_keys(splits: list[int], window: int) -> dict:
    """A step table's filled window (nothing for full attention)."""
    return {"filled-window": window, "filled-window-layers": window_layers(window, splits)} if window else {}


def _shared_answers(c: TuneConfig, window: int) -> dict:
    """For a window, the exact RULER answers of the full-attention run folder (exact prefill has no window, so
    every window shares them); nothing for full attention (its runner sets its own folder, the same one)."""
    from ridgefill.pipeline.run import exact_store

    return {"exact-cache": str(exact_store(c.run_dir).resolve())} if window else {}


def _name(c: TuneConfig, window: int) -> str:
    return f"tune-{_slug(c.model)}" + (f"-window-{window}" if window else "")


def _window_note(window: int) -> str:
    return f", filled window {window}" if window else ""


def _tables(c: TuneConfig, name: str, description: str, splits: list[int], tail: int, tables: dict) -> dict:
    return {"name": name, "description": description, "model": _local(c.model), "data": _local(c.data),
            "splits": splits, "tails": [tail], "seeds": [c.seed], "lam": "auto", "dtype": c.dtype,
            "device": c.device, "chunk": c.chunk, "tolerance": c.tolerance, **tables}


def _local(spec: str) -> str:
    """A local file or folder as an absolute path (the recipe lives in the run folder), anything else as given."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


RECORD = "Generated by `ridgefill tune` (every candidate split; tune measures the ones its search needs)."


def recipes(c: TuneConfig, splits: list[int], window: int = 0) -> tuple["Recipe", dict[str, "Recipe"]]:
    """Filled window `window`'s search recipe (recorded as <its run folder>/recipe.toml when it runs) and, with
    the check, each variant's check recipe (<its run folder>/check/<variant>/recipe.toml): built in memory and
    validated (every step's own checks, no model), errors in one line starting `tune: `."""
    from ridgefill.pipeline.recipe import recipe_from, toml_text

    def built(tables: dict, path: Path):
        return recipe_from(tables, path, toml_text(tables, RECORD), where="tune")

    run_dir = window_dir(c, window)
    search_recipe = built(search_tables(c, splits, window), run_dir / "recipe.toml")
    checks = {}
    if c.nll_check:
        for v in c.fill_names:
            checks[v] = built(check_tables(c, splits, v, window), run_dir / CHECK_FOLDER / v / "recipe.toml")
    return search_recipe, checks


def record(recipe: "Recipe") -> None:
    """Write a recipe's text where it says it lives (the record of what ran; nothing reads it back)."""
    recipe.path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(recipe.path) as tmp:
        tmp.write_text(recipe.text)


def check_fits(c: TuneConfig, limit: int | None) -> None:
    """Every prompt tune will run fits the model's context (before any measurement)."""
    for flag, length in [("--lengths", max(c.ruler_lengths))] + ([("--context", c.context)] if c.nll_check else []):
        check_length(flag, length, limit)


# --- judging a split ----------------------------------------------------------------------------------------
def verdict(point: Point | None, tolerance: float, max_gap: float, judged=("ruler", "nll")) -> str:
    """PASS, or why the point fails, on what `judged` names: the filled-region RULER score within `tolerance`
    points of exact's, the distant-context NLL (tail NLL where none was found) within `max_gap` nats."""
    if "ruler" in judged:
        if point is None or point.retrieval_drop is None:
            return "no RULER score"
        if point.retrieval_drop > tolerance:
            return f"RULER {-point.retrieval_drop:+.1f} points"
    if "nll" in judged:
        if point is None or point.distant_gap is None:
            return "no NLL"
        if point.distant_gap > max_gap:
            return f"{point.nll_metric or 'distant'} NLL {point.distant_gap:+.3f} nats"
    return PASS


# --- the sweep ----------------------------------------------------------------------------------------------
@dataclass
class Sweep:
    """A recipe's tasks, run split by split into one run folder: the measured splits' tasks (and the shared
    calibration) each time, so manifest.json lists everything measured so far and cached tasks cost nothing.
    Each split is judged once, on what `judged` names (verdict()); `reuse`: a run folder whose artifacts of the
    same name (the same key: the same inputs) are linked instead of computed."""

    recipe: "Recipe"
    run_dir: Path
    facts: ModelIdentity
    flops: FlopModel
    variants: list[str]
    tolerance: float
    max_gap: float
    judged: tuple[str, ...] = ("ruler",)
    reuse: Path | None = None
    measured: list[int] = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)  # (variant, split) -> PASS or why not

    def judge(self, split: int) -> dict[str, bool]:
        from ridgefill.pipeline.manifest import Manifest
        from ridgefill.pipeline.plan import plan
        from ridgefill.pipeline.run import run_tasks

        if split not in self.measured:
            note(f"tune: {'checking' if 'ruler' not in self.judged else 'measuring'} split {split}"
                 f"{'' if 'ruler' in self.judged else ' (' + ', '.join(self.variants) + ' NLL)'}")
            self.measured.append(split)
            tasks = [t for t in plan(self.recipe) if t.split is None or t.split in self.measured]
            manifest = Manifest(self.run_dir, self.recipe, self.facts.info)
            run_tasks(tasks, self.run_dir, self.facts.info["weights_hash"], (), manifest, reuse=self.reuse)
            points = {p.variant: p for p in self.frontier().points if p.split == split}
            for v in self.variants:
                self.verdicts[(v, split)] = verdict(points.get(v), self.tolerance, self.max_gap, self.judged)
        return {v: self.verdicts[(v, split)] == PASS for v in self.variants}

    def results(self) -> tuple[dict, list]:
        from ridgefill.report.write import collect

        return collect(self.run_dir)

    def frontier(self):
        _, results = self.results()
        return frontier([r for r in results if r.command == "ruler"], [r for r in results if r.command == "loss"],
                        [], self.tolerance, self.flops)


def merged_points(sweep: Sweep, checks: dict[str, Sweep]) -> list[Point]:
    """The search's points (RULER, FLOP-limit speedup at the serving tail) with the NLL of each checked split."""
    checked = {(p.variant, p.split): p for check in checks.values() for p in check.frontier().points}
    out = []
    for p in sweep.frontier().points:
        nll = checked.get((p.variant, p.split))
        out.append(p if nll is None else replace(p, distant_nll=nll.distant_nll,
                                                 distant_nll_exact=nll.distant_nll_exact,
                                                 nll_metric=nll.nll_metric))
    return out


# --- one window's search and check -------------------------------------------------------------------------
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
                         lambda v, split: _speedup_at(sweep, v, split))
    return WindowRun(window, sweep, checks, searched, chosen, merged_points(sweep, checks))


def window_flops(c: TuneConfig, facts: ModelIdentity, window: int, candidates: list[int]) -> FlopModel:
    """The FLOP count of a window's points: every candidate split's filled rows windowed as window_of says."""
    found = window_of(window, candidates)
    return FlopModel(facts.shape, c.flop_length, c.keep_first,
                     windows={s: found for s in candidates} if found else {})


# --- the command ----------------------------------------------------------------------------------------------
def run(c: TuneConfig) -> dict:
    """Per window, search the splits and check the choices; print the frontier, write the reports and the serving
    config; returns the config. No split within bounds for any variant and window: the reports are written, then
    a one-line error says what to change."""
    from ridgefill.report.write import write_report

    for window in c.window_sizes:  # the steps' checks, no model
        recipes(c, split_values(c.splits) if c.splits is not None else [1], window)
    facts = model_identity(_local(c.model))  # the model's identity, without its weights
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


def best_choice(points: list[Point], chosen: dict[str, int | None]) -> Point | None:
    """Of each variant's chosen split, the point with the highest FLOP-limit speedup (the lower split, then
    identity fill, where it is not counted)."""
    found = [p for p in points if chosen.get(p.variant) == p.split]
    if not found:
        return None
    return max(found, key=lambda p: (p.flop_speedup or 0.0, -p.split, p.variant == "identity"))


def best_window(runs: list[WindowRun]) -> tuple[WindowRun, Point] | None:
    """Of each window's best choice, the one with the highest FLOP-limit speedup; on a tie full attention, then
    the larger window (closer to exact)."""
    found = [(r, r.best) for r in runs if r.best is not None]
    if not found:
        return None
    return max(found, key=lambda pair: (pair[1].flop_speedup or 0.0, pair[0].window == 0, pair[0].window))


def print_frontier(runs: list[WindowRun], served: tuple[WindowRun, Point] | None, tail: int) -> None:
    rows = [frontier_row(r, p, served) for r in runs for p in sorted(r.points, key=lambda p: (-p.split, p.variant))]
    sweep = runs[0].sweep
    length = next((p.length for r in runs for p in r.points if p.length), sweep.flops.length)
    nll = f", NLL within {sweep.max_gap:g} nats" if runs[0].checks else ""
    table(f"tune: FLOP-limit speedup at {length} tokens vs quality (tail {tail}; RULER within "
          f"{sweep.tolerance:g} points{nll} of exact)",
          ["window", "split", "variant", "FLOP-limit speedup", "RULER", "exact RULER", "Δ RULER", "Δ NLL (nats)",
           "RULER verdict", "NLL check", "chosen"], rows)


def frontier_row(run: WindowRun, p: Point, served: tuple[WindowRun, Point] | None) -> list:
    """A point's row of the frontier table; chosen: `served`, `yes` (its window's choice) or `RULER's` (the
    search's choice the check moved up from)."""
    key = (p.variant, p.split)
    check = run.checks[p.variant].verdicts.get(key, "") if p.variant in run.checks else ""
    is_served = served is not None and served[0] is run and (served[1].variant, served[1].split) == key
    chosen = "served" if is_served else "yes" if run.chosen.get(p.variant) == p.split else \
        "RULER's" if run.searched.get(p.variant) == p.split else ""
    return [run.window or "full", p.split, p.variant, p.flop_speedup, p.retrieval, p.retrieval_exact,
            None if p.retrieval_drop is None else p.retrieval - p.retrieval_exact, p.distant_gap,
            run.sweep.verdicts.get(key, ""), check, chosen]


def distant_warning(results: list) -> str | None:
    """A line saying that the NLL verdicts rest on too few distant-context tokens to judge, or None. The tokens
    are the exact model's, the same at every split, so any loss result counts them."""
    from ridgefill.runtime.stats import describe_spread

    spread = next((r.doc.get("distant_spread") for r in results if r.command == "loss"), None)
    if not spread or spread["tokens"] >= MIN_DISTANT_TOKENS:
        return None
    more = "more --passages, a longer --context or a longer --nll-tail"
    if not spread["tokens"]:
        return (f"tune: no distant-context token in {spread['passages']} passages: the NLL check was judged on the "
                f"tail NLL; {more} give a distant-context check (docs/tune.md)")
    return (f"tune: the NLL check rests on {describe_spread(spread)}: fewer than {MIN_DISTANT_TOKENS} cannot "
            f"separate fills within the bound, so treat it as a rough screen; {more} sharpen it (docs/tune.md)")


# --- the serving config -------------------------------------------------------------------------------------
def serving_config(c: TuneConfig, runs: list[WindowRun], served: WindowRun, best: Point,
                   candidates: list[int]) -> dict:
    """What a server needs to fill as tuned (split, tail, keep_first, variant, maps, filled window), what it should
    expect (quality with intervals, FLOP-limit speedup at a stated length) and where it came from (per_window)."""
    sweep = served.sweep
    manifest, results = sweep.results()
    check = served.checks.get(best.variant)
    maps = _maps_of(manifest, sweep.run_dir, best.split) if best.variant in FROM_MAPS else None
    fill = FillSettings(best.variant, best.split, maps, c.tail, c.keep_first, OUTLIER_FACTOR,  # as it was measured
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
    return {v: None if s is None else {"split": s, "flop_limit_speedup": _speedup_at(run.sweep, v, s)}
            for v, s in run.chosen.items()}


def _verdicts(run: WindowRun) -> list[dict]:
    return [{"variant": v, "split": s, "verdict": x} for (v, s), x in run.sweep.verdicts.items()]


def _checks(run: WindowRun) -> list[dict]:
    return [{"variant": v, "split": s, "verdict": x, "recipe": str(check.recipe.path.resolve())}
            for check in run.checks.values() for (v, s), x in check.verdicts.items()]


def _speedup_at(sweep: Sweep, variant: str, split: int) -> float | None:
    return sweep.flops.speedup(variant, split, sweep.recipe.settings["tails"][0])


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
