"""`ridgefill loss`: teacher-forced NLL of each variant on long evaluation passages, on the whole tail and on
LongPPL's distant-context (key) tokens.

Protocol, per passage of `context` tokens (evaluation documents of --data, evals/passages.py):
- every variant prefills the passage with its plan (tail T, keep_first rows) and is scored on the tail tokens
  N-T+1..N-1, each predicted from the row before it; the filled rows are never scored (evals.scoring.tail_nll);
- a tail token is *distant-context* (LongPPL's key token) when the EXACT model's full-context log-prob beats its
  short-window log-prob by more than alpha and is above -beta. The marking uses the exact model only, so every
  variant is scored on the same tokens;
- the short-window loss (evals.scoring.short_context_nll) runs the exact model on windows that start `short` tokens
  before a block of `short_stride` targets (default short // 8): the j-th target of a block sees short + j
  tokens, within 12.5 % of `short` by default; --short-stride 1 gives every target exactly `short` tokens at
  the cost of one window per target. Tokens with at most `short` tokens before them see their whole prefix.

Numbers: means over tokens pooled across passages (LongPPL: exp of the mean NLL over all key tokens), and paired
bootstrap intervals of the differences to exact that resample *passages* (tokens within a passage are not
independent; a passage is the honest unit). The headline `score` is the mean NLL on distant-context tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.base import EngineOptions
from ridgefill.commands import Command, option
from ridgefill.evals.common import exact_cache_option, start, variants_option
from ridgefill.evals.passages import (PassageConfig, evaluation_passages, nll_results,
                                      tail_difference)
from ridgefill.evals.scoring import distant_tokens, short_context_nll, tail_nll
from ridgefill.runtime.stats import (Interval, describe_spread, distant_spread, format_interval, gap_ratio,
                                   interval_dict, paired_bootstrap, relative_difference, select)
from ridgefill.runtime.console import cell, note, table
from ridgefill.method.fill import parse_variants
from ridgefill.runtime.session import check_length


@dataclass
class LossConfig(EngineOptions, PassageConfig):
    needs = ("logprobs",)
    samples: int = option(16, "Passages to score.")
    variants: str | None = variants_option()
    exact_cache: Path | None = exact_cache_option()

    def check(self) -> None:
        super().check()
        parse_variants(self.variants, self.maps)


def run(config: LossConfig) -> dict:
    """Score every passage's tail with each variant; the exact model's per-token NLLs go through the exact store
    (by passage), so a sweep's other splits reuse them."""
    c = config
    m = start("loss", c, parse_variants(c.variants, c.maps))
    check_length("--context", c.context, m.model.context_length)
    texts = evaluation_passages(m.model.tokenizer, c.data, c.context, c.samples, c.skip)
    scored = min(c.tail, c.context)  # a tail beyond the passage runs every row in full
    sums = {name: {"tail": [], "distant": []} for name in m.plans}
    counts = []
    with m.backend.start(c.context + 1):
        for passage, advance in m.progress(texts, f"scoring {len(texts)} passages of {c.context} tokens",
                                           len(m.plans) + 1):
            ids = torch.tensor([passage])
            found = m.store.get("loss-exact-nll", {"ids": passage, "scored": scored, "short": c.short,
                                                   "stride": c.stride},
                                lambda: exact_nlls(m.backend, ids, scored, c.short, c.stride))
            exact, short_nll = torch.tensor(found["full"]), torch.tensor(found["short"])  # [scored-1] float32
            key = distant_tokens(exact, short_nll, c.alpha, c.beta)
            counts.append(int(key.sum()))
            advance()
            for name, plan in m.plans.items():
                nll = exact if plan is None else tail_nll(m.backend, name, ids, scored)[0].float().cpu()
                sums[name]["tail"].append(float(nll.sum()))
                sums[name]["distant"].append(float(nll[key].sum()))
                advance()
    results, intervals = summarise(sums, counts, scored - 1, c.seed)
    if not sum(counts):
        note(f"no distant-context tokens in {len(texts)} passages: lower --alpha/--beta, raise --context or "
             "give more --samples")
    elif sum(n > 0 for n in counts) < 2:
        note("the distant-context tokens all come from one passage: their differences have no interval (give "
             "more --samples or a longer --context)")
    spread = distant_spread(counts)
    doc = m.write(results, intervals, short_stride_used=c.stride, scored_tail=scored, distant_spread=spread)
    print_table(results, intervals, f"NLL on {len(texts)} passages of {c.context} tokens, tail {scored} "
                f"({describe_spread(spread)}; short window {c.short})")
    return doc


COMMAND = Command("loss", LossConfig, run, writes=".json", reads="maps")


def exact_nlls(backend, ids: torch.Tensor, scored: int, short: int, stride: int) -> dict:
    """The exact model's NLL of the scored tail tokens with the full context and with the short window."""
    full = tail_nll(backend, "exact", ids, scored)[0].float().cpu()  # [scored-1]
    short_nll = short_context_nll(backend, ids, scored, short, stride, full).float()
    return {"full": full.tolist(), "short": short_nll.tolist()}


# --- summaries ----------------------------------------------------------------------------------------
def summarise(sums: dict, counts: list[int], tail_tokens: int, seed: int) -> tuple[dict, dict]:
    """sums: variant -> {"tail": per-passage NLL sums over the tail, "distant": ... over distant tokens};
    counts: distant tokens per passage; tail_tokens: scored tokens per passage."""
    n_distant = sum(counts)
    results, intervals = {}, {}
    exact = sums["exact"]
    for name, s in sums.items():
        r = nll_results(s, counts, tail_tokens)
        results[name] = {**r, "distant_ppl": _exp(r["distant_nll"]), "tail_ppl": math.exp(r["tail_nll"])}
        if name == "exact":
            continue
        found = {
            "tail_nll_nats": tail_difference(s, exact, tail_tokens, seed),
            "tail_nll_pct": percent(relative_difference(s["tail"], exact["tail"], seed=seed)),
        }
        if n_distant:  # resample only the passages that hold distant tokens (the others add nothing)
            keep = [c > 0 for c in counts]
            mine, theirs = select(s["distant"], keep), select(exact["distant"], keep)
            found["distant_nll_nats"] = pooled_difference(mine, theirs, select(counts, keep), seed)
            found["distant_nll_pct"] = percent(relative_difference(mine, theirs, seed=seed))
        intervals[name] = {metric: interval_dict(iv) for metric, iv in found.items()}
    if "ridge" in sums and "identity" in sums:
        intervals["ridge"].update(identity_gap_kept(sums["ridge"], sums["identity"], exact, counts, seed))
    return results, intervals


def identity_gap_kept(ridge: dict, identity: dict, exact: dict, counts: list[int], seed: int) -> dict:
    """The share of identity fill's NLL gap to exact that ridge keeps, on the tail and on distant tokens (pooled
    over the passages that hold them), with paired intervals over passages: 0 = ridge is exact, 1 = no better."""
    out = {"identity_gap_kept_tail": gap_ratio(ridge["tail"], identity["tail"], exact["tail"], seed=seed)}
    keep = [c > 0 for c in counts]
    if any(keep):
        out["identity_gap_kept_distant"] = gap_ratio(select(ridge["distant"], keep), select(identity["distant"], keep),
                                                     select(exact["distant"], keep), seed=seed)
    return {metric: interval_dict(iv) for metric, iv in out.items()}


def pooled_difference(sums_a, sums_b, counts, seed: int) -> Interval:
    """Σa/Σn − Σb/Σn over passages (token-pooled mean NLL difference), resampling passages."""
    def statistic(m):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (m["a"] - m["b"]) / m["n"]

    return paired_bootstrap({"a": sums_a, "b": sums_b, "n": counts}, statistic, seed=seed)


def percent(interval: Interval) -> Interval:
    return Interval(100 * interval.estimate, 100 * interval.low, 100 * interval.high, interval.level)


def _exp(value: float | None) -> float | None:
    return None if value is None else math.exp(value)


def print_table(results: dict, intervals: dict, title: str) -> None:
    rows = []
    for name, r in results.items():
        iv = intervals.get(name, {})
        rows.append([name, cell(r["distant_nll"]), cell(r["distant_ppl"]),
                     format_interval(iv.get("distant_nll_nats")), format_interval(iv.get("distant_nll_pct"), False),
                     r["tail_nll"], format_interval(iv.get("tail_nll_nats")),
                     format_interval(iv.get("tail_nll_pct"), False)])
    table(title, ["variant", "distant NLL", "distant PPL", "Δ distant [95% CI]", "Δ distant %", "tail NLL",
                  "Δ tail [95% CI]", "Δ tail %"], rows)
    kept = intervals.get("ridge", {})
    if "identity_gap_kept_tail" in kept:
        table("share of identity fill's gap to exact that ridge keeps (0 = exact, 1 = no better than identity)",
              ["tokens", "share kept [95% CI]"],
              [["distant", format_interval(kept.get("identity_gap_kept_distant"), percent=True)],
               ["tail", format_interval(kept["identity_gap_kept_tail"], percent=True)]])
