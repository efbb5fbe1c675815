"""RULER's synthetic tasks, generated offline with needles placed in chosen rows, scored as RULER scores them.

A sample's needles go where `region` says: `filled` (rows that a filled prefill fills: after the first
`keep_first` rows and before the tail), `tail` (the last `tail` prompt rows, which run the full model) or
`any`. Each sample records its needles' token spans and the tail start, so the placement can be checked.
Haystack sizes are searched so that prompt + generation budget fits the length. Scoring follows RULER:
case-insensitive substring match, string_match_all (share of references found) for niah/vt/cwe/fwe and
string_match_part (any reference found) for qa, x100.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ridgefill.errors import RidgefillError
from ridgefill.evals.ruler.tasks import SPECS, Layout, Sources, make_layout, max_size, task_spec

TASKS: tuple[str, ...] = tuple(SPECS)
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


def build_samples(tokenizer, task: str, length: int, n: int, seed: int, region: str = "filled", tail: int = 256,
                  keep_first: int = 1, haystack: str = "auto", max_new_tokens: int | None = None,
                  chat_template: bool = False, sources: Sources | None = None, advance=None) -> list[RulerSample]:
    """`n` samples of `task` whose prompt plus generation budget fits `length` tokens; same seed, same samples."""
    spec = task_spec(task)
    check_region(region, tail, keep_first, length)
    if haystack not in ("auto", "noise", "essay"):
        raise RidgefillError(f"unknown haystack '{haystack}': use noise, essay or auto (the task's RULER default)")
    kind = spec.haystack if haystack == "auto" or spec.haystack is None else haystack
    sources = sources or Sources.load()
    builder = _Builder(spec, _Prompter(tokenizer, chat_template), length, seed, region, tail, keep_first, kind,
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
    if tail < 1 or keep_first < 0:
        raise RidgefillError("--tail must be at least 1 and --keep-first at least 0")
    if region == "filled" and tail + keep_first >= length:
        raise RidgefillError(f"--tail {tail} plus --keep-first {keep_first} leave no filled row at length {length}: "
                             "lower --tail or use --region tail/any")


def score_prediction(task: str, prediction: str, outputs: list[str]) -> float:
    """RULER's score of one prediction, 0..100: string_match_part for qa tasks, string_match_all otherwise."""
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    found = [1.0 if r.lower() in pred else 0.0 for r in outputs]
    if not found:
        return 0.0
    return 100.0 * (max(found) if task.startswith("qa") else sum(found) / len(found))


def predict(engine, tokenizer, sample: RulerSample, plan) -> str:
    """Greedy generation (stops at EOS) after an exact (plan None) or filled prefill; the decoded answer."""
    ids = torch.tensor([sample.input_ids])
    out = engine.generate(ids, sample.max_new_tokens, plan, tokenizer.eos_token_id)
    return tokenizer.decode(out.tokens[0], skip_special_tokens=True)


# --- placement ------------------------------------------------------------------------------------------
class _Prompter:
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


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token [first, last+1) of the tokens that overlap chars [start, end)."""
    ends = [o[1] for o in offsets]
    first = bisect.bisect_right(ends, start)
    last = first
    while last < len(offsets) and offsets[last][0] < end:
        last += 1
    return first, max(last, first + 1)


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
        spans = [_token_span(offsets, shift + s, shift + e) for s, e in char_spans]
        tail_start = max(0, len(ids) - self.tail)
        if not all(_in_region(s, self.region, self.keep_first, tail_start) for s in spans):
            return None
        c0, c1 = _token_span(offsets, shift + ctx[0], shift + ctx[1])
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


# --- RULER jsonl ----------------------------------------------------------------------------------------
JSONL_FIELDS = {"input": str, "outputs": list, "length": int, "answer_prefix": str}


def read_jsonl(path: str | Path, tokenizer, tail: int, max_new_tokens: int | None = None,
               chat_template: bool = False, limit: int | None = None) -> list[RulerSample]:
    """Samples from a RULER jsonl file (fields input, outputs, length, answer_prefix; optional
    token_position_answer). The task is the file's stem, or its folder's name (RULER's <task>/validation.jsonl).
    Needle spans are the first occurrence of each reference in the input (where found)."""
    path = Path(path)
    if not path.is_file():
        raise RidgefillError(f"--from-jsonl {path} does not exist")
    task = path.stem if path.stem.split("_")[0] in ("niah", "vt", "cwe", "fwe", "qa") else path.parent.name
    prompter = _Prompter(tokenizer, chat_template)
    samples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = _record(path, number, line)
        prompt, shift = prompter.text(record["input"], record["answer_prefix"])
        ids, offsets = prompter.encode(prompt)
        lowered = record["input"].lower()
        spans = sorted(_token_span(offsets, shift + i, shift + i + len(r))
                       for r in record["outputs"] if (i := lowered.find(r.lower())) >= 0)
        end = len(record["input"]) + shift
        context = bisect.bisect_right([o[1] for o in offsets], end)
        depths = [s / max(1, context) for s, _ in spans]
        samples.append(RulerSample(task, record["length"], depths[0] if depths else math.nan, record["input"],
                                   record["answer_prefix"], record["outputs"], budget(task, max_new_tokens), ids,
                                   spans, max(0, len(ids) - tail), depths, len(samples)))
        if limit is not None and len(samples) == limit:
            break
    if not samples:
        raise RidgefillError(f"{path} holds no records: point --from-jsonl at a RULER jsonl file")
    return samples


def _record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RidgefillError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise RidgefillError(f"{path}:{number}: a record must be a JSON object")
    for name, kind in JSONL_FIELDS.items():
        if name not in record:
            raise RidgefillError(f"{path}:{number}: record has no '{name}' (RULER records need "
                                 f"{', '.join(JSONL_FIELDS)})")
        if not isinstance(record[name], kind) or isinstance(record[name], bool):
            raise RidgefillError(f"{path}:{number}: field '{name}' must be a {kind.__name__}")
    if not all(isinstance(r, str) for r in record["outputs"]):
        raise RidgefillError(f"{path}:{number}: field 'outputs' must be a list of strings")
    return record


# --- the command ----------------------------------------------------------------------------------------
DEPTH_BUCKETS = 5  # needle depth buckets of 20 %


def ruler_command(model: str = "smollm2-135m", maps=None, split: int | None = None, tail: int = 256,
                  lengths: str = "4096", tasks: str | None = None, samples: int | None = None,
                  region: str = "filled", seed: int = 0, out="ruler.json", variants: str | None = None,
                  keep_first: int = 1, chunk: int = 2048, dtype: str = "fp32", device: str = "cpu",
                  haystack: str = "auto", essay_corpus: str = "wiki-leads", max_new_tokens: int | None = None,
                  from_jsonl=None, chat_template: bool = False, exact_cache=None) -> dict:
    """Generate (or read) RULER samples, answer them greedily with each variant, score them, write `out`.
    exact_cache: a folder where exact answers are kept by sample (ExactStore), reused by later runs."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}
    from ridgefill.runtime.console import progress_bar
    from ridgefill.evals.exact_store import ExactStore
    from ridgefill.evals.common import ResultWriter, maps_info
    from ridgefill.runtime.session import open_session, parse_variants, variant_plans

    names = parse_variants(variants, maps)
    task_names = _parse_tasks(tasks)
    length_list = _parse_lengths(lengths)
    if samples is not None and samples < 1 or max_new_tokens is not None and max_new_tokens < 1:
        raise RidgefillError("--samples and --max-new-tokens must be at least 1")
    if from_jsonl is None:
        for length in length_list:
            check_region(region, tail, keep_first, length)
        config.update(budgets={t: budget(t, max_new_tokens) for t in task_names},
                      haystacks={t: SPECS[t].haystack if haystack == "auto" else haystack for t in task_names})
    config["region_enforced"] = from_jsonl is None
    writer = ResultWriter("ruler", config, seed)
    session = open_session(model, dtype, device, chunk)
    context = session.engine.adapter.max_positions
    too_long = [n for n in length_list if context and n > context] if from_jsonl is None else []
    if too_long:
        raise RidgefillError(f"length {too_long[0]} exceeds the model's context of {context} (prompt plus generation "
                             "budget must fit): lower --lengths")
    plans, meta = variant_plans(session, maps, split, tail, range(keep_first), names)
    if from_jsonl is not None:
        items = read_jsonl(from_jsonl, session.tokenizer, tail, max_new_tokens, chat_template, samples)
        over = [s for s in items if context and len(s.input_ids) + s.max_new_tokens > context]
        if over:
            raise RidgefillError(f"record {over[0].index + 1} of {from_jsonl} needs {len(over[0].input_ids)} prompt + "
                                 f"{over[0].max_new_tokens} new tokens, over the model's context of {context}")
    else:
        sources = Sources.load(essay_corpus)
        n = samples or 25
        items = []
        with progress_bar("building RULER samples", n * len(task_names) * len(length_list)) as advance:
            for length in length_list:
                for task in task_names:
                    items += build_samples(session.tokenizer, task, length, n, seed, region, tail, keep_first,
                                           haystack, max_new_tokens, chat_template, sources, advance)
    store = ExactStore(exact_cache, session.loaded.info(), dtype, device, chunk)
    predictions = {v: [] for v in plans}
    with progress_bar(f"answering {len(items)} samples x {len(plans)} variants", len(items) * len(plans)) as advance:
        for sample in items:
            for name, plan in plans.items():
                key = {"ids": sample.input_ids, "max_new_tokens": sample.max_new_tokens}
                predictions[name].append(store.get_exact(plan, "ruler-answer", key, lambda plan=plan: predict(
                    session.engine, session.tokenizer, sample, plan)))
                advance()
    scores = {v: [score_prediction(s.task, p, s.outputs) for s, p in zip(items, predictions[v])] for v in plans}
    results, intervals = summarise(items, scores, seed)
    records = [_record_of(s, {v: predictions[v][i] for v in plans}, {v: scores[v][i] for v in plans})
               for i, s in enumerate(items)]
    doc = writer.write(out, session.loaded.info(), maps_info(maps, meta), list(plans), results, intervals,
                       exact_store=store.summary(), samples=records)
    _print_tables(results, intervals, region if from_jsonl is None else "as given", tail)
    return doc


def summarise(items: list[RulerSample], scores: dict[str, list[float]], seed: int) -> tuple[dict, dict]:
    """Per variant: headline score (mean over task x length cells), per task / length / depth bucket; and
    paired-bootstrap intervals of each variant's difference against exact (cells weighted equally)."""
    cells = [(s.task, s.length) for s in items]
    buckets = [depth_bucket(s.depth) for s in items]
    results = {}
    for name, values in scores.items():
        by_cell = _group_means(values, cells)
        results[name] = {
            "score": float(np.mean(list(by_cell.values()))),
            "tasks": {t: {"score": _mean_of(by_cell, lambda c: c[0] == t),
                          "lengths": {str(c[1]): m for c, m in by_cell.items() if c[0] == t}}
                      for t in dict.fromkeys(c[0] for c in cells)},
            "lengths": {str(n): _mean_of(by_cell, lambda c: c[1] == n) for n in dict.fromkeys(c[1] for c in cells)},
            "depths": {b: {"score": m, "n": buckets.count(b)}
                       for b, m in sorted(_group_means(values, buckets).items())},
        }
    intervals = {}
    if "exact" in scores:
        for name in (v for v in scores if v != "exact"):
            diff = _differences(scores[name], scores["exact"], cells, seed)
            intervals[name] = {
                "score": diff(range(len(items))),
                "tasks": {t: diff([i for i, c in enumerate(cells) if c[0] == t]) for t in results[name]["tasks"]},
                "lengths": {str(n): diff([i for i, c in enumerate(cells) if c[1] == n])
                            for n in dict.fromkeys(c[1] for c in cells)},
            }
    return results, intervals


def _differences(a: list[float], b: list[float], cells: list, seed: int):
    """diff(indices) -> the interval of mean(a) - mean(b) over those samples, each cell weighted equally."""
    from ridgefill.evals.stats import mean_difference

    def diff(indices) -> dict:
        indices = list(indices)
        sub = [cells[i] for i in indices]
        return mean_difference(_balanced([a[i] for i in indices], sub), _balanced([b[i] for i in indices], sub),
                               seed=seed).to_dict()

    return diff


def _balanced(values: list[float], groups: list) -> list[float]:
    """Values rescaled so that their plain mean is the mean of the group means."""
    counts = {g: groups.count(g) for g in set(groups)}
    return [v * len(groups) / (len(counts) * counts[g]) for v, g in zip(values, groups)]


def _group_means(values: list[float], groups: list) -> dict:
    out: dict = {}
    for v, g in zip(values, groups):
        out.setdefault(g, []).append(v)
    return {g: float(np.mean(vs)) for g, vs in out.items()}


def _mean_of(by_cell: dict, keep) -> float:
    return float(np.mean([m for c, m in by_cell.items() if keep(c)]))


def depth_bucket(depth: float) -> str:
    if math.isnan(depth):
        return "none"
    width = 100 // DEPTH_BUCKETS
    lo = min(int(depth * 100) // width, DEPTH_BUCKETS - 1) * width
    return f"{lo:02d}-{lo + width}%"


def _record_of(sample: RulerSample, predictions: dict, scores: dict) -> dict:
    nan = math.isnan(sample.depth)
    return {"task": sample.task, "length": sample.length, "index": sample.index,
            "depth": None if nan else sample.depth, "needle_depths": sample.needle_depths,
            "needle_spans": [list(s) for s in sample.needle_spans], "tail_start": sample.tail_start,
            "n_tokens": len(sample.input_ids), "max_new_tokens": sample.max_new_tokens, "outputs": sample.outputs,
            "predictions": predictions, "scores": scores}


def _parse_tasks(text: str | None) -> list[str]:
    names = [t.strip() for t in (text or ",".join(TASKS)).split(",") if t.strip()]
    unknown = [t for t in names if t not in SPECS]
    if unknown or not names:
        raise RidgefillError(f"unknown RULER task(s) {', '.join(unknown) or '(none)'}: use {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def _parse_lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise RidgefillError(f"--lengths '{text}' is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise RidgefillError(f"--lengths '{text}' must list positive token counts, e.g. 2048,4096")
    return sorted(set(values))


def _print_tables(results: dict, intervals: dict, region: str, tail: int) -> None:
    from ridgefill.runtime.console import table

    names = list(results)
    first = results[names[0]]
    rows = [[t, n] + [results[v]["tasks"][t]["lengths"][n] for v in names]
            for t in first["tasks"] for n in first["tasks"][t]["lengths"]]
    rows.append(["score (mean)", ""] + [results[v]["score"] for v in names])
    table(f"RULER score (0-100), needles in {region} rows, tail {tail}", ["task", "length"] + names, rows)
    table("score by needle depth (first needle)", ["depth", "samples"] + names,
          [[b, d["n"]] + [results[v]["depths"][b]["score"] for v in names] for b, d in first["depths"].items()])
    if intervals:
        table("difference vs exact (95% paired bootstrap over samples)", ["variant", "Δ score", "low", "high"],
              [[v, iv["score"]["estimate"], iv["score"]["low"], iv["score"]["high"]] for v, iv in intervals.items()])
