"""Every installed engine agrees with torchfill on the same prompts and maps: the embedded SmolLM2
(vLLM runs its Hugging Face conversion, llama.cpp its GGUF file) with the maps `ridgefill tune` fitted for it
(tests/vllm_fixtures.py smollm2_tuned: ridge at split 15, tail 64), through the commands a user runs
(`generate --compare --out`, `loss --out`): the same greedy tokens of exact and filled prefill, the same rows
filled, and tail NLLs within a stated tolerance of torchfill's (vLLM: fp32 kernels of another order;
llama.cpp: the GGUF's Q4_1 weights and its quantized activations, where torchfill runs their fp32
conversion). Measured when written (2026-12-05): all three engines gave the same 8 greedy tokens, exact and filled,
on a 707-token prompt; tail NLLs within 3e-3 nats of torchfill's on 2 passages. A near-tie is no
agreement test: see PROMPT."""

from __future__ import annotations

import json

import pytest

from helpers import run_captured

ENGINES = ("torchfill", "vllm", "llamacpp")
NLL_TOLERANCE = {"torchfill": 0.0, "vllm": 2e-3, "llamacpp": 2e-2}  # nats, against torchfill's tail NLL
# greedy tokens are compared exactly, so the prompt's continuation must not hang on a near-tie that llama.cpp's
# quantized activations can flip (a repeated sentence did: its first filled token's two best logits were 0.07 apart
# in torchfill and swapped in llama.cpp); counting leaves a margin of about 10
PROMPT = ", ".join(str(i) for i in range(1, 160)) + ","
TEXT = ("The shipping forecast is read four times a day. It covers the seas around the British Isles, area by area, "
        "with the wind, the sea state, the weather and the visibility. ")


def installed(engine: str) -> str | None:
    """Why `engine` cannot run here (None: it can)."""
    from ridgefill.backends import backend_class
    from ridgefill.errors import RidgefillError

    try:
        backend_class(engine).check_installed()
    except RidgefillError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def served(smollm2_tuned, tmp_path_factory):
    """(the tuned maps, their tail, a folder of documents for loss, the prompt file)."""
    _, config = smollm2_tuned
    doc = json.loads(config.read_text())
    root = tmp_path_factory.mktemp("agreement")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):  # documents long enough for 512-token passages
        (corpus / f"doc{i}.txt").write_text(" ".join(f"Passage {i}, sentence {j}: {TEXT[j % 97:j % 97 + 60]}."
                                                     for j in range(120)))
    prompt = root / "prompt.txt"
    prompt.write_text(PROMPT)
    return doc["maps"]["path"], doc["tail"], corpus, prompt


def results_of(engine, served, tmp_path, capfd, monkeypatch) -> tuple[dict, dict]:
    """The result documents of `generate --compare` and `loss` run by `engine`."""
    maps, tail, corpus, prompt = served
    common = ["--engine", engine, "--model", "smollm2-135m", "--maps", maps, "--tail", str(tail)]
    gen, loss = tmp_path / f"generate-{engine}.json", tmp_path / f"loss-{engine}.json"
    done = run_captured(["generate", *common, "--prompt-file", prompt, "--max-new-tokens", "6", "--compare",
                         "--out", gen], capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    done = run_captured(["loss", *common, "--data", corpus, "--context", "512", "--short", "128", "--samples", "2",
                         "--variants", "ridge", "--out", loss], capfd, monkeypatch)
    assert done.returncode == 0, done.stderr
    return json.loads(gen.read_text()), json.loads(loss.read_text())


@pytest.fixture(scope="module")
def own(served, tmp_path_factory):
    """Torchfill's documents, the reference (run once for the module, through the same commands)."""
    from ridgefill.commands import command

    maps, tail, corpus, prompt = served
    root = tmp_path_factory.mktemp("own")
    command("generate")(engine="torchfill", model="smollm2-135m", maps=maps, tail=tail, prompt_file=prompt,
                        max_new_tokens=6, compare=True, out=root / "generate.json")
    command("loss")(engine="torchfill", model="smollm2-135m", maps=maps, tail=tail, data=str(corpus), context=512,
                    short=128, samples=2, variants="ridge", out=root / "loss.json")
    return json.loads((root / "generate.json").read_text()), json.loads((root / "loss.json").read_text())


# vLLM's run (about 3 minutes: four engines on SmolLM2) is the heavy tier's (make test-heavy): make test checks vLLM
# against torchfill on the tiny models (tests/backends/vllm/test_vllm_commands.py, test_vllm_server.py)
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.heavy) if e == "vllm" else e for e in ENGINES])
def test_every_engine_agrees_with_torchfill(engine, served, own, tmp_path, capfd, monkeypatch):
    why = installed(engine)
    if why is not None:
        pytest.skip(f"--engine {engine} cannot run here: {why}")
    gen, loss = results_of(engine, served, tmp_path, capfd, monkeypatch)
    want_gen, want_loss = own
    assert gen["engine"]["name"] == engine
    for name in ("exact", "filled"):
        got, want = gen["results"][name], want_gen["results"][name]
        assert got["tokens"] == want["tokens"], (name, got["tokens"], want["tokens"])
        assert got["filled_tokens"] == want["filled_tokens"] and got["prompt_tokens"] == want["prompt_tokens"]
    assert gen["results"]["filled"]["filled_tokens"] > 0 and gen["results"]["exact"]["filled_tokens"] == 0
    for name in ("exact", "ridge"):  # exact and ridge only: each variant is one more vLLM worker
        got, want = loss["results"][name], want_loss["results"][name]
        assert got["tail_tokens"] == want["tail_tokens"] > 0
        assert abs(got["tail_nll"] - want["tail_nll"]) <= NLL_TOLERANCE[engine], (name, got["tail_nll"],
                                                                                  want["tail_nll"])
    # the fill changed what the tail saw, in every engine alike
    assert loss["results"]["ridge"]["tail_nll"] != loss["results"]["exact"]["tail_nll"]
