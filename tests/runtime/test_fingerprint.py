"""The weights hash is a property of the checkpoint folder: the same however the model is loaded (--dtype,
--device), another for a checkpoint with other weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ridgefill.runtime.models import checkpoint_fingerprint, load_model


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
    from ridgefill.method.maps import save_maps
    from ridgefill.runtime.session import open_session

    maps = tmp_path / "maps.safetensors"
    model = {"id": str(tiny_checkpoint), "weights_hash": load_model(str(tiny_checkpoint), "fp32").fingerprint}
    save_maps(maps, 3, 6, [], {"model": model}, "identity")
    plan, meta = open_session(str(tiny_checkpoint), dtype).fill_plan(str(maps), None, 8)
    assert meta["split"] == 3 and plan.filler is not None
