"""Recipes: one TOML file describes calibrate → fit → evaluations; `ridgefill run` executes it as one cached
pipeline into one run folder (manifest.json, artifacts/, report.md, plots/). Schema: docs/recipes.md.

A recipe holds top-level settings (TOP) and one table per step ([calibrate], [fit], [ruler], [loss], [splice],
[longbench], [bench-ttft]) with that command's options under their command-line names. Names, types and
defaults are read from the commands' declarations in cli.py, so a step table accepts exactly what the command
line does (comma-separated options are TOML lists). Options that tie the steps together (model, dtype, device,
chunk, split, tail, seed, lam, stats, maps, out) are set by the top level and the runner, never in a table.

Sweeps: `splits`, `tails` and `seeds` may be lists. Calibration runs once for all splits, fit once per split,
and each evaluation once per (split, tail, seed) it takes.

Cache: an artifact's file name carries a hash of its inputs (model weights hash, data id, options, the
artifact it reads, ridgefill version); one whose files exist is reused. Commands write atomically, so an
existing file is a finished one; an interrupted calibration resumes from its checkpoint.
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import importlib
import inspect
import itertools
import json
import os
import platform
import re
import subprocess
import time
import tomllib
import typing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ridgefill import __version__
from ridgefill.errors import RidgefillError
from ridgefill.evals.exact_store import forget
from ridgefill.runtime.paths import write_json


@dataclass(frozen=True)
class Step:
    target: str  # "module:function", imported when the step runs
    suffix: str  # of the artifact its --out writes
    summary: bool = False  # also writes <out>.json (calibrate, fit)


STEPS = {
    "calibrate": Step("ridgefill.method.calibrate:calibrate_command", ".safetensors", True),
    "fit": Step("ridgefill.method.fit:fit_command", ".safetensors", True),
    "ruler": Step("ridgefill.evals.ruler:ruler_command", ".json"),
    "loss": Step("ridgefill.evals.loss:loss_command", ".json"),
    "splice": Step("ridgefill.evals.splice:splice_command", ".json"),
    "longbench": Step("ridgefill.evals.longbench:longbench_command", ".json"),
    "bench-ttft": Step("ridgefill.evals.bench_ttft:bench_ttft_command", ".json"),
}
EVALUATIONS = tuple(STEPS)[2:]

# Top-level keys: kind and default (REQUIRED: must be given).
REQUIRED = object()
TOP = {
    "name": (str, None), "description": (str, ""), "model": (str, REQUIRED), "data": (str, None),
    "splits": ("ints", REQUIRED), "tails": ("ints", [256]), "seeds": ("ints", [0]), "lam": ("lam", "auto"),
    "dtype": (str, "fp32"), "device": (str, "cpu"), "chunk": (int, 2048), "tolerance": (float, 5.0),
}
# Options the runner sets, and where a recipe sets them instead.
MANAGED = {
    "model": "the top-level `model`", "dtype": "the top-level `dtype`", "device": "the top-level `device`",
    "chunk": "the top-level `chunk`", "split": "the top-level `splits`", "tail": "the top-level `tails`",
    "seed": "the top-level `seeds`", "lam": "the top-level `lam`",
    "stats": "the runner (it passes the statistics [calibrate] makes)",
    "maps": "the runner (it passes the maps [fit] makes)", "out": "the runner (artifacts go in the run folder)",
    "resume": "the runner (it always resumes an interrupted calibration)",
}
# Comma-separated command-line options, written as TOML lists of this element type.
LISTS = {"lengths": int, "tasks": str, "variants": str, "swap": str, "layers": str}
KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path (string)"}
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".toml", ".gz")


# --- command options, read from cli.py ------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    flag: str  # command-line name without the dashes, e.g. "seq-len"
    param: str  # keyword argument of the workflow function, e.g. "seq_len"
    kind: type  # int, float, str, bool or Path
    default: object  # Ellipsis when the command line requires the option
    help: str


def command_options(step: str) -> dict[str, Option] | None:
    """The options `ridgefill STEP` declares, by flag; None if this ridgefill has no such command."""
    from typer.models import OptionInfo

    from ridgefill.cli import app

    for info in app.registered_commands:
        if (info.name or info.callback.__name__.lower().replace("_", "-")) != step:
            continue
        hints = typing.get_type_hints(info.callback)
        options = {}
        for param, p in inspect.signature(info.callback).parameters.items():
            if isinstance(p.default, OptionInfo):
                flag = p.default.param_decls[0].split("/")[0].lstrip("-")
                kind = next(a for a in typing.get_args(hints[param]) or (hints[param],) if a is not type(None))
                options[flag] = Option(flag, param, kind, p.default.default, p.default.help or "")
        return options
    return None


# --- the recipe -----------------------------------------------------------------------------------------
@dataclass
class Recipe:
    path: Path
    text: str
    name: str
    settings: dict  # top-level values with defaults; splits / tails / seeds as lists
    steps: dict[str, dict]  # step -> {keyword argument: value as the workflow takes it}, in STEPS order


def find_recipe(spec: str | Path) -> Path:
    """A recipe file, or the name of a shipped one (recipes/NAME.toml here or in the source checkout)."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in (Path("recipes"), Path(__file__).resolve().parents[3] / "recipes"):
            if (folder / f"{spec}.toml").is_file():
                return folder / f"{spec}.toml"
    raise RidgefillError(f"recipe {spec} does not exist: pass a .toml file (e.g. recipes/quickstart.toml)")


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe completely (no model is loaded); any problem is one line naming its key."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text)
    except OSError as exc:
        raise RidgefillError(f"cannot read recipe {where}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise RidgefillError(f"{where}: invalid TOML: {exc}") from None
    base = path.resolve().parent
    settings = _settings(where, raw, base)
    settings["name"] = settings["name"] or path.stem
    steps = {}
    for step in STEPS:
        if step in raw:
            steps[step] = _step_options(where, step, raw[step], settings, base)
    if not steps:
        raise RidgefillError(f"{where}: no step: add at least one of the tables {_tables(STEPS)}")
    _check_artifacts(where, steps, raw)
    _preflight(where, steps, settings)
    return Recipe(path, text, settings["name"], settings, steps)


def _settings(where: str, raw: dict, base: Path) -> dict:
    for key, value in raw.items():
        if key in TOP or key in STEPS:
            continue
        if isinstance(value, dict):
            raise RidgefillError(f"{where}: [{key}]: unknown step{_did_you_mean(key, STEPS)}; steps are {_tables(STEPS)}")
        raise RidgefillError(f"{where}: {key}: unknown key{_did_you_mean(key, TOP)}; top-level keys are "
                             f"{', '.join(TOP)}")
    for step in STEPS:
        if step in raw and not isinstance(raw[step], dict):
            raise RidgefillError(f"{where}: {step}: expected a table [{step}] of its options, got {_show(raw[step])}")
    settings = {}
    for key, (kind, default) in TOP.items():
        if key not in raw:
            if default is REQUIRED:
                raise RidgefillError(f"{where}: {key}: missing (required)")
            settings[key] = default
            continue
        settings[key] = _top_value(f"{where}: {key}", raw[key], kind)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", settings["name"] or "x"):
        raise RidgefillError(f"{where}: name: {_show(settings['name'])} is not a folder name: use letters, digits, "
                             ". _ -")
    settings["model"] = _model_spec(f"{where}: model", settings["model"], base)
    if settings["data"] is not None:
        settings["data"] = _data_spec(f"{where}: data", settings["data"], base)
    for key, low in (("splits", 1), ("tails", 1), ("seeds", 0)):
        if min(settings[key]) < low:
            raise RidgefillError(f"{where}: {key}: {min(settings[key])} is out of range: use {low} or more")
    if settings["chunk"] < 1 or settings["tolerance"] < 0:
        raise RidgefillError(f"{where}: chunk must be at least 1 and tolerance at least 0")
    return settings


def _top_value(where: str, value, kind):
    if kind == "ints":
        values = value if isinstance(value, list) else [value]
        if not values or not all(_is_int(v) for v in values):
            raise RidgefillError(f"{where}: expected an integer or a list of integers, got {_show(value)}")
        return sorted(set(values))
    if kind == "lam":
        if value == "auto" or (_is_number(value) and value > 0):
            return value
        raise RidgefillError(f"{where}: expected \"auto\" or a positive number, got {_show(value)}")
    return _typed(where, value, kind)


def _step_options(where: str, step: str, table: dict, settings: dict, base: Path) -> dict:
    options = command_options(step)
    if options is None:
        raise RidgefillError(f"{where}: [{step}]: this ridgefill has no `{step}` command: remove the table or update "
                             "ridgefill")
    out = {}
    for flag, value in table.items():
        at = f"{where}: [{step}].{flag}"
        managed = MANAGED.get(flag.replace("_", "-")) or ("the top-level `data`"
                                                          if step == "calibrate" and flag == "data" else None)
        if managed:
            raise RidgefillError(f"{at}: set by {managed}, not in a step table: remove it")
        if flag not in options:
            hint = f" (write {flag.replace('_', '-')})" if flag.replace("_", "-") in options else \
                _did_you_mean(flag, options)
            raise RidgefillError(f"{at}: unknown option{hint}; [{step}] takes "
                                 f"{', '.join(f for f in options if f not in MANAGED) or 'no options'}")
        option = options[flag]
        if flag in LISTS and option.kind is str:
            out[option.param] = _list(at, value, LISTS[flag])
        elif flag == "data":
            out[option.param] = _data_spec(at, _typed(at, value, str), base)
        elif option.kind is Path:
            out[option.param] = _existing(at, _typed(at, value, Path), base)
        else:
            out[option.param] = _typed(at, value, option.kind)
    if "data" in options and "data" not in table:
        if step == "calibrate" and settings["data"] is None:
            raise RidgefillError(f"{where}: data: missing: [calibrate] needs the calibration text")
        if step != "longbench" and settings["data"] is not None:  # LongBench questions are not calibration text
            out[options["data"].param] = settings["data"]
    missing = [o for f, o in options.items() if o.default is Ellipsis and f not in MANAGED and o.param not in out]
    if missing:
        raise RidgefillError(f"{where}: [{step}].{missing[0].flag}: missing (required): {missing[0].help}")
    return out


def _typed(where: str, value, kind):
    ok = {int: _is_int, float: _is_number, bool: lambda v: isinstance(v, bool)}.get(kind, lambda v: isinstance(v, str))
    if not ok(value):
        raise RidgefillError(f"{where}: expected {KINDS[kind]}, got {_show(value)}")
    return float(value) if kind is float else value


def _list(where: str, value, kind) -> str:
    """A TOML list, as the comma-separated text the command line takes."""
    ok = _is_int if kind is int else (lambda v: isinstance(v, str) and v.strip() and "," not in v)
    if not isinstance(value, list) or not value or not all(ok(v) for v in value):
        raise RidgefillError(f"{where}: expected a list of {'integers' if kind is int else 'strings'}, got {_show(value)}")
    return ",".join(str(v) for v in value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _local(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _existing(where: str, value: str, base: Path) -> Path:
    path = _local(value, base)
    if not path.exists():
        raise RidgefillError(f"{where}: {path} does not exist (relative paths are read from the recipe's folder)")
    return path


def _data_spec(where: str, value: str, base: Path) -> str:
    """A built-in corpus, an existing file or folder (made absolute), or a Hub dataset id (fetched when used)."""
    from ridgefill.runtime.data import builtin_corpora

    if value in builtin_corpora():
        return value
    path = _local(value, base)
    if path.exists():
        return str(path)
    if value.endswith(FILE_SUFFIXES) or value.startswith((".", "/", "~")) or value.count("/") != 1:
        raise RidgefillError(f"{where}: {path} does not exist (relative paths are read from the recipe's folder); "
                             f"use a file or folder, a Hub dataset id or one of {', '.join(builtin_corpora())}")
    return value


def _model_spec(where: str, value: str, base: Path) -> str:
    """An alias, an existing model folder (made absolute), or a Hub id (only resolved when the run starts)."""
    from ridgefill.runtime.models import ALIASES

    if value in ALIASES:
        return value
    path = _local(value, base)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RidgefillError(f"{where}: {path} has no config.json: point it at a Hugging Face model folder")
        return str(path)
    if path.exists() or value.startswith((".", "/", "~")) or value.count("/") != 1:
        raise RidgefillError(f"{where}: {path} does not exist: use a local Hugging Face folder (relative to the "
                             f"recipe's folder), a Hub id (org/name) or an alias ({', '.join(ALIASES)})")
    return value


def _check_artifacts(where: str, steps: dict, raw: dict) -> None:
    """Every artifact a step needs is made by an earlier step."""
    if "fit" in steps and "calibrate" not in steps:
        raise RidgefillError(f"{where}: [fit]: needs the statistics that [calibrate] makes: add a [calibrate] table")
    if "fit" in steps:
        return
    for step in (s for s in EVALUATIONS if s in steps):
        table = raw[step]
        if "variants" in table and "ridge" in table["variants"]:
            raise RidgefillError(f"{where}: [{step}].variants: ridge needs the maps that [fit] makes: add [calibrate] "
                                 "and [fit] tables, or drop ridge")
        if table.get("fill") == "ridge":
            raise RidgefillError(f"{where}: [{step}].fill: ridge needs the maps that [fit] makes: add [calibrate] and "
                                 "[fit] tables, or use identity")


def _preflight(where: str, steps: dict, settings: dict) -> None:
    """The commands' own option checks that need no model, for every tail, before any work starts."""
    from ridgefill.evals.loss import check_lengths
    from ridgefill.evals.ruler import check_region

    for step, table in steps.items():
        options = command_options(step)
        full = {o.param: table.get(o.param, o.default) for o in options.values()}
        try:
            for tail in settings["tails"]:
                if step == "ruler" and full.get("from_jsonl") is None:
                    for length in str(full["lengths"]).split(","):
                        check_region(full["region"], tail, full["keep_first"], int(length))
                if step in ("loss", "splice"):
                    check_lengths(full["context"], full["short"], full["short_stride"], tail, full["samples"],
                                  full["keep_first"])
        except RidgefillError as exc:
            raise RidgefillError(f"{where}: [{step}] (tail {tail}): {exc}") from None


def _show(value) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _tables(names) -> str:
    return ", ".join(f"[{n}]" for n in names)


# --- the plan: one task per artifact --------------------------------------------------------------------
@dataclass
class Task:
    step: str
    label: str  # e.g. loss-s18-t256-seed0
    kwargs: dict  # the workflow's keyword arguments, except out / stats / maps / resume
    split: int | None = None
    tail: int | None = None
    seed: int | None = None
    needs: str | None = None  # label of the task whose artifact it reads (as --stats or --maps)


def plan(recipe: Recipe) -> list[Task]:
    s, steps = recipe.settings, recipe.steps
    tasks = []
    if "calibrate" in steps:
        tasks.append(Task("calibrate", "calibrate", {**_common(s, "calibrate"), **steps["calibrate"],
                                                     "split": ",".join(map(str, s["splits"]))}))
    if "fit" in steps:
        tasks += [Task("fit", f"fit-s{split}", {**steps["fit"], "split": split, "lam": str(s["lam"])}, split,
                       needs="calibrate") for split in s["splits"]]
    for step in (e for e in EVALUATIONS if e in steps):
        options = command_options(step)
        axes = [s[key] if flag in options else [None] for flag, key in
                (("split", "splits"), ("tail", "tails"), ("seed", "seeds"))]
        for split, tail, seed in itertools.product(*axes):
            label = step + "".join(f"-{p}{v}" for p, v in (("s", split), ("t", tail), ("seed", seed)) if v is not None)
            kwargs = {**_common(s, step), **steps[step],
                      **{k: v for k, v in (("split", split), ("tail", tail), ("seed", seed)) if v is not None}}
            needs = f"fit-s{split}" if "fit" in steps and "maps" in options and split is not None else None
            tasks.append(Task(step, label, kwargs, split, tail, seed, needs))
    return tasks


def _common(settings: dict, step: str) -> dict:
    options = command_options(step)
    return {options[k].param: settings[k] for k in ("model", "dtype", "device", "chunk") if k in options}


# --- running --------------------------------------------------------------------------------------------
INPUT = {"calibrate": "stats", "fit": "maps"}  # the option a task's artifact is passed as
NOT_KEYED = {"checkpoint_every", "model", "exact_cache"}  # no effect on the artifact / replaced by the weights hash
EXACT_FOLDER = "exact"  # under artifacts/: exact results by sample, shared by a sweep's tasks (ExactStore)


def run_recipe(spec: str | Path, out_dir: str | Path | None = None, force=(), dry_run: bool = False) -> Path:
    """Validate, then run every task not already cached, write manifest.json after each, and the report."""
    from ridgefill.runtime.console import note, table
    from ridgefill.runtime.session import check_device

    recipe = load_recipe(find_recipe(spec))
    tasks = plan(recipe)
    unknown = [f for f in force if f not in recipe.steps]
    if unknown:
        raise RidgefillError(f"--force {unknown[0]}: not a step of {recipe.path} (its steps: {', '.join(recipe.steps)})")
    run_dir = Path(out_dir) if out_dir is not None else Path("runs") / recipe.name
    if dry_run:
        table(f"{recipe.path}: {len(tasks)} tasks → {run_dir}", ["task", "step", "split", "tail", "seed", "reads"],
              [[t.label, t.step] + ["" if v is None else v for v in (t.split, t.tail, t.seed, t.needs)]
               for t in tasks])
        return run_dir
    check_device(recipe.settings["device"], recipe.settings["dtype"])
    model = model_identity(recipe)
    for step in force:  # a forced step recomputes its exact results too
        forget(run_dir / "artifacts" / EXACT_FOLDER, step)
    manifest = Manifest(run_dir, recipe, model)
    (run_dir / "recipe.toml").write_text(recipe.text)
    keys, artifacts = {}, {}
    for i, task in enumerate(tasks, 1):
        keys[task.label] = task_key(task, model["weights_hash"], keys.get(task.needs))
        artifact = run_dir / "artifacts" / f"{task.label}-{keys[task.label]}{STEPS[task.step].suffix}"
        artifacts[task.label] = artifact
        files = [artifact] + ([Path(f"{artifact}.json")] if STEPS[task.step].summary else [])
        cached = task.step not in force and all(f.is_file() for f in files)
        note(f"[{i}/{len(tasks)}] {task.label}: " + ("cached" if cached else "running"))
        started = time.perf_counter()
        if not cached:
            try:
                _call(task, artifact, artifacts.get(task.needs), fresh=task.step in force)
            except BaseException as exc:
                manifest.finish("interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed at {task.label}")
                raise
        manifest.add(task, keys[task.label], files, cached, time.perf_counter() - started)
    manifest.finish("complete")
    table(f"{recipe.name} → {run_dir}", ["task", "cache", "time (s)"],
          [[e["label"], "hit" if e["cached"] else "computed", e["duration_s"]] for e in manifest.doc["steps"]])
    from ridgefill.report.write import write_report

    write_report(run_dir)
    return run_dir


def _call(task: Task, out: Path, needed: Path | None, fresh: bool) -> None:
    options = command_options(task.step)
    kwargs = {o.param: (Path(o.default) if o.kind is Path and isinstance(o.default, str) else o.default)
              for o in options.values()}
    kwargs.update(task.kwargs, out=out)
    if "exact_cache" in kwargs and kwargs["exact_cache"] is None:  # every split of a sweep reuses exact results
        kwargs["exact_cache"] = out.parent / EXACT_FOLDER
    if task.needs:
        needed_step = task.needs.split("-")[0]  # "calibrate" or "fit-s<split>"
        kwargs[INPUT[needed_step]] = needed
    if task.step == "calibrate":
        kwargs["resume"] = not fresh
    module, name = STEPS[task.step].target.split(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise RidgefillError(f"step {task.step}: {STEPS[task.step].target} does not take the options `ridgefill "
                             f"{task.step}` declares ({exc}): report this as a bug") from None
    fn(**kwargs)


def task_key(task: Task, weights_hash: str, upstream: str | None) -> str:
    """Hash of everything the artifact depends on: step, model weights, options (data as its id), the artifact
    it reads, ridgefill version."""
    options = {k: (data_id(v) if k == "data" or isinstance(v, Path) else v)
               for k, v in task.kwargs.items() if k not in NOT_KEYED}
    payload = {"step": task.step, "ridgefill": __version__, "weights": weights_hash, "options": options,
               "input": upstream}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def data_id(spec) -> str:
    """A data spec's identity: its name, plus the content hash of a local file or folder."""
    from ridgefill.runtime.paths import file_hash

    path = Path(str(spec))
    if path.is_file():
        return f"{path.name}:{file_hash(path)}"
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path)}:{file_hash(f)}".encode())
        return f"{path.name}/:{digest.hexdigest()[:16]}"
    return str(spec)


def model_identity(recipe: Recipe) -> dict:
    """Load the model once: its weights hash keys every artifact; its layer count bounds the splits."""
    from ridgefill.runtime.session import open_session

    s = recipe.settings
    session = open_session(s["model"], s["dtype"], s["device"], s["chunk"])
    info = session.loaded.info()
    n_layers = session.engine.n_layers
    del session
    gc.collect()
    if s["device"] == "cuda":
        import torch

        torch.cuda.empty_cache()
    bad = [x for x in s["splits"] if not 1 <= x < n_layers]
    if bad:
        raise RidgefillError(f"{recipe.path}: splits: {bad[0]} is out of range: use 1..{n_layers - 1} for this "
                             f"{n_layers}-layer model")
    return {**info, "n_layers": n_layers}


# --- manifest -------------------------------------------------------------------------------------------
class Manifest:
    """manifest.json of a run folder, rewritten (atomically) after every task."""

    def __init__(self, run_dir: Path, recipe: Recipe, model: dict) -> None:
        self.run_dir, self.path = run_dir, run_dir / "manifest.json"
        self._t0 = time.perf_counter()
        self._previous = _previous_hashes(self.path)
        s = recipe.settings
        self.doc = {
            "recipe": {"name": recipe.name, "path": str(recipe.path), "sha256": _sha(recipe.text),
                       "text": recipe.text},
            "status": "running", "started_at": _now(), "finished_at": None, "duration_s": None,
            "versions": versions(), "platform": platform.platform(), "device": device_info(s["device"]),
            "load_average": _load(), "git": git_commit(), "model": model,
            "settings": {k: s[k] for k in ("splits", "tails", "seeds", "lam", "dtype", "device", "chunk",
                                           "tolerance")},
            "seeds": s["seeds"], "steps": [],
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        self.write()

    def add(self, task: Task, key: str, files: list[Path], cached: bool, seconds: float) -> None:
        hashes = {}
        for f in files:
            rel = str(f.relative_to(self.run_dir))
            prior = self._previous.get(rel)
            hashes[rel] = prior if cached and prior else _file_hash(f)
        self.doc["steps"].append({"label": task.label, "step": task.step, "split": task.split, "tail": task.tail,
                                  "seed": task.seed, "key": key, "reads": task.needs,
                                  "artifact": str(files[0].relative_to(self.run_dir)), "hashes": hashes,
                                  "cached": cached, "duration_s": round(seconds, 3)})
        self.write()

    def finish(self, status: str) -> None:
        self.doc.update(status=status, finished_at=_now(), duration_s=round(time.perf_counter() - self._t0, 3),
                        load_average_end=_load())
        self.write()

    def write(self) -> None:
        write_json(self.path, self.doc)


def _previous_hashes(path: Path) -> dict:
    try:
        return {k: v for e in json.loads(path.read_text()).get("steps", []) for k, v in e.get("hashes", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _file_hash(path: Path) -> str:
    from ridgefill.runtime.paths import file_hash

    return file_hash(path)


def versions() -> dict:
    import numpy
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "ridgefill": __version__}


def device_info(device: str) -> dict:
    import torch

    if device == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    name = platform.processor() or platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        name = found.group(1).strip() if found else name
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def git_commit() -> dict | None:
    """The commit of the ridgefill source, when it runs from a git checkout."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

