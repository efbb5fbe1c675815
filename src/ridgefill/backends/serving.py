"""The serving seam: what `ridgefill serve`'s front (serve/) and every engine that serves share, with no engine's
import. An engine that serves has a `Server` (backends/<engine>/server.py, named in backends.SERVERS): it checks the
options only its server reads, and builds a `Launch` of its OpenAI-compatible server with a fill or, for the stock
baseline, with none. The front resolves the fill, checks that the engine runs it, checks the port, warns about
exposure, runs the server (serve/process.py), relays its log (serve/log.py), mounts the request guard
(serve/guard.py) and reports a failure in the engine's own words, read from its `LogDialect`; the guard reads how the
engine's requests carry RidgeFill's options from its `GuardDialect`.

- RidgeFill's per-request options (`REQUEST_ARGS`: a request's own tail and keep-first): the names a client sends,
  and `check_request_args`, the check of their values (at the guard, and where the engine admits a request);
- RidgeFill's counters on a server's /metrics (`MARKER`, the line only a server running RidgeFill shows):
  backends/counters.py;
- the server's start (`Launch`) and how this machine reaches it (`health_url`, `check_port`, `free_port`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

from ridgefill.torchfill.rows import MAX_ROWS, keep_first_ok, tail_ok
from ridgefill.errors import RidgefillError

LOG_LIMIT = 32 << 20  # bytes of a server's log in one file: past it the file moves to <log>.1 (the previous one dropped)


# a line of a Python server's log that names an error: "(worker) ... package.SomeError: message"
PYTHON_ERROR = re.compile(r"^(?:\([^)]*\)\s*)?(?:\S+\s+){0,6}?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
UVICORN_ERROR = re.compile(r"^ERROR:\s+(.+)$")  # uvicorn's own error lines (a port taken at bind time)
UVICORN_UP = b"Application startup complete"  # uvicorn's line once the server accepts requests
# a port taken after serve's check, at the server's own bind ({port}: the port it was to listen on)
PORT_FIX = (re.compile(r"address already in use|attempting to bind", re.I),
            "port {port} is taken: pick another --port, or stop what uses it")


@dataclass(frozen=True)
class LogDialect:
    """How an engine's server says in its log that it is up, or why it failed (serve/process.py reads it)."""

    up: bytes = UVICORN_UP  # a line that means it accepts requests
    errors: tuple[re.Pattern, ...] = (PYTHON_ERROR, UVICORN_ERROR)  # lines naming an error: (type, message) or
    # (message) groups
    generic: tuple[str, ...] = ()  # error messages that say only that it failed (the root error is another line)
    fixes: tuple[tuple[re.Pattern, str], ...] = (PORT_FIX,)  # (a pattern of the reason, the fix named with it)
    fill_failed: str = ""  # the log line after which it says why RidgeFill did not load ("": it never says)
    fill_fix: str = "reinstall ridgefill (make install)"  # what to do when it came up without RidgeFill


@dataclass(frozen=True)
class Launch:
    """One server start: its command, environment, where it answers when up, what to say then, and its log."""

    argv: list[str]
    env: dict[str, str]
    health: str  # URL that answers 200 once the server is up
    banner: str  # printed (one line) once it is up
    log: Path
    marker: str | None = None  # a /metrics line starts with it only when RidgeFill runs (None: not checked)
    log_limit: int = LOG_LIMIT
    title: str = "the server"  # how failures name it ("vLLM", "llama.cpp")
    dialect: LogDialect = LogDialect()


@dataclass(frozen=True)
class GuardDialect:
    """How an engine's server carries what the request guard (serve/guard.py) checks."""

    options_field: str  # the request body's object that holds the request's engine options (RidgeFill's among them);
    # "": RidgeFill's options are top-level fields of the body (ridgefill_tail beside prompt and max_tokens)
    key_env: str  # the environment variable the server reads its API key from when none is given on its command line
    auth_middleware: str = ""  # the class name of the server's own API-key middleware, whose keys the guard checks


class Server:
    """One engine's OpenAI-compatible server, as `serve` and `bench-serve` run it. A subclass lives in its engine's
    folder (backends/<engine>/server.py, exposed as SERVER and named in backends.SERVERS); the front calls, in this
    order: `check` (with the command's other checks), `launch` (the fill resolved and checked by the front; None for
    the stock baseline), then runs the Launch. Its texts name its engine; the front's never do."""

    name: ClassVar[str]  # its --engine name
    title: ClassVar[str]  # how texts name it ("vLLM", "llama.cpp")
    guard: ClassVar[GuardDialect]  # how its requests carry what the request guard checks
    log: ClassVar[LogDialect] = LogDialect()  # how its log says it is up, or why it failed

    def check(self, config, own: list[str]) -> None:
        """The settings only this server reads (config.server_args, config.dtype, config.kv_cache_gib), checked
        before anything starts; `own`: serve's own options as written (an abbreviation of one is refused)."""

    def served_dtype(self, dtype: str, model: str) -> str:
        """serve's --dtype (auto resolved) as this server serves `model`."""
        raise NotImplementedError

    def keyed(self, config) -> bool:
        """Whether the server checks an API key (config.server_args or its key variable)."""
        return bool(os.environ.get(self.guard.key_env))

    def launch(self, config, fill, scratch: Path, guard: str | None, env: dict) -> "Launch":
        """Everything only this engine checks (one line each), then its server's start: command, environment (with
        the front's `env`), health URL, its share of the banner (`banner`: what the front's line does not say),
        the /metrics marker of RidgeFill; `fill` (method/fill.FillSettings, checked against the model and this engine
        by the front) served, or none (None: the stock server, bench-serve's baseline, without RidgeFill's counters);
        `guard` (the front's request guard's import path, or None) mounted; `scratch` lives as long as it runs. The
        log's path is the front's (Launch.log is replaced)."""
        raise NotImplementedError

    def context_args(self, tokens: int) -> list[str]:
        """Server arguments (serve's --server-args) that make its context hold `tokens` tokens (bench-serve's
        longest request)."""
        raise NotImplementedError

    def bench_concurrency(self, requests: int) -> int | None:
        """serve's --concurrency for bench-serve's servers when a rate sends `requests` requests (None: serve's
        default)."""
        return None

    def drive(self, base: str, model: str, tokenizer, prompts: list[list[int]], rate: float, output_tokens: int,
              seed: int, time_limit: float, salt: str = "") -> list[dict]:
        """A seeded Poisson stream of `prompts` at `rate` requests/s against this server at `base`: per request its
        ttft, latency, output_tokens and start (bench-serve)."""
        raise NotImplementedError


# --- a request's own RidgeFill options ----------------------------------------------------------------------
PREFIX = "ridgefill_"
TAIL_ARG = "ridgefill_tail"
KEEP_FIRST_ARG = "ridgefill_keep_first"
LARGEST = MAX_ROWS  # the largest value a request may give: the engine's keep-first bound (vLLM's positions are int32)
# key -> (the engine's rule of its values, their least value, what it sets)
REQUEST_ARGS = {TAIL_ARG: (tail_ok, 1, "last prompt tokens that run the full model"),
                KEEP_FIRST_ARG: (keep_first_ok, 0, "leading prompt tokens that run in full")}


def check_request_args(extra: Mapping | None) -> None:
    """Raise ValueError (one line: the key and the valid range) for the first bad `ridgefill_*` key of a request's
    extra arguments; keys without the prefix are not RidgeFill's and pass."""
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        if key not in REQUEST_ARGS:
            raise ValueError(f"unknown RidgeFill request option {key!r}: use {' or '.join(REQUEST_ARGS)}")
        ok, least, what = REQUEST_ARGS[key]
        if not ok(value, LARGEST):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ValueError(f"{key}={shown} is not valid: give an integer in {least}..{LARGEST} ({what})")


# --- the name a server answers under ---------------------------------------------------------------------------
def served_name(model: str) -> str:
    """The name a server answers under (each response's `model`, /v1/models): serve's --model when it names a model
    (an alias, a Hub id), the name of the file (without .gguf) or folder when it is a local path: a response never
    shows a path of this machine."""
    path = Path(model).expanduser()
    if not (model.startswith(("/", ".", "~")) or model.endswith(".gguf") or path.exists()):
        return model
    return path.resolve().name.removesuffix(".gguf")


# --- where the server answers --------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the system picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on (vLLM would fail after loading the model)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise RidgefillError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port, or stop "
                             "what uses it") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def health_url(host: str, port: int) -> str:
    """The URL this machine reaches the server's /health at (a wildcard address through loopback)."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{'[' + local + ']' if ':' in local else local}:{port}/health"
