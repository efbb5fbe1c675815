"""`ridgefill fit` on a statistics file: it reads only the split it fits, refuses split L-1 in one line, and
reports its error on the test rows (on validation rows, with a note, for a file without a test part); it refuses
statistics with a NaN or an infinity before any solve."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from tiny_models import random_ids, tiny_model
from ridgefill.torchfill import Runner, adapter_for
from ridgefill.errors import RidgefillError
from ridgefill.method.calibrate import run_calibration
from ridgefill.method.fit import COMMAND as FIT
from ridgefill.method.statistics import Calibration
from ridgefill.runtime import artifacts
from ridgefill.runtime.artifacts import load_artifact, save_artifact

META = {"model": {"id": "tiny", "weights_hash": "x"}, "data": "random", "data_hash": "abc", "tokens": 640,
        "seq_len": 32}


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    runner = Runner(adapter_for(tiny_model("llama")))
    seqs = [random_ids(32, seed=s)[0].tolist() for s in range(20)]
    path = tmp_path_factory.mktemp("fit") / "stats.safetensors"
    run_calibration(runner, seqs, [2, 3], path, META, holdout=0.25)
    return path


def test_fit_reads_only_the_split_it_fits(stats, tmp_path, monkeypatch):
    with open(stats, "rb") as f:
        at = {entry["begin"]: name for name, entry in artifacts._parse_header(f)[0].items()}
    read, real = [], artifacts._read_tensor

    def recording(f, entry):
        read.append(at[entry["begin"]])
        return real(f, entry)

    monkeypatch.setattr(artifacts, "_read_tensor", recording)
    FIT(stats=stats, out=tmp_path / "maps.safetensors", split=3)
    assert read and all(name.startswith("s3.") for name in read)
    assert any(name.startswith("s2.") for name in at.values())


def test_fit_reports_on_test_rows_and_says_so(stats, tmp_path):
    summary = FIT(stats=stats, out=tmp_path / "maps.safetensors", split=3)
    assert summary["errors_on"] == "test" and summary["lam_chosen_on"] == "validation"
    assert load_artifact(tmp_path / "maps.safetensors", "maps")[1]["errors_on"] == "test"
    assert json.loads((tmp_path / "maps.safetensors.json").read_text())["errors_on"] == "test"


def test_a_file_without_test_part_still_fits_on_validation_with_a_note(stats, tmp_path, capsys):
    tensors, meta = load_artifact(stats, "stats")
    older = tmp_path / "older.safetensors"
    save_artifact(older, {k: v for k, v in tensors.items() if ".test." not in k}, meta)
    summary = FIT(stats=older, out=tmp_path / "maps.safetensors", split=3)
    assert summary["errors_on"] == "validation" and summary["mean_error_map"] < summary["mean_error_identity"]
    assert "no test rows" in capsys.readouterr().err


def test_split_at_the_last_layer_is_one_line(tmp_path):
    path = tmp_path / "last.safetensors"
    save_artifact(path, Calibration.empty([5], 6, 64).tensors(),
                  {**META, "artifact": "stats", "splits": [5], "n_layers": 6, "hidden_size": 64})
    with pytest.raises(RidgefillError, match="split 5 leaves nothing to fit on this 6-layer model"):
        FIT(stats=path, out=tmp_path / "maps.safetensors")
    assert not (tmp_path / "maps.safetensors").exists()


def test_fit_with_normalized_targets(tmp_path):
    """calibrate --normalized-targets keeps the extra sums through save and load; fit --targets normalized
    fits to them, records it, and a file without them is refused in one line."""
    runner = Runner(adapter_for(tiny_model("llama")))
    seqs = [random_ids(32, seed=s)[0].tolist() for s in range(12)]
    path = tmp_path / "stats.safetensors"
    run_calibration(runner, seqs, [3], path, META, holdout=0.25, normalized=True)
    tensors, meta = load_artifact(path, "stats")
    assert meta["normalized_targets"] is True and "s3.train.xtyn" in tensors and "s3.test.yyn" in tensors
    raw = FIT(stats=path, out=tmp_path / "raw.safetensors")
    norm = FIT(stats=path, out=tmp_path / "norm.safetensors", targets="normalized")
    assert norm["targets"] == "normalized" and raw["targets"] == "raw"
    assert load_artifact(tmp_path / "norm.safetensors", "maps")[1]["targets"] == "normalized"
    a = load_artifact(tmp_path / "raw.safetensors", "maps")[0]["weight"]
    b = load_artifact(tmp_path / "norm.safetensors", "maps")[0]["weight"]
    assert a.shape == b.shape and not torch.allclose(a, b)
    plain = tmp_path / "plain.safetensors"
    run_calibration(runner, seqs, [3], plain, META, holdout=0.25)
    with pytest.raises(RidgefillError, match="--normalized-targets"):
        FIT(stats=plain, out=tmp_path / "x.safetensors", targets="normalized")


@pytest.mark.parametrize("rank", [None, 8])
def test_fit_with_lookback(tmp_path, rank):
    """calibrate with lookback 1 -> fit writes maps that read x and the row before it (the file says so, and the
    first position a window may hold: calibration's skip-first), at full or low rank; they load as such a filler,
    and an identity fit from the same statistics stores no lookback."""
    from ridgefill.method.maps import load_filler

    runner = Runner(adapter_for(tiny_model("llama")))
    seqs = [random_ids(32, seed=s)[0].tolist() for s in range(12)]
    path = tmp_path / "stats.safetensors"
    run_calibration(runner, seqs, [3], path, META, holdout=0.25, lookback=1)
    tensors, meta = load_artifact(path, "stats")
    assert meta["lookback"] == 1 and tensors["s3.train.xtx"].shape == (128, 128)
    summary = FIT(stats=path, out=tmp_path / "maps.safetensors", rank=rank)
    assert summary["lookback"] == 1
    maps, maps_meta = load_artifact(tmp_path / "maps.safetensors", "maps")
    assert maps_meta["lookback"] == 1 and maps_meta["lookback_start"] == 1
    assert (maps["weight"].shape == (2, 128, 64)) if rank is None else (maps["u"].shape == (2, 128, 8))
    filler, _ = load_filler(tmp_path / "maps.safetensors", {"weights_hash": "x"})
    assert filler.lookback == 1 and filler.lookback_start == 1 and filler.rank == rank
    assert FIT(stats=path, out=tmp_path / "id.safetensors", kind="identity")["lookback"] == 0


@pytest.mark.parametrize("name, value", [("s3.train.xtx", math.nan), ("s3.val.xty", math.inf),
                                         ("s3.test.yy", -math.inf), ("s3.train.xx", math.nan)])
def test_statistics_with_a_nonfinite_value_are_refused_before_any_fit(stats, tmp_path, monkeypatch, name, value):
    """One NaN or infinity in any sum of any part of the split fitted: one line naming the file, the split, the part
    and the sum, and the fix; nothing is solved or written. Another split's statistics are not concerned."""
    import ridgefill.method.fit as fit

    tensors, meta = load_artifact(stats, "stats")
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata={"ridgefill": json.dumps(meta)})  # as no ridgefill writes it (they refuse)
    assert FIT(stats=bad, out=tmp_path / "s2.safetensors", split=2)["split"] == 2
    before = sorted(tmp_path.iterdir())
    monkeypatch.setattr(fit, "fit_split", lambda *a, **k: pytest.fail("fit solved from non-finite statistics"))
    part = name.split(".")[1]
    message = rf"^{re.escape(str(bad))} holds a NaN or an infinity in split 3's {part} statistics \({re.escape(name)}\)"
    with pytest.raises(RidgefillError, match=message + ": recalibrate .* fp32$"):
        FIT(stats=bad, out=tmp_path / "maps.safetensors", split=3)
    assert sorted(tmp_path.iterdir()) == before


def test_mean_maps_hold_the_train_means_and_every_maps_file_carries_them(stats, tmp_path):
    """fit --kind mean: zero weights, each bias the train mean of its layer's input; its held-out relative error is at
    least 1 (the held-out rows' spread about the train mean is their spread about their own mean, plus the gap
    between the two means) and above the ridge map's. A ridge maps file carries the same means for the control."""
    mean = FIT(stats=stats, out=tmp_path / "mean.safetensors", split=2, kind="mean")
    ridge = FIT(stats=stats, out=tmp_path / "ridge.safetensors", split=2)
    tensors, meta = load_artifact(tmp_path / "mean.safetensors", "maps")
    assert meta["kind"] == "mean" and "weight" not in tensors
    raw, _ = load_artifact(stats, "stats", prefix="s2.")
    train_mean = (raw["s2.train.ysum"] / raw["s2.train.counts"][0]).float()  # [L-S-1, H], counts[0]: rows
    assert torch.allclose(tensors["bias"], train_mean)
    ridge_tensors, _ = load_artifact(tmp_path / "ridge.safetensors", "maps")
    assert torch.equal(ridge_tensors["mean"], tensors["bias"])
    for m, r in zip(mean["layers"], ridge["layers"]):
        assert m["error_map"] >= 1.0 - 1e-12 and m["error_map"] > r["error_map"]
        assert m["error_identity"] == pytest.approx(r["error_identity"], rel=1e-9)


def test_a_solve_that_overflows_fp32_is_refused_and_nothing_is_written(tmp_path):
    """3 training rows of width 8 and λ 1e-300: the float64 solve is finite (|W| ~1e285), its cast to fp32, the
    dtype maps are stored in, is not. fit refuses it in one line naming the file, the tensor and the fix (a larger
    --lam); no maps, no summary, no temporary is left. The same statistics fit at λ 1e-3."""
    g = torch.Generator().manual_seed(0)
    cal = Calibration.empty([2], 5, 8)
    train = cal.stats[(2, "train")]
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    train.add_x(x)
    for index in range(2):
        train.add_y(index, x, x + torch.randn(3, 8, generator=g, dtype=torch.float64))
    stats = tmp_path / "stats.safetensors"
    save_artifact(stats, cal.tensors(), {**META, "artifact": "stats", "splits": [2], "n_layers": 5, "hidden_size": 8})
    out = tmp_path / "out" / "maps.safetensors"
    with pytest.raises(RidgefillError, match=rf"^{re.escape(str(out))} not written: bias holds a NaN or an "
                                             r"infinity as fp32: refit with a larger --lam"):
        FIT(stats=stats, out=out, lam="1e-300")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.safetensors"]
    assert FIT(stats=stats, out=out, lam="1e-3")["split"] == 2
    assert bool(load_artifact(out, "maps")[0]["weight"].isfinite().all())


def test_fit_is_bit_identical_on_any_thread_count(stats, tmp_path):
    """MKL's eigh and matmuls round differently on 1 and 2 threads, and a process's thread count depends on how it was
    started (pytest-xdist's workers run one; a recipe's subprocess, the cores): the fit runs on FIT_THREADS whatever
    the process's count, which it leaves as it was (issue 50: a recipe's fit-s3 differed in the last digits)."""
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = tmp_path / f"maps-{threads}.safetensors"
            summary = FIT(stats=stats, out=out, split=2)
            assert torch.get_num_threads() == threads
            maps, _ = load_artifact(out, "maps")
            results.append((summary["layers"], {k: v.tolist() for k, v in maps.items()}))
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1]
