"""The weights hash is a property of the checkpoint folder: the same however the model is loaded (--dtype,
--device) and wherever the folder is, another for a checkpoint with other weights, another config (RoPE) or another
tokenizer."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ridgefill.runtime import models
from ridgefill.runtime.models import checkpoint_fingerprint, load_model
from tiny_models import save_tiny_checkpoint


def test_the_same_checkpoint_in_fp32_and_bf16_has_one_fingerprint(tiny_checkpoint):
    fp32, bf16 = load_model(str(tiny_checkpoint), "fp32"), load_model(str(tiny_checkpoint), "bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert fp32.fingerprint == bf16.fingerprint == checkpoint_fingerprint(tiny_checkpoint)
    assert fp32.info()["weights_hash"] == fp32.fingerprint and len(fp32.fingerprint) == 16


def _with_one_weight_changed(source, target):
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(k for k in tensors if "layers.3.mlp.down_proj" in k)[0]
    tensors[name][7, 11] += 0.5  # one weight of one matrix; the file's layout (header, size) stays the same
    save_file(tensors, str(path), metadata=metadata)
    return target


def test_a_checkpoint_with_one_changed_weight_has_another(tiny_checkpoint, tmp_path):
    changed = _with_one_weight_changed(tiny_checkpoint, tmp_path / "changed")
    assert (changed / "model.safetensors").stat().st_size == (tiny_checkpoint / "model.safetensors").stat().st_size
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(tiny_checkpoint)


def test_large_files_are_sampled_in_windows(tiny_checkpoint, tmp_path):
    """Past samples x window bytes only evenly spaced windows are read: stable, and still sensitive to the
    header (here: the same tensors stored in another dtype) and to the sampled bytes."""
    small = dict(samples=8, window=64)
    assert checkpoint_fingerprint(tiny_checkpoint, **small) == checkpoint_fingerprint(tiny_checkpoint, **small)
    assert checkpoint_fingerprint(tiny_checkpoint, **small) != checkpoint_fingerprint(tiny_checkpoint)
    resaved = shutil.copytree(tiny_checkpoint, tmp_path / "bf16")
    path = resaved / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert checkpoint_fingerprint(resaved, **small) != checkpoint_fingerprint(tiny_checkpoint, **small)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_maps_fitted_in_fp32_run_under_another_dtype(tiny_checkpoint, tmp_path, dtype):
    """Issue #12 bug 3: maps are keyed to the checkpoint, not to the dtype it was loaded in."""
    from ridgefill.method.fill import FillSettings
    from ridgefill.method.maps import save_maps
    from ridgefill.runtime.session import open_session

    maps = tmp_path / "maps.safetensors"
    model = {"id": str(tiny_checkpoint), "weights_hash": load_model(str(tiny_checkpoint), "fp32").fingerprint}
    save_maps(maps, 3, 6, [], {"model": model}, "identity")
    plan, meta = FillSettings("ridge", None, maps, 8).plan(open_session(str(tiny_checkpoint), dtype))
    assert meta["split"] == 3 and plan.filler is not None


# --- issue #24 item 4: the same model means the same config, tokenizer and weights ----------------------------
SAMPLED = dict(samples=8, window=64)  # past 512 bytes of tensor data a file counts as large: windows only


def _copy(source, target):
    return shutil.copytree(source, target)


def _tensor_bytes(path, name):
    """The byte range of tensor `name` in a safetensors file, and the ranges the sampled windows read."""
    data = path.read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:start])
    begin, end = header[name]["data_offsets"]
    body = len(data) - start
    assert body > SAMPLED["samples"] * SAMPLED["window"]  # the file counts as large
    step = body // SAMPLED["samples"]
    windows = [(start + i * step, start + i * step + SAMPLED["window"]) for i in range(SAMPLED["samples"])]
    return start + begin, start + end, windows


def _add_to_float(path, at, delta=0.5):
    """Add `delta` to the float32 at byte `at` of a file, in place (its size and header stay the same)."""
    with open(path, "r+b") as f:
        f.seek(at)
        (value,) = struct.unpack("<f", f.read(4))
        f.seek(at)
        f.write(struct.pack("<f", value + delta))


def _outside(windows, at, n=4):
    return all(at + n <= a or at >= b for a, b in windows)


@pytest.mark.parametrize("family,tensor", [("llama", "model.layers.2.input_layernorm.weight"),
                                           ("qwen2", "model.layers.3.self_attn.q_proj.bias")])
def test_a_changed_norm_weight_or_bias_changes_the_fingerprint_of_a_sampled_file(tmp_path, family, tensor):
    """One value in the middle of a small tensor, in bytes no sampled window reads: still another fingerprint."""
    source = save_tiny_checkpoint(tmp_path / family, family=family)
    changed = _copy(source, tmp_path / "changed")
    path = changed / "model.safetensors"
    begin, end, windows = _tensor_bytes(path, tensor)
    at = begin + ((end - begin) // 2) // 4 * 4
    assert _outside(windows, at) and begin + 64 <= at < end - 64  # neither a sampled window nor a tensor's edge
    _add_to_float(path, at)
    assert checkpoint_fingerprint(changed, **SAMPLED) != checkpoint_fingerprint(source, **SAMPLED)
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(source)


@pytest.mark.parametrize("tensor,where", [("model.layers.1.mlp.up_proj.weight", "first"),
                                          ("model.embed_tokens.weight", "last"), ("model.norm.weight", "first"),
                                          ("model.layers.5.mlp.down_proj.weight", "last")])
def test_every_tensor_is_hashed_at_both_ends(tiny_checkpoint, tmp_path, monkeypatch, tensor, where):
    """With no tensor small enough to be hashed whole, each tensor's first and last bytes are still hashed."""
    monkeypatch.setattr(models, "SMALL_TENSOR", 0)
    changed = _copy(tiny_checkpoint, tmp_path / "changed")
    path = changed / "model.safetensors"
    begin, end, windows = _tensor_bytes(path, tensor)
    at = begin if where == "first" else end - 4
    assert _outside(windows, at)
    _add_to_float(path, at)
    assert checkpoint_fingerprint(changed, **SAMPLED) != checkpoint_fingerprint(tiny_checkpoint, **SAMPLED)


def _with_config(source, target, change):
    folder = _copy(source, target)
    config = json.loads((folder / "config.json").read_text())
    config = change(config) or config  # a change edits the config in place or returns a new one
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.mark.parametrize("change", [
    lambda c: c["rope_parameters"].update(rope_theta=500000.0),
    lambda c: c["rope_parameters"].update(factor=4.0),
    lambda c: c.update(rope_theta=1e6),
    lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    lambda c: c.update(rms_norm_eps=1e-5),
], ids=["rope-parameters-theta", "rope-parameters-factor", "rope-theta", "rope-scaling", "norm-eps"])
def test_a_config_that_changes_the_computation_is_another_model(tiny_checkpoint, tmp_path, change):
    changed = _with_config(tiny_checkpoint, tmp_path / "changed", change)
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(tiny_checkpoint)
    assert checkpoint_fingerprint(changed, **SAMPLED) != checkpoint_fingerprint(tiny_checkpoint, **SAMPLED)


@pytest.mark.parametrize("change", [
    lambda c: c.update(transformers_version="4.57.1"),
    lambda c: c.update(dtype="bfloat16"),
    lambda c: c.update(torch_dtype="float16"),
    lambda c: c.update(_name_or_path="/somewhere/else", _commit_hash="abc123"),
    lambda c: c.update(use_cache=False),
    lambda c: dict(reversed(list(c.items()))),  # another key order (and indentation)
], ids=["transformers-version", "dtype", "torch-dtype", "private-keys", "use-cache", "key-order"])
def test_config_keys_that_do_not_change_the_computation_are_left_out(tiny_checkpoint, tmp_path, change):
    same = _with_config(tiny_checkpoint, tmp_path / "same", change)
    assert checkpoint_fingerprint(same) == checkpoint_fingerprint(tiny_checkpoint)


def _tokenizer_without_last_merge(folder):
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-1]
    path.write_text(json.dumps(tok))


def _tokenizer_with_other_eos(folder):
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<unk>"}))


def _tokenizer_with_special_tokens_map(folder):
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<unk>"}))


@pytest.mark.parametrize("change", [_tokenizer_without_last_merge, _tokenizer_with_other_eos,
                                    _tokenizer_with_special_tokens_map], ids=["merges", "eos-token", "special-map"])
def test_another_tokenizer_is_another_model(tiny_checkpoint, tmp_path, change):
    changed = _copy(tiny_checkpoint, tmp_path / "changed")
    change(changed)
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(tiny_checkpoint)


def test_generation_settings_are_not_the_model(tiny_checkpoint, tmp_path):
    same = _copy(tiny_checkpoint, tmp_path / "same")
    (same / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7}))
    assert checkpoint_fingerprint(same) == checkpoint_fingerprint(tiny_checkpoint)


def test_a_folder_without_tokenizer_files_has_a_fingerprint(tiny_checkpoint, tmp_path):
    bare = _copy(tiny_checkpoint, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    fingerprint = checkpoint_fingerprint(bare)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert fingerprint != checkpoint_fingerprint(tiny_checkpoint)


def test_a_copy_in_another_folder_is_the_same_model(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path / "elsewhere" / "another-name")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(tiny_checkpoint)
    assert checkpoint_fingerprint(copy, **SAMPLED) == checkpoint_fingerprint(tiny_checkpoint, **SAMPLED)
