"""Calibration statistics against direct computation, row exclusion (per sequence, also when chunked), held-out
parts, checkpoints, resume after an interruption (checked by content, never clobbered), the device the
statistics live on, and rows with a NaN or an infinity (kept out and counted)."""

import json
import math

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.errors import RidgefillError
from ridgefill.runtime.artifacts import load_artifact, save_artifact
from ridgefill.method.calibrate import Checkpoints, part_of, partial_path, run_calibration, start_calibration
from ridgefill.method.statistics import COUNTS, Calibration, accumulate, check_fittable, sum_of_squares
from ridgefill.torchfill import Runner, adapter_for


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
    runner = Runner(adapter_for(model), chunk=7)  # chunking must not change the statistics
    seqs = [random_ids(20, seed=s) for s in range(3)]
    cal = Calibration.empty([2, 4], 6, 64)
    for ids in seqs:
        accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=0)
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


def direct_lookback_inputs(model, seqs, split, skip_first, k):
    """[x_t, x_{t-1}, .., x_{t-k}] of every row whose window stays past the sinks, and each later layer's inputs."""
    fs, ys = [], {}
    for ids in seqs:
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        x, first = hs[split][0].double(), skip_first + k
        fs.append(torch.cat([x[first - j : x.shape[0] - j] for j in range(k + 1)], -1))
        for layer in range(split + 1, len(hs) - 1):
            ys.setdefault(layer, []).append(hs[layer][0, first:].double())
    return torch.cat(fs), {k: torch.cat(v) for k, v in ys.items()}


@pytest.mark.parametrize("chunk", [7, 64])
def test_lookback_statistics_match_hidden_states(chunk):
    """With lookback 2 the maps' inputs are x_t and the two rows before it, also across chunks; the two rows
    after the sink are kept out (their window holds it) and counted with it; Σ‖x‖² stays that of x_t."""
    model = tiny_model("qwen2")
    runner = Runner(adapter_for(model), chunk=chunk)
    seqs = [random_ids(20, seed=s) for s in range(3)]
    cal = Calibration.empty([2], 6, 64, lookback=2)
    for ids in seqs:
        accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=0)
    f, ys = direct_lookback_inputs(model, seqs, 2, 1, 2)
    st = cal.stats[(2, "train")]
    assert st.lookback == 2 and st.xtx.shape == (192, 192) and st.xty.shape == (3, 192, 64)
    assert st.count == f.shape[0] == 3 * 17 and st.skipped_first == 3 * 3
    assert torch.allclose(st.xtx, f.T @ f, rtol=1e-6, atol=1e-6)
    assert torch.allclose(st.xsum, f.sum(0), atol=1e-6)
    assert torch.allclose(st.xx, (f[:, :64] ** 2).sum(), rtol=1e-6)
    for i, layer in enumerate(range(3, 6)):
        assert torch.allclose(st.xty[i], f.T @ ys[layer], rtol=1e-6, atol=1e-6)


def test_rows_whose_window_holds_an_outlier_are_kept_out():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] *= 1000
    ids = random_ids(30)
    ids[ids == 5] = 6
    ids[0, 10] = 5
    cal = Calibration.empty([2], 6, 64, lookback=2)
    accumulate(Runner(adapter_for(model)), cal, ids, "train", skip_first=1, outlier_factor=20)
    st = cal.stats[(2, "train")]
    assert st.skipped_first == 3 and st.skipped_outliers == 3 and st.count == 30 - 6  # rows 0-2; 10-12


def test_outlier_rows_are_kept_out():
    model = tiny_model("llama")
    with torch.no_grad():  # make token 5's embedding huge: its split state becomes an outlier
        model.model.embed_tokens.weight[5] *= 1000
    runner = Runner(adapter_for(model))
    ids = random_ids(30)
    ids[0, 10] = 5
    ids[0, 1:10][ids[0, 1:10] == 5] = 6
    ids[0, 11:][ids[0, 11:] == 5] = 6
    cal = Calibration.empty([2], 6, 64)
    accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=20)
    st = cal.stats[(2, "train")]
    assert st.skipped_outliers == 1 and st.count == 28


def test_resume_after_interruption_gives_the_same_statistics(tmp_path):
    model = tiny_model("qwen2")
    runner = Runner(adapter_for(model))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    meta = {"model": {"id": "tiny", "weights_hash": "x"}, "data": "random", "tokens": 96, "seq_len": 16}
    whole = run_calibration(runner, seqs, [3], tmp_path / "whole.safetensors", meta, holdout=0.34,
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
        run_calibration(runner, seqs, [3], out, meta, holdout=0.34, checkpoint_every=2, advance=advance)
    assert not out.exists() and (tmp_path / "resumed.safetensors.partial").exists()
    resumed = run_calibration(runner, seqs, [3], out, meta, holdout=0.34, checkpoint_every=2, resume=True)
    assert not (tmp_path / "resumed.safetensors.partial").exists()
    for key, st in whole.stats.items():
        other = resumed.stats[key]
        assert st.count == other.count
        assert torch.allclose(st.xty, other.xty, rtol=1e-12, atol=1e-9)
    assert whole.stats[(3, "val")].count > 0
    _, saved = load_artifact(out, "stats")
    assert saved["sequences_done"] == 6 and saved["splits"] == [3]


def count_chunks(runner, monkeypatch) -> list[int]:
    """Rows of each chunk the runner's prefills run (one entry per chunk: the observer's layer-0 calls)."""
    chunks, prefill = [], runner.prefill

    def counting(ids, *args, observe=None, **kwargs):
        def observed(layer, h, positions):
            if layer == 0:
                chunks.append(positions.numel())
            observe(layer, h, positions)

        return prefill(ids, *args, observe=observed if observe else None, **kwargs)

    monkeypatch.setattr(runner, "prefill", counting)
    return chunks


def test_chunked_statistics_take_the_outlier_median_over_the_whole_sequence(monkeypatch):
    """--chunk is honoured (the prefill runs in several chunks) and the statistics equal the unchunked run's,
    with the outlier rule on a per-sequence median: rows 1..5 are outliers of the sequence, though they are most
    of the first chunk (a median per chunk would keep them)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] *= 1000
    ids = random_ids(30)
    ids[ids == 5] = 6
    ids[0, 1:6] = 5
    whole, chunked = Calibration.empty([2], 6, 64), Calibration.empty([2], 6, 64)
    accumulate(Runner(adapter_for(model)), whole, ids, "train", skip_first=1, outlier_factor=20)
    runner = Runner(adapter_for(model), chunk=8)
    chunks = count_chunks(runner, monkeypatch)
    accumulate(runner, chunked, ids, "train", skip_first=1, outlier_factor=20)
    assert chunks == [8, 8, 8, 6] * 2  # a norms-only pass, then the accumulating pass, each in 4 chunks
    a, b = whole.stats[(2, "train")], chunked.stats[(2, "train")]
    assert a.skipped_outliers == b.skipped_outliers == 5 and a.count == b.count == 24
    for name in ("xtx", "xsum", "xty", "ysum", "yy", "xx"):
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-6, atol=1e-6), name


def test_chunked_without_outlier_rule_runs_once(monkeypatch):
    runner = Runner(adapter_for(tiny_model("qwen2")), chunk=8)
    chunks = count_chunks(runner, monkeypatch)
    accumulate(runner, Calibration.empty([2], 6, 64), random_ids(20), "train", outlier_factor=0)
    assert chunks == [8, 8, 4]


def test_heldout_sequences_alternate_between_validation_and_test():
    assert [part_of(i, 3) for i in range(12)] == ["train", "train", "val", "train", "train", "test"] * 2
    assert {part_of(i, 0) for i in range(10)} == {"train"}


def test_checkpoints_follow_the_sequence_and_time_rules():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    by_count = Checkpoints(every=4, done=2, clock=clock)
    assert not by_count.due(5) and by_count.due(6)
    by_time = Checkpoints(seconds=600, clock=clock)
    now[0] = 599.0
    assert not by_time.due(100)
    now[0] = 600.0
    assert by_time.due(1)
    by_time.mark(1)
    assert not by_time.due(2) and not Checkpoints(clock=clock).due(10**6)  # both rules off: only the final write


def test_last_layer_split_is_refused():
    check_fittable([1, 4], 6)
    with pytest.raises(RidgefillError, match="split 5 leaves nothing to fit on this 6-layer model"):
        check_fittable([2, 5], 6)


RUN = {"model": {"id": "tiny", "weights_hash": "x"}, "data": "random", "data_hash": "abc", "tokens": 96,
       "seq_len": 16}


def interrupted(runner, seqs, out, stop_after, meta=RUN, **kwargs):
    """Run a calibration that is interrupted after `stop_after` sequences (its partial file stays)."""

    class Stop(Exception):
        pass

    done = []

    def advance(n=1):
        done.append(n)
        if len(done) == stop_after:
            raise Stop

    with pytest.raises(Stop):
        run_calibration(runner, seqs, [3], out, meta, holdout=0.34, checkpoint_every=2, advance=advance, **kwargs)
    return partial_path(out)


def test_a_plain_rerun_does_not_clobber_the_partial_file(tmp_path):
    runner = Runner(adapter_for(tiny_model("qwen2")))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    whole = run_calibration(runner, seqs, [3], tmp_path / "whole.safetensors", RUN, holdout=0.34)
    out = tmp_path / "stats.safetensors"
    partial = interrupted(runner, seqs, out, 5)
    before = partial.read_bytes()
    with pytest.raises(RidgefillError, match="pass --resume to continue it or --restart to start over"):
        run_calibration(runner, seqs, [3], out, RUN, holdout=0.34, checkpoint_every=2)
    assert partial.read_bytes() == before
    restarted = run_calibration(runner, seqs, [3], out, RUN, holdout=0.34, checkpoint_every=2, restart=True)
    assert not partial.exists()
    for key, st in whole.stats.items():
        assert torch.equal(st.xty, restarted.stats[key].xty) and st.count == restarted.stats[key].count


def test_resume_checks_the_data_by_content_not_by_name(tmp_path):
    runner = Runner(adapter_for(tiny_model("qwen2")))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    out = tmp_path / "stats.safetensors"
    interrupted(runner, seqs, out, 5)
    with pytest.raises(RidgefillError, match=r"other settings \(data_hash 'abc', now 'abd'\): pass --restart"):
        run_calibration(runner, seqs, [3], out, {**RUN, "data_hash": "abd"}, holdout=0.34, resume=True)
    renamed = run_calibration(runner, seqs, [3], out, {**RUN, "data": "renamed.txt"}, holdout=0.34, resume=True)
    assert renamed.sequences_done == 6 and load_artifact(out, "stats")[1]["data"] == "renamed.txt"


class MetaRunner:
    """Just what start_calibration reads of a runner, on the 'meta' device (no data: only placement)."""

    n_layers, device = 6, torch.device("meta")

    class shape:
        hidden = 64


def test_statistics_live_on_the_model_device_also_after_resume(tmp_path):
    """Accumulated where the model runs (a CUDA model's rows are added to CUDA statistics): checked here with
    the 'meta' device, for fresh statistics and for a partial file loaded back."""
    partial = tmp_path / "stats.safetensors.partial"
    meta = {**RUN, "artifact": "stats", "splits": [3]}
    fresh = start_calibration(MetaRunner(), [3], partial, meta)
    assert {t.device.type for t in fresh.tensors().values() if t.is_floating_point()} == {"meta"}
    saved = Calibration.empty([3], 6, 64)
    saved.stats[(3, "train")].xsum += 1
    save_artifact(partial, saved.tensors(), {**meta, "sequences_done": 4, "tokens_done": 64})
    resumed = start_calibration(MetaRunner(), [3], partial, meta, resume=True)
    assert resumed.sequences_done == 4
    assert {t.device.type for t in resumed.tensors().values() if t.is_floating_point()} == {"meta"}


# --- rows with a NaN or an infinity (fp16 overflow) -------------------------------------------------------------
def poisoning(prefill, values: dict[tuple[int, int], float]):
    """`prefill` (a runner's, bound or not) whose observers see values[(layer, position)] in one element of that
    row's input of that layer, as an overflow would leave it; the model itself runs on its own values."""

    def poisoned(observe):
        def observed(layer, h, positions):
            h = h.clone()
            for (at, position), value in values.items():
                rows = (positions == position).nonzero()
                if at == layer and len(rows):
                    h[:, int(rows[0, 0]), 3] = value
            observe(layer, h, positions)

        return observed

    def patched(*args, observe=None, **kwargs):
        return prefill(*args, observe=None if observe is None else poisoned(observe), **kwargs)

    return patched


def rows_except(seqs, first: int, n: int, dropped) -> torch.Tensor:
    """[len(seqs) * (n - first)] bool: the rows first..n-1 of every sequence, but those at positions `dropped`."""
    return torch.tensor([p not in dropped for _ in seqs for p in range(first, n)])


@pytest.mark.parametrize("chunk", [7, 64])
def test_rows_with_a_nonfinite_value_are_kept_out_and_counted(chunk, monkeypatch):
    """A NaN in row 7's split state (layer 2), +Inf in row 12's input of layer 4 (a late input of split 2, the split
    state of split 4) and -Inf in row 15's input of layer 5 (the last): each split's statistics are those of its
    other rows alone, and the rows left out are counted as non-finite, also when the rows go on in later chunks."""
    model = tiny_model("llama")
    runner = Runner(adapter_for(model), chunk=chunk)
    monkeypatch.setattr(runner, "prefill", poisoning(runner.prefill, {(2, 7): math.nan, (4, 12): math.inf,
                                                                      (5, 15): -math.inf}))
    seqs = [random_ids(20, seed=s) for s in range(2)]
    cal = Calibration.empty([2, 4], 6, 64)
    for ids in seqs:
        accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=20)
    for split, dropped in ((2, (7, 12, 15)), (4, (12, 15))):
        x, ys = direct_stats(model, seqs, split, 1)
        clean = rows_except(seqs, 1, 20, dropped)
        x = x[clean]
        st = cal.stats[(split, "train")]
        assert st.skipped_nonfinite == 2 * len(dropped) and st.skipped_outliers == 0 and st.skipped_first == 2
        assert st.count == x.shape[0] == 2 * (19 - len(dropped))
        assert torch.allclose(st.xtx, x.T @ x, rtol=1e-6, atol=1e-6) and torch.allclose(st.xsum, x.sum(0), atol=1e-6)
        assert torch.allclose(st.xx, (x * x).sum(), rtol=1e-6)
        for i, layer in enumerate(range(split + 1, 6)):
            y = ys[layer][clean]
            assert torch.allclose(st.xty[i], x.T @ y, rtol=1e-6, atol=1e-6)
            assert torch.allclose(st.ysum[i], y.sum(0), atol=1e-6) and torch.allclose(st.yy[i], (y * y).sum())


@pytest.mark.parametrize("chunk", [7, 64])
def test_the_outlier_median_is_taken_over_the_finite_rows(chunk, monkeypatch):
    """12 of the 19 rows past the sink have an infinite split state and one row is an outlier: the median of all
    norms would be infinite (a NaN would make it NaN) and let the outlier through; over the finite rows it does not."""
    model = tiny_model("llama")
    with torch.no_grad():  # token 5's split state becomes an outlier
        model.model.embed_tokens.weight[5] *= 1000
    ids = random_ids(20)
    ids[ids == 5] = 6
    ids[0, 17] = 5
    runner = Runner(adapter_for(model), chunk=chunk)
    poison = {(2, p): (math.inf if p % 2 else math.nan) for p in range(1, 13)}
    monkeypatch.setattr(runner, "prefill", poisoning(runner.prefill, poison))
    cal = Calibration.empty([2], 6, 64)
    accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=20)
    st = cal.stats[(2, "train")]
    assert st.skipped_nonfinite == 12 and st.skipped_outliers == 1 and st.count == 6
    assert st.nonfinite() is None


@pytest.mark.parametrize("chunk", [7, 64])
def test_rows_whose_window_holds_a_nonfinite_row_are_kept_out(chunk, monkeypatch):
    """Lookback 2: a NaN in row 13's input of layer 4 (a late input: known only after the split; with chunks of 7,
    row 13 ends a chunk and the rows whose window holds it are in the next) and +Inf in row 20's split state keep
    out rows 13-15 and 20-22; the statistics are those of the other rows."""
    model = tiny_model("qwen2")
    runner = Runner(adapter_for(model), chunk=chunk)
    monkeypatch.setattr(runner, "prefill", poisoning(runner.prefill, {(4, 13): math.nan, (2, 20): math.inf}))
    seqs = [random_ids(30, seed=s) for s in range(2)]
    cal = Calibration.empty([2], 6, 64, lookback=2)
    for ids in seqs:
        accumulate(runner, cal, ids, "train", skip_first=1, outlier_factor=0)
    f, ys = direct_lookback_inputs(model, seqs, 2, 1, 2)
    clean = rows_except(seqs, 3, 30, (13, 14, 15, 20, 21, 22))
    f = f[clean]
    st = cal.stats[(2, "train")]
    assert st.skipped_nonfinite == 2 * 6 and st.skipped_first == 2 * 3 and st.count == f.shape[0] == 2 * 21
    assert torch.allclose(st.xtx, f.T @ f, rtol=1e-6, atol=1e-6)
    assert torch.allclose(st.xsum, f.sum(0), atol=1e-6)
    for i, layer in enumerate(range(3, 6)):
        assert torch.allclose(st.xty[i], f.T @ ys[layer][clean], rtol=1e-6, atol=1e-6)


def test_a_checkpoint_from_before_the_nonfinite_count_loads_and_resumes(tmp_path):
    """A partial file whose parts hold 3 counts (written before skipped_nonfinite) loads with that count 0, and
    --resume continues it to the statistics of an uninterrupted run (which then holds all 4 counts)."""
    runner = Runner(adapter_for(tiny_model("qwen2")))
    seqs = [random_ids(16, seed=s)[0].tolist() for s in range(6)]
    whole = run_calibration(runner, seqs, [3], tmp_path / "whole.safetensors", RUN, holdout=0.34)
    out = tmp_path / "stats.safetensors"
    partial = interrupted(runner, seqs, out, 5)
    tensors, meta = load_artifact(partial, "stats")
    older = {k: v[:3] if k.endswith(".counts") else v for k, v in tensors.items()}
    save_artifact(partial, older, meta)
    loaded = Calibration.from_tensors([3], older, meta).stats[(3, "train")]
    assert loaded.skipped_nonfinite == 0 and loaded.count == int(tensors["s3.train.counts"][0]) > 0
    resumed = run_calibration(runner, seqs, [3], out, RUN, holdout=0.34, checkpoint_every=2, resume=True)
    for key, st in whole.stats.items():
        assert [getattr(st, n) for n in COUNTS] == [getattr(resumed.stats[key], n) for n in COUNTS]
        assert torch.allclose(st.xty, resumed.stats[key].xty, rtol=1e-12, atol=1e-9)
    assert load_artifact(out, "stats")[0]["s3.train.counts"].shape == (len(COUNTS),)


def test_the_command_reports_the_nonfinite_rows_and_fits_from_the_rest(tiny_checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    """`calibrate` counts the rows kept out as non-finite in its table, its summary and a note; `fit` then fits
    finite maps from the other rows."""
    from ridgefill.commands import command
    from tiny_models import write_corpus

    monkeypatch.setattr(Runner, "prefill", poisoning(Runner.prefill, {(2, 5): math.nan, (4, 9): math.inf}))
    monkeypatch.setenv("COLUMNS", "200")  # the table whole, whatever terminal (or none) the test runs under
    text = write_corpus(tmp_path / "text.txt", seed=3, lines_per_document=12)
    stats = tmp_path / "stats.safetensors"
    summary = command("calibrate")(model=str(tiny_checkpoint), data=str(text), split="2", tokens=1024, seq_len=128,
                                   holdout=0.25, out=stats)
    row = summary["rows"][0]
    assert row["skipped_nonfinite"] == 2 * summary["sequences"] and row["skipped_outliers"] == 0
    assert json.loads((tmp_path / "stats.safetensors.json").read_text())["rows"][0] == row
    out, err = capsys.readouterr()
    assert "non-finite rows skipped" in out and f"{row['skipped_nonfinite']} rows of split 2 held a NaN" in err
    command("fit")(stats=stats, out=tmp_path / "maps.safetensors")
    maps, _ = load_artifact(tmp_path / "maps.safetensors", "maps")
    assert all(torch.isfinite(t).all() for t in maps.values())


def test_sums_of_squares_do_not_depend_on_the_thread_count():
    """Σ‖y‖² and Σ‖x‖² feed fit's errors: a whole-tensor torch sum splits over the threads (1 and 2 threads rounded
    SmolLM2's Σ‖y‖² differently, issue 50); row sums, then a running sum over the rows, do not."""
    rows = torch.randn(2048, 576, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows *= torch.logspace(-4, 4, 2048, dtype=torch.float64)[:, None]  # (rows * rows).sum(): 3 values on 1-3 threads
    before, sums = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            sums.append(float(sum_of_squares(rows)))
    finally:
        torch.set_num_threads(before)
    assert len(set(sums)) == 1 and sums[0] == pytest.approx(float((rows * rows).sum()), rel=1e-12)
    assert float(sum_of_squares(rows[:0])) == 0.0
