"""The core commands end to end on a tiny checkpoint, and their one-line errors (exit code 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import run_captured, without_package
from ridgefill.cli import app

RIDGEFILL = [sys.executable, "-m", "ridgefill"]


def run_cli(*args):
    return subprocess.run([*RIDGEFILL, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture
def ridgefill(capfd, monkeypatch):
    """`ridgefill ARGS` in this process (helpers.run_main) as CompletedProcess (exit code, stdout, stderr): the error
    paths below; real processes run generate here and one case of each kind in test_bad_input.py's end-to-end test."""
    return lambda *args: run_captured(args, capfd, monkeypatch)


@pytest.fixture(scope="module")
def stats_and_maps(tiny_fitted):
    """(statistics at splits 2 and 3, maps at split 3): conftest.tiny_fitted, calibrated and fitted through the CLI."""
    return tiny_fitted.stats, tiny_fitted.maps[3]


def test_calibrate_and_fit_write_artifacts_and_summaries(stats_and_maps):
    stats, maps = stats_and_maps
    summary = json.loads(Path(str(stats) + ".json").read_text())
    assert [r["split"] for r in summary["rows"]] == [2, 3]
    assert all(r["train_rows"] > 0 and r["val_rows"] > 0 for r in summary["rows"])
    fit = json.loads(Path(str(maps) + ".json").read_text())
    assert [layer["layer"] for layer in fit["layers"]] == [4, 5]
    assert fit["mean_error_map"] < fit["mean_error_identity"]
    assert not any(p.name.endswith(".partial") for p in stats.parent.iterdir())


def test_generate_prints_only_text_and_tail_covering_prompt_is_exact(tiny_checkpoint, stats_and_maps, ridgefill):
    """The exact run in a real process (its stdout is the text alone, whatever the imports print); the filled runs
    through the same entry point in this process."""
    _, maps = stats_and_maps
    prompt = "The grass is green. The sky is blue. One of the special magic numbers for king is: 1234567."
    exact = run_cli("generate", "--model", tiny_checkpoint, "--exact", "--prompt", prompt, "--max-new-tokens", 8)
    filled = ridgefill("generate", "--model", tiny_checkpoint, "--maps", maps, "--tail", 500, "--prompt", prompt,
                       "--max-new-tokens", 8)
    assert exact.returncode == 0 and filled.returncode == 0, filled.stderr
    assert exact.stdout == filled.stdout and exact.stdout.strip()
    assert "exact" in filled.stderr  # the note that tail >= prompt is exact
    both = ridgefill("generate", "--model", tiny_checkpoint, "--maps", maps, "--tail", 4, "--prompt", prompt,
                     "--max-new-tokens", 4, "--compare")
    assert both.returncode == 0
    assert "=== exact ===" in both.stdout and "=== filled ===" in both.stdout and "ttft" in both.stderr


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "no-such-model", "--exact", "--prompt", "hi"], "unknown model 'no-such-model'"),
    (["calibrate", "--data", "wiki-leads", "--split", "40", "--out", "x.safetensors"], "out of range"),
    (["fit", "--stats", "missing.safetensors", "--out", "m.safetensors"], "does not exist"),
    # command-line errors from the option parser: one line too, naming the fix
    (["loss", "--tail", "8", "--out", "l.json"], "Missing option '--data': see '"),
    (["fit", "--bogus"], "No such option: --bogus"),
    (["ruler", "--tail", "abc", "--out", "r.json"], "Invalid value for '--tail'"),
    (["nosuch"], "No such command 'nosuch': see '"),
])
def test_bad_input_is_one_line_exit_2(args, message, tiny_checkpoint, ridgefill):
    if args[0] == "calibrate":
        args = [*args, "--model", str(tiny_checkpoint)]
    r = ridgefill(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    if args[0] in ("loss", "nosuch"):  # the fix: the command's help
        assert r.stderr.rstrip().endswith(f"ridgefill{' loss' if args[0] == 'loss' else ''} --help'")


def test_corrupted_and_foreign_artifacts_are_refused(tiny_checkpoint, stats_and_maps, tmp_path, ridgefill):
    stats, maps = stats_and_maps
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(maps.read_bytes()[:1000])
    r = ridgefill("fit", "--stats", broken, "--out", tmp_path / "m.safetensors")
    assert r.returncode == 2 and "corrupted or truncated" in r.stderr
    r = ridgefill("fit", "--stats", maps, "--out", tmp_path / "m.safetensors")
    assert r.returncode == 2 and "not a ridgefill stats file" in r.stderr
    r = ridgefill("generate", "--model", tiny_checkpoint, "--maps", maps, "--split", "2", "--prompt", "hi")
    assert r.returncode == 2 and "split 3, not 2" in r.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_maps_for_another_model_are_refused(stats_and_maps, tmp_path, ridgefill):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    _, maps = stats_and_maps
    folder = tmp_path / "changed"
    shutil.copytree(Path(json.loads(Path(str(maps) + ".json").read_text())["model"]["id"]), folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.mul_(2)
    model.save_pretrained(folder)
    r = ridgefill("generate", "--model", folder, "--maps", maps, "--prompt", "hello there")
    assert r.returncode == 2 and "fitted for another model" in r.stderr


def test_data_without_enough_tokens_is_refused(tiny_checkpoint, tmp_path, ridgefill):
    small = tmp_path / "small.txt"
    small.write_text("too short")
    r = ridgefill("calibrate", "--model", tiny_checkpoint, "--data", small, "--split", "2", "--seq-len", "64",
                  "--out", tmp_path / "s.safetensors")
    assert r.returncode == 2 and "yields no calibration sequence" in r.stderr
    assert not (tmp_path / "s.safetensors").exists()


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("ridgefill ")


def test_identity_kind_reports_identity_error_and_json_is_strict(stats_and_maps, tmp_path):
    stats, _ = stats_and_maps
    out = tmp_path / "id.safetensors"
    r = CliRunner().invoke(app, ["fit", "--stats", str(stats), "--out", str(out), "--split", "2", "--kind", "identity"])
    assert r.exit_code == 0, r.output
    summary = json.loads(Path(str(out) + ".json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert summary["kind"] == "identity"
    for layer in summary["layers"]:
        assert layer["error_map"] == layer["error_identity"]
        assert layer["lam"] is None  # NaN is written as null: strict JSON


@pytest.mark.parametrize("args", [
    ["generate", "--exact", "--prompt", "hi"],
    ["ruler", "--split", "18", "--out", "r.json"],
    ["loss", "--split", "18", "--data", "shakespeare", "--out", "l.json"],
    ["bench-ttft", "--split", "18", "--out", "b.json"],
])
def test_llamacpp_without_its_build_is_one_line_naming_make_install(args, ridgefill, monkeypatch):
    """`make demo` does not build llama.cpp: a command run with --engine llamacpp on such an install (simulated: the
    llama_cpp import fails, whether or not a build is installed) is one line naming `make install`, before any model
    loads."""
    from ridgefill.backends.llamacpp import library

    without_package(monkeypatch, "llama_cpp")
    r = ridgefill(*args, "--engine", "llamacpp")
    assert r.returncode == 2 and "make install" in library.INSTALL
    assert r.stderr == f"error: llama-cpp-python is not installed: {library.INSTALL}\n"
