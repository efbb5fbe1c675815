"""`ridgefill tune`: the split to serve with, measured. Calibrate once for a range of candidate splits, then fit
and measure splits one at a time — filled-region RULER (niah tasks) and distant-context NLL of exact, identity and
ridge — until, for each fill variant, the split with the fewest exact layers whose quality stays within bounds of
exact is found; print the frontier (FLOP-limit speedup vs quality per split and variant), write the run's report
and a serving config JSON.

A split *passes* for a variant when its filled-region RULER score is at most `tolerance` points below exact's and
its distant-context NLL at most `max_distant_gap` nats above exact's (tail NLL where the passages held no
distant-context token), on the same samples.

The work is a recipe (recipe.toml in the run folder, generated from the options, every candidate split in it)
run through the recipe pipeline's pieces: one calibration for all candidates, then per measured split its fit,
ruler and loss tasks (pipeline.run.run_tasks), each cached under its key, so a rerun or an interrupted tune
reuses every finished step and `ridgefill run <run folder>/recipe.toml` would measure every candidate.

Search (quality falls as the split moves down, so each variant's passing splits are, up to noise, the ones above
a threshold):
- bisect (default): measure the highest candidate, then halve each variant's open interval between its lowest
  passing and highest failing split; each measurement judges both variants. About 1 + 2·log2(n) of n
  candidates, and the answer is certified locally: the chosen split passed and the candidate below it failed
  (or it is the lowest candidate);
- descend: from the highest candidate down, one by one, until every variant has failed once: the chosen split
  has every higher candidate passing too (robust to a noisy dip, slower);
- all: every candidate (the full frontier table), chosen as in descend.
"""

from __future__ import annotations

import gc
import json
import re
import tempfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ridgefill import __version__
from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import parse_lengths
from ridgefill.report.frontier import FlopModel, Point, frontier
from ridgefill.runtime.console import note, table
from ridgefill.runtime.paths import atomic_path, write_json
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.serving import KIND as SERVING_KIND
from ridgefill.runtime.session import ModelConfig

if TYPE_CHECKING:
    from ridgefill.engine import ModelShape
    from ridgefill.pipeline.recipe import Recipe

FILLS = ("identity", "ridge")
SEARCHES = ("bisect", "descend", "all")
PASS = "pass"
MIN_DISTANT_TOKENS = 300  # fewer give no interval that separates fills (docs/quality.md, issue #13)


# --- options ------------------------------------------------------------------------------------------------
@dataclass
class TuneConfig(ModelConfig):
    data: str = option("wiki-leads", "Calibration text: .txt/.jsonl file or folder, Hub dataset, or 'wiki-leads' / "
                       "'shakespeare'.")
    splits: str | None = option(None, "Candidate splits: values and ranges, e.g. 14-20 or 14,16,18 (default: the "
                                "upper half, L/2..L-2).")
    tail: int = option(256, "Last prompt rows that run the full model.")
    keep_first: int = option(1, "Leading rows run in full (the attention sink).")
    tolerance: float = option(5.0, "Filled-region RULER points below exact that still count as equal quality.")
    max_distant_gap: float = option(0.25, "Distant-context NLL above exact (nats) that still counts as equal "
                                    "quality.")
    variants: str = option("identity,ridge", "Fill variants to tune: identity, ridge (comma-separated).",
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
    eval_data: str = option("shakespeare", "Text whose evaluation passages are scored for the distant-context NLL.")
    context: int = option(2048, "Tokens per scored passage.")
    short: int = option(256, "Short window (tokens) whose loss marks distant-context tokens.")
    passages: int = option(6, "Passages scored per split.")
    length: int | None = option(None, "Prompt length the expected FLOP-limit speedup is stated at (default: the "
                                "longest measured prompt, a RULER length or --context, as the report does).")
    seed: int = option(0, "Sample and bootstrap seed.")
    out_dir: Path | None = option(None, "Run folder (default runs/tune-<model>); a rerun reuses its finished steps.")
    config_out: Path | None = option(None, "Serving config JSON to write (default <out-dir>/serving.json).")

    def check(self) -> None:
        if not self.tolerance >= 0 or not self.max_distant_gap >= 0:
            raise RidgefillError(f"--tolerance {self.tolerance:g} and --max-distant-gap {self.max_distant_gap:g} "
                                 "must be 0 or more (points and nats above exact that still count as equal)")
        if self.search not in SEARCHES:
            raise RidgefillError(f"unknown --search '{self.search}': use {', '.join(SEARCHES)}")
        fills(self.variants)
        parse_lengths(self.lengths)
        if self.splits is not None and split_values(self.splits)[0] < 1:
            raise RidgefillError(f"--splits {self.splits}: split 0 is out of range: a split is 1 or more")
        for flag, value in (("--samples", self.samples), ("--passages", self.passages), ("--tokens", self.tokens),
                            ("--length", self.length)):
            if value is not None and value < 1:
                raise RidgefillError(f"{flag} {value} must be at least 1")

    @property
    def fill_names(self) -> list[str]:
        return fills(self.variants)

    @property
    def ruler_lengths(self) -> list[int]:
        return parse_lengths(self.lengths)

    @property
    def run_dir(self) -> Path:
        return self.out_dir if self.out_dir is not None else Path("runs") / f"tune-{_slug(self.model)}"


def fills(text: str) -> list[str]:
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    if not names or any(v not in FILLS for v in names):
        raise RidgefillError(f"--variants '{text}': tune identity, ridge or both (exact is always measured)")
    return [v for v in FILLS if v in names]


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


# --- the generated recipe -----------------------------------------------------------------------------------
def recipe_text(c: TuneConfig, splits: list[int]) -> str:
    """The recipe of this tune: top-level settings, then [calibrate] and [fit] (for ridge), [ruler], [loss]."""
    variants = ["exact", *c.fill_names]
    top = {"name": f"tune-{_slug(c.model)}",
           "description": f"ridgefill tune: splits {splits[0]}..{splits[-1]}, tail {c.tail}",
           "model": _local(c.model), "data": _local(c.data), "splits": splits, "tails": [c.tail], "seeds": [c.seed],
           "lam": "auto", "dtype": c.dtype, "device": c.device, "chunk": c.chunk, "tolerance": c.tolerance}
    tables: dict[str, dict] = {}
    if "ridge" in variants:
        tables["calibrate"] = {"tokens": c.tokens, "seq-len": c.seq_len, "holdout": c.holdout}
        tables["fit"] = {}
    tables["ruler"] = {"lengths": c.ruler_lengths,
                       "tasks": [t.strip() for t in str(c.tasks).split(",") if t.strip()], "samples": c.samples,
                       "max-new-tokens": c.max_new_tokens, "region": "filled", "keep-first": c.keep_first,
                       "variants": variants}
    tables["loss"] = {"data": _local(c.eval_data), "context": c.context, "short": c.short, "samples": c.passages,
                      "keep-first": c.keep_first, "variants": variants}
    lines = ["# Generated by `ridgefill tune` (every candidate split; tune measures the ones its search needs).",
             *(f"{k} = {_toml(v)}" for k, v in top.items())]
    for step, values in tables.items():
        lines += ["", f"[{step}]", *(f"{k} = {_toml(v)}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


def _local(spec: str) -> str:
    """A local file or folder as an absolute path (the recipe lives in the run folder), anything else as given."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def checked_recipe(c: TuneConfig, splits: list[int], path: Path):
    """Write the recipe to `path` and load it: every step's own checks run (no model), errors in one line."""
    from ridgefill.pipeline.recipe import load_recipe

    with atomic_path(path) as tmp:
        tmp.write_text(recipe_text(c, splits))
    return load_recipe(path)


def preflight(c: TuneConfig) -> None:
    """The steps' checks before the model loads (placeholder split 1 when the candidates need the model)."""
    splits = split_values(c.splits) if c.splits is not None else [1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.toml"
        try:
            checked_recipe(c, splits, path)
        except RidgefillError as exc:
            raise RidgefillError(str(exc).replace(f"{path}: ", "tune: ")) from None


# --- the model ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    info: dict  # id, weights hash, family, widths, layer kinds, n_layers: what the manifest records
    shape: "ModelShape"


def model_facts(c: TuneConfig) -> ModelFacts:
    """Load the model once for its identity and shapes, then free it (every task loads its own). A local folder
    is opened by its absolute path, the model id the recipe's tasks record."""
    session = replace(c, model=_local(c.model)).open()
    facts = ModelFacts({**session.loaded.info(), "n_layers": session.engine.n_layers}, session.shape)
    del session
    gc.collect()
    if c.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return facts


# --- judging a split ----------------------------------------------------------------------------------------
def verdict(point: Point | None, tolerance: float, max_gap: float) -> str:
    """PASS, or why the point fails."""
    if point is None or point.retrieval_drop is None:
        return "no RULER score"
    if point.distant_gap is None:
        return "no NLL"
    if point.retrieval_drop > tolerance:
        return f"RULER {-point.retrieval_drop:+.1f} points"
    if point.distant_gap > max_gap:
        return f"{point.nll_metric or 'distant'} NLL {point.distant_gap:+.3f} nats"
    return PASS


Judge = Callable[[int], dict[str, bool]]  # split -> variant -> passes


# --- search -------------------------------------------------------------------------------------------------
def bisect(candidates: list[int], judge: Judge, variants: list[str]) -> dict[str, int | None]:
    """Per variant the lowest passing candidate, assuming quality falls as the split goes down: the highest
    candidate first, then the midpoint of the widest open interval (lowest known pass, highest known failure
    below it); every measurement narrows every variant's interval."""
    order = sorted(candidates)
    passed = judge(order[-1])
    lowest_pass = {v: len(order) - 1 for v in variants if passed[v]}
    highest_fail = {v: -1 for v in lowest_pass}  # -1: no failure known below (the lowest candidate may pass)
    while True:
        gaps = {v: lowest_pass[v] - highest_fail[v] for v in lowest_pass}
        wide = [v for v in lowest_pass if gaps[v] > 1]
        if not wide:
            break
        widest = max(wide, key=lambda v: gaps[v])
        mid = (lowest_pass[widest] + highest_fail[widest]) // 2
        passed = judge(order[mid])
        for v in lowest_pass:
            if highest_fail[v] < mid < lowest_pass[v]:
                (lowest_pass if passed[v] else highest_fail)[v] = mid
    return {v: order[lowest_pass[v]] if v in lowest_pass else None for v in variants}


def descend(candidates: list[int], judge: Judge, variants: list[str], every: bool = False) -> dict[str, int | None]:
    """Per variant the lowest candidate above which every candidate passes: from the highest down, stopping when
    every variant has failed once (every=True: measure every candidate anyway)."""
    chosen: dict[str, int | None] = {v: None for v in variants}
    open_ = set(variants)
    for split in sorted(candidates, reverse=True):
        if not open_ and not every:
            break
        passed = judge(split)
        for v in [v for v in variants if v in open_]:
            if passed[v]:
                chosen[v] = split
            else:
                open_.discard(v)
    return chosen


def search(mode: str, candidates: list[int], judge: Judge, variants: list[str]) -> dict[str, int | None]:
    if mode == "bisect":
        return bisect(candidates, judge, variants)
    return descend(candidates, judge, variants, every=mode == "all")


# --- the sweep ----------------------------------------------------------------------------------------------
@dataclass
class Sweep:
    """The recipe's tasks, run split by split into one run folder: the measured splits' tasks (and the shared
    calibration) each time, so manifest.json lists everything measured so far and cached tasks cost nothing."""

    recipe: "Recipe"
    run_dir: Path
    facts: ModelFacts
    flops: FlopModel
    tolerance: float
    max_gap: float
    measured: list[int] = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)  # (variant, split) -> PASS or why not

    def judge(self, split: int) -> dict[str, bool]:
        from ridgefill.pipeline.manifest import Manifest
        from ridgefill.pipeline.plan import plan
        from ridgefill.pipeline.run import run_tasks

        note(f"tune: measuring split {split}")
        self.measured.append(split)
        tasks = [t for t in plan(self.recipe) if t.split is None or t.split in self.measured]
        manifest = Manifest(self.run_dir, self.recipe, self.facts.info)
        run_tasks(tasks, self.run_dir, self.facts.info["weights_hash"], (), manifest)
        points = {p.variant: p for p in self.frontier().points if p.split == split}
        out = {}
        for v in self.variants:
            self.verdicts[(v, split)] = verdict(points.get(v), self.tolerance, self.max_gap)
            out[v] = self.verdicts[(v, split)] == PASS
        return out

    @property
    def variants(self) -> list[str]:
        return [v for v in FILLS if v in self.recipe.steps["ruler"]["variants"].split(",")]

    def results(self) -> tuple[dict, list]:
        from ridgefill.report.write import collect

        return collect(self.run_dir)

    def frontier(self):
        _, results = self.results()
        return frontier([r for r in results if r.command == "ruler"], [r for r in results if r.command == "loss"],
                        [], self.tolerance, self.flops)


# --- the command ----------------------------------------------------------------------------------------------
def run(c: TuneConfig) -> dict:
    """Search the splits, print the frontier, write the report and the serving config; returns the config. No
    split within bounds for any variant: the report is written, then a one-line error says what to change."""
    from ridgefill.report.write import write_report

    preflight(c)
    facts = model_facts(c)
    candidates = candidate_splits(c.splits, facts.info["n_layers"])
    run_dir = c.run_dir
    recipe = checked_recipe(c, candidates, run_dir / "recipe.toml")
    flops = FlopModel(facts.shape, c.length or max(c.ruler_lengths + [c.context]), c.keep_first)
    sweep = Sweep(recipe, run_dir, facts, flops, c.tolerance, c.max_distant_gap)
    chosen = search(c.search, candidates, sweep.judge, c.fill_names)
    points = sweep.frontier().points
    print_frontier(sweep, points, chosen, c.tail)
    warning = distant_warning(sweep.results()[1])
    if warning:
        note(warning)
    write_report(run_dir)
    best = best_choice(points, chosen)
    if best is None:
        raise RidgefillError(f"no split of {candidates[0]}..{candidates[-1]} keeps filled-region RULER within "
                             f"{c.tolerance:g} points and the distant-context NLL within {c.max_distant_gap:g} nats "
                             f"of exact ({', '.join(c.fill_names)}): try higher --splits, a longer --tail or looser "
                             f"bounds; the measurements are in {run_dir / 'report.md'}")
    doc = serving_config(c, sweep, best, chosen, candidates)
    path = c.config_out or run_dir / "serving.json"
    write_json(path, doc)
    print(path)
    return doc


COMMAND = Command("tune", TuneConfig, run)


def best_choice(points: list[Point], chosen: dict[str, int | None]) -> Point | None:
    """Of each variant's chosen split, the point with the highest FLOP-limit speedup (the lower split, then
    identity fill, where it is not counted)."""
    found = [p for p in points if chosen.get(p.variant) == p.split]
    if not found:
        return None
    return max(found, key=lambda p: (p.flop_speedup or 0.0, -p.split, p.variant == "identity"))


def print_frontier(sweep: Sweep, points: list[Point], chosen: dict, tail: int) -> None:
    rows = [[p.split, p.variant, p.flop_speedup, p.retrieval, p.retrieval_exact,
             None if p.retrieval_drop is None else p.retrieval - p.retrieval_exact, p.distant_gap,
             sweep.verdicts.get((p.variant, p.split), ""), "yes" if chosen.get(p.variant) == p.split else ""]
            for p in sorted(points, key=lambda p: (-p.split, p.variant))]
    length = next((p.length for p in points if p.length), sweep.flops.length)
    table(f"tune: FLOP-limit speedup at {length} tokens vs quality (tail {tail}; RULER within "
          f"{sweep.tolerance:g} points, NLL within {sweep.max_gap:g} nats of exact)",
          ["split", "variant", "FLOP-limit speedup", "RULER", "exact RULER", "Δ RULER", "Δ NLL (nats)", "verdict",
           "chosen"], rows)


def distant_warning(results: list) -> str | None:
    """A line saying that the NLL verdicts rest on too few distant-context tokens to judge, or None. The tokens
    are the exact model's, the same at every split, so any loss result counts them."""
    from ridgefill.evals.stats import describe_spread

    spread = next((r.doc.get("distant_spread") for r in results if r.command == "loss"), None)
    if not spread or spread["tokens"] >= MIN_DISTANT_TOKENS:
        return None
    if not spread["tokens"]:
        return (f"tune: no distant-context token in {spread['passages']} passages: the NLL bound was judged on the "
                "tail NLL; more --passages or a longer --context give a distant-context check (docs/tune.md)")
    return (f"tune: the NLL verdicts rest on {describe_spread(spread)}: fewer than {MIN_DISTANT_TOKENS} cannot "
            "separate fills within the bound, so treat them as a rough screen; more --passages or a longer "
            "--context sharpen them (docs/tune.md)")


# --- the serving config -------------------------------------------------------------------------------------
def serving_config(c: TuneConfig, sweep: Sweep, best: Point, chosen: dict, candidates: list[int]) -> dict:
    """What a server needs to fill as tuned (split, tail, keep_first, variant, maps), what it should expect
    (quality with intervals, FLOP-limit speedup at a stated length) and where it came from."""
    manifest, results = sweep.results()
    maps = _maps_of(manifest, sweep.run_dir, best.split) if best.variant == "ridge" else None
    info = sweep.facts.info
    return {
        "kind": SERVING_KIND, "version": 1,  # what runtime/serving.py reads
        "model": {"id": info["id"], "weights_hash": info["weights_hash"], "family": info.get("family"),
                  "layers": info["n_layers"]},
        "variant": best.variant, "split": best.split, "tail": c.tail, "keep_first": c.keep_first,
        "maps": maps, "dtype": c.dtype,
        "expected_speedup": {"flop_limit": best.flop_speedup, "prompt_length": best.length or sweep.flops.length},
        "quality": quality(best, results, c),
        "choices": {v: None if s is None else {"split": s, "flop_limit_speedup": _speedup_at(sweep, v, s)}
                    for v, s in chosen.items()},
        "tune": {"run_dir": str(sweep.run_dir.resolve()), "recipe": str((sweep.run_dir / "recipe.toml").resolve()),
                 "search": c.search, "candidates": candidates, "measured": sweep.measured,
                 "tolerance": c.tolerance, "max_distant_gap": c.max_distant_gap,
                 "verdicts": [{"variant": v, "split": s, "verdict": x} for (v, s), x in sweep.verdicts.items()]},
        "ridgefill_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _speedup_at(sweep: Sweep, variant: str, split: int) -> float | None:
    return sweep.flops.speedup(variant, split, sweep.recipe.settings["tails"][0])


def _maps_of(manifest: dict, run_dir: Path, split: int) -> dict:
    step = next(s for s in manifest["steps"] if s["step"] == "fit" and s["split"] == split)
    return {"path": str((run_dir / step["artifact"]).resolve()), "hash": step["hashes"][step["artifact"]]}


def quality(point: Point, results: list, c: TuneConfig) -> dict:
    """The chosen point's RULER and NLL beside exact's, with the paired 95% intervals of the differences."""
    ruler = next(r for r in results if r.command == "ruler" and r.split == point.split)
    loss = next(r for r in results if r.command == "loss" and r.split == point.split)
    v, metric = point.variant, point.nll_metric or "distant"
    ruler_iv, loss_iv = ruler.doc.get("intervals", {}).get(v, {}), loss.doc.get("intervals", {}).get(v, {})
    exact_loss = loss.doc["results"]["exact"]
    return {
        "ruler": {"score": point.retrieval, "exact": point.retrieval_exact, "difference": ruler_iv.get("score"),
                  "tolerance": c.tolerance, "tasks": ruler.config.get("tasks"), "lengths": ruler.config.get("lengths"),
                  "samples": len(ruler.doc.get("samples") or []), "region": "filled"},
        "nll": {"metric": metric, "nll": point.distant_nll, "exact": point.distant_nll_exact,
                "difference": loss_iv.get(f"{metric}_nll_nats"), "bound": c.max_distant_gap,
                "tokens": exact_loss.get(f"{metric}_tokens"), "passages": loss.config.get("samples"),
                "context": loss.config.get("context")},
        "tail_nll_difference": loss_iv.get("tail_nll_nats"),
    }
