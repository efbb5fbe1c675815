"""RULER: generated samples fit and hold their answers, needles sit in the asked rows, RULER's scoring, RULER
jsonl input, and the command end to end on the tiny checkpoint."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgefill.cli import app
from ridgefill.errors import RidgefillError
from ridgefill.evals.ruler import COMMAND as ruler_command
from ridgefill.evals.ruler import TASKS, budget, build_samples, read_jsonl, score_prediction
from ridgefill.evals.ruler.tasks import Sources

NEEDLE = re.compile(r"One of the special magic \w+ for \S+ is: \S+\.")
# the tiny tokenizer (vocab 512) spends more tokens per word than a real one: lengths where each task fits
FIT = {"vt": 1024, "cwe": 2048}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def sources():
    return Sources.load()


def decoded_spans(tokenizer, sample):
    return [tokenizer.decode(sample.input_ids[a:b]) for a, b in sample.needle_spans]


def check_needles(tokenizer, sample):
    """Spans decode back to their needles and together hold every reference answer."""
    texts = decoded_spans(tokenizer, sample)
    assert texts
    for output in sample.outputs:
        assert output in sample.input
        assert any(output in t for t in texts), (output, texts)
    for text in texts:
        if sample.task.startswith("niah"):
            assert NEEDLE.fullmatch(text.strip()), text
        else:
            assert any(o in text for o in sample.outputs), text


@pytest.mark.parametrize("task", TASKS)
def test_every_task_fits_and_holds_its_answers(tokenizer, sources, task):
    length = FIT.get(task, 768)
    samples = build_samples(tokenizer, task, length, 2, seed=0, region="any", tail=64, sources=sources)
    assert len(samples) == 2
    for s in samples:
        assert s.task == task and s.length == length and s.max_new_tokens == budget(task)
        assert len(s.input_ids) + s.max_new_tokens <= length
        assert len(s.input_ids) + s.max_new_tokens > 0.8 * length  # the haystack search fills the length
        assert s.input_ids == tokenizer(s.input + s.answer_prefix)["input_ids"]
        assert s.tail_start == len(s.input_ids) - 64
        assert 0 <= s.depth <= 1
        check_needles(tokenizer, s)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multivalue", "vt",
                                  "fwe"])
def test_filled_region_keeps_needles_after_keep_first_and_before_the_tail(tokenizer, sources, task):
    tail, keep_first = 96, 4
    for s in build_samples(tokenizer, task, FIT.get(task, 768), 3, seed=1, region="filled", tail=tail,
                           keep_first=keep_first, sources=sources):
        assert s.tail_start == len(s.input_ids) - tail
        assert all(keep_first <= a < b <= s.tail_start for a, b in s.needle_spans)
        check_needles(tokenizer, s)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multiquery", "vt"])
def test_tail_region_puts_needles_in_the_tail(tokenizer, sources, task):
    for s in build_samples(tokenizer, task, FIT.get(task, 768), 3, seed=2, region="tail", tail=300,
                           sources=sources):
        assert all(s.tail_start <= a < b <= len(s.input_ids) for a, b in s.needle_spans)
        check_needles(tokenizer, s)


def test_same_seed_same_samples(tokenizer, sources):
    a = build_samples(tokenizer, "niah_multikey_1", 768, 3, seed=5, sources=sources)
    b = build_samples(tokenizer, "niah_multikey_1", 768, 3, seed=5, sources=sources)
    c = build_samples(tokenizer, "niah_multikey_1", 768, 3, seed=6, sources=sources)
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert [s.needle_spans for s in a] == [s.needle_spans for s in b]
    assert [s.outputs for s in a] != [s.outputs for s in c]
    assert len({tuple(s.outputs) for s in a}) == 3  # samples differ from each other


def test_generation_budget_cap_is_recorded_and_frees_room(tokenizer, sources):
    full = build_samples(tokenizer, "niah_single_1", 768, 1, seed=0, sources=sources)[0]
    capped = build_samples(tokenizer, "niah_single_1", 768, 1, seed=0, max_new_tokens=8, sources=sources)[0]
    assert (full.max_new_tokens, capped.max_new_tokens) == (128, 8)
    assert len(capped.input_ids) > len(full.input_ids)


def test_scoring_follows_ruler():
    assert score_prediction("niah_multivalue", " 1234 and 9999, then 5678", ["1234", "5678", "4321", "8765"]) == 50
    assert score_prediction("vt", "  abcde FGHIJ\x00", ["ABCDE", "fghij"]) == 100  # case-insensitive, stripped
    assert score_prediction("cwe", "nothing here", ["apple"]) == 0
    assert score_prediction("qa_1", "It is Paris.", ["paris", "london"]) == 100  # string_match_part: any
    assert score_prediction("qa_2", "Rome", ["paris", "london"]) == 0
    assert score_prediction("niah_single_1", "x", []) == 0


def test_unknown_task_lists_the_valid_ones(tokenizer, sources):
    with pytest.raises(RidgefillError, match="unknown RULER task 'niah_single_9': use niah_single_1, .*fwe"):
        build_samples(tokenizer, "niah_single_9", 768, 1, seed=0, sources=sources)


def test_no_room_is_refused(tokenizer, sources):
    with pytest.raises(RidgefillError, match="leave no filled row at length 512"):
        build_samples(tokenizer, "niah_single_1", 512, 1, seed=0, tail=511, sources=sources)
    with pytest.raises(RidgefillError, match="no room for the niah_single_1 needles"):
        build_samples(tokenizer, "niah_single_1", 512, 1, seed=0, tail=400, sources=sources)
    with pytest.raises(RidgefillError, match="does not fit 128 tokens"):
        build_samples(tokenizer, "niah_single_1", 128, 1, seed=0, region="any", sources=sources)


# --- RULER jsonl ----------------------------------------------------------------------------------------
def ruler_record(value="4271938", **extra):
    text = ("A special magic number is hidden within the following text.\nThe grass is green. "
            f"One of the special magic numbers for key-word is: {value}.\nThe sky is blue.\n"
            "What is the special magic number for key-word mentioned in the provided text?")
    return {"index": 0, "input": text, "outputs": [value], "length": 128,
            "answer_prefix": " The special magic number for key-word mentioned in the provided text is", **extra}


def test_from_jsonl_reads_ruler_records(tmp_path, tokenizer):
    path = tmp_path / "niah_single_1.jsonl"
    path.write_text("\n".join(json.dumps(ruler_record(v)) for v in ("4271938", "1111111")) + "\n\n")
    samples = read_jsonl(path, tokenizer, tail=16)
    assert [s.outputs for s in samples] == [["4271938"], ["1111111"]]
    s = samples[0]
    assert s.task == "niah_single_1" and s.length == 128 and s.max_new_tokens == 128
    assert s.input_ids == tokenizer(s.input + s.answer_prefix)["input_ids"]
    assert "4271938" in tokenizer.decode(s.input_ids[slice(*s.needle_spans[0])])
    assert s.tail_start == len(s.input_ids) - 16
    assert len(read_jsonl(path, tokenizer, tail=16, max_new_tokens=4, limit=1)) == 1
    folder = tmp_path / "vt"  # RULER's <task>/validation.jsonl layout names the task by its folder
    folder.mkdir()
    (folder / "validation.jsonl").write_text(json.dumps(ruler_record()) + "\n")
    assert read_jsonl(folder / "validation.jsonl", tokenizer, tail=16)[0].max_new_tokens == 30


def test_from_jsonl_malformed_record_names_file_line_and_field(tmp_path, tokenizer):
    path = tmp_path / "niah_single_1.jsonl"
    bad = ruler_record()
    del bad["answer_prefix"]
    path.write_text(json.dumps(ruler_record()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RidgefillError, match=rf"^{re.escape(str(path))}:2: record has no 'answer_prefix'"):
        read_jsonl(path, tokenizer, tail=16)
    path.write_text(json.dumps(ruler_record()) + "\n{not json\n")
    with pytest.raises(RidgefillError, match=r":2: not valid JSON"):
        read_jsonl(path, tokenizer, tail=16)
    path.write_text(json.dumps({**ruler_record(), "outputs": "4271938"}) + "\n")
    with pytest.raises(RidgefillError, match=r":1: field 'outputs' must be a list"):
        read_jsonl(path, tokenizer, tail=16)


# --- the command ----------------------------------------------------------------------------------------
def test_command_writes_the_document_and_full_tail_is_exact(tmp_path, tiny_checkpoint):
    out = tmp_path / "ruler.json"
    result = CliRunner().invoke(app, [
        "ruler", "--model", str(tiny_checkpoint), "--split", "3", "--variants", "exact,identity",
        "--tail", "768", "--lengths", "768", "--tasks", "niah_single_1,niah_multikey_3", "--samples", "2",
        "--region", "any", "--max-new-tokens", "3", "--seed", "7", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "RULER score" in result.output
    doc = json.loads(out.read_text())
    for key in ("command", "model", "maps", "config", "variants", "results", "intervals", "seed",
                "ridgefill_version", "started_at", "duration_s", "samples"):
        assert key in doc
    assert doc["command"] == "ruler" and doc["variants"] == ["exact", "identity"] and doc["seed"] == 7
    assert doc["config"]["region"] == "any" and doc["config"]["budgets"] == {"niah_single_1": 3,
                                                                            "niah_multikey_3": 3}
    for name in ("exact", "identity"):
        r = doc["results"][name]
        assert 0 <= r["score"] <= 100
        assert set(r["tasks"]) == {"niah_single_1", "niah_multikey_3"}
        assert set(r["tasks"]["niah_single_1"]["lengths"]) == {"768"} and set(r["lengths"]) == {"768"}
        assert sum(d["n"] for d in r["depths"].values()) == 4
    assert len(doc["samples"]) == 4
    for s in doc["samples"]:
        assert s["tail_start"] == 0 and s["needle_spans"]  # tail >= length: every row runs the full model
        assert s["predictions"]["exact"] == s["predictions"]["identity"]
        assert s["scores"]["exact"] == s["scores"]["identity"]
    assert doc["intervals"]["identity"]["score"] == {"estimate": 0.0, "low": 0.0, "high": 0.0, "level": 0.95}


def test_command_from_jsonl(tmp_path, tiny_checkpoint):
    path = tmp_path / "niah_single_1.jsonl"
    path.write_text(json.dumps(ruler_record()) + "\n")
    doc = ruler_command(model=str(tiny_checkpoint), split=3, variants="identity", tail=8, from_jsonl=path,
                        max_new_tokens=2, out=tmp_path / "r.json")
    assert doc["variants"] == ["exact", "identity"]  # exact always runs: differences are taken against it
    assert doc["config"]["region_enforced"] is False and set(doc["intervals"]) == {"identity"}
    (sample,) = doc["samples"]
    assert sample["length"] == 128 and sample["tail_start"] == sample["n_tokens"] - 8
    assert json.loads((tmp_path / "r.json").read_text())["results"]["identity"]["tasks"]["niah_single_1"]


def test_bad_input_is_refused_before_model_work(tmp_path, tiny_checkpoint):
    out = tmp_path / "r.json"
    # refused before the (missing) model is even loaded
    with pytest.raises(RidgefillError, match="--tail 600 plus --keep-first 1 leave no filled row at length 512"):
        ruler_command(model="/nonexistent", split=3, tail=600, lengths="512", out=out)
    with pytest.raises(RidgefillError, match="unknown RULER task.*use niah_single_1"):
        ruler_command(model="/nonexistent", split=3, tasks="niah,vt", out=out)
    with pytest.raises(RidgefillError, match="length 8192 exceeds the model's context of 4096"):
        ruler_command(model=str(tiny_checkpoint), split=3, lengths="1024,8192", variants="exact,identity", out=out)
    with pytest.raises(RidgefillError, match="ridge variant needs --maps"):  # before the model loads
        ruler_command(model="/nonexistent", split=3, lengths="1024", variants="exact,ridge", out=out)
    assert not out.exists()


def test_cli_error_is_one_line_with_exit_code_2(tmp_path):
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "ridgefill"), "ruler", "--tasks", "nope", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown RULER task(s) nope: use niah_single_1")
    assert proc.stderr.count("\n") == 1


def test_chat_template_wraps_the_input_and_keeps_spans(tiny_checkpoint, sources):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    with pytest.raises(RidgefillError, match="no chat template"):
        build_samples(tok, "niah_single_1", 768, 1, seed=0, chat_template=True, sources=sources)
    tok.chat_template = "{% for m in messages %}<s>user: {{ m['content'] }}</s>{% endfor %}assistant:"
    (s,) = build_samples(tok, "niah_single_1", 768, 1, seed=0, chat_template=True, tail=64, sources=sources)
    assert s.input_ids == tok("<s>user: " + s.input + "</s>assistant:" + s.answer_prefix,
                              add_special_tokens=False)["input_ids"]
    assert s.input_ids[0] == tok.bos_token_id
    check_needles(tok, s)
    assert all(1 <= a < b <= s.tail_start for a, b in s.needle_spans)


def test_exact_answers_are_reused_across_splits(tmp_path, tiny_checkpoint):
    common = dict(model=str(tiny_checkpoint), variants="exact,identity", tail=16, lengths="320",
                  tasks="niah_single_1", samples=2, max_new_tokens=3, exact_cache=tmp_path / "exact")
    first = ruler_command(split=3, out=tmp_path / "a.json", **common)
    second = ruler_command(split=2, out=tmp_path / "b.json", **common)
    assert first["exact_store"]["misses"] == 2 and first["exact_store"]["hits"] == 0
    assert second["exact_store"]["hits"] == 2 and second["exact_store"]["misses"] == 0
    exact_answers = [[s["predictions"]["exact"] for s in doc["samples"]] for doc in (first, second)]
    assert exact_answers[0] == exact_answers[1]
    plain = ruler_command(split=2, out=tmp_path / "c.json", **{**common, "exact_cache": None})
    assert plain["results"] == second["results"] and plain["exact_store"]["folder"] is None


# --- the printed table: lengths bucketed as RULER does -----------------------------------------------------
def test_jsonl_lengths_are_bucketed_by_their_nominal_length():
    from ridgefill.evals.ruler import length_bucket

    assert [length_bucket(n, nominal=False) for n in (1900, 2048, 2049, 1)] == ["≤2048", "≤2048", "≤4096", "≤1"]
    assert length_bucket(1900) == "1900"  # a generated sample carries its nominal length already


def test_table_cells_pool_samples_of_one_bucket():
    from ridgefill.evals.ruler import RulerSample, length_cells

    def sample(task, length):
        return RulerSample(task, length, 0.5, "", "", [], 16, [], [], 0)

    items = [sample("niah_single_1", 2018 + i) for i in range(30)] + [sample("vt", 4000), sample("vt", 1000)]
    scores = {"exact": [100.0] * 30 + [0.0, 100.0], "identity": [100.0] * 20 + [0.0] * 10 + [50.0, 50.0]}
    cells = length_cells(items, scores, nominal=False)
    assert list(cells) == [("niah_single_1", "≤2048"), ("vt", "≤1024"), ("vt", "≤4096")]
    assert cells[("niah_single_1", "≤2048")] == {"exact": 100.0, "identity": pytest.approx(200 / 3)}
    generated = length_cells(items[30:], {v: s[30:] for v, s in scores.items()})
    assert list(generated) == [("vt", "1000"), ("vt", "4000")]


def test_from_jsonl_prints_one_row_per_bucket_and_keeps_the_lengths_in_the_json(tmp_path, tiny_checkpoint, capsys):
    path = tmp_path / "niah_single_1.jsonl"
    path.write_text("".join(json.dumps(ruler_record(v, length=n)) + "\n"
                            for v, n in (("4271938", 100), ("1111111", 120), ("2222222", 127))))
    doc = ruler_command(model=str(tiny_checkpoint), split=3, variants="identity", tail=8, from_jsonl=path,
                        max_new_tokens=2, out=tmp_path / "r.json")
    rows = [line for line in capsys.readouterr().out.splitlines() if "niah_single_1" in line]
    assert len(rows) == 1 and "≤128" in rows[0]
    assert [s["length"] for s in doc["samples"]] == [100, 120, 127]
    assert set(doc["results"]["exact"]["lengths"]) == {"100", "120", "127"}  # the JSON keeps its fields


def test_a_deeply_nested_jsonl_line_is_one_line_exit_2(tmp_path, tiny_checkpoint, monkeypatch, capfd):
    """--from-jsonl with a record nested 100,000 deep: one line naming the file and line, not a traceback."""
    from one_line import DEEP_JSON, refused

    path = tmp_path / "niah_single_1.jsonl"
    path.write_text(json.dumps(ruler_record()) + "\n" + DEEP_JSON + "\n")
    refused(["ruler", "--model", str(tiny_checkpoint), "--split", "3", "--variants", "exact", "--from-jsonl",
             str(path), "--max-new-tokens", "2", "--out", str(tmp_path / "out" / "r.json")], tmp_path, monkeypatch,
            capfd, f"{path}:2: JSON nested too deeply to read: fix the record or remove its line")
