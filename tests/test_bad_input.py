"""Bad input to every command, through the real console entry point (`ridgefill.cli.main`): each case must end
with exit code 2 and exactly one line on stderr, `error: ...` (no traceback), that line saying the case's own problem
in the words its `match` gives (required: a refusal for another, earlier reason fails the case), and leave nothing
behind: the --out folder holds what it held before (no result, no temporary file beside it) and the working folder
stays empty.

Cases run in-process (sys.argv patched, SystemExit caught; stderr captured at the file-descriptor level); a few
run again in a subprocess (`python -m ridgefill`) to prove the same end to end. Inputs are tiny: two tiny
checkpoints that differ only in their random init (A and B), statistics and maps calibrated and fitted once on
A (tokens 1024, seq-len 128).

A case's arguments, text files and match may name the fixtures as {A}, {B}, {stats}, {maps}, {text} (calibration
text), {docs} (long .jsonl documents), {lb} (LongBench records), {in} (the case's own input folder, holding its
files) and {out} (the folder its outputs would go to).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input_cases import CASES, END_TO_END
from bad_input_kit import BASES, COPY_OF_A, SERVE, Case, Inputs
from fixtures.longbench_fixture import build_records, write_jsonl
from helpers import run_main
from tiny_models import save_tiny_checkpoint, training_text, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def inputs(tiny_checkpoint, tmp_path_factory) -> Inputs:
    from ridgefill.commands import command

    root = tmp_path_factory.mktemp("bad-input")
    other = save_tiny_checkpoint(root / "B", seed=1)
    text = write_corpus(root / "text.txt", seed=3, lines_per_document=12)
    docs = root / "docs.jsonl"
    lines = training_text(1200, seed=5)
    documents = [" ".join(lines[i:i + 48]) for i in range(0, len(lines), 48)]
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    lb = write_jsonl(root / "lb.jsonl", build_records(documents, 4, 60))
    stats, maps = root / "stats.safetensors", root / "maps.safetensors"
    command("calibrate")(model=str(tiny_checkpoint), data=str(text), split="2,3", tokens=1024, seq_len=128,
                         holdout=0.25, out=stats)
    command("fit")(stats=stats, split=3, out=maps)
    result = root / "loss.json"
    command("loss")(model=str(tiny_checkpoint), maps=maps, data=str(docs), context=256, short=64, samples=1,
                    tail=16, out=result)
    return Inputs(tiny_checkpoint, other, stats, maps, text, docs, lb, result)


# --- running a case -----------------------------------------------------------------------------------------
def _prepare(args: list[str], files: dict, found: Inputs, tmp: Path) -> tuple[list[str], dict, Path, Path]:
    """Write a case's files; returns (its arguments, the names they use, its output folder, the working folder)."""
    folders = {"in": tmp / "in", "out": tmp / "out", "cwd": tmp / "cwd"}
    for folder in folders.values():
        folder.mkdir()
    names = {**found.names(), "in": str(folders["in"]), "out": str(folders["out"])}
    for name, content in files.items():
        path = folders["out"] / name[4:] if name.startswith("out/") else folders["in"] / name
        if content is COPY_OF_A:
            shutil.copytree(found.A, path)
            continue
        if content is None:
            path.unlink()
            continue
        if callable(content):
            content = content(found)
        if isinstance(content, str):
            content = content.format(**names).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return [a.format(**names) if a.count("{") else a for a in args], names, folders["out"], folders["cwd"]


def _named(text: str, names: dict[str, str]) -> str:
    """`text` with the names of fixtures and folders ({in}, {maps}, ...) replaced by their paths."""
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text


def _main(args: list[str], cwd: Path, monkeypatch) -> int:
    """`ridgefill ARGS` in `cwd` through the console entry point; its exit code."""
    monkeypatch.chdir(cwd)
    return run_main(args, monkeypatch)


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(folder.rglob("*"))} if folder.exists() else {}


def _check(match: str, code: int, stderr: str, out: Path, before: dict, cwd: Path) -> None:
    assert "Traceback" not in stderr, stderr
    assert code == 2, f"exit code {code}, stderr:\n{stderr}"
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not exactly one line on stderr:\n{stderr}"
    assert stderr.startswith("error: "), stderr
    assert match.lower() in stderr.lower(), f"the error does not say {match!r}: {stderr}"
    assert _listing(out) == before, f"files left in the output folder: {sorted(set(_listing(out)) - set(before))}"
    assert not any(cwd.iterdir()), f"files left in the working folder: {list(cwd.iterdir())}"


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, inputs, tmp_path, monkeypatch, capfd):
    args, names, out, cwd = _prepare(case.args, case.files, inputs, tmp_path)
    before = _listing(out)
    if case.args[0] == "serve":  # a check that let it through must not start a server
        from ridgefill.serve import serve

        monkeypatch.setattr(serve, "launch", lambda plan: pytest.fail(f"serve would start vLLM: {plan.argv}"))
    capfd.readouterr()
    code = _main(args, cwd, monkeypatch)
    _check(_named(case.match, names), code, capfd.readouterr().err, out, before, cwd)


@pytest.mark.parametrize("case", [c.param() for c in CASES if c.id in END_TO_END])
def test_bad_input_end_to_end(case, inputs, tmp_path):
    args, names, out, cwd = _prepare(case.args, case.files, inputs, tmp_path)
    before = _listing(out)
    r = subprocess.run([sys.executable, "-m", "ridgefill", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=300)
    _check(_named(case.match, names), r.returncode, r.stderr, out, before, cwd)


def test_cases_cover_every_command_and_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)
    assert set(END_TO_END) <= {c.id for c in CASES}
    commands = {c.args[0] for c in CASES}
    assert commands >= {"calibrate", "fit", "key-scale", "generate", "serve", "ruler", "loss", "splice", "longbench",
                        "bench-ttft", "convert-maps",
                        "run", "report"}


@pytest.mark.parametrize("name", list(BASES))
def test_the_cases_base_commands_run(name, inputs, tmp_path, monkeypatch, capfd):
    """Every case changes one thing of a command line that works: the error comes from that change."""
    args, _, out, cwd = _prepare(BASES[name], {}, inputs, tmp_path)
    assert _main(args, cwd, monkeypatch) == 0, capfd.readouterr().err


def test_the_serve_base_command_passes_every_check(inputs, tmp_path, monkeypatch, capfd):
    """The serve cases' command line gets as far as starting vLLM (its installation's checks pass here)."""
    from ridgefill.serve import serve
    from ridgefill.backends.vllm.config import VLLM_VERSION
    from ridgefill.backends.vllm import server as vserving

    args, _, _, cwd = _prepare(SERVE, {}, inputs, tmp_path)
    launched = []
    monkeypatch.setattr(vserving, "installed_vllm_version", lambda: VLLM_VERSION)
    monkeypatch.setattr(vserving, "plugin_installed", lambda: True)
    monkeypatch.setattr(serve, "launch", lambda plan: launched.append(plan.argv) or 0)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert _main(args, cwd, monkeypatch) == 0 and len(launched) == 1, capfd.readouterr().err


@pytest.mark.parametrize("name", ["calibrate", "fit", "loss", "bench-ttft"])
@pytest.mark.parametrize("above", ["file", "file/sub"], ids=["folder-is-a-file", "folder-under-a-file"])
def test_output_under_a_file_is_refused_before_any_work(name, above, inputs, tmp_path, monkeypatch, capfd):
    """--out in a folder that is a regular file, or that cannot be created because a folder above it is one: one
    line, exit 2, and no model is opened. No permission is involved, so it holds for root too."""
    from ridgefill.runtime.session import ModelConfig

    args, _, out, cwd = _prepare(BASES[name], {"out/file": b"x"}, inputs, tmp_path)
    target = out / above / Path(BASES[name][-1]).name
    args = args[:-1] + [str(target)]
    monkeypatch.setattr(ModelConfig, "open", lambda self, *args, **kwargs: pytest.fail("a model was opened"))
    before = _listing(out)
    capfd.readouterr()
    code = _main(args, cwd, monkeypatch)
    _check(f"--out {target} cannot be written: {out / 'file'} is a file, not a folder", code, capfd.readouterr().err,
           out, before, cwd)


@pytest.mark.parametrize("name", ["calibrate", "fit", "loss", "bench-ttft"])
def test_output_in_a_read_only_folder_is_refused_before_any_work(name, inputs, tmp_path, monkeypatch, capfd):
    """--out in a folder that cannot be written (mode 555): one line, exit 2, and no model is opened. Root may write
    in any folder, and CI runs as root: there the folder's access check answers as it does for every other user."""
    from ridgefill.runtime.session import ModelConfig

    args, _, out, cwd = _prepare(BASES[name], {}, inputs, tmp_path)
    locked = out / "locked"
    locked.mkdir()
    target = locked / Path(BASES[name][-1]).name
    args = args[:-1] + [str(target)]
    monkeypatch.setattr(ModelConfig, "open", lambda self, *args, **kwargs: pytest.fail("a model was opened"))
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (
            not mode & os.W_OK if Path(path) == locked else access(path, mode, **kwargs)))
    before = _listing(out)
    locked.chmod(0o555)
    try:
        capfd.readouterr()
        code = _main(args, cwd, monkeypatch)
        _check(f"--out {target} cannot be written: the folder {locked} is not writable", code,
               capfd.readouterr().err, out, before, cwd)
    finally:
        locked.chmod(0o755)


def test_a_case_must_name_its_own_message():
    """A case without a match, or with one too short to tell its refusal from another (an option's name), is an
    error where it is written."""
    with pytest.raises(TypeError, match="match"):
        Case("no-match", ["fit"])
    with pytest.raises(ValueError, match="too short"):
        Case("option-name", ["fit", "--rank", "0"], match="--rank")
    assert Case("own-words", ["fit", "--rank", "0"], match="--rank 0 is out of range").match
