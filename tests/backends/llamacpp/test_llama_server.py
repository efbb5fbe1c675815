"""llama.cpp's own `llama-server` with ridgefill's server patch (patches/server.patch): the installed binary
(.venv/bin/llama-server, which build.py copies there) started as a user starts it, on a tiny GGUF, its key only in
LLAMA_API_KEY, stopped with SIGTERM. Maps converted to a GGUF adapter read back as they were written; `--parallel 2`
with requests at once, each with its own ridgefill_tail and ridgefill_keep_first, answers as `ridgefill generate
--engine llamacpp` answers each prompt alone, and /metrics counts every prompt row once; a prompt that shares a prefix
with its slot's cache answers as a fresh server does, with the rows it reused counted as cached; without --ridgefill
the patched server is stock llama-server of the same source (build.py --stock-server); what --ridgefill cannot serve
is one line and exit 1, a wrong adapter one line of llama.cpp's; a bad per-request field is a 400 naming it."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tiny_gguf
from helpers import free_port
from ridgefill.backends.llamacpp import build
from ridgefill.cli import app
from server_client import ServerClient
from served_llamacpp import perturbed_maps, stop

MISSING = tiny_gguf.missing_build()
SERVER = Path(sys.prefix) / "bin" / "llama-server"  # where build.py installs it, beside this interpreter
STOCK = build.server_folder(patched=False) / "llama-server"  # build.py --stock-server (the user's cache)
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}"),
    pytest.mark.skipif(not SERVER.is_file(), reason=f"no patched llama-server at {SERVER}: "
                                                    "python src/ridgefill/backends/llamacpp/build.py"),
]
START_TIMEOUT = 120.0
NEW = 8
# byte-level tokens (one per character but "ab" and "cd"): 40-120 tokens each, no two with the same first token (no
# shared prefix, so nothing is cached between them)
PROMPTS = ["Quiet rivers carry old songs past the mill, where seven wizards hum near a frozen lake at dusk.",
           "In 1999 Ada wrote 42 letters to Bob; each one asked where the key to the blue door was hidden.",
           "zebras vex jumbo glyphs: pack my box with five dozen liquor jugs, then whistle.",
           "Mountains of paper, a lamp, two cats and the smell of rain on a Sunday afternoon in May, 1987."]
PLANS = [(1, 0), (5, 1), (12, 3), (30, 2)]  # (ridgefill_tail, ridgefill_keep_first) of each prompt


@dataclass
class Llama(ServerClient):
    proc: subprocess.Popen
    base: str
    key: str
    name: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """RidgeFill's lines of /metrics (llama-server asks for the key there)."""
        status, _, data = self.request("GET", "/metrics")
        assert status == 200, data
        return {line.split()[0]: float(line.split()[1]) for line in data.decode().splitlines()
                if line.startswith("ridgefill_") and " " in line}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def completion(self, prompt: str, **fields) -> dict:
        """llama-server's own /completion, greedy (temperature 0, no other sampling field): its tokens too."""
        status, body = self.post("/completion", {"prompt": prompt, "n_predict": NEW, "temperature": 0,
                                                 "return_tokens": True, **fields})
        assert status == 200, body
        return body


def environment(key: str) -> dict:
    """This environment without llama.cpp's own settings (LLAMA_ARG_*), the key in LLAMA_API_KEY."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}, "LLAMA_API_KEY": key}


def argv(binary: Path, gguf: Path, port: int, args) -> list[str]:
    return [str(binary), "-m", str(gguf), "-c", "2048", "-t", "1", "--metrics", "--parallel", "2", "--host",
            "127.0.0.1", "--port", str(port), *map(str, args)]


@contextmanager
def running(gguf: Path, root: Path, *args, binary: Path = SERVER):
    """llama-server up (GET /health is 200), stopped with SIGTERM afterwards."""
    port, key = free_port(), secrets.token_hex(8)
    log = root / f"llama-server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv(binary, gguf, port, args), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=environment(key))
    server = Llama(proc, f"http://127.0.0.1:{port}", key, "tiny", log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}:\n{server.output()[-4000:]}"
            try:
                if server.request("GET", "/health", key=None, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"llama-server did not come up:\n{server.output()[-4000:]}"
            time.sleep(0.1)
        yield server
    finally:
        stop(proc)


def refused(gguf: Path, root: Path, *args) -> tuple[int, list[str]]:
    """(exit code, output lines) of a llama-server that must not start."""
    try:
        r = subprocess.run(argv(SERVER, gguf, free_port(), args), stdin=subprocess.DEVNULL, capture_output=True,
                           env=environment(secrets.token_hex(8)), timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"llama-server {args} started instead of refusing:\n{exc.output}") from None
    return r.returncode, (r.stdout + r.stderr).decode(errors="replace").splitlines()


def run(args) -> None:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output


def generate(gguf: Path, maps: Path, prompt: str, tail: int, keep_first: int, out: Path) -> dict:
    """`ridgefill generate --engine llamacpp` on `prompt` alone: its filled run's record."""
    run(["generate", "--engine", "llamacpp", "--model", gguf, "--maps", maps, "--tail", tail, "--keep-first",
         keep_first, "--prompt", prompt, "--max-new-tokens", NEW, "--threads", 1, "--out", out])
    return json.loads(out.read_text())["results"]["filled"]


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    """A tiny Llama GGUF and its perturbed maps: safetensors, and converted to F32 and F16 GGUF adapters (the
    conversions' GGUF identities in a cache of the session, not the user's). Its weights are drawn 10x wider than
    transformers' default (initializer_range 0.2): at 0.02 the tiny model's greedy answer is its prompt's last
    character repeated, with or without the fill, and equal tokens would show little."""
    root = tmp_path_factory.mktemp("llama-server")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        _, gguf = tiny_gguf.build("llama", root / "tiny-llama.gguf", initializer_range=0.2)
        found = {"gguf": gguf, "root": root, "safetensors": perturbed_maps(gguf, root / "maps.safetensors", split=3)}
        for kind in ("f32", "f16"):
            found[kind] = root / f"maps-{kind}.gguf"
            run(["convert-maps", "--maps", found["safetensors"], "--out", found[kind], "--gguf-type", kind])
        yield found


def test_converted_maps_read_back_as_written(maps):
    import torch

    from ridgefill.method import maps_gguf
    from ridgefill.method.maps import load_maps

    want, want_meta, _ = load_maps(maps["safetensors"])
    assert {"weight", "bias"} <= set(want) and want["weight"].shape == (2, 64, 64)  # layers 4, 5 of 6 (split 3)
    for kind in ("f32", "f16"):
        assert maps_gguf.is_gguf(maps[kind])
        got, meta, _ = load_maps(maps[kind])
        assert set(got) == set(want), kind
        assert (meta["split"], meta["n_layers"], meta["kind"], meta["gguf"]["matrix_type"]) == \
            (3, 6, "ridge", kind), meta
        assert meta["gguf"]["architecture"] == "llama"
        for name, t in want.items():
            assert got[name].dtype == torch.float32 and got[name].shape == t.shape, name
            if kind == "f16" and name in maps_gguf.MATRICES:  # the matrices rounded to F16 once, nothing else
                assert torch.equal(got[name], t.half().float()), name
                assert not torch.equal(got[name], t)
            else:
                assert torch.equal(got[name], t), (kind, name, (got[name] - t).abs().max())
    assert want_meta["split"] == 3


def concurrently(server: Llama, jobs: list[dict]) -> list:
    """Each job's completion through the openai client, all sent at once (one thread each)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key=server.key, max_retries=0)
    barrier, results = threading.Barrier(len(jobs)), [None] * len(jobs)

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = client.completions.create(model=server.name, prompt=jobs[i]["prompt"], max_tokens=NEW,
                                                   temperature=0, extra_body=jobs[i]["extra"])
        except Exception as exc:  # noqa: BLE001  (reported below, with the server's log)
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    failed = [r for r in results if not hasattr(r, "choices")]
    assert not failed, f"{failed}\n{server.output()[-4000:]}"
    return results


def overlapped(log: str) -> bool:
    """Whether llama-server's log shows a slot launched while the other was still busy with a task."""
    busy = set()
    for kind, slot in re.findall(r"(launch_slot_|release): id +(\d+)", log):
        if kind == "launch_slot_" and busy - {slot}:
            return True
        (busy.add if kind == "launch_slot_" else busy.discard)(slot)
    return False


def test_parallel_requests_answer_as_generate_answers_each_alone(maps):
    """--parallel 2, four requests at once with four plans: each answer's tokens are `ridgefill generate`'s on its
    prompt alone (F32 maps: the same weights, so the same greedy tokens), both slots served, /metrics counted each
    prompt row once (filled as generate filled them, nothing cached) and the fill changed answers."""
    gguf, root = maps["gguf"], maps["root"]
    jobs = [{"prompt": p, "extra": {"ridgefill_tail": t, "ridgefill_keep_first": k, "return_tokens": True,
                                     "verbose": True}} for p, (t, k) in zip(PROMPTS, PLANS)]
    with running(gguf, root, "--ridgefill", maps["f32"]) as server:
        said = [line for line in server.output().splitlines() if "ridgefill: " in line]
        assert len(said) == 1 and "the RAM prompt cache (--cache-ram) is off" in said[0], said  # on by default
        assert server.request("GET", "/metrics", key=None)[0] == 401  # the key from LLAMA_API_KEY holds
        answers = concurrently(server, jobs)
        m = server.metrics()
        assert overlapped(server.output()), server.output()  # the two slots served at once
        exact = [server.complete(p, NEW, ridgefill_tail=1000, id_slot=0) for p in PROMPTS]  # nothing filled
    wants = [generate(gguf, maps["f32"], p, t, k, root / f"generate-{i}.json")
             for i, (p, (t, k)) in enumerate(zip(PROMPTS, PLANS))]
    got = [a.model_extra["__verbose"] for a in answers]
    assert {g["id_slot"] for g in got} == {0, 1}, got
    for i, (answer, g, want) in enumerate(zip(answers, got, wants)):
        assert answer.usage.prompt_tokens == want["prompt_tokens"] == g["tokens_evaluated"], i
        assert 40 <= want["prompt_tokens"] <= 120
        assert g["tokens"] == want["tokens"] and g["tokens"], (i, PLANS[i], g["tokens"], want)
        # generate's text skips the BOS and EOS ids (1, 2: bytes 0x01, 0x02 in this vocabulary), llama-server's not
        assert answer.choices[0].text.replace("\x01", "").replace("\x02", "") == want["text"], (i, answer, want)
        assert want["filled_tokens"] == want["prompt_tokens"] - sum(PLANS[i]), i  # no outliers on these prompts
    prompt_rows = sum(w["prompt_tokens"] for w in wants)
    filled = sum(w["filled_tokens"] for w in wants)
    assert m["ridgefill_filled_tokens_total"] == filled > 0, m
    assert m["ridgefill_cached_prompt_tokens_total"] == 0, m
    assert m["ridgefill_outlier_tokens_total"] == sum(w["outlier_tokens"] for w in wants) == 0, m
    assert m["ridgefill_filled_tokens_total"] + m["ridgefill_full_tokens_total"] + \
        m["ridgefill_cached_prompt_tokens_total"] == prompt_rows, m
    # the fill changes the answer of at least one prompt (else equal tokens would prove nothing)
    assert any(e["choices"][0]["text"] != w["text"] for e, w in zip(exact, wants)), (exact, wants)


def test_outliers_run_in_full_as_generate_runs_them(maps):
    """--ridgefill-outlier-factor 1.2 (low: some rows of each chunk are outliers): each answer and each count is
    `ridgefill generate`'s with --outlier-factor 1.2, and the outliers are counted among the full rows."""
    gguf, root = maps["gguf"], maps["root"]
    with running(gguf, root, "--ridgefill", maps["f32"], "--ridgefill-outlier-factor", "1.2") as server:
        got = [server.completion(p, id_slot=i, ridgefill_tail=3, ridgefill_keep_first=1)
               for i, p in enumerate(PROMPTS[:2])]
        m = server.metrics()
    wants = []
    for i, p in enumerate(PROMPTS[:2]):
        out = root / f"outliers-{i}.json"
        run(["generate", "--engine", "llamacpp", "--model", gguf, "--maps", maps["f32"], "--tail", 3, "--keep-first",
             1, "--outlier-factor", 1.2, "--prompt", p, "--max-new-tokens", NEW, "--threads", 1, "--out", out])
        wants.append(json.loads(out.read_text())["results"]["filled"])
    for g, want in zip(got, wants):
        assert g["tokens"] == want["tokens"] and g["tokens_evaluated"] == want["prompt_tokens"], (g, want)
    outliers = sum(w["outlier_tokens"] for w in wants)
    assert m["ridgefill_outlier_tokens_total"] == outliers > 0, (m, wants)
    assert m["ridgefill_filled_tokens_total"] == sum(w["filled_tokens"] for w in wants), m
    assert m["ridgefill_full_tokens_total"] == 2 * (3 + 1) + outliers, m


SHARED = "Seven lanterns hung above the harbour wall, and every evening the keeper lit them one by one, "
A, B = SHARED + "humming an old tune.", SHARED + "counting the ships that came home."
C = B + " Then he wrote their names in a blue book."
D = C + " The sea was calm."
# (ridgefill_tail, ridgefill_keep_first): B's last 6 rows ran in full and C's plan fills them; D keeps row 1 in full,
# which C filled
REUSE_PLANS = {A: (4, 1), B: (6, 1), C: (5, 1), D: (5, 2)}


def test_a_prompt_sharing_a_prefix_answers_as_a_fresh_server(maps):
    """Slot 0 serves A, then B (A's prefix and another end), C (B and more), D (C and more, another keep-first):
    B, C and D answer as each does on a fresh server, and the rows each reused are exactly those a fresh prefill by
    its plan would leave as they are, counted as cached (B: the whole shared prefix; C: B's rows but its last 6,
    which ran in full where C's plan fills them; D: row 0 only, as C filled row 1), each prompt's rows once."""
    gguf, root = maps["gguf"], maps["root"]
    got, deltas = {}, {}
    with running(gguf, root, "--ridgefill", maps["f32"]) as server:
        status, shared = server.post("/tokenize", {"content": SHARED})
        assert status == 200, shared
        before = server.metrics()
        for prompt, (tail, keep) in REUSE_PLANS.items():
            got[prompt] = server.completion(prompt, id_slot=0, ridgefill_tail=tail, ridgefill_keep_first=keep)
            after = server.metrics()
            deltas[prompt] = {k: after[k] - before.get(k, 0) for k in after}
            before = after
    want = {}
    for p in (B, C, D):  # a fresh server each
        with running(gguf, root, "--ridgefill", maps["f32"]) as fresh:
            want[p] = fresh.completion(p, id_slot=0, ridgefill_tail=REUSE_PLANS[p][0],
                                       ridgefill_keep_first=REUSE_PLANS[p][1])
            assert fresh.metrics()["ridgefill_cached_prompt_tokens_total"] == 0
    n = {p: got[p]["tokens_evaluated"] for p in REUSE_PLANS}
    for p in (B, C, D):
        assert got[p]["tokens"] == want[p]["tokens"] and got[p]["content"] == want[p]["content"], (p, got, want)
        assert n[p] == want[p]["tokens_evaluated"] and got[p]["tokens"]
    cached = {p: d["ridgefill_cached_prompt_tokens_total"] for p, d in deltas.items()}
    for p, d in deltas.items():
        assert d["ridgefill_filled_tokens_total"] + d["ridgefill_full_tokens_total"] + cached[p] == n[p], (p, d)
        assert cached[p] == got[p]["timings"]["cache_n"], (p, d, got[p]["timings"])
        assert d["ridgefill_full_tokens_total"] == sum(REUSE_PLANS[p]) - (cached[p] > 0), (p, d)  # row 0 cached
    assert (cached[A], cached[B], cached[C], cached[D]) == (0, len(shared["tokens"]), n[B] - REUSE_PLANS[B][0], 1)


@pytest.mark.skipif(not STOCK.is_file(), reason=f"no stock llama-server at {STOCK}: "
                                                "python src/ridgefill/backends/llamacpp/build.py --stock-server")
def test_without_ridgefill_it_is_stock_llama_server(maps):
    """The patched server without --ridgefill gives stock llama-server's greedy tokens and first-token
    probabilities (the same source and flags), and publishes no ridgefill counter."""
    gguf, root = maps["gguf"], maps["root"]
    prompts = [*PROMPTS, A, B]

    def served(binary: Path) -> tuple[list[dict], str, str]:
        with running(gguf, root, binary=binary) as server:
            out = [server.completion(p, id_slot=i % 2, n_probs=3) for i, p in enumerate(prompts)]
            status, _, metrics = server.request("GET", "/metrics")
            assert status == 200
        return out, metrics.decode(), server.output()

    patched, patched_metrics, patched_log = served(SERVER)
    stock, stock_metrics, _ = served(STOCK)
    for i, (p, s) in enumerate(zip(patched, stock)):
        assert (p["tokens"], p["content"]) == (s["tokens"], s["content"]), (i, p, s)
        assert p["completion_probabilities"] == s["completion_probabilities"], i
        assert p["tokens"] and p["tokens_evaluated"] == s["tokens_evaluated"] > 40, (i, p, s)
    assert "ridgefill" not in patched_metrics and "ridgefill" not in stock_metrics
    assert "llamacpp:prompt_tokens_total" in patched_metrics
    assert "ridgefill" not in patched_log.lower(), patched_log


@pytest.mark.parametrize("args, names", [
    (["--cache-reuse", "4"], "--cache-reuse"),
    (["--context-shift"], "--context-shift"),
    (["--slot-save-path", "{root}"], "--slot-save-path"),
    (["--model-draft", "{gguf}"], "drop the draft model"),
    (["--spec-type", "ngram-simple"], "--spec-type"),
    (["--embeddings"], "--embeddings"),
    (["--reranking"], "reranking"),
    (["--mmproj", "{gguf}"], "--mmproj"),
    (["--ridgefill-tail", "0"], "--ridgefill-tail must be at least 1"),
    (["--ridgefill-tail", "-2"], "--ridgefill-tail must be at least 1"),
    (["--ridgefill-keep-first", "-2"], "--ridgefill-keep-first must be at least 0"),
    (["--ridgefill-outlier-factor", "-0.5"], "--ridgefill-outlier-factor"),
    (["--ridgefill-outlier-factor", "nan"], "--ridgefill-outlier-factor"),
    (["--ridgefill-outlier-factor", "inf"], "--ridgefill-outlier-factor"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_what_the_fill_cannot_serve_is_one_line(args, names, maps):
    gguf, root = maps["gguf"], maps["root"]
    args = [a.format(root=root, gguf=gguf) for a in args]
    code, lines = refused(gguf, root, "--ridgefill", maps["f32"], *args)
    said = [line for line in lines if "ridgefill: " in line]
    assert code == 1 and len(said) == 1, (code, said, lines[-30:])
    assert names in said[0], said


@pytest.fixture(scope="module")
def wrong_adapters(maps, tmp_path_factory):
    """Files that are no adapter for the tiny Llama, each with the reason llama.cpp gives."""
    root = tmp_path_factory.mktemp("wrong-adapters")
    text = root / "maps.gguf"
    text.write_text("these are not maps\n")
    found = {"text": (text, f"{text} is not a readable GGUF file"),
             "model": (maps["gguf"], f"{maps['gguf']} is not a ridgefill adapter (general.type")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        _, qwen2 = tiny_gguf.build("qwen2", root / "tiny-qwen2.gguf")
        _, short = tiny_gguf.build("llama", root / "tiny-llama-4.gguf", num_hidden_layers=4)
        for name, gguf, split, reason in (("qwen2", qwen2, 3, "holds maps for a qwen2 model, and this model is llama"),
                                          ("layers", short, 2, "holds maps of a 4-layer model of width 64 with 2 KV "
                                                               "heads, and this model has 6 layers of width 64")):
            out = root / f"maps-{name}.gguf"
            run(["convert-maps", "--maps", perturbed_maps(gguf, root / f"{name}.safetensors", split=split), "--out",
                 out, "--gguf-type", "f32"])
            found[name] = (out, f"{out} {reason}")
    return found


@pytest.mark.parametrize("which", ["text", "model", "qwen2", "layers"])
def test_a_wrong_adapter_is_one_line_of_llama_cpp(which, maps, wrong_adapters):
    path, reason = wrong_adapters[which]
    code, lines = refused(maps["gguf"], maps["root"], "--ridgefill", path)
    said = [line for line in lines if "failed to load ridgefill adapter:" in line]
    assert code != 0 and len(said) == 1, (code, said, lines[-30:])
    assert f"llama_adapter_ridgefill_init: failed to load ridgefill adapter: {reason}" in said[0], said


BAD = [("ridgefill_tail", 0), ("ridgefill_tail", -3), ("ridgefill_tail", 2.5), ("ridgefill_tail", "x"),
       ("ridgefill_tail", True), ("ridgefill_keep_first", -1), ("ridgefill_keep_first", "x")]


def test_a_bad_per_request_field_is_a_400_naming_it(maps):
    """Each bad ridgefill_tail or ridgefill_keep_first, on each completion route, is a 400 whose message names the
    field, and so is `n` over 1 with two slots; nothing of it is counted, and the server answers afterwards (serving
    the F16 maps, with the defaults' -1 and --cache-reuse 0, which start)."""
    bodies = {"/v1/completions": {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2},
              "/completion": {"prompt": PROMPTS[0], "n_predict": 2},
              "/v1/chat/completions": {"model": "tiny", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": PROMPTS[0]}]}}
    # the settings' "the adapter's default" values, which are no refusal
    defaults = ["--ridgefill-tail", -1, "--ridgefill-keep-first", -1, "--ridgefill-outlier-factor", -1,
                "--cache-reuse", 0]
    with running(maps["gguf"], maps["root"], "--ridgefill", maps["f16"], *defaults) as server:
        for path, body in bodies.items():
            for field, value in BAD:
                status, got = server.post(path, {**body, "temperature": 0, field: value})
                assert status == 400, (path, field, value, got)
                assert field in got["error"]["message"], (path, field, value, got)
        # more choices than one: their slots would be copies of the first's cache, which do not say what was filled
        status, got = server.post("/v1/completions", {**bodies["/v1/completions"], "n": 2})
        assert status == 400 and "'n'" in got["error"]["message"], got
        assert server.proc.poll() is None
        assert server.metrics().get("ridgefill_full_tokens_total", 0) == 0  # nothing ran
        sent = 0
        for path, body in bodies.items():
            status, got = server.post(path, {**body, "temperature": 0, "ridgefill_tail": 3, "ridgefill_keep_first": 0})
            assert status == 200, (path, got)
            sent += got["usage"]["prompt_tokens"] if "usage" in got else got["tokens_evaluated"]
        m = server.metrics()
    assert m["ridgefill_filled_tokens_total"] > 0, m
    assert sum(m[f"ridgefill_{k}_tokens_total"] for k in ("filled", "full", "cached_prompt")) == sent, (m, sent)
