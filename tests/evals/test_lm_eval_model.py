"""The `ridgefill` lm-eval model: offline custom tasks over a local jsonl, exactness against a plain forward pass,
and the `ridgefill lm-eval` entry point."""

from __future__ import annotations

import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from ridgefill.errors import RidgefillError  # noqa: E402
from ridgefill.evals.lm_eval_model import RidgefillLM  # noqa: E402

ROWS = [
    {"question": "The sky is", "choices": [" blue", " green", " yellow", " the king of the castle"], "label": 0},
    {"question": "The grass is", "choices": [" green", " blue", " yellow", " night and day"], "label": 0},
    {"question": "One of the special magic numbers for river is", "choices": [" 1234567", " love", " war"],
     "label": 0},
]

MC_TASK = """task: rf_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: rf_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "rf_tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    (folder / "rf_tiny_gen.yaml").write_text(GEN_TASK.format(data=data))
    return folder


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network: `datasets` (imported with lm_eval, before any fixture) and the Hub client read these flags
    when called, not the environment."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def evaluate(checkpoint, task_dir, model_args: str, tasks=("rf_tiny_mc", "rf_tiny_gen")) -> dict:
    return lm_eval.simple_evaluate(
        model="ridgefill", model_args=f"pretrained={checkpoint},{model_args}".rstrip(","),
        tasks=list(tasks), device="cpu", log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
    )


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_exact_and_identity_covering_every_row_agree_and_a_short_tail_fills(tiny_checkpoint, task_dir):
    exact = evaluate(tiny_checkpoint, task_dir, "")
    covered = evaluate(tiny_checkpoint, task_dir, "fill=identity,split=2,tail=4096")
    filled = evaluate(tiny_checkpoint, task_dir, "fill=identity,split=2,tail=1,keep_first=0", ["rf_tiny_mc"])
    for task in ("rf_tiny_mc", "rf_tiny_gen"):
        assert responses(exact, task) == responses(covered, task)
        assert exact["results"][task] == covered["results"][task]
    acc = exact["results"]["rf_tiny_mc"]["acc,none"]
    assert isinstance(acc, float) and 0 <= acc <= 1
    assert isinstance(exact["results"]["rf_tiny_gen"]["exact_match,none"], float)
    loglik = [[r[0][0] for r in resp] for resp in responses(exact, "rf_tiny_mc")]
    assert all(math.isfinite(x) and x < 0 for row in loglik for x in row)
    # with one full row, identity fill changes what the continuations see
    assert responses(filled, "rf_tiny_mc") != responses(exact, "rf_tiny_mc")


def test_loglikelihood_matches_a_plain_forward_pass(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    lm = RidgefillLM(pretrained=str(tiny_checkpoint), device="cpu")
    pairs = [("The sky is", " blue"), ("The sky is", " the king of the castle"), ("Here we go", " there and back")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                           disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx, cont = lm.tok_encode(context), lm.tok_encode(context + continuation)[len(lm.tok_encode(context)):]
        assert len(cont) >= 1
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].log_softmax(-1)
        target = torch.tensor(cont)
        assert logprob == pytest.approx(float(logits.gather(1, target[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == target).all())


def test_generate_until_stops_at_the_stop_sequence(tiny_checkpoint):
    lm = RidgefillLM(pretrained=str(tiny_checkpoint), device="cpu")
    context = "The grass is green. The sky is"
    free = lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 8}), 0)])[0]
    ids = lm.tok_encode(context)
    reference = lm.runner.generate(torch.tensor([ids]), 8, None, lm.eot_token_id).tokens[0]
    assert free == lm.tokenizer.decode(reference, skip_special_tokens=True)
    assert len(free) > 1
    stop = free[len(free) // 2]
    cut = lm.generate_until([Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 8}), 0)])[0]
    assert cut == free.split(stop)[0]


def test_bad_model_args_and_rolling_are_refused(tiny_checkpoint):
    with pytest.raises(RidgefillError, match="unknown model_args \\['temperature'\\]"):
        RidgefillLM(pretrained=str(tiny_checkpoint), temperature=0.5)
    with pytest.raises(RidgefillError, match="unknown fill 'swift'"):
        RidgefillLM(pretrained=str(tiny_checkpoint), fill="swift")
    with pytest.raises(RidgefillError, match="identity fill needs --split"):
        RidgefillLM(pretrained=str(tiny_checkpoint), fill="identity")
    lm = RidgefillLM(pretrained=str(tiny_checkpoint), device="cpu")
    with pytest.raises(NotImplementedError, match="no logits"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("text",), 0)])
    with pytest.raises(RidgefillError, match="do_sample=false"):
        lm.generate_until([Instance("generate_until", {}, ("The sky", {"do_sample": True}), 0)])


def test_ridgefill_lm_eval_runs_lm_evals_cli_with_the_model_registered(tiny_checkpoint, task_dir, tmp_path):
    from typer.testing import CliRunner

    from ridgefill.cli import app

    args = ["lm-eval", "--model", "ridgefill", "--model_args", f"pretrained={tiny_checkpoint},fill=identity,split=2",
            "--tasks", "rf_tiny_mc", "--include_path", str(task_dir), "--device", "cpu", "--limit", "2",
            "--output_path", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1
    doc = json.loads(written[0].read_text())
    assert doc["results"]["rf_tiny_mc"]["acc,none"] in (0.0, 0.5, 1.0)
    assert doc["config"]["model"] == "ridgefill"


def test_the_command_imports_without_lm_eval_and_fails_in_one_line_when_run(monkeypatch):
    """`ridgefill --help` and `ridgefill lm-eval` import the command's module; only running it needs lm-eval."""
    import importlib
    import sys

    from ridgefill.cli import click_command
    from ridgefill.commands import command

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing them raises ImportError
    for name in ("ridgefill.evals.lm_eval_model", "ridgefill.evals.lm_eval_cli"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("ridgefill.evals.lm_eval_cli")
    cmd = command("lm-eval")
    assert cmd is module.COMMAND and cmd.passthrough and list(cmd.options) == ["args"]
    assert click_command(cmd).name == "lm-eval"
    with pytest.raises(RidgefillError, match="lm-eval is not installed"):
        cmd(args=["--help"])


def test_the_fill_model_args_are_the_fill_options_with_their_defaults():
    """Every fill option (method/fill.OPTIONS) is a model_arg with the fill's own default and check; anything else is
    refused with the list of what is accepted."""
    from ridgefill.torchfill.prefill import DEFAULT_CHUNK
    from ridgefill.evals.lm_eval_model import model_settings
    from ridgefill.method.fill import OPTIONS
    from ridgefill.method.fill_fields import FIELD

    settings, fill, max_gen_toks, chunk = model_settings(fill="identity", split="3")
    assert (fill, chunk, max_gen_toks) == ("identity", DEFAULT_CHUNK, 256)
    assert {name: getattr(settings, name) for name in OPTIONS} == {**{n: FIELD[n].default for n in OPTIONS},
                                                                  "split": 3}
    given = model_settings(fill="identity", split=3, tail="9", keep_first="0", outlier_factor="2.5",
                           filled_window="4", filled_window_layers="0-1")[0]
    assert (given.tail, given.keep_first, given.outlier_factor, given.filled_window) == (9, 0, 2.5, 4)
    with pytest.raises(RidgefillError, match=r"^--tail 0 must be an integer of at least 1"):
        model_settings(fill="identity", split=3, tail=0)
    with pytest.raises(RidgefillError, match=r"unknown model_args \['window'\] .* use pretrained, dtype, device, fill, "
                                             r"chunk, max_gen_toks, " + ", ".join(OPTIONS) + "$"):
        model_settings(window=4)
