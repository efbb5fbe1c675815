"""`ridgefill loss`: distant-context token marking, short-window NLL, the command's JSON and its errors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tiny_models import random_ids, tiny_model
from ridgefill.cli import app
from ridgefill.torchfill import Runner, adapter_for
from ridgefill.errors import RidgefillError
from ridgefill.evals.loss import summarise
from ridgefill.runtime.stats import describe_spread, distant_spread, mean_difference
from ridgefill.evals.loss import COMMAND as loss_command
from ridgefill.backends.torchfill import TorchfillBackend
from ridgefill.evals.scoring import distant_tokens, short_context_nll, tail_nll


def options(**overrides):
    base = dict(model=None, maps=None, split=3, tail=16, data=None, context=96, short=24, short_stride=None,
                samples=3, alpha=0.0, beta=100.0, keep_first=1, variants=None, seed=0, chunk=2048, dtype="fp32",
                device="cpu", out=None)
    base.update(overrides)
    return base


def test_distant_tokens_known_answer():
    full = torch.tensor([0.5, 0.5, 1.9, 2.5, 0.1, 1.0, 3.0])
    short = torch.tensor([3.0, 2.5, 4.0, 6.0, 2.0, 1.0, 9.0])
    # gain:              2.5  2.0  2.1  3.5  1.9  0.0  6.0   (> 2 strictly)
    # full log-prob > -2: yes  yes  yes  no   yes  yes  no
    assert distant_tokens(full, short).tolist() == [True, False, True, False, False, False, False]
    assert distant_tokens(full, short, alpha=1.5, beta=3.5).tolist() == [True, True, True, True, True, False, True]


@pytest.fixture(scope="module")
def runner():
    return Runner(adapter_for(tiny_model("qwen2")), chunk=16)  # chunk < a few windows: several batches


@pytest.mark.parametrize("stride", [1, 3, 64])
def test_short_context_nll_equals_separate_windows(runner, stride):
    """Target t of a block starting at t0 (all > short) sees exactly the short + (t - t0) tokens before it, as a
    fresh sequence; targets with at most `short` tokens before them keep their full-context NLL."""
    n, tail, short = 28, 20, 10
    ids = random_ids(n)
    backend = TorchfillBackend.over(runner, {"exact": None})
    full = tail_nll(backend, "exact", ids, tail)[0]
    got = short_context_nll(backend, ids, tail, short, stride, full)
    first, start = n - tail + 1, short + 1
    used = max(1, min(stride, n - start))
    for i, t in enumerate(range(first, n)):
        if t <= short:
            assert got[i] == full[i]
            continue
        seen = short + (t - start) % used
        logits = runner.prefill(ids[:, t - seen : t]).logits[:, -1]
        assert abs(float(F.cross_entropy(logits, ids[:, t])) - float(got[i])) < 1e-4, (t, seen)


def test_loss_command_json_and_distant_tokens(tiny_checkpoint, long_docs, tmp_path):
    out = tmp_path / "loss.json"
    r = CliRunner().invoke(app, ["loss", "--model", str(tiny_checkpoint), "--split", "3", "--tail", "16",
                                 "--data", str(long_docs), "--context", "96", "--short", "24", "--samples", "3",
                                 "--alpha", "0", "--beta", "100", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "NLL on 3 passages of 96 tokens" in r.output  # the table
    doc = json.loads(out.read_text())
    for key in ("command", "model", "maps", "config", "variants", "results", "intervals", "seed",
                "ridgefill_version", "started_at", "duration_s"):
        assert key in doc
    assert doc["command"] == "loss" and doc["variants"] == ["exact", "identity"] and doc["maps"] is None
    assert doc["config"]["context"] == 96 and doc["config"]["short"] == 24 and doc["short_stride_used"] == 3
    exact, identity = doc["results"]["exact"], doc["results"]["identity"]
    assert exact["tail_tokens"] == 3 * 15
    counts = exact["per_passage"]["distant_tokens"]
    assert len(counts) == 3 and exact["distant_tokens"] == sum(counts) > 0
    assert exact["score"] == exact["distant_nll"] == pytest.approx(sum(exact["per_passage"]["distant_nll_sum"])
                                                                    / sum(counts))
    assert exact["distant_ppl"] == pytest.approx(math.exp(exact["distant_nll"]))
    assert identity["tail_nll"] != exact["tail_nll"]
    iv = doc["intervals"]["identity"]
    assert set(iv) == {"distant_nll_nats", "distant_nll_pct", "tail_nll_nats", "tail_nll_pct"}
    assert iv["tail_nll_nats"]["estimate"] == pytest.approx(identity["tail_nll"] - exact["tail_nll"])
    assert iv["distant_nll_nats"]["estimate"] == pytest.approx(identity["distant_nll"] - exact["distant_nll"])
    assert iv["distant_nll_pct"]["estimate"] == pytest.approx(100 * (identity["distant_nll"] / exact["distant_nll"] - 1))
    assert iv["tail_nll_nats"]["low"] <= iv["tail_nll_nats"]["estimate"] <= iv["tail_nll_nats"]["high"]


def test_tail_covering_the_context_makes_all_variants_identical(tiny_checkpoint, long_docs, tmp_path):
    doc = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), tail=200, out=tmp_path / "l.json"))
    assert doc["scored_tail"] == 96
    exact, identity = doc["results"]["exact"], doc["results"]["identity"]
    assert exact["tail_tokens"] == 3 * 95
    assert identity["per_passage"] == exact["per_passage"]
    assert doc["intervals"]["identity"]["tail_nll_nats"]["estimate"] == 0.0


@pytest.mark.parametrize("overrides,message", [
    (dict(short=96), "--short 96 must be between 1 and --context - 1"),
    (dict(tail=1), "--tail 1 scores nothing"),
    (dict(short_stride=0), "--short-stride 0 must be at least 1"),
    (dict(variants="exact,best"), "unknown variant"),
    (dict(variants="exact,ridge"), "the ridge variant needs --maps"),
    (dict(context=5000), "--context 5000 exceeds the model's context of 4096"),
    (dict(context=4000), "has no evaluation passage of 4000 tokens"),
    (dict(skip=-1), "--skip -1 must be 0 or more"),
    (dict(skip=100000), "has no evaluation passage of 96 tokens after skipping 100000: give longer documents, lower --skip"),
])
def test_bad_options_are_one_line_errors(tiny_checkpoint, long_docs, tmp_path, overrides, message):
    kw = options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "l.json", **overrides)
    with pytest.raises(RidgefillError, match=message.replace("(", r"\(")) as err:
        loss_command(**kw)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "l.json").exists()


def test_distant_intervals_resample_only_passages_with_distant_tokens():
    exact = {"tail": [30.0, 31.0, 29.0, 33.0], "distant": [0.0, 4.0, 0.0, 9.0]}
    fill = {"tail": [33.0, 35.0, 30.0, 36.0], "distant": [0.0, 7.0, 0.0, 15.0]}
    counts = [0, 2, 0, 3]
    _, iv = summarise({"exact": exact, "ridge": fill}, counts, tail_tokens=10, seed=0)
    d = iv["ridge"]["distant_nll_nats"]
    assert d["estimate"] == pytest.approx((22.0 - 13.0) / 5)  # pooled over the 5 distant tokens
    assert d["low"] < d["estimate"] < d["high"]  # two informative passages: a real interval
    # the same interval as bootstrapping the two informative passages alone
    alone = summarise({"exact": {"tail": [31.0, 33.0], "distant": [4.0, 9.0]},
                       "ridge": {"tail": [35.0, 36.0], "distant": [7.0, 15.0]}}, [2, 3], 10, 0)[1]
    assert d == alone["ridge"]["distant_nll_nats"]


def test_distant_tokens_from_one_passage_have_no_interval():
    exact = {"tail": [30.0, 31.0, 29.0], "distant": [0.0, 4.0, 0.0]}
    fill = {"tail": [33.0, 35.0, 30.0], "distant": [0.0, 7.0, 0.0]}
    _, iv = summarise({"exact": exact, "ridge": fill}, [0, 2, 0], tail_tokens=10, seed=0)
    d = iv["ridge"]["distant_nll_nats"]
    assert d["estimate"] == pytest.approx(1.5) and d["low"] is None and d["high"] is None
    t = iv["ridge"]["tail_nll_nats"]  # the tail still resamples all three passages
    assert t == mean_difference([3.3, 3.5, 3.0], [3.0, 3.1, 2.9], seed=0).to_dict()


def test_exact_cache_reuses_exact_nlls_across_splits(tiny_checkpoint, long_docs, tmp_path, monkeypatch):
    import ridgefill.evals.loss as loss_module

    store = tmp_path / "exact"
    plain = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "a.json"))
    first = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "b.json",
                                   exact_cache=store))
    assert first["exact_store"]["misses"] == 3 and first["results"] == plain["results"]

    def no_exact(*args, **kwargs):
        raise AssertionError("exact NLLs recomputed")

    monkeypatch.setattr(loss_module, "exact_nlls", no_exact)
    other_split = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), split=2,
                                         out=tmp_path / "c.json", exact_cache=store))
    assert other_split["exact_store"] == {"folder": str(store), "hits": 3, "misses": 0}
    assert other_split["results"]["exact"] == plain["results"]["exact"]


def test_outlier_rows_are_counted_in_the_result(tiny_checkpoint, long_docs, tmp_path):
    """--outlier-factor reaches every fill variant's plan, and the result counts the rows it ran in full."""
    low = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "low.json",
                                 outlier_factor=1.05))
    off = loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "off.json",
                                 outlier_factor=0.0))
    rows = low["fill_rows"]["identity"]
    assert rows["outlier_tokens"] > 0
    assert off["fill_rows"]["identity"] == {**rows, "filled_tokens": rows["filled_tokens"] + rows["outlier_tokens"],
                                            "outlier_tokens": 0, "lookback_full_tokens": 0}
    assert low["results"]["exact"] == off["results"]["exact"]
    with pytest.raises(RidgefillError, match="--outlier-factor -1 must be 0"):
        loss_command(**options(model=str(tiny_checkpoint), data=str(long_docs), out=tmp_path / "x.json",
                               outlier_factor=-1.0))


def test_ridge_keeps_a_share_of_identity_fills_gap():
    sums = {"exact": {"tail": [10.0, 12.0, 11.0], "distant": [1.0, 0.0, 2.0]},
            "identity": {"tail": [14.0, 16.0, 15.0], "distant": [3.0, 0.0, 6.0]},
            "ridge": {"tail": [11.0, 14.0, 13.0], "distant": [2.0, 0.0, 3.0]}}
    _, intervals = summarise(sums, [2, 0, 3], 10, seed=0)
    kept = intervals["ridge"]
    assert kept["identity_gap_kept_tail"]["estimate"] == pytest.approx(5 / 12)
    assert kept["identity_gap_kept_distant"]["estimate"] == pytest.approx((1 + 1) / (2 + 4))  # passages 1 and 3
    assert "identity_gap_kept_tail" not in intervals["identity"]


def test_the_spread_of_distant_tokens_is_in_the_json_and_the_table(tiny_checkpoint, long_docs, tmp_path):
    out = tmp_path / "loss.json"
    r = CliRunner().invoke(app, ["loss", "--model", str(tiny_checkpoint), "--split", "3", "--tail", "16",
                                 "--data", str(long_docs), "--context", "96", "--short", "24", "--samples", "3",
                                 "--alpha", "0.5", "--beta", "100", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    counts = doc["results"]["exact"]["per_passage"]["distant_tokens"]
    spread = doc["distant_spread"]
    assert spread == distant_spread(counts)
    assert spread["tokens"] == doc["results"]["exact"]["distant_tokens"] == sum(counts)
    assert spread["passages"] == 3 and spread["passages_with_tokens"] == sum(c > 0 for c in counts)
    assert spread["per_passage_min"] <= spread["per_passage_median"] <= spread["per_passage_max"] == max(counts)
    assert describe_spread(spread) in " ".join(r.output.split())  # the table's title (wrapped by the terminal)
    for key in ("results", "intervals", "scored_tail", "short_stride_used"):  # the older keys stay
        assert key in doc


def test_skip_scores_the_passages_after_the_first(tiny_checkpoint, long_docs, tmp_path):
    """--skip s with --samples n scores passages s..s+n-1 of the same sequence: a set disjoint from skip 0, n = s."""
    kw = dict(model=str(tiny_checkpoint), data=str(long_docs))
    three = loss_command(**options(**kw, samples=3, out=tmp_path / "a.json"))
    last_two = loss_command(**options(**kw, samples=2, skip=1, out=tmp_path / "b.json"))
    assert last_two["config"]["skip"] == 1 and last_two["results"]["exact"]["tail_tokens"] == 2 * 15
    for variant in ("exact", "identity"):
        a, b = three["results"][variant]["per_passage"], last_two["results"][variant]["per_passage"]
        for key in ("tail_nll_sum", "distant_nll_sum", "distant_tokens"):
            assert b[key] == pytest.approx(a[key][1:], abs=1e-4)
    assert last_two["distant_spread"] == distant_spread(three["results"]["exact"]["per_passage"]["distant_tokens"][1:])
