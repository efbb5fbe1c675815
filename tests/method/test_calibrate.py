"""Calibration statistics against direct computation, row exclusion, and resume after an interruption."""

import pytest
import torch

from conftest import random_ids, tiny_model
from ridgefill.runtime.artifacts import load_artifact
from ridgefill.method.calibrate import run_calibration
from ridgefill.method.statistics import Calibration, accumulate
from ridgefill.engine import Engine, adapter_for


def direct_stats(model, seqs, split, skip_first):
    xs, ys = [], {}
    for ids in seqs:
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        xs.append(hs[split][0, skip_first:].double())
        for layer in range(split + 1, len(hs) - 1):
            ys.setdefault(layer, []).append(hs[layer][0, skip_first:].double())
    x = torch.cat(xs)
    return x, {k: torch.cat(v) for k, v in ys.items()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_statistics_match_hidden_states(family):
    model = tiny_model(family)
    engine = Engine(adapter_for(model), chunk=7)  # chunking must not change the statistics
    seqs = [random_ids(20, seed=s) for s in range(3)]
    cal = Calibration.empty([2, 4], 6, 64)
    for ids in seqs:
        accumulate(engine, cal, ids, "train", skip_first=1, outlier_factor=0)
    for split in (2, 4):
        x, ys = direct_stats(model, seqs, split, 1)
        st = cal.stats[(split, "train")]
        assert st.count == x.shape[0] == 57 and st.skipped_first == 3
        assert torch.allclose(st.xtx, x.T @ x, rtol=1e-6, atol=1e-6)
        assert torch.allclose(st.xsum, x.sum(0), atol=1e-6)
        for i, layer in enumerate(range(split + 1, 6)):
            assert torch.allclose(st.xty[i], x.T @ ys[layer], rtol=1e-6, atol=1e-6)
            assert torch.allclose(st.yy[i], (ys[layer] ** 2).sum(), rtol=1e-6)  # float32 states, float64 sums
    assert cal.stats[(2, "val")].count == 0


def test_outlier_rows_are_kept_out():
    model = tiny_model("llama")
    with torch.no_grad():  # make token 5's embedding huge: its split state becomes an outlier
        model.model.embed_tokens.weight[5] *= 1000
    engine = Engine(adapter_for(model))
    ids = random_ids(30)
    ids[0, 10] = 5
    ids[0, 1:10][ids[0, 1:10] == 5] = 6
    ids[0, 11:][ids[0, 11:] == 5] = 6
    cal = Calibration.empty([2], 6, 64)
    accumulate(engine, cal, ids, "train", skip_first=1, outlier_factor=20)
    st = cal.stats[(2, "train")]
    assert st.skipped_outliers == 1 and st.count == 28


def test_resume_after_interruption_gives_the_same_statistics(tmp_path):
    model = tiny_model("qwen2")
    engine = Engine(adapter_for(model))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    meta = {"model": {"id": "tiny", "weights_hash": "x"}, "data": "random", "tokens": 96, "seq_len": 16}
    whole = run_calibration(engine, seqs, [3], tmp_path / "whole.safetensors", meta, holdout=0.34,
                            checkpoint_every=2)

    class Stop(Exception):
        pass

    done = []

    def advance(n=1):
        done.append(n)
        if len(done) == 5:
            raise Stop

    out = tmp_path / "resumed.safetensors"
    with pytest.raises(Stop):
        run_calibration(engine, seqs, [3], out, meta, holdout=0.34, checkpoint_every=2, advance=advance)
    assert not out.exists() and (tmp_path / "resumed.safetensors.partial").exists()
    resumed = run_calibration(engine, seqs, [3], out, meta, holdout=0.34, checkpoint_every=2, resume=True)
    assert not (tmp_path / "resumed.safetensors.partial").exists()
    for key, st in whole.stats.items():
        other = resumed.stats[key]
        assert st.count == other.count
        assert torch.allclose(st.xty, other.xty, rtol=1e-12, atol=1e-9)
    assert whole.stats[(3, "val")].count > 0
    _, saved = load_artifact(out, "stats")
    assert saved["sequences_done"] == 6 and saved["splits"] == [3]
