"""A model's identity read without its weights (runtime/models.model_identity): what a loaded model says of itself
(the info results and manifests record, the shapes the FLOP count reads, the context), for a dense and a hybrid
family, with no weight file read."""

from __future__ import annotations

import shutil

import pytest

from tiny_models import tiny_model
from ridgefill.errors import RidgefillError
from ridgefill.runtime import models
from ridgefill.runtime.models import model_identity
from ridgefill.runtime.session import open_session


def hybrid_checkpoint(root, tokenizer_from):
    folder = root / "qwen3_next"
    tiny_model("qwen3_next").save_pretrained(folder)
    for f in tokenizer_from.iterdir():
        if "token" in f.name:
            shutil.copy(f, folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_the_identity_is_what_the_loaded_model_says(family, tiny_checkpoint, tmp_path, monkeypatch):
    folder = tiny_checkpoint if family == "llama" else hybrid_checkpoint(tmp_path, tiny_checkpoint)
    session = open_session(str(folder))
    loaded = {**session.loaded.info(), "n_layers": session.runner.n_layers}

    def no_weights(*args, **kwargs):
        raise AssertionError("model_identity loaded the weights")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_weights)
    identity = model_identity(str(folder))
    assert identity.info == loaded and identity.shape == session.shape
    assert identity.context_length == session.context_length and identity.n_layers == session.runner.n_layers
    assert models.checkpoint_fingerprint(folder) == identity.info["weights_hash"]


# --- the first conversion of a built-in model, by several processes at once ---------------------------------------
RACER = """
import os, shutil, sys, time
from pathlib import Path
from ridgefill.runtime import models

role, source, sync = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
os.environ["RIDGEFILL_CACHE"] = str(sync / "cache")


def wait_for(name):
    deadline = time.time() + 120
    while not (sync / name).exists():
        assert time.time() < deadline, f"{role} waited for {name}"
        time.sleep(0.02)


def convert(gguf_dir, filename, out):  # the GGUF conversion's stand-in: a copy of the tiny checkpoint
    (sync / f"converting.{role}").touch()
    if role == "A":  # long enough for B to look for the folder meanwhile
        wait_for("asking.B")
        time.sleep(2.0)
    else:  # a second conversion (none should run) ends once A has loaded the first
        wait_for("loaded.A")
    shutil.copytree(source, out)


models.ALIASES["tiny-embedded"] = models.EmbeddedModel("json", "__init__.py", "no install")
models._convert_gguf = convert
if role == "B":
    from transformers import AutoModelForCausalLM, AutoTokenizer  # what load_model imports before it looks

    wait_for("converting.A")  # B asks while A converts: the cache has no folder yet
    (sync / "asking.B").touch()
loaded = models.load_model("tiny-embedded")
folder = Path(models.model_folder("tiny-embedded"))
inode = folder.stat().st_ino
(sync / f"loaded.{role}").touch()
wait_for("loaded.B" if role == "A" else "loaded.A")
assert folder.stat().st_ino == inode, "the folder this process loaded was replaced"
again = models.load_model("tiny-embedded")
assert again.fingerprint == loaded.fingerprint
print(role, inode, loaded.fingerprint)
"""


def test_two_processes_converting_a_builtin_model_at_once_both_load_it(tiny_checkpoint, tmp_path):
    """Two processes load a built-in model for the first time on an empty cache, the second while the first converts
    (the conversion is a stand-in that copies the tiny checkpoint: the real one takes a minute). Both load it, the
    folder either loaded is never replaced or removed (a second conversion would have ended after the first process
    loaded its folder), one conversion runs (the other process waits, then finds its folder), no temporary is left."""
    import subprocess
    import sys

    racers = [subprocess.Popen([sys.executable, "-c", RACER, role, str(tiny_checkpoint), str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in "AB"]
    results = [r.communicate(timeout=300) for r in racers]
    for racer, (out, err) in zip(racers, results):
        assert racer.returncode == 0, err[-3000:]
    (a, inode_a, hash_a), (b, inode_b, hash_b) = (out.split() for out, _ in results)
    assert inode_a == inode_b and hash_a == hash_b
    assert [p.name for p in tmp_path.glob("converting.*")] == ["converting.A"]
    models_dir = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models_dir.iterdir()) == [".tiny-embedded.lock", "tiny-embedded"]


def test_a_folder_that_appears_while_converting_is_kept_and_the_copy_discarded(tmp_path):
    """Another machine sharing the cache (which the lock does not reach) publishes the folder while this process
    builds its own: the folder there stays as it is (nobody may be reading a replacement), this copy is discarded."""
    from ridgefill.runtime.paths import publish_folder_once

    folder = tmp_path / "models" / "m"

    def build(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text("ours")
        folder.mkdir(parents=True)  # the other writer's rename, meanwhile
        (folder / "config.json").write_text("theirs")

    assert publish_folder_once(folder, build) is False
    inode = folder.stat().st_ino
    assert (folder / "config.json").read_text() == "theirs"
    assert publish_folder_once(folder, lambda tmp: pytest.fail("built over an existing folder")) is False
    assert folder.stat().st_ino == inode
    assert sorted(p.name for p in folder.parent.iterdir()) == [".m.lock", "m"]
    fresh = tmp_path / "models" / "n"
    assert publish_folder_once(fresh, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}"))) is True
    assert (fresh / "config.json").read_text() == "{}"


def test_a_cached_folder_without_a_model_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path))
    monkeypatch.setitem(models.ALIASES, "tiny-embedded", models.EmbeddedModel("json", "__init__.py", "no install"))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted over an existing folder"))
    (tmp_path / "models" / "tiny-embedded" / "partial").mkdir(parents=True)
    with pytest.raises(RidgefillError, match=r"tiny-embedded holds no converted model \(no config.json\): remove that "
                                             r"folder, and ridgefill converts tiny-embedded again$"):
        models.model_folder("tiny-embedded")
