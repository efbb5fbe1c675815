"""`ridgefill ruler`: RULER's synthetic tasks with needles placed in chosen rows (placement.py; or RULER's own
jsonl files, jsonl.py), answered greedily by each variant and scored as RULER scores them: case-insensitive
substring match, string_match_all (share of references found) for niah/vt/cwe/fwe and string_match_part (any
reference found) for qa, x100.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ridgefill.backends.base import EngineOptions
from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig, exact_cache_option, parse_lengths, start, variants_option
from ridgefill.evals.ruler.jsonl import read_jsonl
from ridgefill.evals.ruler.placement import RulerSample, budget, build_samples, check_region
from ridgefill.evals.ruler.tasks import SPECS, Sources, check_haystack
from ridgefill.method.fill import parse_variants
from ridgefill.runtime.console import progress_bar, table

TASKS: tuple[str, ...] = tuple(SPECS)


def score_prediction(task: str, prediction: str, outputs: list[str]) -> float:
    """RULER's score of one prediction, 0..100: string_match_part for qa tasks, string_match_all otherwise."""
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    found = [1.0 if r.lower() in pred else 0.0 for r in outputs]
    if not found:
        return 0.0
    return 100.0 * (max(found) if task.startswith("qa") else sum(found) / len(found))


def predict(backend, tokenizer, sample: RulerSample, variant: str) -> str:
    """Greedy generation (stops at EOS) after variant `variant`'s prefill (exact or filled); the decoded answer."""
    out = backend.generate(variant, sample.input_ids, sample.max_new_tokens, tokenizer.eos_token_id)
    return tokenizer.decode(out.tokens, skip_special_tokens=True)



# --- the command ----------------------------------------------------------------------------------------
DEPTH_BUCKETS = 5  # needle depth buckets of 20 %


@dataclass
class RulerConfig(EngineOptions, MeasureConfig):
    lengths: str = option("4096", "Comma-separated prompt + generation lengths (tokens).", listed=int)
    tasks: str | None = option(None, "Comma-separated RULER tasks (default: all 11).", listed=str)
    samples: int | None = option(None, "Samples per task and length (default 25; with --from-jsonl: the first N "
                                 "records, default all).")
    region: str = option("filled", "Where the needles go: filled (rows the fill fills), tail, or any.")
    seed: int = option(0, "Sample and bootstrap seed.", top="seeds")
    variants: str | None = variants_option()
    haystack: str = option("auto", "noise, essay, or auto (each task's RULER default).")
    essay_corpus: str = option("wiki-leads", "Essay haystack text: wiki-leads or shakespeare (evaluation "
                               "documents).")
    max_new_tokens: int | None = option(None, "Cap on RULER's generation budgets (niah 128, vt 30, cwe 120, fwe "
                                        "50).")
    from_jsonl: Path | None = option(None, "Score RULER jsonl records (input, outputs, length, answer_prefix) "
                                     "instead of generating samples.")
    chat_template: bool = option(False, "Wrap inputs in the tokenizer's chat template (default: plain text, as "
                                 "RULER's base template).")
    exact_cache: Path | None = exact_cache_option()

    def check(self) -> None:
        super().check()
        parse_variants(self.variants, self.maps)
        parse_tasks(self.tasks)
        check_haystack(self.haystack)
        lengths = parse_lengths(self.lengths)
        if (self.samples is not None and self.samples < 1
                or self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise RidgefillError("--samples and --max-new-tokens must be at least 1")
        if self.from_jsonl is None:
            for length in lengths:
                check_region(self.region, self.tail, self.keep_first, length)


def run(c: RulerConfig) -> dict:
    """Generate (or read) RULER samples, answer them greedily with each variant, score them, write --out. The
    exact answers go through the exact store (by sample), so a sweep's other splits reuse them."""
    task_names, length_list = parse_tasks(c.tasks), parse_lengths(c.lengths)
    record = c.as_dict()
    if c.from_jsonl is None:
        record.update(budgets={t: budget(t, c.max_new_tokens) for t in task_names},
                      haystacks={t: SPECS[t].haystack if c.haystack == "auto" else c.haystack for t in task_names})
    record["region_enforced"] = c.from_jsonl is None
    m = start("ruler", c, parse_variants(c.variants, c.maps), record)
    context = m.model.context_length
    too_long = [n for n in length_list if context and n > context] if c.from_jsonl is None else []
    if too_long:
        raise RidgefillError(f"length {too_long[0]} exceeds the model's context of {context} (prompt plus generation "
                             "budget must fit): lower --lengths")
    items = _samples(c, m.model.tokenizer, task_names, length_list, context)
    longest = max((len(s.input_ids) + s.max_new_tokens for s in items), default=1)
    with m.backend.start(longest):
        predictions = m.answers(items, f"answering {len(items)} samples x {len(m.plans)} variants", "ruler-answer",
                                lambda s: {"ids": s.input_ids, "max_new_tokens": s.max_new_tokens},
                                lambda s, name: predict(m.backend, m.model.tokenizer, s, name))
    scores = {v: [score_prediction(s.task, p, s.outputs) for s, p in zip(items, predictions[v])] for v in m.plans}
    results, intervals = summarise(items, scores, c.seed)
    records = [_record_of(s, {v: predictions[v][i] for v in m.plans}, {v: scores[v][i] for v in m.plans})
               for i, s in enumerate(items)]
    doc = m.write(results, intervals, samples=records)
    _print_tables(results, intervals, c.region if c.from_jsonl is None else "as given", c.tail,
                  length_cells(items, scores, nominal=c.from_jsonl is None))
    return doc


def _samples(c: RulerConfig, tokenizer, task_names: list[str], length_list: list[int],
             context: int | None) -> list[RulerSample]:
    """The samples to answer: read from --from-jsonl, or built per length and task."""
    if c.from_jsonl is not None:
        items = read_jsonl(c.from_jsonl, tokenizer, c.tail, c.max_new_tokens, c.chat_template, c.samples)
        over = [s for s in items if context and len(s.input_ids) + s.max_new_tokens > context]
        if over:
            raise RidgefillError(f"record {over[0].index + 1} of {c.from_jsonl} needs {len(over[0].input_ids)} prompt "
                                 f"+ {over[0].max_new_tokens} new tokens, over the model's context of {context}")
        return items
    sources = Sources.load(c.essay_corpus)
    n = c.samples or 25
    items = []
    with progress_bar("building RULER samples", n * len(task_names) * len(length_list)) as advance:
        for length in length_list:
            for task in task_names:
                items += build_samples(tokenizer, task, length, n, c.seed, c.region, c.tail, c.keep_first,
                                       c.haystack, c.max_new_tokens, c.chat_template, sources, advance)
    return items


COMMAND = Command("ruler", RulerConfig, run, writes=".json", reads="maps")


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
    from ridgefill.runtime.stats import mean_difference

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


def parse_tasks(text: str | None) -> list[str]:
    names = [t.strip() for t in (text or ",".join(TASKS)).split(",") if t.strip()]
    unknown = [t for t in names if t not in SPECS]
    if unknown or not names:
        raise RidgefillError(f"unknown RULER task(s) {', '.join(unknown) or '(none)'}: use {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def length_bucket(length: int, nominal: bool = True) -> str:
    """The length a sample is shown under in the printed table: a generated sample's nominal length; a RULER
    jsonl record's `length` is its own token count (prompt + answer budget, at most the file's max_seq_length),
    so records are grouped as RULER groups them, by the nominal length they were made for: the next power of
    two (1900 and 2048 tokens -> "≤2048")."""
    if nominal:
        return str(length)
    return f"≤{1 << max(0, length - 1).bit_length()}"


def length_cells(items: list[RulerSample], scores: dict[str, list[float]], nominal: bool = True) -> dict:
    """(task, length bucket) -> variant -> mean score over the samples in that cell; tasks in sample order, each
    task's buckets from the shortest."""
    groups: dict = {}
    for i, s in enumerate(items):
        groups.setdefault((s.task, length_bucket(s.length, nominal)), []).append(i)
    tasks = list(dict.fromkeys(s.task for s in items))
    order = sorted(groups, key=lambda cell: (tasks.index(cell[0]), int(cell[1].lstrip("≤"))))
    return {cell: {v: float(np.mean([scores[v][i] for i in groups[cell]])) for v in scores} for cell in order}


def _print_tables(results: dict, intervals: dict, region: str, tail: int, cells: dict) -> None:
    """The score per task and length bucket (cells: from length_cells), by needle depth, and vs exact."""
    names = list(results)
    first = results[names[0]]
    rows = [[task, length] + [means[v] for v in names] for (task, length), means in cells.items()]
    rows.append(["score (mean)", ""] + [results[v]["score"] for v in names])
    table(f"RULER score (0-100), needles in {region} rows, tail {tail}", ["task", "length"] + names, rows)
    table("score by needle depth (first needle)", ["depth", "samples"] + names,
          [[b, d["n"]] + [results[v]["depths"][b]["score"] for v in names] for b, d in first["depths"].items()])
    if intervals:
        table("difference vs exact (95% paired bootstrap over samples)", ["variant", "Δ score", "low", "high"],
              [[v, iv["score"]["estimate"], iv["score"]["low"], iv["score"]["high"]] for v, iv in intervals.items()])
