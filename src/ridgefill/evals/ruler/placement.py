"""RULER samples generated offline with their needles placed in chosen rows.

A sample's needles go where `region` says: `filled` (rows that a filled prefill fills: after the first
`keep_first` rows and before the tail), `tail` (the last `tail` prompt rows, which run the full model) or
`any`. Each sample records its needles' token spans and the tail start, so the placement can be checked.
Haystack sizes are searched so that prompt + generation budget fits the length.
"""

from __future__ import annotations

import bisect
import math
import random
import re
from dataclasses import dataclass, field

import numpy as np

from ridgefill.defaults import DEFAULT_KEEP_FIRST, DEFAULT_TAIL
from ridgefill.torchfill.rows import check_keep_first, check_tail
from ridgefill.errors import RidgefillError
from ridgefill.evals.ruler.tasks import Layout, Sources, check_haystack, make_layout, max_size, task_spec
from ridgefill.runtime.spans import token_span

REGIONS = ("filled", "tail", "any")
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40))]  # RULER's needle depths (%)
MARGIN = 4  # tokens kept between a needle and its region's edge before the placement is verified
TRIES = 8  # fresh draws per sample before a placement failure is reported


@dataclass
class RulerSample:
    task: str
    length: int
    depth: float  # needle depth in [0, 1] (first needle in the context; nan without needles)
    input: str
    answer_prefix: str
    outputs: list[str]
    max_new_tokens: int
    input_ids: list[int]  # tokenized prompt (input + answer_prefix)
    needle_spans: list[tuple[int, int]]  # token [start, end) of each needle in input_ids, in context order
    tail_start: int  # first row that runs the full model
    needle_depths: list[float] = field(default_factory=list)
    index: int = 0


def budget(task: str, max_new_tokens: int | None = None) -> int:
    """RULER's generation budget for `task` (any RULER task name), capped at `max_new_tokens`."""
    family = re.sub(r"_.*", "", task)
    full = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}.get(family, 128)
    return full if max_new_tokens is None else min(full, max_new_tokens)


def build_samples(tokenizer, task: str, length: int, n: int, seed: int, region: str = "filled",
                  tail: int = DEFAULT_TAIL, keep_first: int = DEFAULT_KEEP_FIRST, haystack: str = "auto",
                  max_new_tokens: int | None = None, chat_template: bool = False, sources: Sources | None = None,
                  advance=None) -> list[RulerSample]:
    """`n` samples of `task` whose prompt plus generation budget fits `length` tokens; same seed, same samples."""
    spec = task_spec(task)
    check_region(region, tail, keep_first, length)
    check_haystack(haystack)
    kind = spec.haystack if haystack == "auto" or spec.haystack is None else haystack
    sources = sources or Sources.load()
    builder = _Builder(spec, Prompter(tokenizer, chat_template), length, seed, region, tail, keep_first, kind,
                       budget(task, max_new_tokens), sources)
    size = builder.largest_size()
    samples = []
    for i in range(n):
        samples.append(builder.sample(i, size))
        if advance is not None:
            advance()
    return samples


def check_region(region: str, tail: int, keep_first: int, length: int) -> None:
    if region not in REGIONS:
        raise RidgefillError(f"unknown region '{region}': use {', '.join(REGIONS)}")
    check_tail(tail)
    check_keep_first(keep_first)
    if region == "filled" and tail + keep_first >= length:
        raise RidgefillError(f"--tail {tail} plus --keep-first {keep_first} leave no filled row at length {length}: "
                             "lower --tail or use --region tail/any")


# --- placement ------------------------------------------------------------------------------------------
class Prompter:
    """Turns (input, answer_prefix) into the prompt text and tokens, optionally through the chat template."""

    def __init__(self, tokenizer, chat_template: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat_template
        if not getattr(tokenizer, "is_fast", False):
            raise RidgefillError("the tokenizer has no offset mapping (not a fast tokenizer): needle rows cannot be "
                                 "located; use a model with a fast tokenizer")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise RidgefillError("--chat-template given but the tokenizer has no chat template: drop the flag")

    def text(self, input_text: str, answer_prefix: str) -> tuple[str, int]:
        """(prompt text, offset of input_text within it)."""
        if not self.chat:
            return input_text + answer_prefix, 0
        wrapped = self.tokenizer.apply_chat_template([{"role": "user", "content": input_text}], tokenize=False,
                                                     add_generation_prompt=True)
        if input_text not in wrapped:
            raise RidgefillError("the chat template alters the prompt text, so needle rows cannot be located: drop "
                                 "--chat-template")
        return wrapped + answer_prefix, wrapped.index(input_text)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=not self.chat, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])


def _render(lay: Layout, positions: list[int]) -> tuple[str, list[tuple[int, int]], list[int], tuple[int, int]]:
    """Insert needle i before unit positions[i] (non-decreasing). Returns (input text, needle char spans,
    char start of each unit boundary 0..len(units), context char span)."""
    items, is_needle, j = [], [], 0
    for b in range(len(lay.units) + 1):
        while j < len(positions) and positions[j] == b:
            items.append(lay.needles[j])
            is_needle.append(True)
            j += 1
        if b < len(lay.units):
            items.append(lay.units[b])
            is_needle.append(False)
    if lay.numbered:
        items = [f"{i + 1}. {t}" for i, t in enumerate(items)]
    pos, spans, starts, pieces = len(lay.head), [], [], []
    for text, needle in zip(items, is_needle):
        if pieces:
            pos += len(lay.joiner)
        if needle:
            spans.append((pos, pos + len(text)))
        else:
            starts.append(pos)
        pieces.append(text)
        pos += len(text)
    context = lay.joiner.join(pieces)
    starts.append(len(lay.head) + len(context))
    return lay.head + context + lay.question, spans, starts, (len(lay.head), len(lay.head) + len(context))


class _Builder:
    def __init__(self, spec, prompter, length, seed, region, tail, keep_first, haystack, budget, sources):
        self.spec, self.prompter, self.length, self.seed = spec, prompter, length, seed
        self.region, self.tail, self.keep_first, self.haystack = region, tail, keep_first, haystack
        self.budget, self.sources = budget, sources

    def _layout(self, index: int, attempt: int, size: int) -> Layout:
        seed = f"{self.seed}:{self.spec.name}:{self.length}:{index}:{attempt}"
        return make_layout(self.spec, seed, size, self.haystack, self.length, self.sources)

    def _tokens(self, lay: Layout) -> int:
        text, _, _, _ = _render(lay, [0] * len(lay.needles))
        return self.prompter.count(self.prompter.text(text, lay.answer_prefix)[0])

    def largest_size(self) -> int:
        """Largest haystack size whose prompt (sample 0's draw) plus the budget fits the length."""
        def fits(size):
            return self._tokens(self._layout(0, 0, size)) + self.budget <= self.length

        lo, top = self.spec.min_size, max_size(self.spec, self.haystack, self.sources)
        if not fits(lo):
            need = self._tokens(self._layout(0, 0, lo)) + self.budget
            raise RidgefillError(f"{self.spec.name} does not fit {self.length} tokens: its shortest prompt plus the "
                                 f"{self.budget}-token generation budget takes {need}; raise --lengths or lower "
                                 "--max-new-tokens")
        good, bad, step = lo, None, 16
        while bad is None:
            probe = good + step if top is None else min(good + step, top)
            if probe == good:
                return good
            if fits(probe):
                good, step = probe, step * 2
            else:
                bad = probe
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        return good

    def sample(self, index: int, size: int) -> RulerSample:
        for attempt in range(TRIES):
            lay = self._layout(index, attempt, size)
            while self._tokens(lay) + self.budget > self.length and size > self.spec.min_size:
                size = max(self.spec.min_size, size - max(1, size // 50))
                lay = self._layout(index, attempt, size)
            sample = self._place(lay, random.Random(f"{self.seed}:{self.spec.name}:{index}:{attempt}:place"), index)
            if sample is not None and len(sample.input_ids) + self.budget <= self.length:
                return sample
        raise RidgefillError(f"could not place the {self.spec.name} needles in the {self.region} rows at length "
                             f"{self.length} (tail {self.tail}): use a longer length, a shorter tail or --region any")

    def _place(self, lay: Layout, rng: random.Random, index: int) -> RulerSample | None:
        """Choose needle boundaries inside the region, render, and verify the spans (None if they miss)."""
        text, _, starts, ctx = _render(lay, [])
        prompt, shift = self.prompter.text(text, lay.answer_prefix)
        ids, offsets = self.prompter.encode(prompt)
        ends = [o[1] for o in offsets]
        bound = [bisect.bisect_right(ends, shift + c) for c in starts]  # token index of each boundary
        c0, c1 = (bisect.bisect_right(ends, shift + c) for c in ctx)
        with_needles = self._tokens(lay)
        needle_tokens = with_needles - len(ids)
        tail_start = with_needles - self.tail
        if self.region == "filled":
            allowed = [b for b, t in enumerate(bound)
                       if t >= self.keep_first + MARGIN and t + needle_tokens + MARGIN <= tail_start]
        elif self.region == "tail":
            allowed = [b for b, t in enumerate(bound) if t >= tail_start + MARGIN]
        else:
            allowed = list(range(len(bound)))
        if lay.needles and not allowed:
            room = "filled rows" if self.region == "filled" else "tail rows"
            raise RidgefillError(f"no room for the {self.spec.name} needles ({needle_tokens} tokens) in the {room} at "
                                 f"length {self.length} with --tail {self.tail} and --keep-first {self.keep_first}: "
                                 f"lower --tail, raise --lengths or use --region any")
        depth = [(t - c0) / max(1, c1 - c0) for t in bound]
        positions = _choose(lay, allowed, depth, rng)
        text, char_spans, _, ctx = _render(lay, positions)
        prompt, shift = self.prompter.text(text, lay.answer_prefix)
        ids, offsets = self.prompter.encode(prompt)
        spans = [token_span(offsets, shift + s, shift + e) for s, e in char_spans]
        tail_start = max(0, len(ids) - self.tail)
        if not all(_in_region(s, self.region, self.keep_first, tail_start) for s in spans):
            return None
        c0, c1 = token_span(offsets, shift + ctx[0], shift + ctx[1])
        depths = [(s - c0) / max(1, c1 - c0) for s, _ in spans]
        return RulerSample(self.spec.name, self.length, depths[0] if depths else math.nan, text, lay.answer_prefix,
                           lay.outputs, self.budget, ids, spans, tail_start, depths, index)


def _choose(lay: Layout, allowed: list[int], depth: list[float], rng: random.Random) -> list[int]:
    """Boundaries for the needles: RULER's 40 depths (those landing in `allowed`) or uniform over `allowed`."""
    k = len(lay.needles)
    if k == 0:
        return []
    if lay.placement == "depth":
        ok = set(allowed)
        options = [b for b in (_nearest(depth, d / 100) for d in DEPTHS) if b in ok]
        if options:
            return sorted(rng.sample(options, k) if len(options) >= k else rng.choices(options, k=k))
    return sorted(rng.choices(allowed, k=k))


def _nearest(sorted_values: list[float], x: float) -> int:
    """Index of the value nearest to x."""
    i = bisect.bisect_left(sorted_values, x)
    if i == 0:
        return 0
    if i == len(sorted_values):
        return i - 1
    return i - 1 if x - sorted_values[i - 1] <= sorted_values[i] - x else i


def _in_region(span: tuple[int, int], region: str, keep_first: int, tail_start: int) -> bool:
    if region == "filled":
        return span[0] >= keep_first and span[1] <= tail_start
    if region == "tail":
        return span[0] >= tail_start
    return True
