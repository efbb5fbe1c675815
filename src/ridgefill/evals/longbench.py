"""LongBench v2 under exact, identity and ridge prefill: four-choice questions over long contexts.

Records carry `_id, domain, sub_domain, difficulty (easy/hard), length (short/medium/long), question,
choice_A..choice_D, answer (A-D), context`. Each question gets the benchmark's 0-shot prompt (reworded here),
wrapped in the tokenizer's chat template when it has one (pred.py sends the prompt as a chat message); a
prompt longer than --max-len tokens keeps its first and last halves (pred.py's middle cut), so the question
at the end survives. Two ways to answer:
- generate: greedy decoding after the prefill, then `The correct answer is (X)` (or `... is X`) is extracted;
- loglik: the prompt ends with the answer lead "The correct answer is (" and the four letters' log-likelihoods
  are compared; the prompt is prefilled once and every option is scored on a clone of its cache.
It runs on torchfill alone (no --engine): option scoring continues torchfill's runner's caches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill.backends.torchfill import TorchfillBackend
from ridgefill.commands import REQUIRED, Command, option
from ridgefill.torchfill import Runner, FillPlan
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig, exact_cache_option, start, variants_option
from ridgefill.evals.scoring import continuation_scores
from ridgefill.runtime.stats import mean_difference
from ridgefill.runtime.console import note, table
from ridgefill.runtime.data import is_hub_id
from ridgefill.runtime.json_input import json_lines, parse_json
from ridgefill.runtime.paths import read_text
from ridgefill.method.fill import parse_variants

LETTERS = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
CATEGORIES = ("overall",) + DIFFICULTIES + LENGTHS
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question",
          "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")
MODES = ("loglik", "generate")
ANSWER_LEAD = "The correct answer is ("

PROMPT = """Please read the text below, then answer the question that follows it.

<text>
{context}
</text>

What is the correct answer to this question: {question}
Choices:
(A) {choice_A}
(B) {choice_B}
(C) {choice_C}
(D) {choice_D}

Reply in the form "The correct answer is (X)", where X is the letter of your choice."""


@dataclass
class Question:
    id: str
    domain: str
    sub_domain: str
    difficulty: str
    length: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str
    context: str


# --- data ----------------------------------------------------------------------------------------------
def load_questions(spec: str) -> list[Question]:
    """LongBench v2 questions from a local .json (a list of records) or .jsonl file, or a Hub dataset id."""
    path = Path(spec).expanduser()
    if path.is_file():
        records = _file_records(path)
    elif not path.exists() and is_hub_id(spec):
        records = _hub_records(spec)
    else:
        raise RidgefillError(f"--data {spec} is neither a file nor a Hub dataset id: pass a LongBench v2 .json "
                             "or .jsonl file")
    questions = [_question(record, where) for record, where in records]
    if not questions:
        raise RidgefillError(f"--data {spec} holds no questions: give a file with LongBench v2 records")
    return questions


def _file_records(path: Path) -> list[tuple[object, str]]:
    """(record, where) pairs; `where` names the file and the line (.jsonl) or record index (.json list)."""
    text = read_text(path, "--data")
    if path.suffix == ".jsonl":
        return [(record, f"{path}:{number}") for number, record in json_lines(text, path, "fix the record")]
    if path.suffix == ".json":
        data = parse_json(text, str(path), "fix the record")
        if not isinstance(data, list):
            raise RidgefillError(f"{path} holds a JSON {type(data).__name__}, not a list of records: give "
                                 "LongBench v2's data.json (a list) or a .jsonl file")
        return [(record, f"{path}, record {i}") for i, record in enumerate(data)]
    raise RidgefillError(f"{path} is neither .json nor .jsonl: give LongBench v2 records in one of those")


def _hub_records(name: str) -> list[tuple[object, str]]:
    try:
        import datasets

        rows = datasets.load_dataset(name, split="train")
    except Exception as exc:  # offline, unknown or gated: all end the same way for the user
        raise RidgefillError(f"LongBench data '{name}' could not be loaded from the Hub ({type(exc).__name__}): "
                             "download data.json from THUDM/LongBench-v2 and pass --data data.json") from None
    return [(dict(row), f"{name}, record {i}") for i, row in enumerate(rows)]


def _question(record, where: str) -> Question:
    if not isinstance(record, dict):
        raise RidgefillError(f"{where}: record is a JSON {type(record).__name__}, not an object with LongBench "
                             "v2 fields")
    for name in FIELDS:
        if name not in record:
            raise RidgefillError(f"{where}: missing field '{name}': every LongBench v2 record needs "
                                 f"{', '.join(FIELDS)}")
        if not isinstance(record[name], str):
            raise RidgefillError(f"{where}: field '{name}' is a {type(record[name]).__name__}, not a string")
    for name, allowed in (("answer", LETTERS), ("difficulty", DIFFICULTIES), ("length", LENGTHS)):
        if record[name] not in allowed:
            raise RidgefillError(f"{where}: field '{name}' is '{record[name]}': use one of {', '.join(allowed)}")
    choices = tuple(record[f"choice_{letter}"] for letter in LETTERS)
    return Question(record["_id"], record["domain"], record["sub_domain"], record["difficulty"], record["length"],
                    record["question"], choices, record["answer"], record["context"])


# --- prompts ---------------------------------------------------------------------------------------------
def prompt_text(question: Question) -> str:
    """The 0-shot prompt (pred.py strips every field before filling the template)."""
    choices = {f"choice_{letter}": c.strip() for letter, c in zip(LETTERS, question.choices)}
    return PROMPT.format(context=question.context.strip(), question=question.question.strip(), **choices)


def prompt_ids(tokenizer, question: Question, mode: str, max_len: int, chat: bool) -> list[int]:
    """Token ids of the prompt (chat-wrapped if `chat`; ending in the answer lead for loglik), cut in the middle
    to at most `max_len` tokens."""
    text = prompt_text(question)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    if mode == "loglik":
        text += ANSWER_LEAD
    ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
    return cut_middle(ids, max_len)


def cut_middle(ids: list[int], max_len: int) -> list[int]:
    """First max_len//2 and last max_len - max_len//2 tokens of an over-long sequence (pred.py's cut)."""
    if len(ids) <= max_len:
        return list(ids)
    head = max_len // 2
    return list(ids[:head]) + list(ids[len(ids) - (max_len - head):])


def option_ids(tokenizer) -> list[list[int]]:
    """The tokens of each letter as it follows the answer lead."""
    lead = tokenizer(ANSWER_LEAD, add_special_tokens=False)["input_ids"]
    options = []
    for letter in LETTERS:
        whole = tokenizer(ANSWER_LEAD + letter, add_special_tokens=False)["input_ids"]
        same_prefix = whole[: len(lead)] == lead
        options.append(whole[len(lead):] if same_prefix else tokenizer(letter, add_special_tokens=False)["input_ids"])
    return options


def extract_answer(response: str) -> str | None:
    """The letter in `The correct answer is (X)`, else in `The correct answer is X`; None if neither appears."""
    response = response.replace("*", "")
    for pattern in (r"The correct answer is \(([A-D])\)", r"The correct answer is ([A-D])"):
        match = re.search(pattern, response)
        if match:
            return match.group(1)
    return None


# --- scoring ---------------------------------------------------------------------------------------------
def answer_question(runner: Runner, tokenizer, ids: list[int], plan: FillPlan | None, mode: str,
                    options: list[list[int]] | None, max_new_tokens: int) -> dict:
    """One variant's answer to one prompt: the predicted letter and what it came from."""
    if mode == "loglik":
        logprobs = [s for s, _ in continuation_scores(runner, ids, options, plan)]
        best = max(range(len(LETTERS)), key=lambda i: logprobs[i])
        return {"prediction": LETTERS[best], "option_logprobs": logprobs}
    run = runner.generate(torch.tensor([ids]), max_new_tokens, plan, tokenizer.eos_token_id)
    response = tokenizer.decode(run.tokens[0], skip_special_tokens=True)
    return {"prediction": extract_answer(response), "response": response}


def summarize(questions: list[Question], answers: list[dict], exact: list[dict] | None) -> dict:
    """Accuracy (%) overall and per difficulty and length; agreement (%) with exact's predictions."""
    correct = [a["prediction"] == q.answer for q, a in zip(questions, answers)]
    accuracy, counts = {}, {}
    for category, members in category_members(questions).items():
        counts[category] = len(members)
        accuracy[category] = 100 * sum(correct[i] for i in members) / len(members) if members else None
    out = {"score": accuracy["overall"], "accuracy": accuracy, "counts": counts,
           "unanswered": sum(a["prediction"] is None for a in answers)}
    if exact is not None:
        same = [a["prediction"] == e["prediction"] for a, e in zip(answers, exact)]
        out["agreement_with_exact"] = 100 * sum(same) / len(same)
        if "option_logprobs" in answers[0]:  # loglik: how far the options' log-likelihoods moved from exact's
            moved = [abs(x - y) for a, e in zip(answers, exact)
                     for x, y in zip(a["option_logprobs"], e["option_logprobs"])]
            out["mean_abs_logprob_change"] = sum(moved) / len(moved)
    out["per_question"] = [{"id": q.id, "answer": q.answer, "correct": c, **a}
                           for q, a, c in zip(questions, answers, correct)]
    return out


def category_members(questions: list[Question]) -> dict[str, list[int]]:
    members = {"overall": list(range(len(questions)))}
    for category in DIFFICULTIES + LENGTHS:
        members[category] = [i for i, q in enumerate(questions) if category in (q.difficulty, q.length)]
    return members


def accuracy_intervals(questions: list[Question], results: dict, seed: int) -> dict:
    """Paired bootstrap interval of each variant's accuracy minus exact's (percentage points), per category."""
    if "exact" not in results:
        return {}
    points = {name: [100.0 * p["correct"] for p in r["per_question"]] for name, r in results.items()}
    intervals = {}
    for name in results:
        if name == "exact":
            continue
        intervals[name] = {}
        for category, members in category_members(questions).items():
            if members:
                diff = mean_difference([points[name][i] for i in members], [points["exact"][i] for i in members],
                                       seed=seed)
                intervals[name][category] = diff.to_dict()
    return intervals


# --- the command -----------------------------------------------------------------------------------------
@dataclass
class LongBenchConfig(MeasureConfig):
    data: str = option(REQUIRED, "LongBench v2 records: .json list or .jsonl file, or a Hub dataset id "
                       "(THUDM/LongBench-v2).")  # no fallback: LongBench questions are not calibration text
    mode: str = option("loglik", "loglik (compare the letters' log-likelihood) or generate (greedy, extract 'The "
                       "correct answer is (X)').")
    max_len: int | None = option(None, "Longer prompts keep their first and last halves (default: the model's "
                                 "context).")
    limit: int | None = option(None, "Run only the first N questions.")
    variants: str | None = variants_option()
    chat_template: bool = option(True, "Wrap prompts in the tokenizer's chat template when it has one.",
                                 negatable=True)
    max_new_tokens: int = option(128, "Tokens to generate (generate mode).")
    exact_cache: Path | None = exact_cache_option()

    def check(self) -> None:
        super().check()
        if self.mode not in MODES:
            raise RidgefillError(f"unknown --mode '{self.mode}': use loglik or generate")
        if self.limit is not None and self.limit < 1:
            raise RidgefillError(f"--limit must be at least 1, got {self.limit}")
        if self.max_len is not None and self.max_len < 2:
            raise RidgefillError(f"--max-len must be at least 2 tokens, got {self.max_len}")
        if self.max_new_tokens < 1:
            raise RidgefillError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.keep_first < 0:
            raise RidgefillError(f"--keep-first must be 0 or more, got {self.keep_first}")
        parse_variants(self.variants, self.maps)


def run(c: LongBenchConfig) -> dict:
    """Answer every question with each variant; exact answers go through the exact store (by prompt)."""
    names = parse_variants(c.variants, c.maps)
    questions = load_questions(str(c.data))[:c.limit]
    record = {**c.as_dict(), "variants": names, "questions": len(questions)}
    m = start("longbench", c, names, record, engine=TorchfillBackend.name)
    tokenizer = m.model.tokenizer
    options = option_ids(tokenizer) if c.mode == "loglik" else None
    budget = max(len(o) for o in options) if options else c.max_new_tokens
    max_len = _checked_max_len(c.max_len, budget, m.model.context_length)
    chat = bool(c.chat_template and getattr(tokenizer, "chat_template", None))
    record.update(max_len=max_len, chat_template_used=chat, split=m.split)
    if c.tail >= max_len:
        note(f"note: tail {c.tail} >= --max-len {max_len}: every prompt row runs the full model (exact)")
    prompts = [prompt_ids(tokenizer, q, c.mode, max_len, chat) for q in questions]
    answers = m.answers(prompts, f"LongBench v2 ({c.mode})", "longbench-answer",
                        lambda ids: {"ids": ids, "mode": c.mode, "options": options,
                                     "max_new_tokens": c.max_new_tokens},
                        lambda ids, name: answer_question(m.backend.runner, tokenizer, ids, m.plans[name], c.mode,
                                                          options, c.max_new_tokens))
    record["prompt_tokens"] = {"mean": sum(map(len, prompts)) / len(prompts), "max": max(map(len, prompts))}
    results = {name: summarize(questions, answers[name], answers.get("exact")) for name in m.plans}
    intervals = accuracy_intervals(questions, results, c.seed)
    doc = m.write(results, intervals)
    _print_table(results, intervals, questions, record)
    return doc


COMMAND = Command("longbench", LongBenchConfig, run, writes=".json", reads="maps")


def _checked_max_len(max_len: int | None, budget: int, context: int | None) -> int:
    """--max-len (default: the model's context minus the answer budget), refused if the prompt plus the
    answer tokens cannot fit the model's context."""
    if max_len is None:
        if context is None:
            raise RidgefillError("this model declares no context length: pass --max-len")
        return context - budget
    if context is not None and max_len + budget > context:
        raise RidgefillError(f"prompts of up to --max-len {max_len} tokens plus {budget} answer tokens exceed the "
                             f"model's context of {context}: use --max-len {context - budget} or less")
    return max_len


def _print_table(results: dict, intervals: dict, questions: list[Question], config: dict) -> None:
    counts = next(iter(results.values()))["counts"]
    rows = []
    for name, r in results.items():
        acc = [r["accuracy"][c] if r["accuracy"][c] is not None else "–" for c in CATEGORIES]
        iv = intervals.get(name, {}).get("overall")
        delta = f"{iv['estimate']:+.1f} [{iv['low']:+.1f}, {iv['high']:+.1f}]" if iv else "–"
        rows.append([name, *acc, delta, r.get("agreement_with_exact", "–")])
        if config["mode"] == "loglik":
            rows[-1].append(r.get("mean_abs_logprob_change", "–"))
    sizes = ", ".join(f"{c} {counts[c]}" for c in CATEGORIES)
    columns = ["variant", *CATEGORIES, "Δ overall vs exact [95% CI]", "agrees with exact %"]
    if config["mode"] == "loglik":
        columns.append("mean |Δ log p| of options vs exact")
    table(f"LongBench v2 accuracy (%), {config['mode']}, split {config['split']}, tail {config['tail']}, "
          f"max-len {config['max_len']} — questions: {sizes}", columns, rows)
