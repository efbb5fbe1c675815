"""A model's identity read without its weights (runtime/models.model_identity): what a loaded model says of itself
(the info results and manifests record, the shapes the FLOP count reads, the context), for a dense and a hybrid
family, with no weight file read."""

from __future__ import annotations

import shutil

import pytest

from conftest import tiny_hybrid_model
from ridgefill.runtime import models
from ridgefill.runtime.models import model_identity
from ridgefill.runtime.session import open_session


def hybrid_checkpoint(root, tokenizer_from):
    folder = root / "qwen3_next"
    tiny_hybrid_model("qwen3_next").save_pretrained(folder)
    for f in tokenizer_from.iterdir():
        if "token" in f.name:
            shutil.copy(f, folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_the_identity_is_what_the_loaded_model_says(family, tiny_checkpoint, tmp_path, monkeypatch):
    folder = tiny_checkpoint if family == "llama" else hybrid_checkpoint(tmp_path, tiny_checkpoint)
    session = open_session(str(folder))
    loaded = {**session.loaded.info(), "n_layers": session.engine.n_layers}

    def no_weights(*args, **kwargs):
        raise AssertionError("model_identity loaded the weights")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_weights)
    identity = model_identity(str(folder))
    assert identity.info == loaded and identity.shape == session.shape
    assert identity.context_length == session.context_length and identity.n_layers == session.engine.n_layers
    assert models.checkpoint_fingerprint(folder) == identity.info["weights_hash"]
