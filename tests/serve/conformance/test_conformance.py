"""The conformance suite: the same hostile and careless clients against every server `ridgefill serve` runs
(conformance_servers.SERVERS: llama.cpp's and vLLM's; a later server is one more entry there). Each server starts once
(a module fixture, its pytest-xdist group), as a user starts it, with an API key; the last test stops it with SIGTERM.

What every server must do: the key checked before any body, on every route and method (CORS preflights included);
keyless or unfinished requests take no admission place; each hostile or careless body (a grammar or JSON schema that
does not parse, token ids outside the vocabulary, logprobs 0 or false, an empty prompt, a wrong content type, empty
bodies, nested or oversized JSON) a 4xx with one line, never a 5xx, a traceback, an echoed body or an internal path;
several prompts or `n` > 1 served or refused, never silently one answer; a client that goes away mid-prefill (streamed
or not) leaves the server alive, the next request answered as alone, the abandoned prefill stopped; `temperature: 0`
and no other sampling field the tokens of `ridgefill generate --engine X`; the `model` field never a local path; a
port taken at bind time named as the reason; SIGTERM obeyed within 10 s with idle and keyless connections open."""

from __future__ import annotations

import json
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conformance_servers import (GROUPS, RIDGEFILL, SERVERS, answer_of, closed_within, long_text, raw, stop,
                                 streamed_body)

# a local file path in a message (an internal module, the model file): /a/b.py, /x/y/model.gguf, ...
PATH = re.compile(r"(?:/[\w.+-]+){2,}\.(?:py|gguf|safetensors|json|so)\b|site-packages|Traceback")
GREEDY_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
SHORT = "Once upon a time, in a small village by the sea, there lived"
LONG = 4000  # tokens a request would generate (over a minute on 2 cores) unless it stops
pytestmark = pytest.mark.slow  # servers in processes: not the fast tier


@pytest.fixture(scope="module", params=[pytest.param(kind, id=kind.name, marks=pytest.mark.xdist_group(GROUPS[
    kind.name])) for kind in SERVERS])
def served(request, tmp_path_factory):
    kind = request.param
    server = kind.start(request, tmp_path_factory)
    server.start_tracebacks = server.tracebacks()
    try:
        yield server
    finally:
        stop(server.proc)


def clean_refusal(status: int, body: dict, sent: bytes | str = b"", low: int = 400) -> str:
    """The one-line message of a 4xx in the OpenAI error format, checked: no traceback, no internal path, and not
    the body's own text echoed (`sent`: a marker the body held)."""
    assert low <= status < 500, (status, body)
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    assert isinstance(message, str) and message and "\n" not in message, body
    assert not PATH.search(message), message
    marker = sent.decode() if isinstance(sent, bytes) else sent
    assert not marker or marker not in message, message
    return message


def alive(served) -> None:
    assert served.proc.poll() is None
    assert served.request("GET", "/health", key=None)[0] == 200
    assert served.tracebacks() == served.start_tracebacks, served.log.read_text(errors="replace")[-3000:]


# --- the key before any body ---------------------------------------------------------------------------------------
def test_the_key_comes_before_any_body_on_every_route_and_method(served):
    """Without the key (or with a wrong one), every guarded route and method is 401 before its body is read: a bad
    option, a declared 1 GiB body of which a few bytes come, a CORS preflight; /health and /metrics are open."""
    kind = served.kind
    bad = {"model": served.name, "prompt": "x", **kind.options({"ridgefill_tail": 0})}
    for path in kind.body_routes:
        assert served.post(path, bad, key=None)[0] == 401, path
        assert served.post(path, bad, key="not-" + served.key)[0] == 401, path
        for method in ("POST", "GET", "OPTIONS"):
            preflight = "\nOrigin: http://page.example\nAccess-Control-Request-Method: POST" * (method == "OPTIONS")
            s = raw(served, f"{method} {path} HTTP/1.1\nHost: x\nContent-Length: {1 << 30}{preflight}", b'{"pr')
            with s:
                got = answer_of(s, 30)
            assert got is not None and got[0] == 401, (method, path, got)
    for path in kind.get_routes:
        for method in ("GET", "HEAD", "OPTIONS"):
            assert served.request(method, path, key=None)[0] == 401, (method, path)
    assert served.request("GET", "/health", key=None)[0] == 200
    assert served.request("GET", "/metrics", key=None)[0] == 200
    status, body = served.post("/v1/completions", bad)
    assert clean_refusal(status, body).startswith("ridgefill_tail=0 is not valid"), body


def test_keyless_and_unfinished_requests_take_no_admission_place(served):
    """As many keyless preflights and posts as the server admits at once, each declaring a body it never sends,
    are 401 at once and hold nothing; as many keyed requests whose bodies never end (POST, GET, OPTIONS) wait for
    their bodies outside admission: a whole keyed request is still answered. A keyed GET declaring a body over the
    bound is 413."""
    kind, held = served.kind, []
    try:
        for i in range(kind.bound):
            for method, path in (("OPTIONS", "/v1/completions"), ("POST", "/v1/completions")):
                s = raw(served, f"{method} {path} HTTP/1.1\nHost: x\nOrigin: http://page.example\n"
                        "Access-Control-Request-Method: POST\nContent-Length: 1000", b"{")
                held.append(s)
                got = answer_of(s, 30)
                assert got is not None and got[0] == 401, got
        key = f"Authorization: Bearer {served.key}"
        for i in range(kind.bound):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("OPTIONS", "/v1/completions")):
                held.append(raw(served, f"{method} {path} HTTP/1.1\nHost: x\n{key}\nContent-Length: 1000", b"{"))
        time.sleep(1.0)  # each is read as far as it goes
        assert served.complete(SHORT, 2)["usage"]["completion_tokens"] == 2  # not a 503: no place was taken
        with raw(served, f"GET /v1/models HTTP/1.1\nHost: x\n{key}\nContent-Length: {1 << 30}", b"{") as s:
            got = answer_of(s, 30)
        assert got is not None and got[0] == 413, got
    finally:
        for s in held:
            s.close()
    alive(served)


# --- hostile and careless bodies -----------------------------------------------------------------------------------
def hostile(served) -> list[tuple[str, str, bytes, dict, str]]:
    """(what, path, body, headers, a marker the answer must not echo)."""
    kind, name = served.kind, served.name
    marker = "echo-" + secrets.token_hex(6)

    def body(**fields) -> bytes:
        return json.dumps({"model": name, "max_tokens": 2, **fields}).encode()

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tokenize = kind.tokenize_empty
    return [
        ("a grammar that does not parse", "/v1/completions", body(prompt="x", **kind.bad_grammar), {}, ""),
        ("a JSON schema with no grammar", "/v1/chat/completions", body(**chat, **kind.bad_schema), {}, ""),
        ("a token id outside the vocabulary as the prompt", "/v1/completions", body(prompt=[10 ** 6]), {}, ""),
        ("a token id outside the vocabulary in logit_bias", "/v1/completions",
         body(prompt="x", logit_bias={str(10 ** 6): 5}), {}, ""),
        ("a logit_bias key that is no token id", "/v1/completions", body(prompt="x", logit_bias={"abc": 1}), {}, ""),
        ("an empty prompt", "/v1/completions", body(prompt=""), {}, ""),
        ("JSON sent as text/plain", "/v1/completions", body(prompt=marker), {"Content-Type": "text/plain"}, marker),
        ("tokenize without its text", tokenize[0], json.dumps(tokenize[1]).encode(), {}, ""),
        ("JSON nested 100,000 deep", "/v1/completions",
         b'{"prompt": "x", "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, ""),
        ("an option behind an escape", "/v1/completions",
         json.dumps({"prompt": "x", **kind.options({"ridgefill_tail": 5})}).encode().replace(
             b"ridgefill_tail", b"ridgefill\\u005ftail").replace(b": 5", b": true"), {}, ""),
        ("an integer of 5,000 digits", "/v1/completions",
         json.dumps({"prompt": "x", **kind.options({"ridgefill_tail": 7})}).encode().replace(b"7", b"1" + b"0" *
                                                                                                5000), {}, ""),
        ("malformed JSON", "/v1/completions", b'{"prompt": "' + marker.encode() + b'", ', {}, marker),
        ("a body that is no object", "/v1/completions", b'["' + marker.encode() + b'"]', {}, marker),
        ("fields of the wrong type", "/v1/completions", body(prompt=5, max_tokens="many"), {}, ""),
    ]


def test_hostile_bodies_are_a_4xx_with_one_line_never_a_5xx(served):
    """Each hostile body one 4xx line (no 5xx, traceback, echoed body or internal path); logprobs 0 or false served
    or refused alike; bodies over the bound 413 (declared, sent, streamed); a Content-Length of 5,001 digits one 400
    that closes the connection; and the server answers as before, its log without a traceback."""
    before = served.complete(SHORT, 6)["choices"][0]["text"]
    for what, path, body, headers, marker in hostile(served):
        status, answer = served.post(path, body, headers=headers)
        try:
            message = clean_refusal(status, answer, marker)
            assert "content-type" not in {k.lower() for k in headers} or "json" in message.lower(), message
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        assert served.proc.poll() is None, what
    for logprobs in (0, False):
        status, answer = served.post("/v1/completions", {"model": served.name, "prompt": "x", "max_tokens": 2,
                                                         "logprobs": logprobs})
        if status != 200:
            clean_refusal(status, answer)
    status, answer = served.post("/v1/completions", json.dumps({"prompt": "p" * (9 << 20)}).encode())
    assert clean_refusal(status, answer, low=413).startswith("the request body is over 8,388,608 bytes"), answer
    with raw(served, f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {served.key}\n"
             f"Content-Length: {1 << 30}", b'{"prompt": "') as s:
        got = answer_of(s, 60)
        assert got is not None and got[0] == 413 and got[1].get("connection") == "close" and closed_within(s, 5)
    status, answer = streamed_body(served, "/v1/completions", 10, served.key)
    assert status == 413, answer
    for path, key in [("/health", ""), ("/v1/completions", f"\nAuthorization: Bearer {served.key}")]:
        with raw(served, f"POST {path} HTTP/1.1\nHost: x{key}\nContent-Length: {'0' * 5000}5", b"{}   ") as s:
            got = answer_of(s, 30)
            assert got is not None and got[0] == 400 and closed_within(s, 5), got
            assert json.loads(got[2])["error"]["message"].startswith("the request's Content-Length is not a number")
    assert served.complete(SHORT, 6)["choices"][0]["text"] == before
    alive(served)


def test_token_ids_outside_the_vocabulary_to_detokenize_are_a_4xx_with_one_line(served):
    path, body = served.kind.detokenize(served, [5, 10 ** 6])
    status, answer = served.post(path, body)
    clean_refusal(status, answer)
    assert "1000000" in answer["error"]["message"], answer  # the id refused is named
    alive(served)


def test_empty_bodies_on_every_route_are_a_4xx_with_one_line(served):
    for path in served.kind.body_routes + served.kind.open_routes:
        status, answer = served.post(path, b"")
        assert status != 200, (path, answer)
        clean_refusal(status, answer)
    for path in served.kind.get_routes:
        assert served.request("GET", path, b"")[0] < 500, path
    alive(served)


def test_several_prompts_or_choices_are_served_or_refused_never_one_silently(served):
    asked = {"model": served.name, "max_tokens": 2, "temperature": 0}
    for fields, count in (({"prompt": [SHORT, "The sky"]}, 2), ({"prompt": SHORT, "n": 3}, 3),
                          ({"prompt": SHORT, "n": 3, "temperature": 1.0}, 3)):
        status, answer = served.post("/v1/completions", {**asked, **fields})
        if status == 200:
            assert len(answer["choices"]) == count, (fields, answer)
        else:
            assert status == 400, (fields, answer)
            clean_refusal(status, answer)


def test_the_model_field_is_never_a_local_path(served):
    names = [m["id"] for m in json.loads(served.request("GET", "/v1/models")[2])["data"]]
    answers = [served.complete(SHORT, 2)["model"],
               served.post("/v1/completions", {"prompt": SHORT, "max_tokens": 2})[1]["model"],  # no model given
               served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})[1]["model"]]
    for name in names + answers:
        assert "/" not in name and not Path(name).suffix == ".gguf" and not Path(name).exists(), name
    assert served.name in names


# --- greedy is greedy ----------------------------------------------------------------------------------------------
def test_temperature_0_alone_gives_the_tokens_of_generate(served, tmp_path):
    """The OpenAI client's greedy request (temperature 0, no other sampling field: no repeat penalty, as vLLM and
    llama.cpp's llama-server) gives the same tokens as `ridgefill generate --engine X` with the server's fill, on a
    prompt that repeats itself (a default penalty would steer away from the repeat)."""
    out = tmp_path / "generate.json"
    r = subprocess.run([*RIDGEFILL, "generate", *served.generate, "--prompt", GREEDY_PROMPT, "--max-new-tokens",
                        "16", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = json.loads(out.read_text())["results"].values()
    from openai import OpenAI

    with OpenAI(base_url=served.base + "/v1", api_key=served.key, max_retries=0) as client:
        answer = client.completions.create(model=served.name, prompt=GREEDY_PROMPT, max_tokens=16, temperature=0)
    assert answer.usage.completion_tokens == len(run["tokens"])
    assert answer.choices[0].text == run["text"], (answer.choices[0].text, run["text"])


def test_a_server_whose_stderr_nobody_reads_keeps_answering(served):
    """Every request is a line of the server's log; the relay keeps reading it though serve's stderr is a pipe nobody
    has read since serve's line: twice two pipes' worth of log lines later the server still answers."""
    pad = "x" * 4096
    start, answered = served.log.stat().st_size, 0
    while served.log.stat().st_size - start < 4 * (64 << 10):
        assert served.request("GET", f"/health?pad={pad}", key=None)[0] == 200, answered
        answered += 1
    assert served.proc.poll() is None


# --- a client that goes away mid-prefill ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_a_client_gone_mid_prefill_stops_its_work_and_the_next_is_answered_as_alone(served, stream):
    """A long prompt's client goes away a second into its prefill: the server lives, the next request (sent at once)
    gets the answer it got alone, and RidgeFill's prompt counters grow by less than the abandoned prompt (its prefill
    stopped; each prompt token is counted once, in filled, full or cached)."""
    alone = served.complete(SHORT, 6)
    long = long_text(served.kind.abandoned_tokens, secrets.randbelow(1 << 30))
    before = served.prompt_tokens()
    body = json.dumps({"model": served.name, "prompt": long, "max_tokens": 4, "temperature": 0,
                       "stream": stream}).encode()
    s = raw(served, f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {served.key}\n"
            f"Content-Type: application/json\nContent-Length: {len(body)}", body)
    time.sleep(1.0)
    assert answer_of(s, 0.5) is None  # still in its prefill
    s.close()
    again = served.complete(SHORT, 6)
    assert again["choices"][0]["text"] == alone["choices"][0]["text"]
    counted = served.prompt_tokens() - before
    assert counted < served.kind.abandoned_tokens, (counted, served.kind.abandoned_tokens)
    alive(served)


def test_past_its_bound_a_quick_503_and_a_client_that_goes_away_frees_its_place(served):
    """Where a server bounds admission (llama.cpp's: one model, one context), with its bound of 2: one request
    generating and one waiting for the model, a third gets a quick 503 with Retry-After; a waiting client that goes
    away frees its place; a generating client that goes away stops its generation, so the next one is answered long
    before the generating request's LONG tokens would have ended."""
    if served.kind.admitted is None:
        pytest.skip(f"{served.kind.name} admits every request (no bound, no 503)")
    body = json.dumps({"model": served.name, "prompt": SHORT, "max_tokens": 2, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {served.key}\n"
            "Content-Type: application/json\nContent-Length: ")
    long = json.dumps({"model": served.name, "prompt": SHORT, "max_tokens": LONG, "temperature": 0,
                       "stream": True}).encode()
    generating = raw(served, head + str(len(long)), long)
    generating.settimeout(60)
    assert generating.recv(65536).startswith(b"HTTP/1.1 200")  # its stream has begun
    queued = raw(served, head + str(len(body)), body)
    served.admitted(2)  # one generating, one waiting for the model
    status, headers, answer = served.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and headers.get("retry-after") == "1", (status, headers, answer)
    assert json.loads(answer)["error"]["message"].startswith("the server is busy: 2 requests are running or waiting")
    queued.close()  # the waiting client goes away: its place is free
    served.admitted(1)
    replacement = raw(served, head + str(len(body)), body)
    served.admitted(2)
    assert answer_of(replacement, 1.0) is None  # admitted (no 503), waiting behind the generating request
    generating.close()  # the generating client goes away: its generation stops at its next token
    got = answer_of(replacement, 60.0)
    assert got is not None and got[0] == 200, got
    served.admitted(0)
    replacement.close()
    assert served.complete(SHORT, 3)["usage"]["completion_tokens"] == 3
    alive(served)


# --- the process ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [pytest.param(kind, id=kind.name, marks=pytest.mark.xdist_group(GROUPS[kind.name]))
                                  for kind in SERVERS])
def test_a_port_taken_at_bind_time_is_named_as_the_reason(kind, tmp_path):
    """The port is free when serve checks it and taken (listened on) once serve has started the server: serve ends
    with one line naming the taken address, exit code 2."""
    if kind.name == "vllm":
        pytest.importorskip("vllm")
    else:
        pytest.importorskip("llama_cpp")
    from helpers import free_port

    port = free_port()
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", port))  # bound, not listening: serve's check (SO_REUSEADDR) still binds
    args = ["--model", "smollm2-135m", "--split", "15", "--port", str(port), "--log-file", str(tmp_path / "s.log")]
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--engine", kind.name, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 300
        while proc.poll() is None and not children.read_text().split():  # the server started: serve checked the port
            assert time.monotonic() < deadline
            time.sleep(0.002)
        blocker.listen(1)
        _, err = proc.communicate(timeout=300)
    finally:
        blocker.close()
        stop(proc)
    assert proc.returncode == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "already in use" in line.lower(), err
    assert str(port) in line and "pick another --port" in line, err  # the taken port named, and the fix


def test_sigterm_exits_within_10_s_with_idle_and_keyless_connections_open(served):
    """Last: an idle keep-alive connection, a keyless preflight and a keyless post that declared bodies they never
    send are open; SIGTERM to serve ends it (and its server) with exit code 0 within 10 s."""
    idle = raw(served, "GET /health HTTP/1.1\nHost: x")
    assert answer_of(idle, 30)[0] == 200
    keyless = [raw(served, f"{method} /v1/completions HTTP/1.1\nHost: x\nOrigin: http://page.example\n"
                   "Access-Control-Request-Method: POST\nContent-Length: 1000", b"{") for method in ("OPTIONS", "POST")]
    try:
        began = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        try:
            code = served.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - began
        assert code == 0 and took <= 10.0, (code, took, served.log.read_text(errors="replace")[-2000:])
    finally:
        for s in [idle, *keyless]:
            s.close()
