"""A tiny random-init checkpoint folder (model + a byte-level BPE tokenizer trained here) that commands can
load with `--model PATH`, offline and in seconds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = ("the grass is green sky blue sun yellow here we go there and back again one of special magic number "
         "numbers word words for key value is what are all mentioned in provided text answer question memorize "
         "king queen lord lady castle river night day love war time friend enemy letter").split()


def training_text(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."] * 20
    for _ in range(n):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + ".")
        lines.append(f"One of the special magic numbers for {rng.choice(WORDS)} is: {rng.randint(10**6, 10**7 - 1)}.")
    return lines


def write_corpus(path: Path, seed: int, lines_per_document: int, n: int = 600) -> Path:
    """A .txt corpus of training_text(n, seed) lines, `lines_per_document` to a document (documents are separated
    by two blank lines, as ridgefill's .txt reader splits them)."""
    lines = training_text(n, seed=seed)
    path.write_text("\n\n\n".join(" ".join(lines[i:i + lines_per_document])
                                  for i in range(0, len(lines), lines_per_document)))
    return path


def save_tiny_checkpoint(path: Path, family: str = "llama", vocab: int = 512, dtype=None, **overrides) -> Path:
    """Write config, weights and tokenizer of a tiny model of `family` (a dense family, or a hybrid one:
    conftest.HYBRID_FAMILIES) into `path`, its weights in `dtype` (None: float32)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import HYBRID_FAMILIES, tiny_hybrid_model, tiny_model

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    settings = dict(vocab_size=len(fast), max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    settings.update(overrides)
    model = (tiny_hybrid_model if family in HYBRID_FAMILIES else tiny_model)(family, **settings)
    if dtype is not None:
        model = model.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    torch.manual_seed(0)
    return path


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory) -> Path:
    """A .jsonl corpus of documents of ~700 tokens; about one in five is an evaluation document."""
    import json

    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    lines = training_text(1200, seed=5)
    docs = [" ".join(lines[i : i + 48]) for i in range(0, len(lines), 48)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama-family checkpoint folder, shared by the whole test session (treat it as read-only)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama")
