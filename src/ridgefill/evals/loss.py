"""`ridgefill loss`: teacher-forced NLL of each variant on long evaluation passages, on the whole tail and on
LongPPL's distant-context (key) tokens.

Protocol, per passage of `context` tokens (evaluation documents of --data, cut with data.passages):
- every variant prefills the passage with its plan (tail T, keep_first rows) and is scored on the tail tokens
  N-T+1..N-1, each predicted from the row before it; the filled rows are never scored (evals.nll.tail_nll);
- a tail token is *distant-context* (LongPPL's key token) when the EXACT model's full-context log-prob beats its
  short-window log-prob by more than alpha and is above -beta. The marking uses the exact model only, so every
  variant is scored on the same tokens;
- the short-window loss (evals.nll.short_context_nll) runs the exact model on windows that start `short` tokens
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

from ridgefill.commands import REQUIRED, Command, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig, exact_cache_option, start, variants_option
from ridgefill.evals.scoring import distant_tokens, short_context_nll, tail_nll
from ridgefill.runtime.console import cell, note, table
from ridgefill.runtime.data import documents_for, load_corpus, passages
from ridgefill.runtime.session import parse_variants
from ridgefill.evals.stats import (Interval, format_interval, mean_difference, paired_bootstrap, relative_difference,
                             select)


@dataclass
class PassageConfig(MeasureConfig):
    """Options of the commands that score the tails of long passages (loss, splice)."""

    tail: int = option(256, "Last rows of each passage that run the full model (scored).", top="tails")
    data: str = option(REQUIRED, "Text whose evaluation documents are cut into --context passages: .txt/.jsonl "
                       "file or folder, Hub dataset, or 'wiki-leads' / 'shakespeare'.", fallback="data")
    context: int = option(4096, "Tokens per passage.")
    short: int = option(512, "Short window (tokens) whose loss marks distant-context tokens.")
    short_stride: int | None = option(None, "Tail tokens per short window (each sees short..short+stride-1 "
                                      "tokens); 1 = exactly --short each. Default: short // 8.")
    alpha: float = option(2.0, "Distant-context token: full-context log-prob gain over the short window above "
                          "alpha ...")
    beta: float = option(2.0, "... and full-context log-prob above -beta (LongPPL's key tokens).")

    def check(self) -> None:
        check_lengths(self.context, self.short, self.short_stride, self.tail, self.samples, self.keep_first)

    @property
    def stride(self) -> int:
        """Tail tokens per short window."""
        return self.short_stride or max(1, self.short // 8)


@dataclass
class LossConfig(PassageConfig):
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
    check_context(m.session, c.context)
    texts = evaluation_passages(m.tokenizer, c.data, c.context, c.samples)
    scored = min(c.tail, c.context)  # a tail beyond the passage runs every row in full
    sums = {name: {"tail": [], "distant": []} for name in m.plans}
    counts = []
    for passage, advance in m.progress(texts, f"scoring {len(texts)} passages of {c.context} tokens",
                                       len(m.plans) + 1):
        ids = torch.tensor([passage])
        found = m.store.get("loss-exact-nll", {"ids": passage, "scored": scored, "short": c.short,
                                               "stride": c.stride},
                            lambda: exact_nlls(m.engine, ids, scored, c.short, c.stride))
        exact, short_nll = torch.tensor(found["full"]), torch.tensor(found["short"])  # [scored-1] float32
        key = distant_tokens(exact, short_nll, c.alpha, c.beta)
        counts.append(int(key.sum()))
        advance()
        for name, plan in m.plans.items():
            nll = exact if plan is None else tail_nll(m.engine, ids, scored, plan)[0].float().cpu()
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
    doc = m.write(results, intervals, short_stride_used=c.stride, scored_tail=scored)
    print_table(results, intervals, f"NLL on {len(texts)} passages of {c.context} tokens, tail {scored} "
                f"({sum(counts)} distant-context tokens, short window {c.short})")
    return doc


COMMAND = Command("loss", LossConfig, run, writes=".json", reads="maps")


def exact_nlls(engine, ids: torch.Tensor, scored: int, short: int, stride: int) -> dict:
    """The exact model's NLL of the scored tail tokens with the full context and with the short window."""
    full = tail_nll(engine, ids, scored)[0].float().cpu()  # [scored-1]
    short_nll = short_context_nll(engine, ids, scored, short, stride, full).float()
    return {"full": full.tolist(), "short": short_nll.tolist()}


# --- options ------------------------------------------------------------------------------------------
def check_lengths(context: int, short: int, short_stride: int | None, tail: int, samples: int,
                  keep_first: int) -> None:
    if context < 2:
        raise RidgefillError(f"--context {context} is too small: use at least 2 tokens")
    if not 1 <= short < context:
        raise RidgefillError(f"--short {short} must be between 1 and --context - 1 ({context - 1}): the short "
                             "window must be shorter than the full context")
    if short_stride is not None and short_stride < 1:
        raise RidgefillError(f"--short-stride {short_stride} must be at least 1 (1 = exactly --short tokens)")
    if tail < 2:
        raise RidgefillError(f"--tail {tail} scores nothing: use at least 2 (the tail's rows predict its tokens)")
    if samples < 1:
        raise RidgefillError(f"--samples {samples} must be at least 1")
    if keep_first < 0:
        raise RidgefillError(f"--keep-first {keep_first} must be 0 or more")


def check_context(session, context: int) -> None:
    limit = session.context_length
    if limit and context > limit:
        raise RidgefillError(f"--context {context} exceeds the model's context of {limit}: lower it")


def evaluation_passages(tokenizer, data: str, context: int, samples: int) -> list[list[int]]:
    """Up to `samples` passages of `context` tokens from the evaluation documents of `data`."""
    texts = passages(tokenizer, documents_for(load_corpus(data), "evaluation"), context, samples)
    if not texts:
        raise RidgefillError(f"data '{data}' has no evaluation document of {context} tokens: give longer "
                             "documents or lower --context")
    if len(texts) < samples:
        note(f"note: data '{data}' yields {len(texts)} passages of {context} tokens, not {samples}")
    return texts


# --- summaries ----------------------------------------------------------------------------------------
def summarise(sums: dict, counts: list[int], tail_tokens: int, seed: int) -> tuple[dict, dict]:
    """sums: variant -> {"tail": per-passage NLL sums over the tail, "distant": ... over distant tokens};
    counts: distant tokens per passage; tail_tokens: scored tokens per passage."""
    n_distant, n_tail = sum(counts), tail_tokens * len(counts)
    results, intervals = {}, {}
    exact = sums["exact"]
    for name, s in sums.items():
        distant = sum(s["distant"]) / n_distant if n_distant else None
        mean_tail = sum(s["tail"]) / n_tail
        results[name] = {
            "score": distant, "distant_nll": distant, "distant_ppl": _exp(distant), "distant_tokens": n_distant,
            "tail_nll": mean_tail, "tail_ppl": math.exp(mean_tail), "tail_tokens": n_tail,
            "per_passage": {"distant_nll_sum": s["distant"], "distant_tokens": counts, "tail_nll_sum": s["tail"]},
        }
        if name == "exact":
            continue
        per_token = [x / tail_tokens for x in s["tail"]], [x / tail_tokens for x in exact["tail"]]
        found = {
            "tail_nll_nats": mean_difference(*per_token, seed=seed),
            "tail_nll_pct": percent(relative_difference(s["tail"], exact["tail"], seed=seed)),
        }
        if n_distant:  # resample only the passages that hold distant tokens (the others add nothing)
            keep = [c > 0 for c in counts]
            mine, theirs = select(s["distant"], keep), select(exact["distant"], keep)
            found["distant_nll_nats"] = pooled_difference(mine, theirs, select(counts, keep), seed)
            found["distant_nll_pct"] = percent(relative_difference(mine, theirs, seed=seed))
        intervals[name] = {metric: interval_dict(iv) for metric, iv in found.items()}
    return results, intervals


def pooled_difference(sums_a, sums_b, counts, seed: int) -> Interval:
    """Σa/Σn − Σb/Σn over passages (token-pooled mean NLL difference), resampling passages."""
    def statistic(m):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (m["a"] - m["b"]) / m["n"]

    return paired_bootstrap({"a": sums_a, "b": sums_b, "n": counts}, statistic, seed=seed)


def percent(interval: Interval) -> Interval:
    return Interval(100 * interval.estimate, 100 * interval.low, 100 * interval.high, interval.level)


def interval_dict(interval: Interval) -> dict:
    """Interval.to_dict() with NaN (a resample without distant tokens gives one; not JSON) stored as None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in interval.to_dict().items()}


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
