"""LongBench v2: record loading and its errors, prompts and the middle cut, answer extraction, the shared-prefill
option scorer against known answers, and the command end to end on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ridgefill.torchfill import Runner, FillPlan, IdentityFiller, adapter_for
from ridgefill.errors import RidgefillError
from ridgefill.evals.longbench import COMMAND as longbench_command
from ridgefill.evals.longbench import ANSWER_LEAD, cut_middle, extract_answer, load_questions, option_ids, prompt_ids
from ridgefill.evals.scoring import continuation_scores

from tiny_models import random_ids, tiny_model
from fixtures.longbench_fixture import build_records, write_jsonl
from tiny_models import training_text


def documents(n: int = 16) -> list[str]:
    """Short documents (about 60 words) of text the tiny checkpoint's tokenizer was trained on."""
    lines = training_text(3 * n)[20:]
    return [" ".join(lines[6 * i : 6 * i + 6]) for i in range(n)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return build_records(documents(), 6, 60, seed=0)


@pytest.fixture(scope="module")
def data_file(records, tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("longbench") / "lb.jsonl", records)


# --- data ----------------------------------------------------------------------------------------------
def test_questions_load_from_jsonl_and_json_lists(records, data_file, tmp_path):
    questions = load_questions(str(data_file))
    assert [q.id for q in questions] == [r["_id"] for r in records]
    assert questions[0].choices == tuple(records[0][f"choice_{x}"] for x in "ABCD")
    assert {q.difficulty for q in questions} == {"easy", "hard"} and {q.length for q in questions} == {
        "short", "medium", "long"}
    as_list = tmp_path / "data.json"
    as_list.write_text(json.dumps(records))
    assert [q.answer for q in load_questions(str(as_list))] == [r["answer"] for r in records]


def test_malformed_records_name_the_file_the_line_and_the_field(records, tmp_path):
    broken = [dict(r) for r in records[:3]]
    del broken[2]["choice_C"]
    jsonl = write_jsonl(tmp_path / "broken.jsonl", broken)
    with pytest.raises(RidgefillError, match=f"{jsonl}:3: missing field 'choice_C'"):
        load_questions(str(jsonl))
    as_list = tmp_path / "broken.json"
    as_list.write_text(json.dumps(broken))
    with pytest.raises(RidgefillError, match=f"{as_list}, record 2: missing field 'choice_C'"):
        load_questions(str(as_list))
    bad_answer = [dict(records[0], answer="E")]
    with pytest.raises(RidgefillError, match="field 'answer' is 'E': use one of A, B, C, D"):
        load_questions(str(write_jsonl(tmp_path / "e.jsonl", bad_answer)))
    (tmp_path / "junk.jsonl").write_text(json.dumps(records[0]) + "\n{not json\n")
    with pytest.raises(RidgefillError, match="junk.jsonl:2: not valid JSON"):
        load_questions(str(tmp_path / "junk.jsonl"))
    (tmp_path / "obj.json").write_text(json.dumps(records[0]))
    with pytest.raises(RidgefillError, match="not a list of records"):
        load_questions(str(tmp_path / "obj.json"))


def test_an_unreachable_hub_dataset_is_one_line(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(RidgefillError, match="could not be loaded from the Hub \\(ConnectionError\\): download "
                                             "data.json from THUDM/LongBench-v2 and pass --data data.json"):
        load_questions("THUDM/LongBench-v2")


# --- prompts and answers -----------------------------------------------------------------------------------
def test_cut_middle_keeps_the_first_and_last_halves():
    assert cut_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert cut_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert cut_middle([1, 2, 3], 5) == [1, 2, 3]


def test_long_prompts_are_cut_in_the_middle_and_keep_the_answer_lead(tiny_checkpoint, data_file):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    question = load_questions(str(data_file))[0]
    whole = prompt_ids(tokenizer, question, "loglik", 10**6, chat=False)
    cut = prompt_ids(tokenizer, question, "loglik", 101, chat=False)
    assert len(whole) > 101 and len(cut) == 101
    assert cut == whole[:50] + whole[-51:]
    assert tokenizer.decode(cut).endswith(ANSWER_LEAD)
    assert not tokenizer.decode(prompt_ids(tokenizer, question, "generate", 10**6, chat=False)).endswith(ANSWER_LEAD)
    options = option_ids(tokenizer)
    assert [tokenizer.decode(o) for o in options] == ["A", "B", "C", "D"]


def test_extract_answer():
    assert extract_answer("The correct answer is (C).") == "C"
    assert extract_answer("**The correct answer is (B)**") == "B"
    assert extract_answer("I think The correct answer is D, because") == "D"
    assert extract_answer("The answer is (A)") is None
    assert extract_answer("The correct answer is (E)") is None


# --- scoring -------------------------------------------------------------------------------------------------
def test_continuation_scores_match_a_full_forward_pass_and_are_independent():
    model = tiny_model("llama")
    runner = Runner(adapter_for(model), chunk=16)
    context = random_ids(40, seed=3)[0].tolist()
    conts = [random_ids(1, seed=4)[0].tolist(), random_ids(3, seed=5)[0].tolist(), random_ids(5, seed=6)[0].tolist()]
    conts.append(runner.generate(torch.tensor([context]), 3).tokens[0])  # the model's own greedy choice
    scores = continuation_scores(runner, context, conts)
    assert [greedy for _, greedy in scores] == [False, False, False, True]
    for cont, (logprob, greedy) in zip(conts, scores):
        with torch.no_grad():
            logits = model(torch.tensor([context + cont])).logits[0, len(context) - 1 : -1].log_softmax(-1)
        target = torch.tensor(cont)
        assert logprob == pytest.approx(float(logits.gather(1, target[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == target).all())
    # each continuation alone scores the same: the clones keep the shared cache intact
    alone = [continuation_scores(runner, context, [c])[0] for c in conts]
    assert [s for s, _ in alone] == pytest.approx([s for s, _ in scores], abs=1e-5)
    assert [g for _, g in alone] == [g for _, g in scores]


def test_filled_context_scores_equal_one_filled_prefill_with_the_continuation_in_the_tail():
    model = tiny_model("qwen3")
    runner = Runner(adapter_for(model), chunk=16)
    context, cont = random_ids(48, seed=7)[0].tolist(), random_ids(4, seed=8)[0].tolist()
    filler, tail = IdentityFiller(3, runner.n_layers), 6
    (logprob, _), = continuation_scores(runner, context, [cont], FillPlan(filler, tail, (0,)))
    whole = torch.tensor([context + cont[:-1]])
    rows = list(range(len(context) - 1, whole.shape[1]))
    logits = runner.prefill(whole, fill=FillPlan(filler, tail + len(cont) - 1, (0,)), logits_at=rows).logits[0]
    reference = logits.float().log_softmax(-1).gather(1, torch.tensor(cont)[:, None]).sum()
    assert logprob == pytest.approx(float(reference), abs=1e-4)
    (exact, _), = continuation_scores(runner, context, [cont])
    assert abs(exact - logprob) > 1e-3  # the fill is in effect


# --- the command ---------------------------------------------------------------------------------------------
def run(checkpoint, data, out, **overrides):
    options = dict(model=str(checkpoint), maps=None, split=2, tail=8, data=str(data), mode="loglik", max_len=160,
                   out=out, limit=None, keep_first=1, seed=0, chunk=64, dtype="fp32", device="cpu",
                   variants="exact,identity", max_new_tokens=4)
    options.update(overrides)
    return longbench_command(**options)


def test_loglik_run_writes_accuracies_intervals_and_per_question_answers(tiny_checkpoint, data_file, tmp_path):
    doc = run(tiny_checkpoint, data_file, tmp_path / "lb.json")
    assert json.loads((tmp_path / "lb.json").read_text())["results"] == json.loads(json.dumps(doc["results"]))
    assert doc["command"] == "longbench" and doc["variants"] == ["exact", "identity"]
    assert doc["config"]["prompt_tokens"]["max"] <= 160 and doc["config"]["max_len"] == 160
    for name, result in doc["results"].items():
        per = result["per_question"]
        assert len(per) == 6 and all(len(p["option_logprobs"]) == 4 for p in per)
        assert all(p["prediction"] == "ABCD"[max(range(4), key=p["option_logprobs"].__getitem__)] for p in per)
        assert result["score"] == pytest.approx(100 * sum(p["correct"] for p in per) / 6)
        assert result["counts"] == {"overall": 6, "easy": 3, "hard": 3, "short": 2, "medium": 2, "long": 2}
        hard = [p["correct"] for p, r in zip(per, load_questions(str(data_file))) if r.difficulty == "hard"]
        assert result["accuracy"]["hard"] == pytest.approx(100 * sum(hard) / 3)
    iv = doc["intervals"]["identity"]["overall"]
    assert iv["low"] <= iv["estimate"] <= iv["high"]
    assert iv["estimate"] == pytest.approx(doc["results"]["identity"]["score"] - doc["results"]["exact"]["score"])
    exact = [p["option_logprobs"] for p in doc["results"]["exact"]["per_question"]]
    filled = [p["option_logprobs"] for p in doc["results"]["identity"]["per_question"]]
    assert exact != filled  # 8 full rows of up to 160: the fill changes the scores
    moved = [abs(a - b) for e, f in zip(exact, filled) for a, b in zip(e, f)]
    assert doc["results"]["identity"]["mean_abs_logprob_change"] == pytest.approx(sum(moved) / len(moved))
    assert doc["results"]["exact"]["mean_abs_logprob_change"] == 0


def test_exact_answers_are_reused_across_splits(tiny_checkpoint, data_file, tmp_path):
    store = tmp_path / "exact"
    first = run(tiny_checkpoint, data_file, tmp_path / "a.json", exact_cache=store)
    second = run(tiny_checkpoint, data_file, tmp_path / "b.json", exact_cache=store, split=3)
    assert first["exact_store"]["misses"] == 6 and second["exact_store"] == {"folder": str(store), "hits": 6,
                                                                              "misses": 0}
    plain = run(tiny_checkpoint, data_file, tmp_path / "c.json", split=3)
    assert second["results"] == plain["results"]  # stored log-probs come back exactly


@pytest.fixture(scope="module")
def tiny_maps(tiny_fitted) -> Path:
    return tiny_fitted.maps[2]


def test_all_three_variants_with_maps(tiny_checkpoint, data_file, tiny_maps, tmp_path):
    doc = run(tiny_checkpoint, data_file, tmp_path / "lb.json", maps=tiny_maps, split=None,
              variants="exact,identity,ridge", limit=2)
    assert doc["variants"] == ["exact", "identity", "ridge"] and doc["config"]["split"] == 2
    assert doc["maps"]["path"] == str(tiny_maps) and doc["maps"]["split"] == 2
    assert set(doc["intervals"]) == {"identity", "ridge"}
    ridge = [p["option_logprobs"] for p in doc["results"]["ridge"]["per_question"]]
    identity = [p["option_logprobs"] for p in doc["results"]["identity"]["per_question"]]
    assert ridge != identity


def test_identity_with_a_tail_covering_the_prompt_is_exact(tiny_checkpoint, data_file, tmp_path):
    doc = run(tiny_checkpoint, data_file, tmp_path / "lb.json", tail=160, limit=3)
    exact, identity = (doc["results"][v]["per_question"] for v in ("exact", "identity"))
    assert [p["option_logprobs"] for p in exact] == [p["option_logprobs"] for p in identity]
    assert doc["results"]["identity"]["agreement_with_exact"] == 100


def test_generate_mode_through_the_cli(tiny_checkpoint, data_file, tmp_path):
    from typer.testing import CliRunner

    from ridgefill.cli import app

    out = tmp_path / "gen.json"
    result = CliRunner().invoke(app, ["longbench", "--model", str(tiny_checkpoint), "--data", str(data_file),
                                      "--mode", "generate", "--variants", "exact", "--limit", "2", "--max-len", "96",
                                      "--max-new-tokens", "3", "--chunk", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    per = doc["results"]["exact"]["per_question"]
    assert len(per) == 2 and all(isinstance(p["response"], str) for p in per)
    assert all(p["prediction"] == extract_answer(p["response"]) for p in per)
    assert doc["config"]["limit"] == 2 and doc["intervals"] == {}


def test_prompts_that_cannot_fit_the_model_are_refused_with_a_fix(tiny_checkpoint, data_file, tmp_path):
    with pytest.raises(RidgefillError, match="exceed the model's context of 4096: use --max-len 4095 or less"):
        run(tiny_checkpoint, data_file, tmp_path / "x.json", max_len=5000)
    with pytest.raises(RidgefillError, match="use --max-len 3968 or less"):
        run(tiny_checkpoint, data_file, tmp_path / "x.json", max_len=4000, mode="generate", max_new_tokens=128)
    with pytest.raises(RidgefillError, match="the ridge variant needs --maps"):
        run(tiny_checkpoint, data_file, tmp_path / "x.json", variants="exact,ridge")
    assert not (tmp_path / "x.json").exists()


def test_cli_prints_one_line_for_a_missing_data_file(tmp_path):
    exe = Path(sys.executable).with_name("ridgefill")
    proc = subprocess.run([str(exe), "longbench", "--variants", "exact", "--data", str(tmp_path / "none.jsonl"), "--out",
                           str(tmp_path / "o.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --data {tmp_path / 'none.jsonl'} is neither a file nor a Hub "
                                                "dataset id: pass a LongBench v2 .json or .jsonl file"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_deeply_nested_record_is_one_line_exit_2(records, suffix, tiny_checkpoint, tmp_path, monkeypatch, capfd):
    """LongBench records nested 100,000 deep (a .jsonl line, a whole .json file): one line naming where, not a
    traceback."""
    from one_line import DEEP_JSON, refused

    path = tmp_path / f"lb{suffix}"
    path.write_text(json.dumps(records[0]) + "\n" + DEEP_JSON + "\n" if suffix == ".jsonl" else DEEP_JSON)
    where = f"{path}:2" if suffix == ".jsonl" else str(path)
    refused(["longbench", "--model", str(tiny_checkpoint), "--variants", "exact", "--data", str(path), "--limit",
             "1", "--max-len", "96", "--out", str(tmp_path / "out" / "lb.json")], tmp_path, monkeypatch, capfd,
            f"{where}: JSON nested too deeply to read: fix the record")
