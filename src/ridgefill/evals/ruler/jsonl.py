"""RULER samples read from RULER's own jsonl files (fields input, outputs, length, answer_prefix)."""

from __future__ import annotations

import bisect
import math
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.evals.ruler.placement import Prompter, RulerSample, budget
from ridgefill.runtime.json_input import json_lines
from ridgefill.runtime.paths import read_text
from ridgefill.runtime.spans import token_span


JSONL_FIELDS = {"input": str, "outputs": list, "length": int, "answer_prefix": str}


def read_jsonl(path: str | Path, tokenizer, tail: int, max_new_tokens: int | None = None,
               chat_template: bool = False, limit: int | None = None) -> list[RulerSample]:
    """Samples from a RULER jsonl file (fields input, outputs, length, answer_prefix; optional
    token_position_answer). The task is the file's stem, or its folder's name (RULER's <task>/validation.jsonl).
    Needle spans are the first occurrence of each reference in the input (where found)."""
    path = Path(path)
    if not path.is_file():
        raise RidgefillError(f"--from-jsonl {path} {'is not a file' if path.exists() else 'does not exist'}: pass a "
                             "RULER jsonl file")
    task = path.stem if path.stem.split("_")[0] in ("niah", "vt", "cwe", "fwe", "qa") else path.parent.name
    prompter = Prompter(tokenizer, chat_template)
    samples = []
    for number, parsed in json_lines(read_text(path, "--from-jsonl"), path, "fix the record or remove its line"):
        record = _record(path, number, parsed)
        prompt, shift = prompter.text(record["input"], record["answer_prefix"])
        ids, offsets = prompter.encode(prompt)
        lowered = record["input"].lower()
        spans = sorted(token_span(offsets, shift + i, shift + i + len(r))
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


def _record(path: Path, number: int, record) -> dict:
    """`record` (line `number` of `path`) checked to hold RULER's fields."""
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
