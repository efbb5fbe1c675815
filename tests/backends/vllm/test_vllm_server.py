"""`ridgefill serve` as a user runs it, with vLLM: one server on the embedded SmolLM2 from the serving config
`ridgefill tune` wrote, with serve's defaults otherwise (compiled, prefix caching on: the settings operators keep;
tests/served_vllm.py, shared with the conformance suite), answers OpenAI completion requests as ridgefill's engine
does (per-request tail, malformed RidgeFill options, maps changed while it serves); bad configurations in real
processes. What every server must do (the key, hostile bodies, clients that go away, SIGTERM, a stderr nobody reads):
tests/serve/conformance. The in-process checks of what serve hands to vLLM are in tests/serve/test_serve.py. Skipped
where vLLM is not installed (the fixtures skip)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import free_port
from served_vllm import Server
from vllm_fixtures import prompts, reference

RIDGEFILL = [sys.executable, "-m", "ridgefill"]


# --- the server, end to end -------------------------------------------------------------------------------------
def post(url: str, body: dict | bytes, timeout: float = 120.0, key: str | None = None) -> tuple[int, dict]:
    """POST a JSON body (a dict, or its bytes as sent), with the API key when one is given: (status, answer)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def exact_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """Under transformers' forward of the checkpoint: the log-prob of each of `tokens` after `prompt` and what
    came before it, and the largest log-prob at that step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits.double(), -1)
    return ([float(logp[i, t]) for i, t in enumerate(tokens)], [float(v) for v in logp.max(-1).values])


# --- one server from tune's serving config (SmolLM2, split 15, tail 64): tests/served_vllm.py's, for the session --
@pytest.fixture
def server(vllm_server):
    """The session's vLLM server (tests/served_vllm.py), shared with the conformance suite (tests/serve/conformance)."""
    return vllm_server.get()


def complete(server: Server, prompt, **options) -> tuple[int, dict]:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **options}
    return post(f"{server.base}/v1/completions", body, key=server.key)


def answer(server: Server, prompt, **options) -> tuple[list[int], list[float]]:
    status, body = complete(server, prompt, logprobs=1, **options)
    assert status == 200, body
    (choice,) = body["choices"]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def metrics(server: Server) -> dict[str, float]:
    """The ridgefill_* counters on the server's /metrics."""
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("ridgefill_") and " " in line}


def test_serve_starts_with_its_defaults_and_says_what_it_serves(server):
    """The serving config's fill (its maps, split and tail) is what serve serves and says it serves."""
    first = server.banner
    assert first.startswith("ridgefill serve: smollm2-135m through vLLM at http://127.0.0.1:"), first
    assert "split 15 of 30 layers" in first and "tail 64" in first and "KV cache" in first, first
    assert "with RidgeFill: ridge fill, maps " in first and "serving.json (split 15" in first, first
    assert "Traceback" not in server.log.read_text(errors="replace")
    status, models = server.get("/v1/models", server.key)
    assert status == 200 and [m["id"] for m in json.loads(models)["data"]] == ["smollm2-135m"]


def test_filled_requests_match_ridgefills_engine(server):
    """Test 2 on the embedded SmolLM2 (split 15 of 30, tail 64) through the server, the 8 requests sent at once (the
    server batches them): first-token top-5 log-probs within 1e-3 of ridgefill's own filled prefill, at least 7 of 8
    greedy 32-token continuations equal; the server's counters count each filled row."""
    from concurrent.futures import ThreadPoolExecutor

    batch = prompts(8, [300, 420, 256, 380], 49152, seed=4)
    before = metrics(server)
    with ThreadPoolExecutor(len(batch)) as pool:
        replies = list(pool.map(lambda p: complete(server, p, max_tokens=32, logprobs=5,
                                                   return_tokens_as_token_ids=True), batch))
    got = []
    for status, body in replies:
        assert status == 200, body
        (choice,) = body["choices"]
        top = {int(k.split(":")[1]): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
        got.append((choice["token_ids"], top))
    after = metrics(server)
    tokens, first = reference(server.folder, server.maps, 64, batch, 32)
    gaps = [max(abs(lp - float(f[t])) for t, lp in top.items()) for (_, top), f in zip(got, first)]
    same = sum(g[0] == t for g, t in zip(got, tokens))
    print(f"SmolLM2 through serve: max first-token log-prob gap {max(gaps):.2e}; {same} of 8 continuations agree")
    assert max(gaps) < 1e-3 and same >= 7, (gaps, same)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    outliers = delta["ridgefill_outlier_tokens_total"]
    assert delta["ridgefill_filled_tokens_total"] == sum(len(p) - 65 for p in batch) - outliers
    assert delta["ridgefill_full_tokens_total"] == 65 * len(batch) + outliers
    assert delta["ridgefill_stock_steps_total"] == 0


def test_a_request_sets_its_tail_and_a_tail_over_the_prompt_is_exact(server):
    prompt = prompts(1, [120], 49152, seed=9)[0]
    filled = answer(server, prompt)
    exact = answer(server, prompt, vllm_xargs={"ridgefill_tail": 10000})
    tokens, logprobs = exact
    expected, best = exact_logprobs(server.folder, prompt, tokens)
    assert logprobs == pytest.approx(expected, abs=1e-3)  # transformers' own forward
    assert expected == pytest.approx(best, abs=1e-3)  # and its greedy choices
    assert filled[0] != tokens or filled[1] != pytest.approx(logprobs, abs=1e-4)  # RidgeFill ran


def malformed(rng: random.Random) -> dict:
    """A request whose RidgeFill options are bad in one of many ways (vLLM's request model or RidgeFill's checks
    must refuse it)."""
    key = rng.choice(["ridgefill_tail", "ridgefill_keep_first", "ridgefill_tial", "ridgefill_", "ridgefill_split",
                      "ridgefill_tail_", "ridgefill_keepfirst"])
    huge = rng.choice([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, 10**30])
    value = rng.choice([
        huge, -huge, -1, -(2**31), rng.randint(-10**6, -1), 0.5, 1.0, 64.0, -3.5, 1e300, "64", "", "ten", "1e3",
        True, False, None, [64], [1, 2, 3], {"tail": 64}, {"a": {"b": [1, {"c": 2}]}}, [[1]], "∞",
    ])
    if key == "ridgefill_keep_first" and value in (0, 1, 64) and type(value) is int:  # noqa: E721  (valid)
        value = -1
    if key == "ridgefill_tail" and type(value) is int and 1 <= value < 2**31:  # noqa: E721  (valid)
        value = 0
    xargs = {key: value}
    if rng.random() < 0.3:  # beside a valid option, before or after it
        valid = ("ridgefill_keep_first", 2) if key == "ridgefill_tail" else ("ridgefill_tail", 32)
        xargs = {**xargs, valid[0]: valid[1]} if rng.random() < 0.5 else {valid[0]: valid[1], **xargs}
    return {"vllm_xargs": xargs} if rng.random() < 0.9 else {"vllm_xargs": rng.choice(
        [[key, value] if isinstance(value, (int, float, str)) else [key], "ridgefill_tail=5", 17, True])}


def test_malformed_requests_are_400_and_the_server_serves_on(server):
    """A bounded fuzz: 240 requests with malformed RidgeFill options (unknown ridgefill_* keys, huge and negative
    integers, floats, strings, booleans, nulls, nested objects, a vllm_xargs that is no object) are each answered
    400; the server stays up, and a well-formed request gives the same output before and after."""
    prompt = prompts(1, [200], 49152, seed=10)[0]
    before = answer(server, prompt, max_tokens=8)
    rng = random.Random(23)
    answers = []
    deadline = time.monotonic() + 600
    for i in range(240):
        extra = malformed(rng)
        status, body = complete(server, prompt[: 20 + i % 50], max_tokens=1, **extra)
        answers.append((status, extra, body))
        assert time.monotonic() < deadline, "the fuzz took over 10 minutes"
    bad = [(status, extra, body) for status, extra, body in answers if status != 400]
    assert not bad, bad[:5]
    messages = [body["error"]["message"] for _, _, body in answers]
    ours = [m for m in messages if m.startswith(("ridgefill_", "unknown RidgeFill request option"))]
    assert len(ours) > 150 and all("\n" not in m for m in ours), ours  # most are RidgeFill's own, one line each
    with urllib.request.urlopen(f"{server.base}/health", timeout=30) as r:
        assert r.status == 200
    assert answer(server, prompt, max_tokens=8) == before


def test_changing_the_maps_file_while_serving_changes_nothing(server):
    """The maps were read into private memory when the server started: overwriting the file in place, then
    truncating it, leaves every answer as it was (no SIGBUS, no other maps)."""
    prompt = prompts(1, [300], 49152, seed=11)[0]
    before = answer(server, prompt, max_tokens=8)
    original = server.maps.read_bytes()
    size = len(original)
    try:
        with open(server.maps, "r+b") as f:  # the same file, its bytes replaced (the tensors' part zeroed)
            f.seek(size // 2)
            f.write(bytes(size - size // 2))
        assert answer(server, prompt, max_tokens=8) == before
        with open(server.maps, "r+b") as f:
            f.truncate(100)
        assert answer(server, prompt, max_tokens=8) == before
    finally:  # tune's maps, as the serving config pins them
        server.maps.write_bytes(original)


# --- bad configurations and tune's serving config, in real processes ------------------------------------
def test_a_bad_configuration_in_a_real_process_is_one_line_and_exit_2(vllm_tiny, tmp_path):
    """The same through `python -m ridgefill` (one case: each process pays ridgefill's imports)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = subprocess.run([*RIDGEFILL, "serve", "--model", str(vllm_tiny["qwen2"][0]), "--maps", str(vllm_tiny["llama"][1]),
                        "--port", str(free_port())], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "fitted for another model" in r.stderr
    assert "Traceback" not in r.stderr and not any(cwd.iterdir())


def test_a_setting_vllm_reads_from_a_config_file_that_breaks_the_fill_ends_serve_with_one_line(vllm_tiny, tmp_path):
    """LoRA turned on in a vLLM --config file (no option serve could refuse): the plugin refuses vLLM's resolved
    configuration in the API server before any engine starts; serve prints that reason as its one line and exits 2."""
    folder, maps = vllm_tiny["llama"]
    config = tmp_path / "vllm.yaml"
    config.write_text("enable-lora: true\n")
    log = tmp_path / "vllm.log"
    r = subprocess.run([*RIDGEFILL, "serve", "--model", str(folder), "--maps", str(maps), "--port", str(free_port()),
                        "--log-file", str(log), "--config", str(config)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: LoRA is not supported with RidgeFill"), r.stderr
    assert f"(the server's log: {log})" in r.stderr and "Traceback" in log.read_text()  # the whole story is in the log
