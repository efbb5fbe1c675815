"""RULER's synthetic tasks as layouts: the text before and after the context, the haystack units and the needles.

Templates, needle sentences, haystacks, task settings and generation budgets follow NVIDIA/RULER
(scripts/data/synthetic, scripts/synthetic.yaml). Two stand-ins keep it offline: the essay haystack is the
built-in corpora's evaluation documents cut into sentences (RULER: Paul Graham essays), and words (needle
keys, common words) are drawn from the wiki-leads vocabulary (RULER: wonderwords' noun and adjective lists).
The vt in-context example uses 5 noise sentences (RULER sizes it to ~500 tokens).

A layout is rendered by ruler.py: needles are inserted between haystack units at boundaries it chooses (so it
can keep them in the filled rows or the tail), then the prompt is `head + context + question` followed by
`answer_prefix`.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections import Counter
from dataclasses import dataclass

from ridgefill.runtime.data import documents_for, load_corpus
from ridgefill.errors import RidgefillError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} "
                 "mentioned in the provided text?")
NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

HAYSTACKS = ("auto", "noise", "essay")  # what --haystack takes (auto: each task's own, which may be "needle")


def check_haystack(name: str) -> None:
    if name not in HAYSTACKS:
        raise RidgefillError(f"unknown haystack '{name}': use noise, essay or auto (the task's RULER default)")
ESSAY_CORPORA = ("wiki-leads", "shakespeare")
VT_HOPS, CWE_COMMON = 4, 10
FWE_ALPHA, FWE_ZETA = 2.0, math.pi ** 2 / 6  # zeta(2): the Zipf normaliser RULER uses for alpha 2


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str  # niah, vt, cwe, fwe
    budget: int  # RULER's generation budget (tokens)
    haystack: str | None = None  # default haystack (noise, essay, needle); None: the task has its own context
    keys: str = "words"
    values: str = "numbers"
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1

    @property
    def min_size(self) -> int:
        """The smallest haystack size (units, or words for cwe/fwe) the generator accepts."""
        return {"cwe": CWE_COMMON, "fwe": 30}.get(self.family, 1)


SPECS = {s.name: s for s in (
    TaskSpec("niah_single_1", "niah", 128, "noise"),
    TaskSpec("niah_single_2", "niah", 128, "essay"),
    TaskSpec("niah_single_3", "niah", 128, "essay", values="uuids"),
    TaskSpec("niah_multikey_1", "niah", 128, "essay", n_keys=4),
    TaskSpec("niah_multikey_2", "niah", 128, "needle"),
    TaskSpec("niah_multikey_3", "niah", 128, "needle", keys="uuids", values="uuids"),
    TaskSpec("niah_multivalue", "niah", 128, "essay", n_values=4),
    TaskSpec("niah_multiquery", "niah", 128, "essay", n_queries=4),
    TaskSpec("vt", "vt", 30, "noise"),
    TaskSpec("cwe", "cwe", 120),
    TaskSpec("fwe", "fwe", 50),
)}


def task_spec(name: str) -> TaskSpec:
    if name not in SPECS:
        raise RidgefillError(f"unknown RULER task '{name}': use {', '.join(SPECS)}")
    return SPECS[name]


@dataclass
class Layout:
    head: str  # everything before the context (instruction, in-context example)
    units: list[str]  # haystack units, in order
    needles: list[str]  # inserted between units, in this order
    joiner: str  # between context items
    question: str  # after the context
    answer_prefix: str
    outputs: list[str]
    placement: str  # "depth": needles at RULER's 40 depths; "uniform": anywhere
    numbered: bool = False  # cwe: items render as "1. word 2. word ..."


@dataclass
class Sources:
    """Offline text the generators draw from: a word vocabulary and essay sentences."""

    words: list[str]
    sentences: list[str]
    essay_corpus: str

    @classmethod
    def load(cls, essay_corpus: str = "wiki-leads") -> "Sources":
        if essay_corpus not in ESSAY_CORPORA:
            raise RidgefillError(f"unknown essay corpus '{essay_corpus}': use {' or '.join(ESSAY_CORPORA)}")
        wiki = load_corpus("wiki-leads")
        counts = Counter(w for d in wiki.documents for w in re.findall(r"\b[a-z]{4,10}\b", d))
        words = sorted(w for w, c in counts.items() if c >= 3)
        essay = wiki if essay_corpus == "wiki-leads" else load_corpus(essay_corpus)
        text = " ".join(re.sub(r"\s+", " ", d).strip() for d in documents_for(essay, "evaluation"))
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
        return cls(words, sentences, essay_corpus)


def make_layout(spec: TaskSpec, seed: str, size: int, haystack: str, length: int, sources: Sources) -> Layout:
    """The layout of one sample: deterministic in (seed, size). Draws that do not depend on `size` (needles,
    query, answers) come first, so a sample keeps them while its haystack size is searched."""
    rng = random.Random(seed)
    if spec.family == "niah":
        return _niah(spec, rng, size, haystack, sources)
    if spec.family == "vt":
        return _vt(rng, size, haystack, sources)
    if spec.family == "cwe":
        return _cwe(rng, size, length, sources)
    return _fwe(rng, size, length)


def max_size(spec: TaskSpec, haystack: str, sources: Sources) -> int | None:
    """The largest haystack size there is text for (None: unbounded)."""
    if spec.family in ("niah", "vt") and haystack == "essay":
        return len(sources.sentences)
    if spec.family == "cwe":
        return len(sources.words)
    return None


# --- tasks ----------------------------------------------------------------------------------------------
def _niah(spec, rng, size, haystack, sources) -> Layout:
    n_keys = max(spec.n_keys, spec.n_queries)
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(_draw(spec.keys, rng, sources))
        values.append([_draw(spec.values, rng, sources) for _ in range(spec.n_values)])
        needles += [NEEDLE.format(kind=spec.values, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(n_keys), spec.n_queries)
    queries = [keys[i] for i in asked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, kind = NIAH_TEMPLATE + "\0" + NIAH_ANSWER, spec.values
    if spec.n_queries * spec.n_values == 1:  # RULER's singular wording
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        kind = kind[:-1]
    if haystack == "needle":  # distractors: needle sentences with their own random keys and values
        units = [NEEDLE.format(kind=spec.values, key=_draw(spec.keys, rng, sources),
                               value=_draw(spec.values, rng, sources)) for _ in range(size)]
    else:
        units = _plain_haystack(haystack, size, sources)
    head, question, answer_prefix = _split(template, kind=kind, query=query)
    return Layout(head, units, needles, " " if haystack == "essay" else "\n", question, answer_prefix,
                  [v for i in asked for v in values[i]], "depth")


def _vt(rng, size, haystack, sources) -> Layout:
    names, chain = _chain(rng, 5)
    example_names, example_chain = _chain(rng, 3)
    example_units = [NOISE] * 5
    slots = sorted(rng.choices(range(len(example_units) + 1), k=len(example_chain)))
    items = list(example_units)
    for offset, (slot, statement) in enumerate(zip(slots, example_chain)):
        items.insert(slot + offset, statement)
    e_head, e_question, e_prefix = _split(VT_TEMPLATE + "\0" + VT_ANSWER, query=example_chain[0].split("= ")[-1],
                                          num_v=VT_HOPS + 1)
    example = e_head + "\n".join(items) + e_question + e_prefix + " ".join(example_names) + "\n\n"
    head, question, answer_prefix = _split(VT_TEMPLATE + "\0" + VT_ANSWER, query=chain[0].split("= ")[-1],
                                           num_v=VT_HOPS + 1)
    return Layout(example + head, _plain_haystack(haystack, size, sources), chain,
                  " " if haystack == "essay" else "\n", question, answer_prefix, names, "uniform")


def _cwe(rng, size, length, sources) -> Layout:
    short = length < 4096  # RULER's settings below 4k tokens
    example_n, example_common, example_rare = (20, 3, 1) if short else (40, 10, 3)
    common_reps, rare_reps = (6, 1) if short else (30, 3)
    e_words = rng.sample(sources.words, example_n)
    e_list = e_words[:CWE_COMMON] * example_common + e_words[CWE_COMMON:] * example_rare
    rng.shuffle(e_list)
    e_head, e_question, e_prefix = _split(CWE_TEMPLATE + "\0" + CWE_ANSWER)
    example = (e_head + _numbered(e_list) + e_question + e_prefix + " " + _numbered(e_words[:CWE_COMMON]) + "\n")
    words = rng.sample(sources.words, size)
    needles = words[:CWE_COMMON] * common_reps
    units = words[CWE_COMMON:] * rare_reps
    rng.shuffle(needles)
    rng.shuffle(units)
    head, question, answer_prefix = _split(CWE_TEMPLATE + "\0" + CWE_ANSWER)
    return Layout(example + head, units, needles, " ", question, answer_prefix, words[:CWE_COMMON], "uniform",
                  numbered=True)


def _fwe(rng, size, length) -> Layout:
    vocab_size = max(10, length // 50)
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise
    counts = [int(size * k ** -FWE_ALPHA / FWE_ZETA) for k in range(1, vocab_size + 1)]
    answers = vocab[1:4]
    needles = [w for w, c in zip(vocab[1:4], counts[1:4]) for _ in range(c)]
    units = [w for i, (w, c) in enumerate(zip(vocab, counts)) if not 1 <= i <= 3 for _ in range(c)]
    rng.shuffle(needles)
    rng.shuffle(units)
    head, question, answer_prefix = _split(FWE_TEMPLATE + "\0" + FWE_ANSWER)
    return Layout(head, units, needles, " ", question, answer_prefix, answers, "uniform")


# --- pieces ---------------------------------------------------------------------------------------------
def _draw(kind: str, rng: random.Random, sources: Sources) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(sources.words)}-{rng.choice(sources.words)}"  # words: RULER's "adjective-noun" keys


def _chain(rng: random.Random, letters: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99998)}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(VT_HOPS)]
    return names, chain


def _plain_haystack(haystack: str, size: int, sources: Sources) -> list[str]:
    if haystack == "essay":
        return sources.sentences[:size]
    return [NOISE] * size


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _split(template: str, **fields) -> tuple[str, str, str]:
    """(head, question, answer_prefix) of a template `head{context}question\\0answer_prefix`."""
    text = template.replace("{context}", "\1").format(**fields)
    body, answer_prefix = text.split("\0")
    head, question = body.split("\1")
    return head, question, answer_prefix
