"""Seeded, vectorised paired bootstrap intervals, and how distant-context tokens spread over passages.

All variants are measured on the same samples (prompts, passages, runs), so resampling draws one set of
sample indices per replicate and applies it to every variant: the interval of a difference reflects the
pairing. Same seed, same numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    level: float = 0.95

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.estimate:+.4g} [{self.low:+.4g}, {self.high:+.4g}]"


def paired_bootstrap(
    samples: Mapping[str, Sequence[float]],
    statistic: Callable[[Mapping[str, np.ndarray]], np.ndarray],
    reduce: str | float = "mean",
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Percentile interval of `statistic` over paired resamples.

    samples: name -> per-sample values (all the same length, index i = the same sample).
    statistic: takes name -> reduced values (a scalar array for the estimate, [n_boot] for replicates).
    reduce: how each resample is summarised per variant: 'mean', 'median', or a percentile (a number in 0..100).
    One sample has no spread to resample: its interval's bounds are NaN (the estimate stands alone).
    """
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in samples.items()}
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"paired samples need equal lengths, got {sorted(lengths)}")
    n = lengths.pop()
    if n == 0:
        raise ValueError("no samples")
    if isinstance(reduce, str):
        fn = {"mean": np.mean, "median": np.median}[reduce]
    else:
        def fn(v, axis=None):
            return np.percentile(v, reduce, axis=axis)
    estimate = float(statistic({k: fn(v) for k, v in arrays.items()}))
    if n == 1:
        return Interval(estimate, math.nan, math.nan, level)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))  # one set of indices per replicate, shared by all variants
    replicates = np.asarray(statistic({k: fn(v[idx], axis=1) for k, v in arrays.items()}), dtype=np.float64)
    alpha = (1 - level) / 2
    low, high = np.nanquantile(replicates, [alpha, 1 - alpha])
    return Interval(estimate, float(low), float(high), level)


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are numbers (None and NaN left out); None when none is."""
    kept = [float(v) for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def select(values: Sequence, keep: Sequence[bool]) -> list:
    """The values whose `keep` flag is set (e.g. the passages that hold any distant-context token)."""
    return [v for v, k in zip(values, keep, strict=True) if k]


def mean_difference(a, b, **kw) -> Interval:
    """mean(a) − mean(b), paired."""
    return paired_bootstrap({"a": a, "b": b}, lambda m: m["a"] - m["b"], **kw)


def relative_difference(a, b, **kw) -> Interval:
    """mean(a) / mean(b) − 1 (as a fraction), paired."""
    return paired_bootstrap({"a": a, "b": b}, lambda m: m["a"] / m["b"] - 1, **kw)


def ratio_of_medians(a, b, **kw) -> Interval:
    """median(a) / median(b), paired (e.g. exact time / filled time = speedup)."""
    return paired_bootstrap({"a": a, "b": b}, lambda m: m["a"] / m["b"], reduce="median", **kw)


def percentile(values, q: float, **kw) -> Interval:
    """The q-th percentile of `values` (e.g. q 90: p90 of times to first token), with its bootstrap interval."""
    return paired_bootstrap({"a": values}, lambda m: m["a"], reduce=q, **kw)


def gap_closed(fill, swapped, exact, **kw) -> Interval:
    """Share of the fill's gap to exact that a swap closes: (fill − swapped) / (fill − exact), paired."""
    def share(m):
        gap = m["fill"] - m["exact"]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gap != 0, (m["fill"] - m["swapped"]) / gap, np.nan)

    return paired_bootstrap({"fill": fill, "swapped": swapped, "exact": exact}, share, **kw)


def gap_ratio(variant, reference, exact, **kw) -> Interval:
    """The share of the reference's gap to exact that the variant keeps: mean(variant − exact) / mean(reference −
    exact), paired (e.g. ridge vs identity fill: 0 = ridge is exact, 1 = no better than identity)."""
    def ratio(m):
        gap = m["reference"] - m["exact"]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gap != 0, (m["variant"] - m["exact"]) / gap, np.nan)

    return paired_bootstrap({"variant": variant, "reference": reference, "exact": exact}, ratio, **kw)


def distant_spread(counts: list[int]) -> dict:
    """How the distant-context tokens spread over the passages (counts: tokens per passage): the total, how many
    passages hold any, the min / median / max per passage (over all passages, zeros included), and the share of
    the total in the richest passage (null without tokens)."""
    total = int(sum(counts))
    return {"tokens": total, "passages": len(counts), "passages_with_tokens": sum(c > 0 for c in counts),
            "per_passage_min": int(min(counts)) if counts else None,
            "per_passage_median": float(np.median(counts)) if counts else None,
            "per_passage_max": int(max(counts)) if counts else None,
            "largest_share": max(counts) / total if total else None}


def describe_spread(spread: dict) -> str:
    """'342 distant-context tokens in 11 of 12 passages (per passage min 0, median 25, max 70)' for a table."""
    text = f"{spread['tokens']} distant-context tokens in {spread['passages_with_tokens']} of {spread['passages']} " \
           "passages"
    if spread["passages"]:
        text += (f" (per passage min {spread['per_passage_min']}, median {spread['per_passage_median']:g}, "
                 f"max {spread['per_passage_max']})")
    return text


def format_interval(values: dict | None, bounds: bool = True, percent: bool = False, spec: str = "+.3g",
                    suffix: str = "") -> str:
    """An `Interval.to_dict()` for a table: '+0.031 [+0.012, +0.05]' (each number formatted with `spec`, then
    `suffix`), or '43% [20%, 61%]' with percent=True. bounds=False, or bounds that are null/NaN (one sample):
    the estimate only; '–' when there is no estimate."""
    if not values or _missing(values.get("estimate")):
        return "–"
    show = (lambda v: f"{100 * v:.0f}%") if percent else (lambda v: f"{v:{spec}}{suffix}")
    text = show(values["estimate"])
    if bounds and not _missing(values.get("low")) and not _missing(values.get("high")):
        text += f" [{show(values['low'])}, {show(values['high'])}]"
    return text


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def interval_dict(interval: Interval) -> dict:
    """Interval.to_dict() with NaN (a resample without distant tokens gives one; not JSON) stored as None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in interval.to_dict().items()}
