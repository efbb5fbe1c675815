"""`ridgefill generate`: greedy generation after exact or filled prefill, with time to first token."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ridgefill.backends.base import EngineOptions
from ridgefill.commands import Command, option
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.torchfill.rows import check_keep_first
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import ResultWriter, engine_record, maps_info
from ridgefill.method.fill import ServedOptions
from ridgefill.runtime.console import note
from ridgefill.runtime.paths import check_output, read_text
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.session import ModelConfig
from ridgefill.runtime.spans import token_span


@dataclass
class GenerateConfig(EngineOptions, ServedOptions, ModelConfig):
    keep_rows: str | None = option(None, "More prompt rows (0-based token positions) that run in full, e.g. "
                                   "0-3,120-140.", listed=str)
    keep_text: str | None = option(None, "Run the tokens of this text's first occurrence in the prompt in full "
                                   "(e.g. the question).")
    exact: bool = option(False, "Exact prefill (no maps).")
    prompt: str | None = option(None, "Prompt text.")
    prompt_file: Path | None = option(None, "Read the prompt from a file.")
    max_new_tokens: int = option(64, "Tokens to generate (greedy).")
    compare: bool = option(False, "Run exact and filled; print both with their TTFT.")
    out: Path | None = option(None, "Also write a result JSON: each run's text, tokens, time to first token and rows "
                              "filled, and the engine (docs/results-schema.md).", role="output")

    def source_rule(self):
        return (), None if self.exact else ", or pass --exact"

    def check(self) -> None:
        if (self.prompt is None) == (self.prompt_file is None):
            raise RidgefillError("give exactly one of --prompt or --prompt-file")
        if self.prompt_file is not None and not Path(self.prompt_file).is_file():
            raise RidgefillError(f"--prompt-file {self.prompt_file} "
                                 f"{'is not a file' if Path(self.prompt_file).exists() else 'does not exist'}: "
                                 "pass a text file")
        if self.exact and self.compare:
            raise RidgefillError("--compare already runs exact: drop --exact")
        if self.max_new_tokens < 1:
            raise RidgefillError("--max-new-tokens must be at least 1")
        super().check()
        check_keep_first(self.keep_first)
        if self.keep_rows is not None:
            parse_ranges(self.keep_rows, "--keep-rows", "row", "0-3,120-140")
        if self.keep_text is not None and not self.keep_text.strip():
            raise RidgefillError("--keep-text is empty: give the text whose tokens should run in full")
        check_output(self)


def run(c: GenerateConfig) -> dict:
    """The generated text of each run (exact, filled), by name."""
    writer = ResultWriter("generate", c.as_dict())
    c, tuned = c.served()
    tail, exact, max_new_tokens, compare = c.tail, c.exact, c.max_new_tokens, c.compare
    prompt = c.prompt if c.prompt_file is None else read_text(c.prompt_file, "--prompt-file")
    backend = c.open_backend()
    model = backend.model
    ids = model.tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]
    if ids.shape[1] == 0:
        raise RidgefillError("the prompt is empty after tokenization")
    limit = model.context_length
    if limit and not exact:  # before any row of the fill is planned
        check_keep_first(c.keep_first, limit, within=" (this model's context)")
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise RidgefillError(f"prompt ({ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceed the model's "
                             f"context of {limit}: shorten the prompt")
    if tuned is not None:
        tuned.check_model(model.fingerprint, c.serving_config)
    fills, plans, maps_meta = {}, {}, None
    if exact or compare:
        fills["exact"] = plans["exact"] = None
    if not exact:
        fills["filled"] = c.fill()
        plans["filled"], maps_meta = fills["filled"].plan(model, keep_rows(c, model.tokenizer, prompt, ids.shape[1]))
        if tail >= ids.shape[1]:
            note(f"note: tail {tail} >= prompt length {ids.shape[1]}: every row runs the full model (exact)")
        elif c.keep_first + tail >= ids.shape[1]:
            note(f"note: keep-first {c.keep_first} and tail {tail} cover the {ids.shape[1]}-token prompt: every row "
                 "runs the full model (exact)")
    eos = model.tokenizer.eos_token_id
    prompt_ids = ids[0].tolist()
    runs = {}
    with backend.use(fills, plans).start(len(prompt_ids) + max_new_tokens):
        for name in fills:
            done = backend.generate(name, prompt_ids, max_new_tokens, eos)
            runs[name] = Run(done.tokens, done.ttft_s, backend.tally(name))
    texts = {k: model.tokenizer.decode(r.tokens, skip_special_tokens=True) for k, r in runs.items()}
    if c.out is not None:
        results = {k: {"text": texts[k], "tokens": r.tokens, "ttft_s": r.ttft_s, "prompt_tokens": ids.shape[1],
                       **r.tally.to_dict()} for k, r in runs.items()}
        writer.write(c.out, model.model_info, maps_info(c.maps if not exact else None, maps_meta), list(runs),
                     results, {}, computed_by=backend.provenance(), engine=engine_record(backend))
    where = f" ({backend.title})" if backend.title else ""
    if compare:
        for name, r in runs.items():
            note(f"[{name}]{where} {r.summary(ids.shape[1])}")
            print(f"=== {name} ===\n{texts[name]}")
        note("outputs are identical" if texts["exact"] == texts["filled"] else "outputs differ")
    else:
        (name, r), = runs.items()
        note(f"{where.strip()} {r.summary(ids.shape[1])}".strip())
        sys.stdout.write(texts[name] + "\n")
    return texts


@dataclass
class Run:
    """One generation: its tokens, time to first token, and what its prefill filled (rows filled, run in full as
    outliers, run in full without a whole lookback window)."""

    tokens: list[int]
    ttft_s: float
    tally: FillTally

    def summary(self, n: int) -> str:
        t = self.tally
        text = f"ttft {self.ttft_s * 1000:.0f} ms, {t.filled_tokens / max(1, n):.0%} of {n} prompt rows filled"
        text += f" ({t.outlier_tokens} outlier rows ran in full)" if t.outlier_tokens else ""
        return text + (f" ({t.lookback_full_tokens} rows without a lookback window ran in full)"
                       if t.lookback_full_tokens else "")


def keep_rows(c: GenerateConfig, tokenizer, prompt: str, n: int) -> list[int]:
    """The rows to run in full besides the tail: the first --keep-first, --keep-rows, and the tokens of
    --keep-text's first occurrence in the prompt."""
    rows = set(range(min(check_keep_first(c.keep_first), n)))  # never more rows than the prompt has
    for a, b in parse_ranges(c.keep_rows, "--keep-rows", "row", "0-3,120-140") if c.keep_rows else ():
        if b >= n:
            raise RidgefillError(f"--keep-rows {a}-{b} reaches past the {n}-token prompt (rows 0..{n - 1})")
        rows.update(range(a, b + 1))
    if c.keep_text is not None:
        at = prompt.find(c.keep_text)
        if at < 0:
            raise RidgefillError(f"--keep-text {c.keep_text[:40]!r} does not occur in the prompt: give a piece of it")
        if not getattr(tokenizer, "is_fast", False):
            raise RidgefillError("--keep-text needs a fast tokenizer (with offsets): use --keep-rows")
        offsets = tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
        first, last = token_span([tuple(o) for o in offsets], at, at + len(c.keep_text))
        rows.update(range(first, last))
    return sorted(rows)


COMMAND = Command("generate", GenerateConfig, run)
