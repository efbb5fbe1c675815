"""`ridgefill run RECIPE [KEY=VALUE ...]` and `ridgefill demo`: a recipe's tasks as one cached pipeline into one
run folder (recipe.toml, manifest.json, artifacts/, report.md, plots/).

Cache: an artifact's file name carries a hash of its inputs (the checkpoint's hash, every keyed option of its command
with its default filled in, data by content or revision, the key of the artifact it reads) and of what computes it
(ridgefill's version and a hash of its source, the maps format, and the provenance of the engine that runs the step:
torch and transformers for torchfill, vLLM's version, the llama.cpp build); a task whose files exist is
reused, so a pull that changes the code or a default, or an upgrade or another build, recomputes. Commands write
atomically, so an existing file is a finished one; an interrupted calibration resumes from its checkpoint.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ridgefill.backends import DEFAULT_ENGINE
from ridgefill.commands import REQUIRED, Command, Config, Option, command, option
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.manifest import Manifest
from ridgefill.pipeline.plan import Task, plan, task_values
from ridgefill.pipeline.recipe import Recipe, find_recipe, load_recipe
from ridgefill.runtime.console import note, table
from ridgefill.runtime.data import data_identity, path_identity
from ridgefill.runtime.paths import atomic_path
from ridgefill.runtime.provenance import result_versions

EXACT_FOLDER = "exact"  # under artifacts/: exact results by sample, shared by a sweep's tasks (ExactStore)


# --- the commands -------------------------------------------------------------------------------------------
@dataclass
class RunConfig(Config):
    recipe: str = option(REQUIRED, "Recipe file (e.g. recipes/quickstart.toml) or a shipped recipe's name.",
                         positional=True)
    overrides: list[str] = option([], "KEY=VALUE settings over the recipe's, each a TOML value: a top-level key "
                                  "(splits=[15,18]) or STEP.OPTION (ruler.samples=20).", positional=True)
    out_dir: Path | None = option(None, "Run folder (default runs/<recipe name>).")
    force: list[str] = option([], "Recompute this step even if its artifacts are cached (repeatable).")
    dry_run: bool = option(False, "Validate the recipe and list its tasks; run nothing.")

    def check(self) -> None:
        check_run_dir(self.out_dir)


def run(config: RunConfig) -> Path:
    return run_recipe(config.recipe, config.out_dir, tuple(config.force), config.dry_run, tuple(config.overrides))


@dataclass
class DemoConfig(Config):
    out_dir: Path | None = option(None, "Run folder (default runs/quickstart).")

    def check(self) -> None:
        check_run_dir(self.out_dir)


def check_run_dir(path: Path | None) -> None:
    """A run folder given with --out-dir must be a folder (or not exist yet)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise RidgefillError(f"--out-dir {path} is a file, not a folder: give a run folder (it is created if missing)")


def demo(config: DemoConfig) -> Path:
    return run_recipe("quickstart", config.out_dir)


COMMAND = Command("run", RunConfig, run)
DEMO = Command("demo", DemoConfig, demo)


# --- running a recipe ---------------------------------------------------------------------------------------
def run_recipe(spec: str | Path, out_dir: str | Path | None = None, force=(), dry_run: bool = False,
               overrides=()) -> Path:
    """Validate, then run every task not already cached, write manifest.json after each, and the report."""
    from ridgefill.runtime.device import check_device

    recipe = load_recipe(find_recipe(spec), overrides)
    tasks = plan(recipe)
    unknown = [f for f in force if f not in recipe.steps]
    if unknown:
        raise RidgefillError(f"--force {unknown[0]}: not a step of {recipe.path} (its steps: "
                             f"{', '.join(recipe.steps)})")
    run_dir = Path(out_dir) if out_dir is not None else Path("runs") / recipe.name
    if dry_run:
        show_plan(recipe, tasks, run_dir)
        return run_dir
    check_device(recipe.settings["device"], recipe.settings["dtype"])  # resolved as the recipe was read
    model = model_identity(recipe)
    forget_forced(tasks, run_dir, force)
    manifest = Manifest(run_dir, recipe, model)
    with atomic_path(run_dir / "recipe.toml") as tmp: tmp.write_text(recipe.text)  # noqa: E701
    run_tasks(tasks, run_dir, model["weights_hash"], force, manifest)
    table(f"{recipe.name} → {run_dir}", ["task", "cache", "time (s)"],
          [[e["label"], "hit" if e["cached"] else "computed", e["duration_s"]] for e in manifest.doc["steps"]])
    from ridgefill.pipeline.report import write_report

    write_report(run_dir)
    return run_dir


def show_plan(recipe: Recipe, tasks: list[Task], run_dir: Path) -> None:
    table(f"{recipe.path}: {len(tasks)} tasks → {run_dir}", ["task", "step", "split", "tail", "seed", "reads"],
          [[t.label, t.step] + ["" if v is None else v for v in (t.split, t.tail, t.seed, t.needs)] for t in tasks])


def run_tasks(tasks: list[Task], run_dir: Path, weights_hash: str, force, manifest: Manifest,
              reuse: Path | None = None) -> None:
    """Each task in order: cached when its files exist (and its step is not forced), else run; the manifest
    records each, and the run's status when it stops. reuse: another run folder whose artifacts of the same
    name (the same key: the same inputs) are linked into this one instead of computed."""
    keys, artifacts = {}, {}
    made_by = engines_made_by(tasks)
    identify = functools.cache(data_identity)  # each data spec hashed (or its Hub commit asked) once per run
    for i, task in enumerate(tasks, 1):
        cmd = command(task.step)
        keys[task.label] = task_key(task, cmd, weights_hash, keys.get(task.needs), made_by[task_engine(task)],
                                    identify)
        artifact = artifacts[task.label] = run_dir / "artifacts" / f"{task.label}-{keys[task.label]}{cmd.writes}"
        files = [artifact] + ([Path(f"{artifact}.json")] if cmd.summary_json else [])
        started = time.perf_counter()
        with claim(artifact, f"[{i}/{len(tasks)}] {task.label}"):  # another run sharing the folder waits here
            cached = task.step not in force and (all(f.is_file() for f in files) or
                                                 linked(files, run_dir, reuse))
            note(f"[{i}/{len(tasks)}] {task.label}: " + ("cached" if cached else "running"))
            if not cached:
                try:
                    cmd(**task_values(cmd, task, artifact, artifacts.get(task.needs), exact_store(run_dir),
                                      fresh=task.step in force))
                except BaseException as exc:
                    manifest.finish("interrupted" if isinstance(exc, KeyboardInterrupt) else
                                    f"failed at {task.label}")
                    raise
        manifest.add(task, keys[task.label], files, cached, time.perf_counter() - started,
                     made_by[task_engine(task)]["code"])
    manifest.finish("complete")


def linked(files: list[Path], run_dir: Path, source: Path | None) -> bool:
    """Hard-link (copy, across file systems) each of `files` from the same place in run folder `source`; True
    when `source` holds all of them (nothing is linked otherwise)."""
    if source is None:
        return False
    found = [source / f.relative_to(run_dir) for f in files]
    if not all(f.is_file() for f in found):
        return False
    for src, dst in zip(found, files):
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            with atomic_path(dst) as tmp:
                shutil.copyfile(src, tmp)
    return True


@contextmanager
def claim(artifact: Path, label: str):
    """Hold an exclusive lock on computing `artifact` (artifacts/.locks/<name>.lock), so that two runs sharing a
    run folder never compute or write one artifact at once: the second waits, then finds it cached. The lock
    files stay (deleting one while a run waits on it would let a third run take a fresh one)."""
    path = artifact.parent / ".locks" / f"{artifact.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note(f"{label}: another run is computing it; waiting")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def exact_store(run_dir: Path) -> Path:
    return run_dir / "artifacts" / EXACT_FOLDER


def forget_forced(tasks: list[Task], run_dir: Path, force) -> None:
    """A forced step recomputes its exact results too: delete what it stored in each store its tasks use."""
    from ridgefill.evals.exact_store import forget

    for task in (t for t in tasks if t.step in force):
        cmd = command(task.step)
        for o in cmd.options.values():
            if o.role == "store":
                forget(task.kwargs.get(o.name) or exact_store(run_dir), task.step)


# --- cache keys ---------------------------------------------------------------------------------------------
def task_engine(task: Task) -> str:
    """The engine that runs a task: its step's --engine as the recipe sets it or as it defaults (generate,
    bench-ttft, ruler, loss), else torchfill (calibrate, fit and the rest run in this process on torch)."""
    engine = next((o for o in command(task.step).options.values() if o.name == "engine"), None)
    return task.kwargs.get("engine") or (engine.default if engine is not None else DEFAULT_ENGINE)


def engines_made_by(tasks: list[Task]) -> dict[str, dict]:
    """What computes each engine's tasks, by engine name (runtime/provenance.result_versions of the engine's
    Backend.provenance), asked once per run before any task runs."""
    from ridgefill.backends import backend_class

    engines = sorted({task_engine(t) for t in tasks})
    return {name: result_versions(backend_class(name).provenance()) for name in engines}


WIRED = ("input", "output", "resume", "restart", "store")  # option roles the runner sets: not the task's choice


def task_key(task: Task, cmd: Command, weights_hash: str, upstream: str | None, made_by: dict,
             identify=data_identity) -> str:
    """Hash of everything the artifact depends on: step, the checkpoint's hash, every keyed option of the command as
    it will run (the recipe's value or the default: stating a default gives the key of leaving it out; data by content
    or revision, files and folders by content), the key of the artifact it reads, and `made_by`: what computes it
    (runtime/provenance.result_versions: ridgefill's version and source hash, the maps format, and the provenance of
    the task's engine: engines_made_by). identify: a data spec's identity (runtime/data.data_identity, or a run's
    cached copy of it)."""
    payload = {"step": task.step, "made_by": made_by, "weights": weights_hash,
               "options": resolved_options(cmd, task.kwargs, identify), "input": upstream}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def resolved_options(cmd: Command, given: dict, identify=data_identity) -> dict:
    """Every keyed option of `cmd` (not the ones the runner wires) with its value as it will run: `given`'s, else
    the option's default."""
    out = {}
    for o in cmd.options.values():
        if not o.keyed or o.role in WIRED or o.name == cmd.extra_args:
            continue
        value = given.get(o.name, None if o.required else o.default)
        value = float(value) if o.kind is float and type(value) is int else value
        out[o.name] = identify(value) if is_data(o) and value is not None else keyed_value(value)
    return out


def is_data(o: Option) -> bool:
    """Whether option `o` takes a data spec (a built-in corpus, a file or folder, a Hub id), as a recipe reads it."""
    return (o.fallback or o.flag) == "data" and not o.many


def keyed_value(value):
    """A value as its key sees it: a path (or a string naming an existing absolute path, as a recipe makes a
    local data spec) by its content, anything else as it is."""
    if isinstance(value, Path) or (isinstance(value, str) and os.path.isabs(value) and os.path.exists(value)):
        return path_identity(Path(value))
    return value


def model_identity(recipe: Recipe) -> dict:
    """The model's identity, read without its weights (runtime/models.model_identity): its checkpoint hash keys every
    artifact; its layer count bounds the splits."""
    from ridgefill.runtime.models import model_identity as identity

    info = identity(recipe.settings["model"]).info
    n_layers = info["n_layers"]
    bad = [x for x in recipe.settings["splits"] if not 1 <= x < n_layers]
    if bad:
        raise RidgefillError(f"{recipe.named}: splits: {bad[0]} is out of range: use 1..{n_layers - 1} for this "
                             f"{n_layers}-layer model")
    return info
