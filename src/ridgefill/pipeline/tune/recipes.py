"""The recipes `ridgefill tune` runs, built in memory from its options: the search's (one calibration for every
candidate, per split its fit and ruler tasks) and each variant's NLL check (check/<variant>/), with a filled window
or without; validated before any model work and written into their run folders as the record."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.method.fill import FROM_MAPS
from ridgefill.pipeline.tune.options import TuneConfig, slug, window_dir, window_layers
from ridgefill.runtime.paths import atomic_path
from ridgefill.runtime.session import check_length

if TYPE_CHECKING:
    from ridgefill.pipeline.recipe import Recipe

CHECK_FOLDER = "check"  # under the run folder: check/<variant>/ per variant, check/exact the exact NLLs they share


def search_tables(c: TuneConfig, splits: list[int], window: int = 0) -> dict:
    """The search's recipe: top-level settings, then [calibrate] and [fit] (for ridge) and [ruler], with filled
    window `window` (0: full attention)."""
    variants = ["exact", *c.fill_names]
    tables = _fit_tables(c, splits, window) if any(v in FROM_MAPS for v in variants) else {}
    tables["ruler"] = {"lengths": c.ruler_lengths,
                       "tasks": [t.strip() for t in str(c.tasks).split(",") if t.strip()], "samples": c.samples,
                       "max-new-tokens": c.max_new_tokens, "region": "filled", "keep-first": c.keep_first,
                       "variants": variants, **_window_keys(splits, window), **_shared_answers(c, window),
                       **_engine_key(c)}
    return _tables(c, _name(c, window), f"ridgefill tune: splits {splits[0]}..{splits[-1]}, tail {c.tail}"
                   f"{_window_note(window)}", splits, c.tail, tables)


def check_tables(c: TuneConfig, splits: list[int], variant: str, window: int = 0) -> dict:
    """A variant's NLL check: for ridge the search's [calibrate] and [fit] (the same tasks, so the same
    artifacts), then [loss] on the check's passages at the check's own tail (exact NLLs in the run folder's
    check/exact, whatever the window)."""
    tables = _fit_tables(c, splits, window) if variant in FROM_MAPS else {}
    tables["loss"] = {"data": local(c.eval_data), "context": c.context, "short": c.short,
                      "short-stride": c.short_stride, "samples": c.passages, "keep-first": c.keep_first,
                      "variants": ["exact", variant],
                      "exact-cache": str((c.run_dir / CHECK_FOLDER / "exact").resolve()),
                      **_window_keys(splits, window), **_engine_key(c)}
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


def _engine_key(c: TuneConfig) -> dict:
    """The engine that runs a measuring step (ruler, loss): nothing for the default, ridgefill's own (so the
    recipes, and the steps' cache keys, are as before --engine)."""
    return {"engine": c.engine} if c.engine != "ridgefill" else {}


def _shared_answers(c: TuneConfig, window: int) -> dict:
    """For a window, the exact RULER answers of the full-attention run folder (exact prefill has no window, so
    every window shares them); nothing for full attention (its runner sets its own folder, the same one)."""
    from ridgefill.pipeline.run import exact_store

    return {"exact-cache": str(exact_store(c.run_dir).resolve())} if window else {}


def _name(c: TuneConfig, window: int) -> str:
    return f"tune-{slug(c.model)}" + (f"-window-{window}" if window else "")


def _window_note(window: int) -> str:
    return f", filled window {window}" if window else ""


def _tables(c: TuneConfig, name: str, description: str, splits: list[int], tail: int, tables: dict) -> dict:
    return {"name": name, "description": description, "model": local(c.model), "data": local(c.data),
            "splits": splits, "tails": [tail], "seeds": [c.seed], "lam": "auto", "dtype": c.dtype,
            "device": c.device, "chunk": c.chunk, "tolerance": c.tolerance, **tables}


def local(spec: str) -> str:
    """A local file or folder as an absolute path (the recipe lives in the run folder), anything else as given."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


RECORD = "Generated by `ridgefill tune` (every candidate split; tune measures the ones its search needs)."


def recipes(c: TuneConfig, splits: list[int], window: int = 0) -> tuple["Recipe", dict[str, "Recipe"]]:
    """Filled window `window`'s search recipe (recorded as <its run folder>/recipe.toml when it runs) and, with
    the check, each variant's check recipe (<its run folder>/check/<variant>/recipe.toml): built in memory and
    validated (every step's own checks, no model), errors in one line starting `tune: `."""
    from ridgefill.pipeline.recipe import recipe_from
    from ridgefill.pipeline.recipe_toml import toml_text

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
