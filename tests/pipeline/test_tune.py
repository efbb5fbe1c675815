"""`ridgefill tune`: the search on stubbed quality tables (the chosen split is the lowest within bounds; early stop;
bisect agrees with a full descent when quality is monotone; the NLL check steps up from the RULER choice), the
verdict and the choice between variants, bad input in one line, and the command on the tiny checkpoint: the
serving config's fields, the report's frontier, the check runs (linked calibration), caching on rerun,
--no-nll-check, and --windows (a run folder per window, its windowed maps and FLOP count, the choice between
windows and the serving config's window). Failing verdicts come from crafted result documents in a copy of a run
folder, which the rerun finds cached and judges."""

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ridgefill.cli import main
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.frontier import Point
from ridgefill.pipeline.tune import COMMAND as tune_command
from ridgefill.pipeline.tune.options import candidate_splits, parse_windows, window_of
from ridgefill.pipeline.tune.verdict import MIN_DISTANT_TOKENS, PASS, best_choice, distant_warning, verdict
from ridgefill.pipeline.tune.windows import WindowRun, best_window
from tiny_models import write_corpus


# --- verdicts and the choice between variants -----------------------------------------------------------
def point(variant="ridge", split=15, drop=2.0, gap=0.1, speedup=1.5, metric="distant") -> Point:
    return Point(variant, split, 256, retrieval=90.0 - drop, retrieval_exact=90.0, distant_nll=2.0 + gap,
                 distant_nll_exact=2.0, nll_metric=metric, flop_speedup=speedup)


@pytest.mark.parametrize("p,expected", [
    (point(), PASS),
    (point(drop=5.0, gap=0.25), PASS),  # the bounds themselves still count as equal quality
    (point(drop=5.5), "RULER -5.5 points"),
    (point(gap=0.3), "distant NLL +0.300 nats"),
    (point(gap=0.3, metric="tail"), "tail NLL +0.300 nats"),
    (Point("ridge", 15, 256, retrieval=88.0, retrieval_exact=90.0), "no NLL"),
    (None, "no RULER score"),
])
def test_verdict(p, expected):
    assert verdict(p, 5.0, 0.25) == expected


def test_each_stage_judges_only_what_it_measures():
    ruler_only = Point("ridge", 15, 256, retrieval=88.0, retrieval_exact=90.0)
    assert verdict(ruler_only, 5.0, 0.25, judged=("ruler",)) == PASS
    nll_only = Point("ridge", 15, 1024, distant_nll=2.5, distant_nll_exact=2.0, nll_metric="distant")
    assert verdict(nll_only, 5.0, 0.25, judged=("nll",)) == "distant NLL +0.500 nats"
    assert verdict(replace(nll_only, distant_nll=2.2), 5.0, 0.25, judged=("nll",)) == PASS
    assert verdict(None, 5.0, 0.25, judged=("nll",)) == "no NLL"


def loss_result(counts: list[int]):
    from ridgefill.runtime.stats import distant_spread
    from ridgefill.report.results import Result

    return Result(Path("loss.json"), {"command": "loss", "distant_spread": distant_spread(counts)})


def test_too_few_distant_tokens_are_called_a_rough_screen():
    warning = distant_warning([loss_result([0, 4, 0, 12, 1, 0])])
    assert warning.startswith("tune: the NLL check rests on 17 distant-context tokens in 3 of 6 passages")
    assert f"fewer than {MIN_DISTANT_TOKENS} cannot separate fills" in warning and "--nll-tail" in warning
    assert "judged on the tail NLL" in distant_warning([loss_result([0, 0])])
    assert distant_warning([loss_result([150, 150])]) is None  # enough to judge
    assert distant_warning([]) is None  # no loss measured


def test_the_served_variant_is_the_faster_choice():
    points = [point("identity", 18, speedup=1.4), point("ridge", 15, speedup=1.7), point("ridge", 18, speedup=1.35)]
    assert best_choice(points, {"identity": 18, "ridge": 15}).variant == "ridge"
    assert best_choice(points, {"identity": 18, "ridge": None}).split == 18
    assert best_choice(points, {"identity": None, "ridge": None}) is None
    tied = [point("identity", 15, speedup=None), point("ridge", 15, speedup=None)]
    assert best_choice(tied, {"identity": 15, "ridge": 15}).variant == "identity"  # no count: no maps to run


def test_candidate_splits():
    assert candidate_splits(None, 30) == list(range(15, 29)) and candidate_splits("14-16,20", 30) == [14, 15, 16, 20]
    with pytest.raises(RidgefillError, match=r"^--splits 14-29: split 29 is out of range: use 1..28 for this "
                                             r"30-layer model"):
        candidate_splits("14-29", 30)


# --- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values,expected", [
    ({"tolerance": -1.0}, "--tolerance -1 and --max-distant-gap 0.25 must be 0 or more"),
    ({"max_distant_gap": -0.1}, "--max-distant-gap -0.1 must be 0 or more"),
    ({"search": "binary"}, "unknown --search 'binary': use bisect, descend, all"),
    ({"variants": "exact"}, "--variants 'exact': tune any of identity, ridge, drop, mean"),
    ({"splits": "20-14"}, "--splits '20-14': '20-14' is not a split or an increasing range"),
    ({"splits": "0-3"}, "--splits 0-3: split 0 is out of range"),
    ({"passages": 0}, "--passages 0 must be at least 1"),
    ({"lengths": "2k"}, "--lengths '2k' is not a comma-separated list of integers"),
    ({"short": 4096}, "tune: [loss] (tail 1024): --short 4096 must be between 1 and --context - 1"),
    ({"nll_tail": 0}, "--nll-tail 0 must be at least 1"),
    ({"nll_tail": 4096}, "--nll-tail 4096 plus --keep-first 1 leave no filled row in a --context 4096 passage"),
    ({"short_stride": 0}, "--short-stride 0 must be at least 1"),
    ({"tail": 2048}, "tune: [ruler] (tail 2048): --tail 2048 plus --keep-first 1 leave no filled row"),
    ({"tasks": "niah_single_9"}, "unknown RULER task(s) niah_single_9"),
    ({"windows": "x"}, "--windows 'x' is not a comma-separated list of filled windows of at least 0"),
    ({"windows": "-1"}, "--windows '-1' is not a comma-separated list of filled windows of at least 0"),
    ({"windows": "0,16.5"}, "--windows '0,16.5' is not a comma-separated list"),
])
def test_bad_input_is_one_line_before_any_model_work(tmp_path, values, expected):
    with pytest.raises(RidgefillError) as info:
        tune_command(out_dir=tmp_path / "run", **values)  # the embedded model is never loaded
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_windows_are_parsed_sorted_without_repeats():
    assert parse_windows("16, 0,16") == [0, 16] and parse_windows("0") == [0]
    assert window_of(16, [3, 4]) == {"size": 16, "first": 0, "last": 2} and window_of(0, [3, 4]) is None


def test_bad_input_on_the_command_line_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ridgefill", "tune", "--tolerance", "-2"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: --tolerance -2 and --max-distant-gap 0.25 must be")


def fake_engine(monkeypatch, **given):
    """An engine registered through the registry only (tests.backends' fake fourth engine's way), with `caps`."""
    import types

    from ridgefill import backends
    from ridgefill.backends.base import Backend, Capabilities

    class Fake(Backend):
        name = "fake"
        caps = Capabilities(**{"variants": ("identity", "ridge"), "logprobs": True, **given})

    module = types.ModuleType("fake_engine_module")
    module.BACKEND = Fake
    monkeypatch.setitem(sys.modules, "fake_engine_module", module)
    monkeypatch.setitem(backends.ENGINES, "fake", ("fake_engine_module", "a fake engine"))


def test_tune_takes_engine_through_the_seam(monkeypatch, tmp_path):
    """--engine reaches the measuring steps (ruler, loss) of every recipe, the default too; what the engine cannot
    run is refused in one line before any model work."""
    from ridgefill.pipeline.tune.recipes import check_tables, search_tables

    fake_engine(monkeypatch)
    c = tune_command.make(out_dir=tmp_path / "run", engine="fake")
    c.check()
    assert search_tables(c, [3, 4])["ruler"]["engine"] == "fake"
    assert check_tables(c, [3, 4], "ridge")["loss"]["engine"] == "fake"
    default = tune_command.make(out_dir=tmp_path / "run")
    assert search_tables(default, [3, 4])["ruler"]["engine"] == "torchfill"
    assert check_tables(default, [3, 4], "ridge")["loss"]["engine"] == "torchfill"
    for values, expected in (
            ({"variants": "mean"}, "the mean variant is not supported with --engine fake: use exact, identity, ridge"),
            ({"windows": "0,16"}, "a filled window (--windows) is not supported with --engine fake: use --windows 0"),
            ({"engine": "nope"}, "unknown --engine 'nope': use one of torchfill, vllm, llamacpp, fake")):
        with pytest.raises(RidgefillError) as info:
            tune_command(out_dir=tmp_path / "run", **{"engine": "fake", **values})
        assert str(info.value) == expected
    fake_engine(monkeypatch, logprobs=False)
    with pytest.raises(RidgefillError, match=r"^logprobs, which this command needs, is not supported with --engine fake"):
        tune_command(out_dir=tmp_path / "run", engine="fake")
    tune_command.make(out_dir=tmp_path / "run", engine="fake", nll_check=False).check()  # RULER alone: no log-probs
    assert not (tmp_path / "run").exists()


# --- the command on the tiny checkpoint -------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("tune-data") / "text.txt", seed=5, lines_per_document=40)


def tiny_options(model: Path, data: Path, out_dir: Path, **extra) -> dict:
    return dict(model=str(model), data=str(data), eval_data=str(data), tail=32, tokens=1024, seq_len=128,
                holdout=0.25, lengths="320", tasks="niah_single_1", samples=1, max_new_tokens=4, context=256,
                short=64, short_stride=8, passages=2, nll_tail=64, max_distant_gap=100.0, out_dir=out_dir,
                **extra)


@pytest.fixture(scope="module")
def tuned(tiny_checkpoint, texts, tmp_path_factory) -> tuple[dict, Path]:
    """A finished tune of the 6-layer tiny model (candidates 3 and 4); tests that rerun it work on a copy."""
    run_dir = tmp_path_factory.mktemp("tune") / "run"
    return tune_command(**tiny_options(tiny_checkpoint, texts, run_dir)), run_dir


def steps(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "manifest.json").read_text())["steps"]


def labels(run_dir: Path) -> list[str]:
    return [s["label"] for s in steps(run_dir)]


def rewrite(run_dir: Path, step: str, change) -> None:
    """Craft a run folder's result documents of `step` (its manifest's ruler-*, loss-*): change(doc) edits each,
    written to a fresh file (never through a hard link). A rerun finds them cached and judges what they say."""
    for entry in (s for s in steps(run_dir) if s["label"].startswith(f"{step}-")):
        path = run_dir / entry["artifact"]
        doc = json.loads(path.read_text())
        change(doc)
        path.unlink()
        path.write_text(json.dumps(doc))


def fills_below_exact(doc: dict) -> None:
    """A RULER result whose every fill scores 50 points below exact."""
    for variant, result in doc["results"].items():
        if variant != "exact":
            result["score"] = doc["results"]["exact"]["score"] - 50.0


def nll_above_exact(variant: str):
    """A loss result's change that puts `variant`'s NLL 200 nats above exact's (distant-context and tail): past
    tiny_options' bound of 100."""
    def change(doc: dict) -> None:
        exact = doc["results"]["exact"]
        for metric in ("distant_nll", "tail_nll"):
            if exact[metric] is not None:
                doc["results"][variant][metric] = exact[metric] + 200.0
    return change


def nll_metric(run_dir: Path) -> str:
    """What a check folder's loss results judge: distant-context NLL, or tail NLL where exact found none."""
    doc = json.loads((run_dir / steps(run_dir)[0]["artifact"]).read_text())
    return "distant" if doc["results"]["exact"]["distant_nll"] is not None else "tail"


def test_serving_config_holds_what_a_server_needs(tuned, tiny_checkpoint):
    doc, run_dir = tuned
    assert json.loads((run_dir / "serving.json").read_text()) == doc
    assert doc["kind"] == "ridgefill-serving-config" and doc["version"] == 2 and doc["outlier_factor"] == 20.0
    assert doc["model"]["id"] == str(tiny_checkpoint) and len(doc["model"]["weights_hash"]) == 16
    # quality is flat on a random model (RULER 0 everywhere), so the search keeps the lowest candidate for both
    # variants; identity fill there has the higher FLOP-limit speedup (no maps), so it is checked first, passes
    # and is served: ridge is never checked
    assert doc["tune"]["ruler_choices"] == {"identity": 3, "ridge": 3}
    assert doc["choices"]["identity"]["split"] == 3 and doc["choices"]["ridge"] is None
    assert (doc["variant"], doc["split"], doc["tail"], doc["keep_first"], doc["maps"]) == ("identity", 3, 32, 1, None)
    assert doc["expected_speedup"]["prompt_length"] == 320
    assert doc["expected_speedup"]["flop_limit"] == doc["choices"]["identity"]["flop_limit_speedup"] > 1
    ruler, nll = doc["quality"]["ruler"], doc["quality"]["nll"]
    assert ruler["region"] == "filled" and ruler["difference"]["estimate"] == ruler["score"] - ruler["exact"]
    assert nll["metric"] in ("distant", "tail") and nll["bound"] == 100.0 and nll["passages"] == 2
    assert (nll["context"], nll["scored_tail"]) == (256, 64)  # the check's passages and tail, not the serving tail
    assert nll["difference"]["low"] <= nll["difference"]["estimate"] <= nll["difference"]["high"]
    assert doc["tune"]["candidates"] == [3, 4] and doc["tune"]["measured"] == [4, 3]
    assert {(v["variant"], v["split"], v["verdict"]) for v in doc["tune"]["verdicts"]} == \
        {(v, s, PASS) for v in ("identity", "ridge") for s in (3, 4)}
    assert [(v["variant"], v["split"], v["verdict"]) for v in doc["tune"]["checks"]] == [("identity", 3, PASS)]


def test_expected_speedup_is_the_flop_count_of_the_plan(tuned, tiny_checkpoint):
    from ridgefill.torchfill import FillPlan, IdentityFiller
    from ridgefill.evals.flops import prefill_flops
    from ridgefill.runtime.session import open_session

    doc, _ = tuned
    runner = open_session(str(tiny_checkpoint)).runner
    plan = FillPlan(IdentityFiller(3, runner.n_layers), 32, (0,))
    expected = prefill_flops(runner.shape, 320) / prefill_flops(runner.shape, 320, plan.full_rows(320).numpy(), 3, 0)
    assert np.isclose(doc["expected_speedup"]["flop_limit"], expected)


def test_the_run_folder_is_a_recipe_run_with_a_report(tuned):
    doc, run_dir = tuned
    assert labels(run_dir) == ["calibrate", "fit-s3", "fit-s4", "ruler-s3-t32-seed0", "ruler-s4-t32-seed0"]
    from ridgefill.pipeline.recipe import load_recipe

    recipe = load_recipe(run_dir / "recipe.toml")  # the generated recipe is a valid one, every candidate in it
    assert recipe.settings["splits"] == [3, 4] and recipe.steps["ruler"]["region"] == "filled"
    for v in ("identity", "ridge"):
        check = load_recipe(run_dir / "check" / v / "recipe.toml")
        assert check.settings["tails"] == [64] and check.steps["loss"]["variants"] == f"exact,{v}"
    assert list(load_recipe(run_dir / "check" / "ridge" / "recipe.toml").steps) == ["calibrate", "fit", "loss"]
    assert list(load_recipe(run_dir / "check" / "identity" / "recipe.toml").steps) == ["loss"]
    assert (run_dir / "check" / "identity" / "report.md").is_file()
    assert not (run_dir / "check" / "ridge" / "manifest.json").exists()  # never checked: identity was served
    report = (run_dir / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| identity | 32 | 3 |"))
    assert row.split(" | ")[3] == f"{doc['expected_speedup']['flop_limit']:.4g}"  # FLOP-limit speedup, no bench


def test_rerun_reuses_every_step(tuned, tiny_checkpoint, texts, tmp_path, capsys):
    doc, run_dir = tuned
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    capsys.readouterr()
    again = tune_command(**tiny_options(tiny_checkpoint, texts, copy))
    out = capsys.readouterr()
    assert "tune: the NLL check rests on" in out.out + out.err or "tune: no distant-context token" in out.out + out.err
    for folder in ("", "check/identity"):
        assert all(s["cached"] for s in steps(copy / folder))
        assert [s["key"] for s in steps(copy / folder)] == [s["key"] for s in steps(run_dir / folder)]
    same = ("variant", "split", "quality", "choices", "expected_speedup")
    assert {k: again[k] for k in same} == {k: doc[k] for k in same}


def test_no_split_within_bounds_writes_the_report_and_no_config(tuned, tiny_checkpoint, texts, tmp_path):
    _, run_dir = tuned
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    (copy / "serving.json").unlink()
    rewrite(copy, "ruler", fills_below_exact)  # every fill 50 points below exact at every split
    with pytest.raises(RidgefillError, match=r"^no split of 3..4 keeps filled-region RULER within 5 points and the "
                                             r"distant-context NLL within 100 nats of exact") as info:
        tune_command(**tiny_options(tiny_checkpoint, texts, copy))
    assert "\n" not in str(info.value) and not (copy / "serving.json").exists()
    assert labels(copy)[-1] == "ruler-s4-t32-seed0"  # only the top split was measured, and nothing checked
    assert (copy / "report.md").is_file()


def test_a_failing_check_moves_the_choice_up_without_calibrating_again(tuned, tiny_checkpoint, texts, tmp_path):
    _, run_dir = tuned
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    check = copy / "check" / "ridge"
    failed = f"{nll_metric(copy / 'check' / 'identity')} NLL +200.000 nats"
    rewrite(copy / "check" / "identity", "loss", nll_above_exact("identity"))  # identity 3's check fails
    doc = tune_command(**tiny_options(tiny_checkpoint, texts, copy))
    # fastest first: identity 3 fails, ridge 3 (the next fastest) is checked, passes and is served
    assert [(v["variant"], v["split"], v["verdict"]) for v in doc["tune"]["checks"]] == [
        ("identity", 3, failed), ("ridge", 3, PASS)]
    assert (doc["variant"], doc["split"]) == ("ridge", 3) and doc["choices"]["identity"] is None
    rewrite(check, "loss", nll_above_exact("ridge"))  # now ridge 3's check fails too
    doc = tune_command(**tiny_options(tiny_checkpoint, texts, copy))
    # identity 3, ridge 3 (both fail), identity 4 (passes: served; ridge 4 is slower, never checked)
    assert [(v["variant"], v["split"], v["verdict"]) for v in doc["tune"]["checks"]] == [
        ("identity", 3, failed), ("identity", 4, PASS), ("ridge", 3, failed)]
    assert (doc["variant"], doc["split"]) == ("identity", 4) and doc["choices"]["ridge"] is None
    assert doc["quality"]["nll"]["difference"] is not None
    assert labels(copy / "check" / "identity") == ["loss-s3-t64-seed0", "loss-s4-t64-seed0"]
    assert labels(check) == ["calibrate", "fit-s3", "loss-s3-t64-seed0"]  # only the checked split
    for entry in steps(check)[:2]:  # the search's calibration and fit, hard-linked (same key, same inputs)
        assert entry["cached"] and os.path.samefile(check / entry["artifact"], copy / entry["artifact"])
    assert (copy / "check" / "exact").is_dir()  # the exact NLLs both checks share


def test_no_nll_check_judges_ruler_alone(tuned, tiny_checkpoint, texts, tmp_path, capsys):
    _, run_dir = tuned
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    shutil.rmtree(copy / "check")
    capsys.readouterr()
    doc = tune_command(**tiny_options(tiny_checkpoint, texts, copy, nll_check=False))
    assert doc["quality"]["nll"] is None and doc["tune"]["checks"] == [] and not (copy / "check").exists()
    assert doc["split"] == 3 and all(s["cached"] for s in steps(copy))
    assert "--no-nll-check: the split was judged on RULER alone" in "".join(capsys.readouterr())


def test_prompts_longer_than_the_model_takes_stop_before_any_measurement(tiny_checkpoint, texts, tmp_path):
    from ridgefill.runtime.session import open_session

    limit = open_session(str(tiny_checkpoint)).context_length
    for flag, values in (("--context", {"context": limit + 1}), ("--lengths", {"lengths": str(limit + 1)})):
        with pytest.raises(RidgefillError, match=rf"^{flag} {limit + 1} exceeds the model's context of {limit} tokens"):
            tune_command(**{**tiny_options(tiny_checkpoint, texts, tmp_path / "run"), **values})
        assert not (tmp_path / "run").exists()


def test_splits_out_of_range_for_the_model(tiny_checkpoint, texts, tmp_path):
    with pytest.raises(RidgefillError, match=r"^--splits 2-5: split 5 is out of range: use 1..4 for this 6-layer"):
        tune_command(**tiny_options(tiny_checkpoint, texts, tmp_path / "run", splits="2-5"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variant", ["identity", "ridge"])
def test_generate_and_bench_ttft_take_the_serving_config_tune_wrote(variant, tuned, tiny_checkpoint, texts, tmp_path):
    """Both variants: the file tune writes (ridge: its maps by path and sha256) is the file generate and bench-ttft
    read, giving what the same options give (the ridge config from a tune of ridge alone, on the same run folder's
    cached steps)."""
    from ridgefill.evals.bench_ttft import COMMAND as bench_ttft
    from ridgefill.method.fill import load_serving
    from ridgefill.runtime.paths import file_sha256
    from ridgefill.evals.generate import COMMAND as generate

    doc, run_dir = tuned
    config = run_dir / "serving.json"
    if variant == "ridge":
        copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
        config = tmp_path / "ridge.json"
        doc = tune_command(**tiny_options(tiny_checkpoint, texts, copy, variants="ridge", config_out=config))
        assert doc["maps"]["sha256"] == file_sha256(doc["maps"]["path"])
    fill = load_serving(config).fill
    assert (fill.variant, fill.split, fill.tail, fill.keep_first) == (variant, 3, 32, 1)
    options = dict(split=3) if variant == "identity" else dict(maps=fill.maps)
    prompt = "The grass is green. The sky is blue. " * 12
    served = generate(model=str(tiny_checkpoint), prompt=prompt, serving_config=config, max_new_tokens=4)
    assert served == generate(model=str(tiny_checkpoint), prompt=prompt, tail=32, max_new_tokens=4, **options)
    timed = bench_ttft(model=str(tiny_checkpoint), serving_config=config, lengths="96", repeats=1, warmup=0,
                       data="random", out=tmp_path / "ttft.json")
    assert timed["variants"] == ["exact", variant] and timed["split"] == 3 and timed["config"]["tail"] == 32
    assert timed["results"][0]["fill"][variant]["filled_rows"] == 96 - 33


# --- --windows: the search once per filled window ---------------------------------------------------------
@pytest.fixture(scope="module")
def windowed(tiny_checkpoint, texts, tmp_path_factory) -> tuple[dict, Path]:
    """A tune of the tiny model at full attention and filled window 16 (windowed layers 0-2, below both
    candidates)."""
    run_dir = tmp_path_factory.mktemp("tune-windows") / "run"
    return tune_command(**tiny_options(tiny_checkpoint, texts, run_dir, windows="0,16")), run_dir


def frontier_speedups(run_dir: Path) -> dict:
    """(variant, split) -> FLOP-limit speedup of a run folder's points, as its report counts them."""
    from ridgefill.pipeline.frontier import flop_model, frontier
    from ridgefill.report.results import collect

    manifest, results = collect(run_dir)
    points = frontier([r for r in results if r.command == "ruler"], [], [], 5.0, flop_model(manifest, results)).points
    return {(p.variant, p.split): p.flop_speedup for p in points}


def test_each_window_is_a_run_folder_of_its_own(windowed):
    from ridgefill.runtime.artifacts import read_meta

    doc, run_dir = windowed
    window = run_dir / "window-16"
    for folder in (run_dir, window):  # full attention keeps the folder layout of a tune without --windows
        assert (folder / "recipe.toml").is_file() and (folder / "report.md").is_file()
        assert labels(folder) == ["calibrate", "fit-s3", "fit-s4", "ruler-s3-t32-seed0", "ruler-s4-t32-seed0"]
    assert not (run_dir / "window-0").exists()
    stored = {"size": 16, "first": 0, "last": 2}  # below the lowest candidate, 3
    artifacts = {s["label"]: window / s["artifact"] for s in steps(window)}
    assert read_meta(artifacts["calibrate"], "stats")["filled_window"] == stored
    assert all(read_meta(artifacts[f"fit-s{s}"], "maps")["filled_window"] == stored for s in (3, 4))
    assert "filled_window" not in read_meta(run_dir / steps(run_dir)[0]["artifact"], "stats")
    assert json.loads(Path(f"{artifacts['fit-s3']}.json").read_text())["filled_window"] == stored
    ruler = json.loads(artifacts["ruler-s3-t32-seed0"].read_text())["config"]
    assert (ruler["filled_window"], ruler["filled_window_layers"]) == (16, "0-2")
    # exact prefill has no window: the windowed run's exact RULER answers are the full-attention run's
    assert not (window / "artifacts" / "exact").exists() and any((run_dir / "artifacts" / "exact").iterdir())
    assert (window / "check" / "identity" / "report.md").is_file() and not (window / "check" / "exact").exists()


def test_the_window_raises_the_flop_limit_speedup_at_every_point(windowed):
    doc, run_dir = windowed
    full, windowed_ = frontier_speedups(run_dir), frontier_speedups(run_dir / "window-16")
    assert set(full) == set(windowed_) == {(v, s) for v in ("identity", "ridge") for s in (3, 4)}
    assert all(windowed_[k] > full[k] > 1 for k in full)
    choices = doc["choices"]  # several windows: keyed by window, then by variant
    assert set(choices) == {"0", "16"} and doc["tune"]["windows"] == [0, 16]
    assert choices["16"]["identity"]["flop_limit_speedup"] == pytest.approx(windowed_[("identity", 3)])
    assert choices["0"]["identity"]["flop_limit_speedup"] == pytest.approx(full[("identity", 3)])
    assert doc["tune"]["ruler_choices"] == {"0": {"identity": 3, "ridge": 3}, "16": {"identity": 3, "ridge": 3}}
    assert doc["tune"]["run_dir"] == str(run_dir.resolve())
    assert doc["tune"]["recipe"]["16"] == str((run_dir / "window-16" / "recipe.toml").resolve())


def test_the_serving_config_carries_the_chosen_window(windowed, tiny_checkpoint):
    from ridgefill.evals.flops import prefill_flops
    from ridgefill.method.fill import load_serving
    from ridgefill.runtime.session import open_session

    doc, run_dir = windowed
    # quality is flat on a random model, so every window passes at split 3 and the window's speedup wins
    assert (doc["variant"], doc["split"], doc["filled_window"], doc["filled_window_layers"]) == \
        ("identity", 3, 16, "0-2")
    fill = load_serving(run_dir / "serving.json").fill
    assert (fill.filled_window, fill.filled_window_layers) == (16, "0-2")
    session = open_session(str(tiny_checkpoint))
    plan, _ = fill.plan(session)
    assert (plan.window.size, plan.window.first, plan.window.last, plan.window.sinks) == (16, 0, 2, 1)
    shape = session.runner.shape
    expected = prefill_flops(shape, 320) / prefill_flops(shape, 320, plan.full_rows(320).numpy(), 3, 0,
                                                         window=plan.window)
    assert np.isclose(doc["expected_speedup"]["flop_limit"], expected)
    assert doc["quality"]["nll"]["scored_tail"] == 64  # the window's own NLL check


def test_a_tie_between_windows_keeps_full_attention():
    def run(window, speedup):
        return WindowRun(window, None, {}, {}, {"identity": 3}, [point("identity", 3, speedup=speedup)])

    assert best_window([run(0, 1.5), run(16, 1.5), run(64, 1.5)])[0].window == 0
    assert best_window([run(16, 1.5), run(64, 1.5)])[0].window == 64  # then the larger window
    assert best_window([run(0, 1.4), run(16, 1.5)])[0].window == 16
    assert best_window([WindowRun(0, None, {}, {}, {"identity": None}, [point("identity", 3)])]) is None


def test_no_window_within_bounds_names_the_windows(windowed, tiny_checkpoint, texts, tmp_path):
    _, run_dir = windowed
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    for folder in (copy, copy / "window-16"):
        rewrite(folder, "ruler", fills_below_exact)
    with pytest.raises(RidgefillError, match=r"^no split of 3..4 keeps .* of exact \(identity, ridge; full "
                                             r"attention, window 16\): try higher --splits, a longer --tail, a wider "
                                             r"--windows or looser bounds; the measurements are in .*report.md and "
                                             r".*window-16/report.md$") as info:
        tune_command(**tiny_options(tiny_checkpoint, texts, copy, windows="0,16"))
    assert "\n" not in str(info.value)
