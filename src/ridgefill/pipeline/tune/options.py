"""`ridgefill tune`'s options (TuneConfig) and what they name: the fill variants, the filled windows and their
run folders, the candidate splits."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ridgefill.backends import DEFAULT_ENGINE, engine_help
from ridgefill.commands import option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import parse_lengths
from ridgefill.method.fill import FILLS
from ridgefill.method.fill_fields import FIELD, check_fill
from ridgefill.pipeline.search import SEARCHES
from ridgefill.runtime.paths import check_output
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.session import ModelConfig


@dataclass
class TuneConfig(ModelConfig):
    data: str = option("wiki-leads", "Calibration text: .txt/.jsonl file or folder, Hub dataset, or 'wiki-leads' / "
                       "'shakespeare'.")
    splits: str | None = option(None, "Candidate splits: values and ranges, e.g. 14-20 or 14,16,18 (default: the "
                                "upper half, L/2..L-2).")
    tail: int = FIELD["tail"].option("the served fill's tail")
    keep_first: int = FIELD["keep_first"].option()
    tolerance: float = option(5.0, "Filled-region RULER points below exact that still count as equal quality.")
    max_distant_gap: float = option(0.25, "Distant-context NLL above exact (nats) that still counts as equal "
                                    "quality.")
    variants: str = option("identity,ridge", "Fill variants to tune: identity, ridge, or the null controls drop and "
                           "mean (comma-separated).",
                           listed=str)
    search: str = option("bisect", "bisect (halve each variant's interval), descend (from the highest split down "
                         "to the first failure) or all (every candidate).")
    tokens: int = option(32768, "Calibration tokens (one pass for every candidate split).")
    seq_len: int = option(1024, "Tokens per calibration sequence.")
    holdout: float = option(0.1, "Share of calibration sequences held out (λ is chosen on them per layer).")
    lengths: str = option("1024", "RULER prompt + answer lengths (tokens), comma-separated.", listed=int)
    tasks: str = option("niah_single_1,niah_multikey_1", "RULER tasks (needles in filled rows), comma-separated.",
                        listed=str)
    samples: int = option(10, "RULER samples per task and length.")
    max_new_tokens: int = option(16, "Cap on RULER's answer budget (a niah answer is a 7-digit number).")
    nll_check: bool = option(True, "Check distant-context NLL from the RULER choices up, fastest split first, "
                             "until one is within --max-distant-gap (--no-nll-check: judge RULER alone).",
                             negatable=True)
    eval_data: str = option("shakespeare", "Text whose evaluation passages the NLL check scores.")
    context: int = option(4096, "Tokens per passage of the NLL check.")
    nll_tail: int = option(1024, "Last tokens of each check passage that run in full and are scored (the check's "
                           "own tail, not the serving --tail: only scored tokens can be distant-context tokens).")
    short: int = option(256, "Short window (tokens) whose loss marks distant-context tokens.")
    short_stride: int = option(64, "Scored tokens per short window of the check's exact pass (1: one window per "
                               "token, exact but slow).")
    passages: int = option(20, "Passages the NLL check scores per split (SmolLM2: 333 distant-context tokens in "
                           "20).")
    windows: str = option("0", "Filled windows W to search (comma-separated; 0: full attention): each runs the "
                          "search and the check in its own run folder (W > 0: <out-dir>/window-W), its filled rows "
                          "attending only to the kept first rows and the W rows before them below the lowest "
                          "candidate split; the fastest passing (window, variant, split) is served.", listed=int)
    length: int | None = option(None, "Prompt length the expected FLOP-limit speedup is stated at (default: the "
                                "longest measured prompt: a RULER length, or --context with the check).")
    seed: int = option(0, "Sample and bootstrap seed.")
    out_dir: Path | None = option(None, "Run folder (default runs/tune-<model>); a rerun reuses its finished steps.")
    config_out: Path | None = option(None, "Serving config JSON to write (default <out-dir>/serving.json).")
    engine: str = option(DEFAULT_ENGINE, engine_help() + " It runs tune's RULER tasks and NLL check.")

    def check(self) -> None:
        check_fill(tail=self.tail, keep_first=self.keep_first)  # served with the default outlier factor
        if not self.tolerance >= 0 or not self.max_distant_gap >= 0:
            raise RidgefillError(f"--tolerance {self.tolerance:g} and --max-distant-gap {self.max_distant_gap:g} "
                                 "must be 0 or more (points and nats above exact that still count as equal)")
        if self.search not in SEARCHES:
            raise RidgefillError(f"unknown --search '{self.search}': use {', '.join(SEARCHES)}")
        fills(self.variants)
        parse_lengths(self.lengths)
        parse_windows(self.windows)
        if self.splits is not None and split_values(self.splits)[0] < 1:
            raise RidgefillError(f"--splits {self.splits}: split 0 is out of range: a split is 1 or more")
        if self.nll_check and self.nll_tail + self.keep_first >= self.context:
            raise RidgefillError(f"--nll-tail {self.nll_tail} plus --keep-first {self.keep_first} leave no filled row "
                                 f"in a --context {self.context} passage: the NLL check would compare exact with "
                                 f"exact; use a --nll-tail below {self.context - self.keep_first}")
        for flag, value in (("--samples", self.samples), ("--passages", self.passages), ("--tokens", self.tokens),
                            ("--length", self.length), ("--nll-tail", self.nll_tail),
                            ("--short-stride", self.short_stride)):
            if value is not None and value < 1:
                raise RidgefillError(f"{flag} {value} must be at least 1")
        check_output(self, "config_out")
        self.check_engine()

    def check_engine(self) -> None:
        """--engine through the seam: an engine that cannot run what tune measures (its variants, the NLL check's
        log-probs, a filled window) is refused in one line, before anything loads."""
        from ridgefill.backends import backend_class
        from ridgefill.backends.base import check_engine_options, refuse

        check_engine_options(self, ("logprobs",) if self.nll_check else (), ["exact", *self.fill_names])
        if any(self.window_sizes) and not backend_class(self.engine).caps.filled_window:
            raise refuse(self.engine, "a filled window (--windows)", "use --windows 0")

    @property
    def fill_names(self) -> list[str]:
        return fills(self.variants)

    @property
    def ruler_lengths(self) -> list[int]:
        return parse_lengths(self.lengths)

    @property
    def window_sizes(self) -> list[int]:
        return parse_windows(self.windows)

    @property
    def flop_length(self) -> int:
        return self.length or max(self.ruler_lengths + ([self.context] if self.nll_check else []))

    @property
    def run_dir(self) -> Path:
        return self.out_dir if self.out_dir is not None else Path("runs") / f"tune-{slug(self.model)}"


def fills(text: str) -> list[str]:
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    if not names or any(v not in FILLS for v in names):
        raise RidgefillError(f"--variants '{text}': tune any of {', '.join(FILLS)} (exact is always measured)")
    return [v for v in FILLS if v in names]


def parse_windows(text: str) -> list[int]:
    """--windows: comma-separated filled windows W >= 0 (0: full attention), sorted, without repeats."""
    try:
        values = sorted({int(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise RidgefillError(f"--windows '{text}' is not a comma-separated list of filled windows of at least 0 "
                             "(0: full attention), e.g. --windows 0,256")
    return values


def window_dir(c: TuneConfig, window: int) -> Path:
    """A window's run folder: the run folder itself for full attention (0), else window-W below it."""
    return c.run_dir if not window else c.run_dir / f"window-{window}"


def window_of(window: int, candidates: list[int]) -> dict | None:
    """Filled window `window` as tune runs it, {size, first, last}: in layers 0..min(candidates)-1, below every
    candidate split (so one windowed calibration serves them all); None for 0 (full attention)."""
    return {"size": window, "first": 0, "last": min(candidates) - 1} if window else None


def window_layers(window: int, candidates: list[int]) -> str | None:
    """The --filled-window-layers text of window_of (None for full attention)."""
    found = window_of(window, candidates)
    return None if found is None else f"{found['first']}-{found['last']}"


def describe_windows(windows: list[int]) -> str:
    """The windows in words, e.g. 'full attention, window 256'."""
    return ", ".join("full attention" if not w else f"window {w}" for w in windows)


def split_values(text: str) -> list[int]:
    ranges = parse_ranges(text, "--splits", "split", "14-20")
    return sorted({s for lo, hi in ranges for s in range(lo, hi + 1)})


def candidate_splits(text: str | None, n_layers: int) -> list[int]:
    """The candidates: --splits, or the upper half of the layers; each in 1..L-2 (at L-1 nothing is filled but
    the last layer, whose input is the split state itself: there is nothing to fit)."""
    top = n_layers - 2
    if top < 1:
        raise RidgefillError(f"a {n_layers}-layer model has no split to tune: it needs at least 3 layers")
    splits = split_values(text) if text is not None else list(range(max(1, n_layers // 2), top + 1))
    bad = [s for s in splits if not 1 <= s <= top]
    if bad:
        raise RidgefillError(f"--splits {text}: split {bad[0]} is out of range: use 1..{top} for this {n_layers}-layer "
                             f"model (at {n_layers - 1} nothing is left to fit)")
    return splits


def slug(model: str) -> str:
    """A model spec as a folder and recipe name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name) or "model"
