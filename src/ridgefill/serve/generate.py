"""`ridgefill generate`: greedy generation after exact or filled prefill, with time to first token."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ridgefill.commands import Command, option
from ridgefill.engine.rows import check_keep_first
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import ServedOptions
from ridgefill.runtime.console import note
from ridgefill.runtime.paths import read_text
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.session import ModelConfig
from ridgefill.runtime.spans import token_span
from ridgefill.serve.vllm_engine import check_engine, engine_cpu_only, engine_option


@dataclass
class GenerateConfig(ServedOptions, ModelConfig):
    keep_rows: str | None = option(None, "More prompt rows (0-based token positions) that run in full, e.g. "
                                   "0-3,120-140.", listed=str)
    keep_text: str | None = option(None, "Run the tokens of this text's first occurrence in the prompt in full "
                                   "(e.g. the question).")
    exact: bool = option(False, "Exact prefill (no maps).")
    prompt: str | None = option(None, "Prompt text.")
    prompt_file: Path | None = option(None, "Read the prompt from a file.")
    max_new_tokens: int = option(64, "Tokens to generate (greedy).")
    compare: bool = option(False, "Run exact and filled; print both with their TTFT.")
    engine: str = engine_option()

    def source_rule(self):
        return (), None if self.exact else ", or pass --exact"

    def cpu_only(self) -> str | None:
        return engine_cpu_only(self.engine)

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
        check_engine(self.engine)
        if self.engine == "vllm" and (self.keep_rows is not None or self.keep_text is not None):
            raise RidgefillError("--keep-rows and --keep-text are not supported with --engine vllm (the plugin keeps "
                                 "the first --keep-first rows and the tail): drop them")


def run(c: GenerateConfig) -> dict:
    """The generated text of each run (exact, filled), by name."""
    c, tuned = c.served()
    tail, exact, max_new_tokens, compare = c.tail, c.exact, c.max_new_tokens, c.compare
    prompt = c.prompt if c.prompt_file is None else read_text(c.prompt_file, "--prompt-file")
    session = c.open()
    ids = session.tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]
    if ids.shape[1] == 0:
        raise RidgefillError("the prompt is empty after tokenization")
    limit = session.context_length
    if limit and not exact:  # before any row of the fill is planned
        check_keep_first(c.keep_first, limit, within=" (this model's context)")
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise RidgefillError(f"prompt ({ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceed the model's "
                             f"context of {limit}: shorten the prompt")
    if tuned is not None:
        tuned.check_model(session.loaded.fingerprint, c.serving_config)
    plan = None
    if not exact:
        plan, _ = c.fill().plan(session, keep_rows(c, session.tokenizer, prompt, ids.shape[1]))
        if tail >= ids.shape[1]:
            note(f"note: tail {tail} >= prompt length {ids.shape[1]}: every row runs the full model (exact)")
        elif c.keep_first + tail >= ids.shape[1]:
            note(f"note: keep-first {c.keep_first} and tail {tail} cover the {ids.shape[1]}-token prompt: every row "
                 "runs the full model (exact)")
    eos = session.tokenizer.eos_token_id
    if c.engine == "vllm":
        runs = vllm_runs(c, session, ids[0].tolist(), plan, exact or compare)
    else:
        runs = {}
        if exact or compare:
            runs["exact"] = Run.of(session.engine.generate(ids, max_new_tokens, None, eos))
        if plan is not None:
            runs["filled"] = Run.of(session.engine.generate(ids, max_new_tokens, plan, eos))
    texts = {k: session.tokenizer.decode(r.tokens, skip_special_tokens=True) for k, r in runs.items()}
    where = " (vLLM)" if c.engine == "vllm" else ""
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
    """One generation: its tokens, time to first token, and rows filled / run in full as outliers / run in full
    without a whole lookback window."""

    tokens: list[int]
    ttft_s: float
    filled: int
    outliers: int
    unwindowed: int = 0

    @classmethod
    def of(cls, result) -> "Run":
        pre = result.prefill
        return cls(result.tokens[0], result.ttft_s, pre.n_filled, pre.n_outliers, pre.n_unwindowed)

    def summary(self, n: int) -> str:
        text = f"ttft {self.ttft_s * 1000:.0f} ms, {self.filled / max(1, n):.0%} of {n} prompt rows filled"
        text += f" ({self.outliers} outlier rows ran in full)" if self.outliers else ""
        return text + (f" ({self.unwindowed} rows without a lookback window ran in full)" if self.unwindowed else "")


def vllm_runs(c: GenerateConfig, session, ids: list[int], plan, exact: bool) -> dict[str, Run]:
    """The same generations in vLLM: exact on stock vLLM, filled with ridgefill's plugin (identity fill through
    an identity maps file written for the run). Each stops at the end-of-sequence token."""
    import tempfile

    from ridgefill.runtime.models import model_folder
    from ridgefill.serve.vllm_config import check_engine_dtype
    from ridgefill.serve.vllm_engine import EngineSettings, vllm_dtype

    folder = model_folder(c.model)
    check_engine_dtype(folder, c.dtype)
    base = dict(dtype=vllm_dtype(c.dtype), max_model_len=len(ids) + c.max_new_tokens)
    runs = {}
    if exact:
        runs["exact"] = _vllm_run(EngineSettings(folder, plugin=False, **base), ids, c.max_new_tokens)
    if plan is not None:
        with tempfile.TemporaryDirectory(prefix="ridgefill-vllm-") as scratch:
            fill = c.fill().for_vllm(session.engine.n_layers, session.loaded.info(), Path(scratch))
            runs["filled"] = _vllm_run(EngineSettings(folder, fill, **base), ids, c.max_new_tokens)
    return runs


def _vllm_run(settings, ids: list[int], new: int) -> Run:
    from ridgefill.serve.vllm_engine import VllmWorker

    with VllmWorker(settings) as worker:
        (done,) = worker.generate([ids], new, stop_at_eos=True)
        tally = worker.tally()
    return Run(done.tokens, done.first_token_s or done.seconds, tally["filled_rows"],
               tally["outlier_rows_run_full"], tally["lookback_rows_run_full"])


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
