"""Paired bootstrap intervals against cases with known answers; determinism; formatting."""

import math

import numpy as np
import pytest

from ridgefill.runtime.stats import (format_interval, gap_closed, mean_difference, paired_bootstrap, ratio_of_medians,
                             relative_difference, select)


def test_constant_difference_has_a_degenerate_interval():
    a = np.linspace(0, 5, 40)
    iv = mean_difference(a + 0.25, a)
    assert iv.estimate == pytest.approx(0.25) and iv.low == pytest.approx(0.25) and iv.high == pytest.approx(0.25)


def test_one_sample_has_an_estimate_and_no_interval():
    iv = mean_difference([3.0], [1.0])
    assert iv.estimate == 2.0 and math.isnan(iv.low) and math.isnan(iv.high)
    assert format_interval(iv.to_dict() | {"low": None, "high": None}) == "+2"


def test_select_keeps_flagged_values_and_checks_lengths():
    assert select([1, 2, 3], [True, False, True]) == [1, 3]
    with pytest.raises(ValueError):
        select([1, 2], [True])


def test_pairing_removes_shared_variation():
    rng = np.random.default_rng(0)
    shared = rng.normal(0, 10, 200)  # large per-sample variation common to both variants
    a, b = shared + rng.normal(1.0, 0.1, 200), shared
    paired = mean_difference(a, b, seed=1)
    assert paired.high - paired.low < 0.1  # only the 0.1 noise remains
    assert paired.low < 1.0 < paired.high


def test_interval_matches_normal_theory_for_a_mean():
    rng = np.random.default_rng(3)
    d = rng.normal(0.5, 2.0, 2000)
    iv = mean_difference(d, np.zeros_like(d), n_boot=4000, seed=2)
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert iv.estimate == pytest.approx(d.mean())
    assert iv.low == pytest.approx(d.mean() - 1.96 * se, abs=0.25 * se)
    assert iv.high == pytest.approx(d.mean() + 1.96 * se, abs=0.25 * se)


def test_same_seed_same_numbers_and_other_seed_differs():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0, 1, 30), rng.normal(0, 1, 30)
    assert mean_difference(a, b, seed=7) == mean_difference(a, b, seed=7)
    assert mean_difference(a, b, seed=7) != mean_difference(a, b, seed=8)


def test_ratio_relative_and_gap_closed_estimates():
    exact = np.array([2.0, 4.0, 6.0, 8.0])
    fill = exact * 1.5
    assert ratio_of_medians(fill, exact).estimate == pytest.approx(1.5)
    assert relative_difference(fill, exact).estimate == pytest.approx(0.5)
    swapped = exact + 0.25 * (fill - exact)  # closes 75 % of every sample's gap
    iv = gap_closed(fill, swapped, exact)
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((0.75, 0.75, 0.75))


def test_statistic_sees_every_variant_resampled_together():
    a = np.arange(10.0)
    iv = paired_bootstrap({"a": a, "b": a}, lambda m: m["a"] - m["b"], n_boot=500, seed=0)
    assert (iv.low, iv.high) == (0.0, 0.0)  # same indices for both: the difference never moves


def test_bad_samples_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        mean_difference([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="no samples"):
        mean_difference([], [])


def test_format_interval():
    assert format_interval({"estimate": 0.031, "low": 0.012, "high": 0.05}) == "+0.031 [+0.012, +0.05]"
    assert format_interval({"estimate": 0.43, "low": 0.2, "high": 0.61}, percent=True) == "43% [20%, 61%]"
    assert format_interval({"estimate": 0.43, "low": 0.2, "high": 0.61}, bounds=False, percent=True) == "43%"
    assert format_interval(None) == "–" and format_interval({"estimate": None}) == "–"


def test_gap_ratio_is_the_share_of_the_reference_gap_kept():
    from ridgefill.runtime.stats import gap_ratio

    iv = gap_ratio([11.0, 14.0, 13.0], [14.0, 16.0, 15.0], [10.0, 12.0, 11.0], seed=0)
    assert iv.estimate == pytest.approx((1 + 2 + 2) / (4 + 4 + 4))
    assert iv.low <= iv.estimate <= iv.high
    with pytest.warns(RuntimeWarning):  # no gap to keep a share of: NaN, every replicate too
        assert math.isnan(gap_ratio([1.0, 2.0], [1.0, 2.0], [1.0, 2.0]).estimate)


def test_distant_spread_counts_tokens_and_passages():
    from ridgefill.runtime.stats import describe_spread, distant_spread

    spread = distant_spread([0, 3, 0, 7, 2])
    assert spread == {"tokens": 12, "passages": 5, "passages_with_tokens": 3, "per_passage_min": 0,
                      "per_passage_median": 2.0, "per_passage_max": 7, "largest_share": 7 / 12}
    assert describe_spread(spread) == "12 distant-context tokens in 3 of 5 passages (per passage min 0, median 2, max 7)"
    none = distant_spread([0, 0])
    assert none["tokens"] == 0 and none["passages_with_tokens"] == 0 and none["largest_share"] is None
    assert distant_spread([4, 5])["per_passage_median"] == 4.5
    assert distant_spread([])["passages"] == 0


def test_percentile_interval_is_the_percentile_with_a_seeded_bootstrap_interval():
    from ridgefill.runtime.stats import percentile

    values = np.random.default_rng(0).exponential(1.0, size=200)
    for q in (50, 90, 99):
        iv = percentile(values, q, seed=1)
        assert iv.estimate == pytest.approx(np.percentile(values, q))
        assert iv.low <= iv.estimate <= iv.high and iv.low < iv.high
        assert iv == percentile(values, q, seed=1)
    assert percentile(values, 90, seed=1).low > percentile(values, 50, seed=1).high  # p90 well above the median
    assert np.isnan(percentile([0.3], 90).low)  # one sample: no spread to resample
