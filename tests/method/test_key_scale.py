"""`ridgefill key-scale`: the least-squares scale of filled key norms, its maps file, and the runner using it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.commands import command
from ridgefill.torchfill import Runner, FillPlan, IdentityFiller, adapter_for
from ridgefill.method.key_scale import KeyNormSums, key_norm_sums
from ridgefill.method.maps import load_filler
from ridgefill.runtime.artifacts import load_artifact

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_scale_is_the_least_squares_scalar_per_head():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(2, 3, 50, 8, generator=g, dtype=torch.float64)  # [B, Hkv, n, D]
    filled = exact * torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).view(1, 3, 1, 1)
    filled = filled + 0.01 * torch.randn(filled.shape, generator=g, dtype=torch.float64)
    sums = KeyNormSums.empty(3, 3)
    sums.add(1, exact[:, :, :20], filled[:, :, :20])  # streamed in two parts
    sums.add(1, exact[:, :, 20:], filled[:, :, 20:])
    scale = sums.scale()
    ne, nf = exact.norm(dim=-1), filled.norm(dim=-1)  # [B, Hkv, n]
    direct = (ne * nf).sum((0, 2)) / (nf * nf).sum((0, 2))
    assert torch.allclose(scale[1], direct, rtol=1e-12)
    assert torch.allclose(scale[1], torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64), rtol=0.02)
    assert torch.equal(scale[0], torch.ones(3, dtype=torch.float64))  # nothing summed: 1
    error = sums.norm_error(scale)
    assert error[1] < sums.norm_error(torch.ones_like(scale))[1] and error[1] < 1e-3


def test_pass_counts_only_filled_rows_of_late_attention_layers():
    runner = Runner(adapter_for(tiny_model("llama")), chunk=16)
    split, ids = 2, random_ids(24)
    plan = FillPlan(IdentityFiller(split, runner.n_layers), tail=1, keep_rows=(0,))
    sums = KeyNormSums.empty(runner.n_layers - split, runner.shape.kv_heads)
    key_norm_sums(runner, plan, ids, sums)
    assert sums.rows == 22  # 24 rows less the sink and the last
    assert torch.equal(sums.filled[0], torch.zeros(runner.shape.kv_heads, dtype=torch.float64))  # layer S is exact
    assert (sums.filled[1:] > 0).all()


def copied_maps(tiny_fitted, folder):
    """(calibration text, a copy in `folder` of the maps fitted on it at split 2): conftest.tiny_fitted."""
    return tiny_fitted.text, Path(shutil.copy(tiny_fitted.maps[2], folder / "maps.safetensors"))


def test_command_writes_maps_with_a_scale_the_engine_applies(tiny_checkpoint, tiny_fitted, tmp_path):
    text, maps = copied_maps(tiny_fitted, tmp_path)
    out = tmp_path / "ks.safetensors"
    summary = command("key-scale")(model=str(tiny_checkpoint), maps=maps, data=str(text), tokens=512, seq_len=128,
                                   out=out)
    tensors, meta = load_artifact(out, "maps")
    before, _ = load_artifact(maps, "maps")
    assert set(tensors) == set(before) | {"key_scale"}
    assert all(torch.equal(tensors[k], before[k]) for k in before)  # the maps themselves are unchanged
    n_layers = meta["n_layers"]
    scale = tensors["key_scale"]
    assert scale.shape[0] == n_layers - 2 and torch.equal(scale[0], torch.ones_like(scale[0]))
    assert meta["key_scale"]["sequences"] == 4 and meta["key_scale"]["filled_rows"] == 4 * 126
    layers = summary["layers"]
    assert [r["layer"] for r in layers] == list(range(3, n_layers))
    assert all(r["norm_error_after"] <= r["norm_error_before"] + 1e-12 for r in layers)  # least squares
    assert json.loads((tmp_path / "ks.safetensors.json").read_text())["split"] == 2
    session_info = {"weights_hash": meta["model"]["weights_hash"]}
    filler, _ = load_filler(out, session_info)
    assert torch.allclose(filler.key_scale, scale)


def test_maps_refit_during_the_pass_do_not_get_the_scale_of_the_old_ones(tiny_checkpoint, tiny_fitted, tmp_path,
                                                                        monkeypatch):
    """The maps file is rewritten (refit, other weights) while the pass runs, after its first sequence: the output
    holds the maps the scale was measured on, those read at the start, and records their sha256 (the file now holds
    other bytes). The hook is the pass's progress bar (runtime.console.progress_bar, as key_scale imports it)."""
    import contextlib
    import hashlib

    import ridgefill.method.key_scale as key_scale
    from ridgefill.runtime.artifacts import save_artifact

    text, maps = copied_maps(tiny_fitted, tmp_path)
    out = tmp_path / "ks.safetensors"
    original, meta = load_artifact(maps, "maps")
    pinned = hashlib.sha256(maps.read_bytes()).hexdigest()
    real = key_scale.progress_bar

    @contextlib.contextmanager
    def refit_after_the_first_sequence(*args, **kwargs):
        with real(*args, **kwargs) as advance:
            def advanced(*a):
                advance(*a)
                if not refit:
                    refit.append(save_artifact(maps, {**original, "weight": 2 * original["weight"]}, meta))
            yield advanced

    refit = []
    monkeypatch.setattr(key_scale, "progress_bar", refit_after_the_first_sequence)
    summary = command("key-scale")(model=str(tiny_checkpoint), maps=maps, data=str(text), tokens=512, seq_len=128,
                                   out=out)
    assert refit and summary["sequences"] == 4
    assert hashlib.sha256(maps.read_bytes()).hexdigest() != pinned
    written, written_meta = load_artifact(out, "maps")
    assert torch.equal(written["weight"], original["weight"])  # the maps measured, not the refit
    assert written_meta["key_scale"]["maps_sha256"] == pinned == summary["maps_sha256"]


def test_a_scale_that_overflows_fp32_is_refused_and_nothing_is_written(tiny_checkpoint, tiny_fitted, tmp_path):
    """Maps that fill rows with a bias of 1e-42 (and no weight): finite, but the filled keys come out ~1e-39, so
    the least-squares scale is ~1e40: finite in float64, infinite as the fp32 the maps file stores. key-scale refuses
    it in one line naming the tensor and the fix; no maps, no summary is written."""
    import re

    from ridgefill.errors import RidgefillError
    from ridgefill.runtime.artifacts import save_artifact

    text, maps = copied_maps(tiny_fitted, tmp_path)
    out = tmp_path / "ks.safetensors"
    tensors, meta = load_artifact(maps, "maps")
    tiny = tmp_path / "tiny.safetensors"
    save_artifact(tiny, {**tensors, "weight": torch.zeros_like(tensors["weight"]),
                         "bias": torch.full_like(tensors["bias"], 1e-42)}, meta)
    with pytest.raises(RidgefillError, match=rf"^{re.escape(str(out))} not written: key_scale holds a NaN or an "
                                             rf"infinity as fp32: the maps {re.escape(str(tiny))} fill keys the scale "
                                             r"cannot reach in fp32: refit them \(a larger --lam\), then rerun key-scale$"):
        command("key-scale")(model=str(tiny_checkpoint), maps=tiny, data=str(text), tokens=256, seq_len=128, out=out)
    assert not out.exists() and not (tmp_path / "ks.safetensors.json").exists()
