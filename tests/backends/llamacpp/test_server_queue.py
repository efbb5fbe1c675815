"""The served queue of `ridgefill serve --engine llamacpp` (one model, one context): with --concurrency 2, one request
generating and one waiting for the model, a third gets a quick 503 with Retry-After; a waiting client that goes away
frees its place; a generating client that goes away stops its generation, so the next one is answered at once; the
server stays up. On the embedded SmolLM2 GGUF (split 15, identity fill), whose decode steps are slow enough to keep a
request generating."""

from __future__ import annotations

import json
import secrets
import socket
import time

import pytest

import tiny_gguf
from served_llamacpp import start, stop, stream_open, tail

MISSING = tiny_gguf.missing_build()
# one worker runs the module (pytest-xdist --dist loadgroup): its server starts once
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}"),
              pytest.mark.xdist_group("llamacpp-server-queue")]

LONG = 4000  # tokens a request would generate (over a minute on 2 cores) unless it stops


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = start(["--model", "smollm2-135m", "--split", "15", "--tail", "16", "--concurrency", "2"],
                   tmp_path_factory.mktemp("llamacpp-queue"), secrets.token_hex(8))
    try:
        yield server
    finally:
        stop(server.proc)


def waiting(served, max_tokens: int) -> socket.socket:
    """A completion request sent on its own connection, its answer not read."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", served.port()), timeout=60)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {served.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def answered(s: socket.socket, within: float) -> bytes:
    """The answer on `s` (its status line and headers at least), or b"" if none came within `within` seconds."""
    s.settimeout(within)
    try:
        return s.recv(65536)
    except TimeoutError:
        return b""


def admitted(served, count: int) -> None:
    """Wait until the server's gauge shows `count` requests admitted (running or waiting for the model)."""
    deadline = time.monotonic() + 60
    while served.metrics()["ridgefill_admitted_requests"] != count:
        assert time.monotonic() < deadline, served.metrics()
        time.sleep(0.1)


def test_past_the_bound_a_quick_503_and_a_client_that_goes_away_frees_its_place(served):
    """The timings are bounds far below the generating request's own (LONG tokens: over a minute), loose enough
    for a loaded machine."""
    began = time.monotonic()
    generating, _ = stream_open(served, {"prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0})
    queued = waiting(served, 2)
    admitted(served, 2)  # one generating, one waiting for the model
    status, headers, body = served.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and headers.get("retry-after") == "1", (status, headers, body)
    assert json.loads(body)["error"]["message"].startswith("the server is busy: 2 requests are running or waiting")
    queued.close()  # the waiting client goes away: its place is free
    admitted(served, 1)
    replacement = waiting(served, 2)
    admitted(served, 2)
    assert answered(replacement, 1.0) == b""  # admitted (no 503), waiting behind the generating request
    generating.close()  # the generating client goes away: its generation stops at its next token
    head = answered(replacement, 60.0)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert time.monotonic() - began < 45.0  # not the LONG tokens the first request asked for
    admitted(served, 0)
    replacement.close()
    assert served.request("GET", "/health", key=None)[0] == 200
    done = served.complete("Once upon a time", 3)
    assert done["usage"]["completion_tokens"] == 3
    assert served.proc.poll() is None and "Traceback" not in served.log.read_text(errors="replace"), tail(served.log)
