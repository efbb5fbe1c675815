"""Token sequences as a stream: the same sequences the list version cut, yielded lazily, and the documents' hash."""

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
