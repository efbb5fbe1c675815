"""Long passages whose tails are scored (`ridgefill loss` and `ridgefill splice`): their options and checks, the
passages themselves, and the NLL summary both commands report.

A passage of --context tokens runs its last --tail rows in full; those rows predict the tail's tokens N-T+1..N-1
(the filled rows are never scored). Its distant-context tokens (LongPPL's key tokens) are the tail tokens whose
exact full-context log-prob beats their short-window log-prob by more than alpha and is above -beta. Every table
and result document says how many there are and how they spread over the passages (`distant_spread`): a pooled
mean over 300 tokens from one passage is one passage's number, not 300 tokens' worth of evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.commands import REQUIRED, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig
from ridgefill.method.fill_fields import FIELD
from ridgefill.runtime.stats import mean_difference
from ridgefill.runtime.console import note
from ridgefill.runtime.data import documents_for, load_corpus, passages


@dataclass
class PassageConfig(MeasureConfig):
    """Options of the commands that score the tails of long passages (loss, splice)."""

    tail: int = FIELD["tail"].option(help="Last rows of each passage that run the full model (scored).")
    data: str = option(REQUIRED, "Text whose evaluation documents are cut into --context passages: .txt/.jsonl "
                       "file or folder, Hub dataset, or 'wiki-leads' / 'shakespeare'.", fallback="data")
    context: int = option(4096, "Tokens per passage.")
    short: int = option(512, "Short window (tokens) whose loss marks distant-context tokens.")
    short_stride: int | None = option(None, "Tail tokens per short window (each sees short..short+stride-1 "
                                      "tokens); 1 = exactly --short each. Default: short // 8.")
    alpha: float = option(2.0, "Distant-context token: full-context log-prob gain over the short window above "
                          "alpha ...")
    beta: float = option(2.0, "... and full-context log-prob above -beta (LongPPL's key tokens).")
    skip: int = option(0, "Passages to skip first: score passages skip..skip+samples-1 (a set disjoint from a "
                       "run with the same --context and a lower skip + samples).")

    def check(self) -> None:
        super().check()
        check_lengths(self.context, self.short, self.short_stride, self.tail, self.samples, self.keep_first)
        if self.skip < 0:
            raise RidgefillError(f"--skip {self.skip} must be 0 or more (passages to skip)")

    @property
    def stride(self) -> int:
        """Tail tokens per short window."""
        return self.short_stride or max(1, self.short // 8)


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


def evaluation_passages(tokenizer, data: str, context: int, samples: int, skip: int = 0) -> list[list[int]]:
    """Up to `samples` passages of `context` tokens from the evaluation documents of `data`, after the first `skip`
    (passages are cut in document order, so skip s takes the passages a run with skip 0 and samples s never saw)."""
    texts = passages(tokenizer, documents_for(load_corpus(data), "evaluation"), context, skip + samples)[skip:]
    if not texts:
        after = f" after skipping {skip}" if skip else ""
        raise RidgefillError(f"data '{data}' has no evaluation passage of {context} tokens{after}: give longer "
                             "documents" + (", lower --skip" if skip else "") + " or lower --context")
    if len(texts) < samples:
        note(f"note: data '{data}' yields {len(texts)} passages of {context} tokens"
             + (f" after skipping {skip}" if skip else "") + f", not {samples}")
    return texts


# --- the NLL summary ----------------------------------------------------------------------------------------
def nll_results(sums: dict, counts: list[int], tail_tokens: int) -> dict:
    """The mean NLL (tokens pooled over passages) of one variant on all tail tokens and on distant-context tokens.
    sums: {"tail": per-passage NLL sums over the tail, "distant": ... over distant tokens}; counts: distant tokens
    per passage; tail_tokens: scored tokens per passage."""
    n_distant, n_tail = sum(counts), tail_tokens * len(counts)
    distant = sum(sums["distant"]) / n_distant if n_distant else None
    return {"score": distant, "distant_nll": distant, "distant_tokens": n_distant,
            "tail_nll": sum(sums["tail"]) / n_tail, "tail_tokens": n_tail,
            "per_passage": {"distant_nll_sum": sums["distant"], "distant_tokens": counts,
                            "tail_nll_sum": sums["tail"]}}


def tail_difference(sums: dict, reference: dict, tail_tokens: int, seed: int):
    """Interval of the per-token tail NLL difference to the reference, resampling passages."""
    return mean_difference([x / tail_tokens for x in sums["tail"]], [x / tail_tokens for x in reference["tail"]],
                           seed=seed)
