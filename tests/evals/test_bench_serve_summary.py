"""bench-serve's numbers from per-request outputs, whatever engine served them (evals/bench_serve.py): TTFT
percentiles each with a seeded bootstrap interval, goodput against the objective, the fill/stock ratio, the table."""

from __future__ import annotations

import numpy as np
import pytest

from ridgefill.evals.bench_serve import print_table, summary, ttft_ratio


def outputs(ttfts, start=0.0):
    return [{"ttft": t, "latency": t + 1.0, "output_tokens": 11, "start": start + i} for i, t in enumerate(ttfts)]


def test_summary_has_each_percentile_with_its_interval_and_goodput():
    ttfts = np.random.default_rng(0).uniform(0.5, 3.0, size=40).tolist()
    s = summary("ridge", 0.5, outputs(ttfts), slo=2.0, seed=3)
    for q in (50, 90, 99):
        iv = s["ttft_intervals_s"][f"p{q}"]
        assert iv["estimate"] == pytest.approx(np.percentile(ttfts, q)) == pytest.approx(s[f"ttft_p{q}_s"])
        assert iv["low"] <= iv["estimate"] <= iv["high"]
    assert s["within_slo"] == sum(t <= 2.0 for t in ttfts)
    assert s["goodput_rps"] == pytest.approx(s["within_slo"] / s["duration_s"])
    assert s["tpot_mean_s"] == pytest.approx(0.1)  # (latency - ttft) / (11 - 1)
    assert summary("ridge", 0.5, outputs(ttfts), slo=2.0, seed=3) == s  # seeded


def test_table_shows_the_intervals_and_the_ratio(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one row per line (rich wraps cells to the terminal's width)
    exact, ridge = outputs([2.0, 2.2, 2.4, 2.6]), outputs([1.0, 1.1, 1.3, 1.2])
    doc = {"results": [summary("exact", 0.1, exact, 5.0), summary("ridge", 0.1, ridge, 5.0)],
           "ratios": [ttft_ratio(0.1, exact, ridge, seed=0)]}
    assert doc["ratios"][0]["ttft_p50_ratio"] == pytest.approx(np.median([1.0, 1.1, 1.3, 1.2]) / 2.3)
    print_table(doc, "llama.cpp")
    out = capsys.readouterr().out
    assert "RidgeFill in llama.cpp against stock llama.cpp" in out and "TTFT p50 [95% CI]" in out and "2.3 [" in out and "1.15 [" in out
