"""Maps files a filler cannot run are refused in one line wherever maps load (`load_filler`: the runner and the
vLLM plugin): a tensor with a NaN or an infinity, a tensor shaped otherwise than the file's own metadata says, or one
that is not floating point. Calibration's and fit's side are in test_calibrate.py, test_fit.py and test_ridge.py."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from ridgefill.errors import RidgefillError
from ridgefill.method.maps import load_filler, save_maps
from ridgefill.method.ridge import fit_split
from ridgefill.method.statistics import SplitStats
from ridgefill.runtime.artifacts import load_artifact

H, LAYERS, SPLIT, KV_HEADS = 8, 5, 2, 2  # two maps: layers 3 and 4
INFO = {"weights_hash": "x"}  # what the vLLM plugin knows of the model
ENGINE_INFO = {**INFO, "hidden_size": H}  # the runner also knows its width


def maps_file(path, rank=None, lookback=0):
    """Maps fitted on random statistics (rank r: low rank, u [2, F, r] and v [2, r, H]; F = (K+1)·H with lookback
    K), with a key scale [L-S, Hkv]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, (lookback + 1) * H, generator=g, dtype=torch.float64)  # [n, F]
    st = SplitStats.empty(SPLIT, LAYERS, H, lookback=lookback)
    st.add_x(x)
    for i in range(LAYERS - SPLIT - 1):
        st.add_y(i, x, x[:, :H] + 0.1 * torch.randn(200, H, generator=g, dtype=torch.float64))
    window = {"lookback": lookback, "lookback_start": 1} if lookback else {}
    save_maps(path, SPLIT, LAYERS, fit_split(st, None, lam=1e-3, rank=rank),
              {"model": {"id": "tiny", "weights_hash": "x"}, "rank": rank, **window}, "ridge",
              torch.ones(LAYERS - SPLIT, KV_HEADS))
    return path


def changed(path, name, change):
    """`path` with tensor `name` changed by `change` (on a copy), its metadata kept; written with safetensors itself,
    as no ridgefill writer would write it (they refuse a NaN or an infinity)."""
    tensors, meta = load_artifact(path, "maps")
    tensors[name] = change(tensors[name].clone())
    save_file({k: t.contiguous() for k, t in tensors.items()}, path, metadata={"ridgefill": json.dumps(meta)})
    return path


def set_first(value):
    def change(t):
        t.view(-1)[0] = value
        return t

    return change


FULL, LOW, LOOKBACK = {}, {"rank": 3}, {"lookback": 1}


@pytest.mark.parametrize("kind, name, value", [
    (FULL, "weight", math.nan), (FULL, "bias", math.inf), (FULL, "key_scale", math.nan),
    (LOW, "u", -math.inf), (LOW, "v", math.nan), (LOOKBACK, "weight", math.inf),
], ids=["weight-nan", "bias-inf", "key-scale-nan", "low-rank-u-inf", "low-rank-v-nan", "lookback-weight-inf"])
def test_maps_with_a_nonfinite_value_are_refused(tmp_path, kind, name, value):
    path = maps_file(tmp_path / "maps.safetensors", **kind)
    filler, _ = load_filler(path, INFO)
    assert filler.rank == kind.get("rank") and filler.lookback == kind.get("lookback", 0)
    changed(path, name, set_first(value))
    for info in (INFO, ENGINE_INFO):
        with pytest.raises(RidgefillError, match=rf"^{path} holds a NaN or an infinity in {name}: re.*fp32\)$"):
            load_filler(path, info)


@pytest.mark.parametrize("kind, name, change, info, message", [
    (FULL, "bias", lambda t: t[:, :-1], ENGINE_INFO, r"bias of shape \[2, 7\], not \[2, 8\]"),
    (FULL, "bias", lambda t: torch.cat([t, t[:1]]), INFO, r"bias of shape \[3, 8\], not \[2, 8\]"),
    (FULL, "bias", lambda t: t.reshape(-1), INFO, r"bias of shape \[16\], not \[2, \*\]"),
    (FULL, "weight", lambda t: t[:, :, :-1], INFO, r"weight of shape \[2, 8, 7\], not \[2, 8, 8\]"),
    (FULL, "weight", lambda t: t[:1], INFO, r"weight of shape \[1, 8, 8\], not \[2, 8, 8\]"),
    (LOOKBACK, "weight", lambda t: t[:, :H], INFO, r"weight of shape \[2, 8, 8\], not \[2, 16, 8\]"),
    (LOW, "v", lambda t: t[:, :-1], INFO, r"v of shape \[2, 2, 8\], not \[2, 3, 8\]"),
    (LOW, "u", lambda t: t[:, :, :-1], INFO, r"u of shape \[2, 8, 2\], not \[2, 8, 3\]"),
    (FULL, "key_scale", lambda t: t[:-1], INFO,
     r"key_scale of shape \[2, 2\], not \[3, \*\] .*: rerun ridgefill key-scale"),
    (FULL, "key_scale", lambda t: t.reshape(-1), INFO, r"key_scale of shape \[6\], not \[3, \*\]"),
    (FULL, "bias", lambda t: t.to(torch.int64), INFO, r"holds bias as torch.int64, not floating point: refit"),
], ids=["bias-width", "bias-maps", "bias-1d", "weight-width", "weight-maps", "lookback-weight-inputs", "low-rank-v",
        "low-rank-u", "key-scale-layers", "key-scale-1d", "bias-int"])
def test_maps_whose_tensors_do_not_fit_their_metadata_are_refused(tmp_path, kind, name, change, info, message):
    path = changed(maps_file(tmp_path / "maps.safetensors", **kind), name, change)
    with pytest.raises(RidgefillError, match=message) as refused:
        load_filler(path, info)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(str(path))


# --- writers: nothing non-finite is written (test_fit.py: fit's solve that overflows fp32) -------------------------
def test_calibrate_refuses_to_write_statistics_that_are_not_finite(tmp_path):
    """A resumed calibration whose checkpoint holds an infinity (a changed file: calibrate keeps rows that overflow
    out) would carry it into every later checkpoint and the final file: the write is refused in one line naming the
    file and the sum, and the final file is not written."""
    from tiny_models import random_ids, tiny_model
    from ridgefill.torchfill import Runner, adapter_for
    from ridgefill.method.calibrate import partial_path, run_calibration

    runner = Runner(adapter_for(tiny_model("llama")))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    out, meta = tmp_path / "stats.safetensors", {"model": {"id": "tiny", "weights_hash": "x"}, "data": "random"}

    def interrupted():
        yield from seqs[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_calibration(runner, interrupted(), [2], out, meta, holdout=0.0, checkpoint_every=1)
    partial = partial_path(out)
    tensors, saved = load_artifact(partial, "stats")
    tensors["s2.train.xx"] = torch.tensor(math.inf, dtype=torch.float64)
    save_file(tensors, partial, metadata={"ridgefill": json.dumps(saved)})
    with pytest.raises(RidgefillError, match=rf"^{partial} not written: s2.train.xx holds a NaN or an infinity as "
                                             r"float64: calibrate again from the start \(--restart\)"):
        run_calibration(runner, seqs, [2], out, meta, holdout=0.0, checkpoint_every=1, resume=True)
    assert not out.exists()


def test_the_mean_controls_maps_are_not_written_from_nonfinite_means(tmp_path):
    """The mean control served by vLLM is written from a maps file's calibration means (backends/vllm/fill.mean_maps): an
    infinity there (a changed file) is refused in one line and no mean maps are written."""
    from ridgefill.backends.vllm.fill import mean_maps

    path = tmp_path / "maps.safetensors"
    save_maps(path, SPLIT, LAYERS, [], {"model": {"id": "tiny", "weights_hash": "x"}}, "identity",
              means=torch.ones(LAYERS - SPLIT - 1, H))
    out = tmp_path / "scratch" / "mean.maps.safetensors"
    assert mean_maps(path, out) == out and load_artifact(out, "maps")[1]["kind"] == "mean"
    out.unlink()
    changed(path, "mean", set_first(math.inf))
    with pytest.raises(RidgefillError, match=rf"^{out} not written: bias holds a NaN or an infinity as fp32: refit"):
        mean_maps(path, out)
    assert not out.exists()
