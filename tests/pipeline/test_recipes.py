"""Recipes: validation with key paths, the shipped recipes, the cached pipeline on a tiny checkpoint (determinism,
cache hits, --force, resume after an interruption) and the manifest; key=value overrides; and that the runner
takes every step, option and rule from the command registry (throwaway commands, no pipeline change)."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ridgefill import commands
from ridgefill.cli import main
from ridgefill.commands import REQUIRED, Command, Entry, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.loss import LossConfig
from ridgefill.pipeline import recipe as recipes
from ridgefill.pipeline.plan import plan
from ridgefill.pipeline.recipe import load_recipe
from ridgefill.pipeline.run import run_recipe
from ridgefill.runtime.paths import write_json
from ridgefill.runtime.session import ModelConfig
from tiny_models import write_corpus

ROOT = Path(__file__).resolve().parents[2]


def write(folder: Path, text: str, name: str = "recipe.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(RidgefillError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- validation -----------------------------------------------------------------------------------------
BASE = 'model = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 18\n[calibrate]\n[fit]\n'


@pytest.mark.parametrize("text,expected", [
    (BASE + '[ruler]\nlengths = "2k"\n', 'recipe.toml: [ruler].lengths: expected a list of integers, got "2k"'),
    (BASE + "[ruler]\nlengths = [512, 1.5]\n", "recipe.toml: [ruler].lengths: expected a list of integers, got [512, 1.5]"),
    (BASE + "[loss]\nsamples = \"4\"\n", 'recipe.toml: [loss].samples: expected an integer, got "4"'),
    (BASE + "[loss]\nalpha = true\n", "recipe.toml: [loss].alpha: expected a number, got true"),
    (BASE + "[loss]\nsampels = 4\n", "recipe.toml: [loss].sampels: unknown option (did you mean samples?)"),
    (BASE + "[loss]\nshort_stride = 4\n", "recipe.toml: [loss].short_stride: unknown option (write short-stride)"),
    (BASE + "[loss]\ntail = 64\n", "recipe.toml: [loss].tail: set by the top-level `tails`"),
    (BASE + "[fit]\n", "invalid TOML"),
    (BASE + "[rulr]\n", "recipe.toml: [rulr]: unknown step (did you mean ruler?)"),
    ("splitz = 3\n" + BASE, "recipe.toml: splitz: unknown key (did you mean splits?)"),
    (BASE.replace("splits = 18", 'splits = "18"'), 'recipe.toml: splits: expected an integer or a list of integers, got "18"'),
    (BASE.replace("splits = 18", "splits = [0, 4]"), "recipe.toml: splits: 0 is out of range"),
    (BASE.replace('model = "smollm2-135m"\n', ""), "recipe.toml: model: missing (required)"),
    (BASE + '[calibrate.extra]\n', "recipe.toml: [calibrate].extra: unknown option"),
    ('model = "smollm2-135m"\nsplits = 18\n', "recipe.toml: no step"),
], ids=lambda v: "" if "\n" in v else v.split(": ", 1)[-1][:40])
def test_bad_recipes_name_the_key(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


def test_missing_files_are_reported_with_their_key(tmp_path):
    message = error_of(write(tmp_path, BASE + '[loss]\ndata = "held-out.txt"\n'))
    assert "recipe.toml: [loss].data:" in message and "held-out.txt does not exist" in message
    message = error_of(write(tmp_path, BASE.replace('"wiki-leads"', '"corpus/texts.jsonl"')))
    assert "recipe.toml: data:" in message and "does not exist" in message
    message = error_of(write(tmp_path, BASE.replace('"smollm2-135m"', '"./models/mine"')))
    assert "recipe.toml: model:" in message and "does not exist" in message
    message = error_of(write(tmp_path, BASE + '[ruler]\nfrom-jsonl = "ruler.jsonl"\n'))
    assert "recipe.toml: [ruler].from-jsonl:" in message and "does not exist" in message


def test_steps_needing_a_missing_artifact_are_refused(tmp_path):
    head = 'model = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 18\n'
    assert "[fit]: needs the statistics that [calibrate] makes" in error_of(write(tmp_path, head + "[fit]\n"))
    message = error_of(write(tmp_path, head + '[loss]\nvariants = ["exact", "ridge"]\n'))
    assert "[loss].variants: ridge needs the maps that [fit] makes" in message
    assert "[splice].fill: ridge needs" in error_of(write(tmp_path, head + '[splice]\nfill = "ridge"\n'))
    # without maps, exact and identity (every command's default then) need no artifact
    assert [t.needs for t in plan(load_recipe(write(tmp_path, head + "[ruler]\nlengths = [512]\n")))] == [None]
    recipe = load_recipe(write(tmp_path, head + '[ruler]\nvariants = ["exact", "identity"]\nlengths = [512]\n'))
    assert [t.needs for t in plan(recipe)] == [None]


def test_options_are_checked_against_every_tail_before_any_work(tmp_path):
    text = BASE.replace("splits = 18", "splits = 18\ntails = [64, 1024]") + "[ruler]\nlengths = [1024]\n"
    assert "recipe.toml: [ruler] (tail 1024): --tail 1024 plus --keep-first 1 leave no filled row" in \
        error_of(write(tmp_path, text))
    assert "recipe.toml: [loss] (tail 256): --short 512 must be between 1 and --context - 1" in \
        error_of(write(tmp_path, BASE + "[loss]\ncontext = 512\n"))


def test_longbench_needs_its_own_data(tmp_path):
    message = error_of(write(tmp_path, BASE + "[longbench]\n"))
    assert message.startswith(f"{tmp_path / 'recipe.toml'}: [longbench].data: missing")


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    tasks = plan(recipe)
    assert tasks[0].step == "calibrate" and all(t.needs for t in tasks[1:])


def test_distant_tokens_recipe_scores_disjoint_passages_with_skip():
    """The distant-token recipe's loss task, and its confirmation set: loss.skip moves the passages (and the cache
    key) and nothing else; every row beyond a short window of the first tail targets is a filled row."""
    path = ROOT / "recipes" / "distant-tokens.toml"
    [chosen] = [t for t in plan(load_recipe(path)) if t.step == "loss"]
    [confirm] = [t for t in plan(load_recipe(path, ["loss.skip=30"])) if t.step == "loss"]
    kw = chosen.kwargs
    assert kw.get("skip", 0) == 0 and confirm.kwargs["skip"] == 30 and kw["samples"] == 26  # passages 0-25 vs 30-55
    assert kw["data"] == "shakespeare" and kw["context"] == 4096 and kw["tail"] == 1024 and kw["short"] == 256
    assert kw.get("alpha", 2.0) == kw.get("beta", 2.0) == 2.0  # LongPPL's thresholds, unchanged
    assert {k: v for k, v in confirm.kwargs.items() if k != "skip"} == {k: v for k, v in kw.items() if k != "skip"}


def test_sweep_plan_shares_calibration_and_fits_each_split():
    recipe = load_recipe(ROOT / "recipes" / "smollm2-methodology.toml")
    tasks = plan(recipe)
    assert [t.label for t in tasks if t.step in ("calibrate", "fit")] == ["calibrate", "fit-s10", "fit-s15", "fit-s20"]
    assert tasks[0].kwargs["split"] == "10,15,20"
    ruler = [t for t in tasks if t.step == "ruler"]
    assert {(t.split, t.tail) for t in ruler} == {(s, t) for s in (10, 15, 20) for t in (256, 1024)}
    assert all(t.needs == f"fit-s{t.split}" and t.kwargs["lengths"] == "2048,4096,8192" for t in ruler)


def test_bad_recipe_on_the_command_line_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, BASE + '[ruler]\nlengths = "2k"\n')
    monkeypatch.setattr(sys, "argv", ["ridgefill", "run", str(path)])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == f'error: {path}: [ruler].lengths: expected a list of integers, got "2k"'


def test_a_deeply_nested_recipe_or_override_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """TOML nested 100,000 deep, in the recipe file or in a KEY=VALUE override: one line, not a traceback."""
    path = write(tmp_path, 'model = "smollm2-135m"\nsplits = ' + "[" * 100_000 + "\n")
    for argv, expected in (([str(path)], f"error: {path}: invalid TOML: nested too deeply to read: fix the recipe"),
                           ([str(write(tmp_path, LOSS, "loss.toml")), "splits=" + "[" * 100_000],
                            "error: override splits=[[[")):
        monkeypatch.setattr(sys, "argv", ["ridgefill", "run", *argv, "--dry-run"])
        with pytest.raises(SystemExit) as info:
            main()
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith(expected) and err.count("\n") == 1, err[:300]


# --- overrides: KEY=VALUE on the command line ------------------------------------------------------------
LOSS = 'model = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 18\n[loss]\ncontext = 1024\n'


def override_error(path: Path, *overrides: str) -> str:
    with pytest.raises(RidgefillError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_overrides_set_step_options_and_top_level_keys(tmp_path):
    overrides = ("loss.samples=3", "splits=[15,18]", "tails=[64, 128]", 'loss.variants=["exact", "identity"]',
                 "loss.data=shakespeare", "loss.alpha=1")
    recipe = load_recipe(write(tmp_path, LOSS), overrides)
    assert recipe.steps["loss"] == {"context": 1024, "samples": 3, "variants": "exact,identity", "alpha": 1.0,
                                    "data": "shakespeare"}  # a bare word is a string; 1 is a number here
    assert recipe.settings["splits"] == [15, 18] and recipe.overrides == overrides
    assert [t.label for t in plan(recipe)] == [f"loss-s{s}-t{t}-seed0" for s in (15, 18) for t in (64, 128)]
    assert load_recipe(write(tmp_path, LOSS), ["loss.samples=4", "loss.samples=5"]).steps["loss"]["samples"] == 5


@pytest.mark.parametrize("override,expected", [
    ("loss.samples=abc", 'override loss.samples=abc: expected an integer, got "abc"'),
    ('loss.samples="4"', 'override loss.samples="4": expected an integer, got "4"'),
    ("loss.alpha=true", "override loss.alpha=true: expected a number, got true"),
    ("splits=abc", 'override splits=abc: expected an integer or a list of integers, got "abc"'),
    ("splits=[0,4]", "override splits=[0,4]: 0 is out of range"),
    ("splitz=3", "override splitz=3: unknown key (did you mean splits?)"),
    ("loss.sampels=4", "override loss.sampels=4: unknown option (did you mean samples?)"),
    ("loss.short_stride=4", "override loss.short_stride=4: unknown option (write short-stride)"),
    ("loss.tail=64", "override loss.tail=64: set by the top-level `tails`"),
    ("ruler.samples=20", "override ruler.samples=20: {path} has no [ruler] table: add one to the recipe"),
    ("rulr.samples=20", "override rulr.samples=20: unknown step (did you mean ruler?)"),
    ("loss=3", "override loss=3: [loss] is a step table: set its options one by one"),
    ("samples", "override samples: expected KEY=VALUE or STEP.OPTION=VALUE"),
    ("loss.data=held-out.txt", "override loss.data=held-out.txt: "),
    ('loss.variants=["exact","ridge"]', 'override loss.variants=["exact","ridge"]: ridge needs the maps that [fit] '
     "makes: add [calibrate] and [fit] tables, or leave ridge out"),
    ("loss.context=512", "recipe.toml: [loss] (tail 256): --short 512 must be between 1 and --context - 1"),
], ids=lambda v: v if "=" in v or " " not in v else "")
def test_a_bad_override_is_one_line_naming_it(tmp_path, override, expected):
    path = write(tmp_path, LOSS)
    assert expected.format(path=path) in override_error(path, override)


def test_override_paths_are_read_from_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "held-out.txt").write_text("text")
    path = write(tmp_path, LOSS)
    monkeypatch.chdir(tmp_path / "here")
    assert load_recipe(path, ["loss.data=held-out.txt"]).steps["loss"]["data"] == str(tmp_path / "here" /
                                                                                      "held-out.txt")
    assert "does not exist" in override_error(path, "loss.data=./missing.txt")


def test_overrides_on_the_command_line(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, LOSS)
    monkeypatch.setattr(sys, "argv", ["ridgefill", "run", str(path), "loss.samples=abc"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == 'error: override loss.samples=abc: expected an integer, got "abc"'
    monkeypatch.setattr(sys, "argv", ["ridgefill", "run", str(path), "splits=[15,18]", "--dry-run", "seeds=[0,1]"])
    main()
    shown = capsys.readouterr().out
    assert all(f"loss-s{s}-t256-seed{seed}" in shown for s in (15, 18) for seed in (0, 1))


# --- the pipeline on a tiny checkpoint ------------------------------------------------------------------
TINY = """
name = "tiny"
model = "{model}"
data = "text.txt"
splits = 3
tails = 32
seeds = 0

[calibrate]
tokens = 1024
seq-len = 128
holdout = 0.25

[fit]

[ruler]
lengths = [320]
tasks = ["niah_single_1"]
samples = 1
max-new-tokens = 4

[loss]
context = 256
short = 64
samples = 2

[bench-ttft]
lengths = [64]
repeats = 1
warmup = 0
"""


@pytest.fixture(scope="module")
def tiny_recipe(tiny_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recipe")
    write_corpus(folder / "text.txt", seed=5, lines_per_document=40)
    return write(folder, TINY.format(model=tiny_checkpoint))


@pytest.fixture(scope="module")
def first_run(tiny_recipe, tmp_path_factory) -> Path:
    """A finished run; tests that rerun it work on a copy."""
    return run_recipe(tiny_recipe, tmp_path_factory.mktemp("runs") / "first")


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


def steps(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "manifest.json").read_text())["steps"]


def metrics(run_dir: Path) -> dict:
    """Every result number of a run, without timings, paths and dates."""
    out = {}
    for step in steps(run_dir):
        for name in step["hashes"]:
            if name.endswith(".json"):
                doc = json.loads((run_dir / name).read_text())
                if doc["command"] == "bench-ttft":  # everything but the clock: FLOPs, filled rows, first tokens
                    out[step["label"]] = [[e["length"], e["flops"], e["first_token"]] + [
                        [f["filled_rows"], f["limit_speedup"]] for f in e["fill"].values()] for e in doc["results"]]
                    continue
                keep = ("results", "intervals", "layers", "rows", "samples", "mean_error_identity", "mean_error_map")
                out[step["label"]] = {k: doc[k] for k in keep if k in doc}
    return out


LABELS = ["calibrate", "fit-s3", "ruler-s3-t32-seed0", "loss-s3-t32-seed0", "bench-ttft-s3-t32-seed0"]


def test_two_runs_from_scratch_give_identical_metrics(tiny_recipe, first_run, tmp_path):
    second = run_recipe(tiny_recipe, tmp_path / "second")
    assert list(metrics(first_run)) == LABELS
    assert metrics(first_run) == metrics(second)
    assert [s["artifact"] for s in steps(first_run)] == [s["artifact"] for s in steps(second)]  # same keys
    assert not any(s["cached"] for s in steps(second))
    assert (second / "report.md").stat().st_size > 0


def test_two_runs_sharing_a_folder_compute_each_artifact_once(tiny_recipe, first_run, tmp_path):
    """Two runs of one recipe into one folder at the same time: each task is computed by one of them while the
    other waits on its claim and then finds it cached; the artifacts are the single run's."""
    shared = tmp_path / "shared"
    runs = [subprocess.Popen([sys.executable, "-m", "ridgefill", "run", str(tiny_recipe), "--out-dir", str(shared)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ,
                                                                                             "COLUMNS": "200"})
            for _ in range(2)]
    outputs = [r.communicate(timeout=600) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    computed = [sum(f"│ {label} " in line and "computed" in line for line in out.splitlines())
                for label in LABELS for out, _ in outputs]
    assert sum(computed) == len(LABELS)  # each task computed once, by one run or the other
    assert metrics(shared) == metrics(first_run)
    assert not [p for p in (shared / "artifacts").iterdir() if p.name.startswith(".") and p.name != ".locks"]


def test_rerun_reuses_every_step_and_force_recomputes_one(tiny_recipe, first_run, tmp_path):
    run_dir = copy_of(first_run, tmp_path)
    again = steps(run_recipe(tiny_recipe, run_dir))
    assert all(s["cached"] for s in again)
    assert [s["hashes"] for s in again] == [s["hashes"] for s in steps(first_run)]
    forced = steps(run_recipe(tiny_recipe, run_dir, force=("loss",)))
    assert [s["cached"] for s in forced] == [True, True, True, False, True]
    assert metrics(run_dir) == metrics(first_run)
    loss_doc = json.loads(next((run_dir / "artifacts").glob("loss-*.json")).read_text())
    assert loss_doc["exact_store"] == {"folder": str(run_dir / "artifacts" / "exact"), "hits": 0, "misses": 2}


def test_sweep_tasks_share_exact_results(first_run):
    """The run keeps exact results by sample under artifacts/exact: RULER answers and loss NLLs, computed once."""
    docs = {p.name.split("-")[0]: json.loads(p.read_text()) for p in (first_run / "artifacts").glob("*-seed0-*.json")}
    assert docs["ruler"]["exact_store"]["misses"] == 1 and docs["loss"]["exact_store"]["misses"] == 2
    kinds = sorted(p.name.rsplit("-", 1)[0] for p in (first_run / "artifacts" / "exact").iterdir())
    assert kinds == ["loss-exact-nll", "loss-exact-nll", "ruler-answer"]


def test_changed_option_recomputes_only_what_depends_on_it(tiny_recipe, first_run, tmp_path):
    run_dir = copy_of(first_run, tmp_path)
    changed = write(tmp_path, tiny_recipe.read_text().replace("samples = 2", "samples = 1").replace(
        '"text.txt"', f'"{tiny_recipe.parent / "text.txt"}"'))
    assert [s["cached"] for s in steps(run_recipe(changed, run_dir))] == [True, True, True, False, True]


def test_manifest_records_what_reproduces_the_run(tiny_recipe, first_run):
    manifest = json.loads((first_run / "manifest.json").read_text())
    assert manifest["recipe"]["text"] == tiny_recipe.read_text() == (first_run / "recipe.toml").read_text()
    assert manifest["status"] == "complete" and manifest["duration_s"] > 0
    assert set(manifest["versions"]) >= {"python", "torch", "transformers", "ridgefill"}
    assert manifest["device"]["kind"] == "cpu" and manifest["platform"]
    assert manifest["git"] is None or len(manifest["git"]["commit"]) == 40
    assert manifest["seeds"] == [0] and manifest["model"]["weights_hash"] and manifest["model"]["n_layers"] == 6
    assert manifest["recipe"]["overrides"] == []
    for step in manifest["steps"]:
        assert step["key"] in step["artifact"] and step["duration_s"] >= 0
        assert all((first_run / name).is_file() and len(digest) == 16 for name, digest in step["hashes"].items())
    fit = manifest["steps"][1]
    assert fit["reads"] == "calibrate" and len(fit["hashes"]) == 2  # maps and their JSON summary


def test_an_override_runs_as_if_the_file_said_it(tiny_recipe, tmp_path):
    """Same cache keys as the edited file, and the manifest records the overrides beside the file's text."""
    text = tiny_recipe.read_text().split("[calibrate]")[0] + "[loss]\ncontext = 256\nshort = 64\nsamples = 2\n"
    recipe = write(tiny_recipe.parent, text, "loss-only.toml")
    edited = write(tiny_recipe.parent, text.replace("samples = 2", "samples = 1").replace("tails = 32", "tails = 16"),
                   "loss-edited.toml")
    overridden = run_recipe(recipe, tmp_path / "overridden", overrides=("loss.samples=1", "tails=16"))
    from_file = run_recipe(edited, tmp_path / "edited")
    assert [s["artifact"] for s in steps(overridden)] == [s["artifact"] for s in steps(from_file)]
    assert [s["label"] for s in steps(overridden)] == ["loss-s3-t16-seed0"]
    manifest = json.loads((overridden / "manifest.json").read_text())
    assert manifest["recipe"]["overrides"] == ["loss.samples=1", "tails=16"] and manifest["recipe"]["text"] == text
    assert json.loads((overridden / steps(overridden)[0]["artifact"]).read_text())["config"]["samples"] == 1
    assert all(s["cached"] for s in steps(run_recipe(edited, overridden)))  # the file's edit hits the same cache


def _interrupt(config):
    raise KeyboardInterrupt


INTERRUPTED_LOSS = Command("loss", LossConfig, _interrupt, writes=".json", reads="maps")


def test_interrupted_run_resumes_where_it_stopped(tiny_recipe, first_run, tmp_path, monkeypatch):
    run_dir = copy_of(first_run, tmp_path)
    for f in (run_dir / "artifacts").glob("loss-*"):
        f.unlink()
    monkeypatch.setitem(commands.REGISTRY, "loss", Entry(__name__, "interrupted", step=True,
                                                         attribute="INTERRUPTED_LOSS"))
    with pytest.raises(KeyboardInterrupt):
        run_recipe(tiny_recipe, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and [s["label"] for s in manifest["steps"]] == LABELS[:3]
    assert not list((run_dir / "artifacts").glob("loss-*"))
    monkeypatch.undo()
    assert [s["cached"] for s in steps(run_recipe(tiny_recipe, run_dir))] == [True, True, True, False, True]
    assert metrics(run_dir) == metrics(first_run)


def test_force_names_a_step_of_the_recipe(tiny_recipe, tmp_path):
    with pytest.raises(RidgefillError, match="--force splice: not a step of"):
        run_recipe(tiny_recipe, tmp_path / "run", force=("splice",))


def test_docs_example_and_shipped_names_resolve(tmp_path):
    text = (ROOT / "docs" / "recipes.md").read_text()
    example = text[text.rindex("```toml") + len("```toml"):text.rindex("```")]
    recipe = load_recipe(write(tmp_path, example))
    assert recipe.name == "sweep-example" and len(plan(recipe)) == 1 + 3 + 2 * 3 * 2
    assert recipes.find_recipe("quickstart").resolve() == ROOT / "recipes" / "quickstart.toml"
    with pytest.raises(RidgefillError, match="recipe nope does not exist"):
        recipes.find_recipe("nope")


# --- the runner knows no step: everything comes from the commands' declarations ------------------------------
@dataclass
class WiderLossConfig(LossConfig):
    window: int = option(3, "An option the pipeline has never heard of.")

    def check(self) -> None:
        super().check()
        if self.window < 1:
            raise RidgefillError(f"--window {self.window} must be at least 1")


WIDER_LOSS = Command("loss", WiderLossConfig, lambda config: None, writes=".json", reads="maps")


def test_an_option_added_to_a_command_is_a_recipe_key(tmp_path, monkeypatch):
    path = write(tmp_path, LOSS + "window = 5\n")
    assert "recipe.toml: [loss].window: unknown option" in error_of(path)
    monkeypatch.setitem(commands.REGISTRY, "loss", Entry(__name__, "loss, wider", True, "WIDER_LOSS"))
    assert load_recipe(path).steps["loss"]["window"] == 5
    assert load_recipe(path, ["loss.window=7"]).steps["loss"]["window"] == 7
    assert 'recipe.toml: [loss].window: expected an integer, got "x"' in error_of(write(tmp_path, LOSS + 'window = "x"'))
    assert "recipe.toml: [loss] (tail 256): --window 0 must be at least 1" in error_of(write(tmp_path, LOSS + "window = 0"))


@dataclass
class MakeConfig(ModelConfig):
    split: str = option(REQUIRED, "Splits, comma-separated.", listed=int, top="splits")
    size: int = option(2, "How many things.")
    out: Path = option(REQUIRED, "Things to write.", role="output")
    resume: bool = option(False, "Continue an interrupted run.", role="resume")

    def check(self) -> None:
        if self.size < 1:
            raise RidgefillError(f"--size {self.size} must be at least 1")


@dataclass
class UseConfig(ModelConfig):
    things: Path | None = option(None, "Things from toy-make.", role="input")
    split: int | None = option(None, "Split.", top="splits")
    tail: int = option(8, "Tail.", top="tails")
    data: str = option(REQUIRED, "Text.", fallback="data")
    use: str = option("none", "none, or things (needs --things).")
    words: str | None = option(None, "Words, comma-separated.", listed=str)
    note: str = option("", "A remark: no part of the result.", keyed=False)
    store: Path | None = option(None, "Results shared by the tasks of a run.", role="store", keyed=False)
    out: Path = option(REQUIRED, "Result to write.", role="output")

    def wants_input(self):
        return ("use", "things", "use none") if self.use == "things" else None


def toy_run(name: str, config) -> dict:
    doc = {"command": name, "config": config.as_dict()}
    write_json(config.out, doc)
    return doc


TOY_MAKE = Command("toy-make", MakeConfig, lambda c: toy_run("toy-make", c), writes=".json", makes="things")
TOY_USE = Command("toy-use", UseConfig, lambda c: toy_run("toy-use", c), writes=".json", reads="things")
TOY_REGISTRY = {"toy-make": Entry(__name__, "Make things.", True, "TOY_MAKE"),
                "toy-use": Entry(__name__, "Use them.", True, "TOY_USE")}
TOY = """
model = "{model}"
data = "wiki-leads"
splits = [2, 4]
tails = [8, 16]

[toy-make]
size = 3

[toy-use]
use = "things"
words = ["a", "b"]
"""


@pytest.fixture
def toy_registry(monkeypatch):
    monkeypatch.setattr(commands, "REGISTRY", TOY_REGISTRY)


@pytest.mark.parametrize("text,expected", [
    ('[toy-use]\nuse = "things"\n', "recipe.toml: [toy-use].use: things needs the things that [toy-make] makes: add "
     "a [toy-make] table, or use none"),
    ('[toy-make]\n[toy-use]\nthings = "x"\n', "recipe.toml: [toy-use].things: set by the runner (it passes the "
     "things that [toy-make] makes)"),
    ('[toy-make]\nout = "x"\n', "recipe.toml: [toy-make].out: set by the runner (artifacts go in the run folder)"),
    ("[toy-make]\nresume = false\n", "recipe.toml: [toy-make].resume: set by the runner (it always resumes"),
    ("[toy-use]\nsplit = 3\n", "recipe.toml: [toy-use].split: set by the top-level `splits`"),
    ("[toy-use]\nwords = \"a,b\"\n", 'recipe.toml: [toy-use].words: expected a list of strings, got "a,b"'),
    ("[toy-make]\nsize = 0\n", "recipe.toml: [toy-make]: --size 0 must be at least 1"),
    ("[ruler]\n", "recipe.toml: [ruler]: unknown step; steps are [toy-make], [toy-use]"),
], ids=lambda v: "" if "\n" in v else v.split(": ", 1)[-1][:40])
def test_a_throwaway_command_is_validated_from_its_config(toy_registry, tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, 'model = "smollm2-135m"\ndata = "wiki-leads"\nsplits = 2\n' + text))


def test_a_throwaway_command_takes_its_data_from_the_top_level(toy_registry, tmp_path):
    message = error_of(write(tmp_path, 'model = "smollm2-135m"\nsplits = 2\n[toy-use]\n'))
    assert message.endswith("recipe.toml: data: missing: [toy-use] needs its data (Text): set the top-level `data` "
                            "or [toy-use].data")
    recipe = load_recipe(write(tmp_path, 'model = "smollm2-135m"\nsplits = 2\n[toy-use]\ndata = "shakespeare"\n'))
    assert recipe.steps["toy-use"] == {"data": "shakespeare"}


def test_a_throwaway_pipeline_runs_from_its_declarations(toy_registry, tiny_checkpoint, tmp_path):
    """Sweep axes, the listed split, input / output / resume / store wiring and the cache key: all read from
    the toy commands' Configs."""
    path = write(tmp_path, TOY.format(model=tiny_checkpoint))
    tasks = plan(load_recipe(path))
    assert [(t.label, t.needs) for t in tasks] == [("toy-make", None)] + [
        (f"toy-use-s{s}-t{t}", "toy-make") for s in (2, 4) for t in (8, 16)]
    assert tasks[0].kwargs == {"model": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu", "chunk": 2048,
                               "split": "2,4", "size": 3}
    run_dir = run_recipe(path, tmp_path / "run")
    made = steps(run_dir)
    docs = {s["label"]: json.loads((run_dir / s["artifact"]).read_text()) for s in made}
    use = docs["toy-use-s4-t16"]["config"]
    assert use["things"] == str(run_dir / made[0]["artifact"]) and (use["split"], use["tail"]) == (4, 16)
    assert use["store"] == str(run_dir / "artifacts" / "exact") and use["data"] == "wiki-leads"
    assert use["words"] == "a,b" and docs["toy-make"]["config"]["resume"] is True
    assert all(s["cached"] for s in steps(run_recipe(path, run_dir, overrides=("toy-use.note=hi",))))  # not keyed
    changed = steps(run_recipe(path, run_dir, overrides=('toy-use.words=["c"]',)))
    assert [s["cached"] for s in changed] == [True, False, False, False, False]
    forced = steps(run_recipe(path, run_dir, force=("toy-make",)))
    assert [s["cached"] for s in forced] == [False, True, True, True, True]  # same key: its readers stay cached
    assert json.loads((run_dir / forced[0]["artifact"]).read_text())["config"]["resume"] is False


# --- outputs never destroy inputs -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "", ".hidden", "a/b", "..\\\\x", "runs/../.."])
def test_a_recipe_name_must_be_a_plain_folder_name(tmp_path, name):
    message = error_of(write(tmp_path, f'name = "{name}"\n' + BASE))
    assert "recipe.toml: name:" in message and "not a plain folder name" in message


def test_a_recipe_file_name_that_is_no_folder_name_needs_a_name(tmp_path):
    assert "name (from the file name)" in error_of(write(tmp_path, BASE, "...toml"))  # its stem is ".."
    assert load_recipe(write(tmp_path, 'name = "ok"\n' + BASE, "...toml")).name == "ok"
    assert load_recipe(write(tmp_path, 'name = "v1.2_run-3"\n' + BASE)).name == "v1.2_run-3"


def test_force_keeps_the_users_own_files_in_an_exact_cache_folder(tmp_path):
    """`run --force ruler` forgets the exact results ruler stored in the exact-cache folder a table names, and
    nothing else there: a user's own ruler-1.json survives."""
    from ridgefill.evals.exact_store import ExactStore
    from ridgefill.pipeline.run import forget_forced

    folder = tmp_path / "my-results"
    folder.mkdir()
    (folder / "ruler-1.json").write_text('{"mine": true}')
    ExactStore(folder, {"id": "m", "weights_hash": "h"}, "fp32", "cpu", 2048).get("ruler-answer", {"ids": [1]},
                                                                                  lambda: "42")
    recipe = load_recipe(write(tmp_path, BASE + f'[ruler]\nexact-cache = "{folder}"\n'))
    forget_forced(plan(recipe), tmp_path / "run", ("ruler",))
    assert [p.name for p in folder.iterdir()] == ["ruler-1.json"]
    assert (folder / "ruler-1.json").read_text() == '{"mine": true}'
