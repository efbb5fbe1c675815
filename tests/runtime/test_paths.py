"""runtime/paths.py: atomic writes that are on disk when they exist, the temporaries a killed writer leaves removed
by the next write of the same output (never a running writer's), and the one check of an output path that every
command writing a file runs before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ridgefill.commands import command, option
from ridgefill.errors import RidgefillError
from ridgefill.runtime import paths
from ridgefill.runtime.artifacts import save_artifact
from ridgefill.runtime.paths import atomic_path, check_output, remove_stale_temporaries, write_json

HOST = paths._writer().split("@", 1)[1]


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- fsync ----------------------------------------------------------------------------------------------------
@pytest.fixture
def synced(monkeypatch) -> list[int]:
    """The inodes os.fsync is called on."""
    inodes, real = [], os.fsync

    def fsync(fd):
        inodes.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return inodes


def test_json_is_fsynced_before_the_rename_and_its_folder_after(tmp_path, synced):
    out = tmp_path / "result.json"
    write_json(out, {"a": 1.5})
    assert json.loads(out.read_text()) == {"a": 1.5}
    assert out.stat().st_ino in synced  # the file's own bytes (a rename keeps the inode)
    assert tmp_path.stat().st_ino in synced  # the folder that holds the rename
    assert synced.index(out.stat().st_ino) < synced.index(tmp_path.stat().st_ino)


def test_a_written_folder_has_every_file_fsynced(tmp_path, synced):
    out = tmp_path / "model"
    with atomic_path(out) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        (tmp / "sub" / "weights.bin").write_bytes(b"0" * 64)
    assert {(out / "config.json").stat().st_ino, (out / "sub" / "weights.bin").stat().st_ino} <= set(synced)


def test_safetensors_are_written_through_the_same_path(tmp_path, synced):
    out = tmp_path / "maps.safetensors"
    save_artifact(out, {"w": torch.ones(2, 2)}, {"kind": "maps"})
    assert out.stat().st_ino in synced and tmp_path.stat().st_ino in synced
    assert temporaries(tmp_path) == []


def test_a_failed_block_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "result.json"
    write_json(out, {"old": True})
    with pytest.raises(RuntimeError), atomic_path(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert json.loads(out.read_text()) == {"old": True} and temporaries(tmp_path) == []


# --- stale temporaries ----------------------------------------------------------------------------------------
def dead_pid() -> int:
    """The id of a process that has finished (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def temporary(out: Path, tag: str, age_s: float = 0.0, content: str | None = None) -> Path:
    """A temporary folder as atomic_path leaves one beside `out`: `.<name>.<tag>` holding `out`'s name."""
    folder = out.parent / f".{out.name}.{tag}"
    folder.mkdir()
    inner = folder / (content or out.name)
    inner.write_text("half-written")
    if age_s:
        then = time.time() - age_s
        for p in (inner, folder):
            os.utime(p, (then, then))
    return folder


def test_next_write_removes_a_dead_writers_temporary_and_keeps_a_live_ones(tmp_path):
    out = tmp_path / "stats.safetensors"
    dead = temporary(out, f"{dead_pid()}@{HOST}.abcd1234")
    live = temporary(out, f"{os.getpid()}@{HOST}.live_123")
    write_json(out, {"done": True})
    assert not dead.exists() and live.exists()
    assert temporaries(tmp_path) == [live.name]


def test_unknown_writers_temporaries_go_only_when_old(tmp_path):
    """Another machine's (its pids mean nothing here) or an unnamed one (written before temporaries named their
    writer): removed once unchanged for STALE_AFTER_S, kept while recent."""
    out = tmp_path / "loss.json"
    old = paths.STALE_AFTER_S + 60
    gone = [temporary(out, f"{dead_pid()}@another-host.aaaaaaaa", age_s=old), temporary(out, "bbbbbbbb", age_s=old)]
    kept = [temporary(out, f"{dead_pid()}@another-host.cccccccc"), temporary(out, "dddddddd")]
    write_json(out, [1])
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)


def test_only_this_outputs_temporaries_are_touched(tmp_path):
    """A dead writer's temporary of another output, a folder that holds other files, and names atomic_path never
    makes all stay."""
    out = tmp_path / "a.json"
    pid = dead_pid()
    kept = [temporary(tmp_path / "a.json.json", f"{pid}@{HOST}.aaaaaaaa"),  # the summary beside another output
            temporary(tmp_path / "b.json", f"{pid}@{HOST}.bbbbbbbb"),
            temporary(out, f"{pid}@{HOST}.cccccccc", content="notes.txt"),  # not the output's own name inside
            temporary(out, "user-notes", age_s=paths.STALE_AFTER_S * 10)]
    (tmp_path / f".a.json.{pid}@{HOST}.dddddddd").write_text("a file, not a folder")
    write_json(out, {})
    assert all(p.exists() for p in kept) and (tmp_path / f".a.json.{pid}@{HOST}.dddddddd").exists()
    assert remove_stale_temporaries(out) == []


KILLED = textwrap.dedent("""
    import os, sys
    from ridgefill.runtime.paths import atomic_path
    with atomic_path(sys.argv[1]) as tmp:
        tmp.write_bytes(b"x" * 4096)
        os._exit(9)  # killed mid-write: no cleanup runs
""")

WAITING = textwrap.dedent("""
    import sys
    from ridgefill.runtime.paths import atomic_path
    with atomic_path(sys.argv[1]) as tmp:
        tmp.write_text("live")
        print("writing", flush=True)
        sys.stdin.readline()  # still writing until told to finish
""")


def test_a_killed_writers_temporary_is_cleaned_while_a_running_writer_finishes(tmp_path):
    out = tmp_path / "stats.safetensors"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(out)])
    assert killed.returncode == 9 and len(temporaries(tmp_path)) == 1 and not out.exists()
    (left,) = temporaries(tmp_path)
    assert left.startswith(".stats.safetensors.") and f"@{HOST}." in left  # named by its writer

    running = subprocess.Popen([sys.executable, "-c", WAITING, str(out)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert running.stdout.readline().strip() == "writing"
        (live,) = [name for name in temporaries(tmp_path) if name.startswith(f".stats.safetensors.{running.pid}@")]
        write_json(out, {"another": "writer"})  # a write of the same output meanwhile
        assert temporaries(tmp_path) == [live]  # the killed writer's is gone, the running one's kept
    finally:
        running.communicate("\n", timeout=60)
    assert running.returncode == 0 and out.read_text() == "live" and temporaries(tmp_path) == []


# --- the output check -----------------------------------------------------------------------------------------
@dataclass
class Toy:
    stats: Path | None = None
    data: str = "wiki-leads"
    out: Path | None = None
    config_out: Path | None = None


def refusal(config, *args, **kwargs) -> str:
    with pytest.raises(RidgefillError) as info:
        check_output(config, *args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_an_output_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "maps.safetensors").mkdir()
    assert "--out" in refusal(Toy(out=tmp_path / "maps.safetensors")) and "existing folder" in refusal(
        Toy(out=tmp_path / "maps.safetensors"))
    (tmp_path / "ok.safetensors.json").mkdir()  # the summary written beside it
    message = refusal(Toy(out=tmp_path / "ok.safetensors"), beside=(".json",))
    assert "ok.safetensors.json" in message and "existing folder" in message
    check_output(Toy(out=tmp_path / "ok.safetensors"))  # without the summary: nothing in the way


def test_an_output_under_a_file_or_in_a_folder_it_cannot_write_is_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    assert "is a file" in refusal(Toy(out=tmp_path / "f" / "out.json"))
    assert "is a file" in refusal(Toy(out=tmp_path / "f" / "deeper" / "out.json"))
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    assert "not writable" in refusal(Toy(out=locked / "out.json"))
    check_output(Toy(out=tmp_path / "new" / "folders" / "out.json"))  # made when written


def test_an_output_that_is_an_input_is_refused(tmp_path):
    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(b"statistics")
    assert "--stats" in refusal(Toy(stats=stats, out=stats))
    (tmp_path / "link").symlink_to(stats)
    assert "--stats" in refusal(Toy(stats=tmp_path / "link", out=stats))  # the same file by another name
    data = tmp_path / "docs.jsonl"
    data.write_text("{}\n")
    assert "--data" in refusal(Toy(data=str(data), out=data))
    (tmp_path / "x.json").write_text("{}")
    assert "--stats" in refusal(Toy(stats=tmp_path / "x.json", out=tmp_path / "x"), beside=(".json",))
    assert "--config-out" in refusal(Toy(stats=data, config_out=data), "config_out")
    check_output(Toy(stats=stats, out=tmp_path / "maps.safetensors"))
    check_output(Toy(config_out=None))  # no output given: its default goes elsewhere


@dataclass
class ToyWithFolders:
    model: str = "smollm2-135m"
    data: str = "wiki-leads"
    out_dir: Path | None = None
    store: Path | None = option(None, "a folder the command writes results into", role="store")
    out: Path | None = None
    config_out: Path | None = None


def test_an_output_inside_an_input_folder_is_refused(tmp_path):
    """Outputs must not land on any input, files inside an input folder included (`calibrate --model ./m --out
    ./m/model.safetensors` would replace the checkpoint's weights): the model folder, a data folder, at any depth,
    by a link too; the folders a command writes (out_dir, a store) are no inputs."""
    model, corpus = tmp_path / "m", tmp_path / "corpus"
    (model / "sub").mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    corpus.mkdir()
    for out in (model / "model.safetensors", model / "new.safetensors", model / "sub" / "deeper" / "x.json"):
        assert refusal(ToyWithFolders(model=str(model), out=out)) == (
            f"--out {out} is inside the folder --model reads ({model}): writing there would change that input: choose "
            "another --out, outside it")
    assert "inside the folder --model reads" in refusal(ToyWithFolders(model=str(model), out=tmp_path / "o"),
                                                        beside=("/../m/o.json",))
    (tmp_path / "link").symlink_to(model)
    assert "--model reads" in refusal(ToyWithFolders(model=str(model), out=tmp_path / "link" / "o.safetensors"))
    assert "--data reads" in refusal(ToyWithFolders(data=str(corpus), out=corpus / "stats.safetensors"))
    assert "--config-out" in refusal(ToyWithFolders(data=str(corpus), config_out=corpus / "s.json"), "config_out")
    runs = tmp_path / "runs"
    runs.mkdir()
    check_output(ToyWithFolders(model=str(model), data=str(corpus), out_dir=runs, config_out=runs / "s.json"),
                 "config_out")
    check_output(ToyWithFolders(model=str(model), store=runs, out=runs / "r.json"))
    check_output(ToyWithFolders(model=str(model), data=str(corpus), out=tmp_path / "m2" / "stats.safetensors"))


IN_MODEL_FOLDER = [("calibrate", dict(data="wiki-leads", split="2")), ("key-scale", dict(data="wiki-leads")),
                   ("ruler", dict(split=2)), ("loss", dict(data="shakespeare", split=2))]


@pytest.mark.parametrize("name,values", [pytest.param(*w, id=w[0]) for w in IN_MODEL_FOLDER])
def test_no_command_writes_into_its_model_folder(name, values, tiny_checkpoint, tmp_path):
    """calibrate, key-scale and the evals refuse an --out in their --model's folder (its weights file included)
    before any work; the same file beside the folder is taken."""
    if name == "key-scale":
        values = {**values, "maps": tmp_path / "maps.safetensors"}
        values["maps"].write_bytes(b"maps")
    for out in (tiny_checkpoint / "model.safetensors", tiny_checkpoint / "result.json"):
        with pytest.raises(RidgefillError, match=rf"^--out {out} is (the file|inside the folder) --model reads"):
            command(name).make(model=str(tiny_checkpoint), **values, out=out).check()
    command(name).make(model=str(tiny_checkpoint), **values, out=tmp_path / "result.json").check()


def test_fit_and_calibrate_refuse_an_output_in_their_data_or_onto_their_statistics(tmp_path):
    """calibrate --data <folder> with --out in that folder is refused; fit's summary (<out>.json) onto --stats too."""
    corpus, stats = tmp_path / "corpus", tmp_path / "stats.safetensors"
    corpus.mkdir()
    stats.write_bytes(b"statistics")
    with pytest.raises(RidgefillError, match=r"inside the folder --data reads"):
        command("calibrate").make(data=str(corpus), split="2", out=corpus / "stats.safetensors").check()
    summary_on_stats = tmp_path / "maps.json"
    summary_on_stats.write_bytes(b"statistics")
    with pytest.raises(RidgefillError, match=r"maps.json \(written beside it\) is the file --stats reads"):
        command("fit").make(stats=summary_on_stats, out=tmp_path / "maps").check()
    command("fit").make(stats=stats, out=tmp_path / "maps.safetensors").check()


def test_calibrate_may_resume_from_its_own_checkpoint(tmp_path):
    """--resume reads and rewrites <out>.partial by design: it is no option, so nothing refuses it."""
    out = tmp_path / "stats.safetensors"
    Path(f"{out}.partial").write_bytes(b"checkpoint")
    command("calibrate").make(data="wiki-leads", split="2", out=out, resume=True).check()
    Path(f"{out}.partial").unlink()
    Path(f"{out}.partial").mkdir()
    with pytest.raises(RidgefillError, match="partial"):
        command("calibrate").make(data="wiki-leads", split="2", out=out).check()


WRITERS = [("calibrate", dict(data="wiki-leads", split="2"), "data"), ("fit", dict(), "stats"),
           ("key-scale", dict(data="wiki-leads"), "maps"), ("ruler", dict(split=2), "maps"),
           ("loss", dict(data="shakespeare", split=2), "maps"), ("splice", dict(data="shakespeare", split=2), "maps"),
           ("longbench", dict(split=2), "data"), ("bench-ttft", dict(split=2), "maps")]


@pytest.mark.parametrize("name,values,input_option", [pytest.param(*w, id=w[0]) for w in WRITERS])
def test_every_command_that_writes_checks_its_output_before_any_work(name, values, input_option, tmp_path):
    """Each command's check() (which loads no model) refuses a folder --out and an --out that is one of its
    inputs, and takes a new file."""
    source = tmp_path / "input.jsonl"
    source.write_bytes(b"an input")
    given = {**values, input_option: source if input_option in ("stats", "maps") else str(source)}
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(RidgefillError, match="existing folder"):
        command(name).make(**given, out=folder).check()
    with pytest.raises(RidgefillError, match=f"--{input_option} reads"):
        command(name).make(**given, out=source).check()
    command(name).make(**given, out=tmp_path / "result").check()


def test_tune_checks_its_config_out(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("some text")
    with pytest.raises(RidgefillError, match="--config-out .* --data"):
        command("tune").make(data=str(data), config_out=data).check()
    with pytest.raises(RidgefillError, match="existing folder"):
        command("tune").make(config_out=tmp_path).check()
    command("tune").make().check()


@pytest.mark.parametrize("command", [["loss", "--data", "shakespeare"], ["bench-serve", "--split", "3"]])
@pytest.mark.parametrize("converted", [True, False])
def test_an_output_inside_the_folder_of_a_model_alias_is_refused(command, converted, tmp_path, monkeypatch, capfd):
    """--model smollm2-135m names its cache folder by alias: an output inside that folder (converted already, or to
    be made by the conversion) is refused like one inside any input folder, in one line, nothing written."""
    from ridgefill import cli

    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    if converted:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    out = folder / "result.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ridgefill", *command, "--model", "smollm2-135m", "--out", str(out)])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2 and capfd.readouterr().err == (
        f"error: --out {out} is inside the folder --model reads ({folder}): writing there would change that input: "
        "choose another --out, outside it\n")
    assert (list(folder.iterdir()) == [folder / "config.json"]) if converted else not folder.exists()
