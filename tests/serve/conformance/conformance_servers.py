"""The servers the conformance suite (test_conformance.py) runs against, one `Kind` each in SERVERS (a later server is
one more entry), and the clients it runs: every server started as a user starts it (`ridgefill serve --engine X`, the
API key given), requests over loopback, raw sockets where a client misbehaves."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from server_client import ServerClient

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 300.0
PROMPT_COUNTERS = ("ridgefill_filled_tokens_total", "ridgefill_full_tokens_total",
                   "ridgefill_cached_prompt_tokens_total")  # each prompt token counted once in one of them


@dataclass
class Served(ServerClient):
    """A running server: its `ridgefill serve` process, address, key, log, and what the suite needs of its kind."""

    kind: "Kind"
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    key: str
    log: Path
    name: str  # the model name clients send
    generate: list[str]  # `ridgefill generate` options that run the server's fill (--engine X included)

    def prompt_tokens(self) -> float:
        """The prompt tokens RidgeFill's counters have counted (filled, full or cached)."""
        metrics = self.metrics()
        return sum(metrics.get(name, 0.0) for name in PROMPT_COUNTERS)

    def admitted(self, count: int) -> None:
        """Wait until the server's gauge shows `count` requests admitted (running or waiting for the model)."""
        deadline = time.monotonic() + 60
        while self.metrics()[self.kind.admitted] != count:
            assert time.monotonic() < deadline, self.metrics()
            time.sleep(0.1)

    def tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback")


@dataclass(frozen=True)
class Kind:
    """One server of the suite: how it starts and how its requests are written where servers differ."""

    name: str
    start: Callable  # (pytest request, tmp_path_factory) -> Served
    body_routes: tuple[str, ...]  # guarded POST routes that read a JSON body
    open_routes: tuple[str, ...]  # POST routes open without the key that read a JSON body
    get_routes: tuple[str, ...]  # guarded GET routes
    detokenize: Callable[[Served, list[int]], tuple[str, dict]]  # (path, body) detokenizing ids
    tokenize_empty: tuple[str, dict]  # (path, body) of a tokenize request without its text
    options: Callable[[dict], dict]  # RidgeFill's options as a request body carries them
    bad_grammar: dict  # completion fields with a grammar the server's grammar engine cannot parse
    bad_schema: dict  # chat completion fields with a JSON schema that gives no usable grammar
    bound: int  # the requests the server admits at once (serve --concurrency)
    admitted: str | None  # the /metrics gauge of the requests admitted now, where past `bound` the server answers 503
    abandoned_tokens: int  # a prompt this long prefills for seconds on 2 cores


def start_serve(engine: str, args: list[str], root: Path, key: str, env: dict) -> tuple[subprocess.Popen, str, Path]:
    """`ridgefill serve --engine ENGINE ARGS --port P --log-file L`, up: its stderr read up to serve's line saying
    what it serves, never again."""
    from helpers import free_port

    port, log = free_port(), root / f"serve-{engine}.log"
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--engine", engine, *args, "--port", str(port), "--log-file",
                             str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})
    lines: list[str] = []

    def read() -> None:
        for line in iter(proc.stderr.readline, b""):
            lines.append(line.decode(errors="replace"))
            if line.startswith(b"ridgefill serve: "):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT)
    if not lines or not lines[-1].startswith("ridgefill serve: "):
        stop(proc)
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
        raise AssertionError(f"serve did not come up ({proc.poll()}):\n{''.join(lines)[-3000:]}\n{tail}")
    return proc, f"http://127.0.0.1:{port}", log


def stop(proc: subprocess.Popen, wait: float = 60.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- llama.cpp ---------------------------------------------------------------------------------------------------
LLAMACPP_ARGS = ["--model", "smollm2-135m", "--split", "15", "--tail", "16"]


def start_llamacpp(request, tmp_path_factory) -> Served:
    from ridgefill.backends.llamacpp.library import check_installed
    from ridgefill.errors import RidgefillError

    try:
        check_installed()
    except RidgefillError as exc:
        pytest.skip(f"no patched llama.cpp build: {exc}")
    key = secrets.token_hex(8)
    root = tmp_path_factory.mktemp("conformance-llamacpp")
    proc, base, log = start_serve("llamacpp", [*LLAMACPP_ARGS, "--concurrency", str(LLAMACPP.bound), "--api-key",
                                               key], root, key, {})
    return Served(LLAMACPP, proc, base, key, log, "smollm2-135m", ["--engine", "llamacpp", *LLAMACPP_ARGS])


LLAMACPP = Kind(
    name="llamacpp", start=start_llamacpp,
    body_routes=("/v1/completions", "/v1/chat/completions", "/completion", "/infill", "/v1/embeddings",
                 "/apply-template"),
    open_routes=("/tokenize", "/detokenize"),  # open without the key, as vLLM's (serve's guard: no model runs)
    get_routes=("/v1/models", "/props"),
    detokenize=lambda served, ids: ("/detokenize", {"tokens": ids}),
    tokenize_empty=("/tokenize", {}),
    options=lambda options: dict(options),
    bad_grammar={"grammar": 'root ::= ("a"'},
    bad_schema={"response_format": {"type": "json_object", "schema": {"enum": []}}},
    bound=2, admitted="ridgefill_admitted_requests", abandoned_tokens=5000)


# --- vLLM --------------------------------------------------------------------------------------------------------
def start_vllm(request, tmp_path_factory) -> Served:
    pytest.importorskip("vllm")
    server = request.getfixturevalue("vllm_server").get()  # tests/served_vllm.py: the session's, shared
    return Served(VLLM, server.proc, server.base, server.key, server.log, "smollm2-135m",
                  ["--engine", "vllm", "--model", "smollm2-135m", "--serving-config", str(server.config)])


VLLM = Kind(
    name="vllm", start=start_vllm,
    body_routes=("/v1/completions", "/v1/chat/completions", "/invocations"),
    open_routes=("/tokenize", "/detokenize"),
    get_routes=("/v1/models", "/version", "/load"),
    detokenize=lambda served, ids: ("/detokenize", {"model": served.name, "tokens": ids}),
    tokenize_empty=("/tokenize", {}),
    options=lambda options: {"vllm_xargs": dict(options)},
    bad_grammar={"structured_outputs": {"grammar": 'root ::= ("a"'}},
    bad_schema={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}},
    bound=2, admitted=None, abandoned_tokens=7000)  # vLLM queues every request: no 503

SERVERS = [LLAMACPP, VLLM]  # a later server: one more Kind here
GROUPS = {"llamacpp": "conformance-llamacpp", "vllm": "vllm-server"}  # pytest-xdist groups: each server starts once


# --- clients that misbehave --------------------------------------------------------------------------------------
def raw(served: Served, head: str, body: bytes = b"", timeout: float = 60.0) -> socket.socket:
    """A request written byte for byte on its own connection (`head`: the request line and headers, without the
    blank line); its answer not read."""
    s = socket.create_connection(("127.0.0.1", served.port()), timeout=timeout)
    s.sendall(head.replace("\n", "\r\n").encode("latin-1") + b"\r\n\r\n" + body)
    return s


def answer_of(s: socket.socket, within: float) -> tuple[int, dict, bytes] | None:
    """(status, headers, body) of the answer on `s`, or None if none came within `within` seconds."""
    s.settimeout(within)
    try:
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except (TimeoutError, socket.timeout):
        return None


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closed the connection within `seconds` (what it still sends is dropped)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if s.recv(65536) == b"":
                return True
        except (TimeoutError, socket.timeout):
            return False
        except OSError:
            return True
    return False


def streamed_body(served: Served, path: str, chunks: int, key: str) -> tuple[int, dict]:
    """A POST sent in `chunks` chunks of 1 MiB, without a Content-Length: (status, answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port(), timeout=120)
    body = (b'{"prompt": "' if i == 0 else b"w" * (1 << 20) for i in range(chunks))
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                     encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def long_text(tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens (a word per token, roughly), seeded so that no earlier prompt shares its prefix
    (a server's prefix cache must not shorten the prefill)."""
    import random

    rng = random.Random(seed)
    words = ["river", "stone", "market", "lantern", "winter", "garden", "copper", "harbor", "violet", "engine",
             "silent", "thunder", "meadow", "candle", "orbit", "marble", "falcon", "willow", "saddle", "ember"]
    return f"{seed}: " + " ".join(rng.choice(words) for _ in range(tokens))
