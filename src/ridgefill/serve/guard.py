"""The request guard: one pure ASGI middleware any server can mount (`ridgefill serve` mounts it outermost in the
engine's server), engine-neutral, with no engine's import. It checks the API key before any byte of a body is read,
bounds the body, and checks RidgeFill's own options of a request (backends/serving.REQUEST_ARGS) in the JSON as the
client sent it, before the server's request models read (and may coerce) it: `{"ridgefill_tail": true}` is refused
like any other non-integer. What differs between servers is the engine's `GuardDialect` (backends/serving.py): the
body's field that holds a request's engine options ("" where they are top-level fields), the environment variable
of the server's API key, and the server's own key middleware, whose keys the guard checks. The guard takes it as
`dialect`, else from the engine named by RIDGEFILL_GUARD_ENGINE (`ridgefill serve` sets it), else from the engine
serve runs by default (backends.SERVING_DEFAULT).

A server adds its middleware inside its own, so this check runs before the server's API-key check: it authenticates
first itself, with the server's keys, in the OpenAI-compatible servers' 401, and stricter than a server that guards
some path prefixes only: every path needs the key except those in OPEN, with every method (CORS preflights included:
a browser's cross-origin client needs a same-origin proxy that adds the key), so a route a server adds later is
guarded too. An unauthenticated request gets the 401 before a byte of its body is read. (The 401 comes without CORS
headers; the 400 and 413 below go out through the server's CORS middleware when it has one, as its own 400s do.)
Then the request's framing: a Content-Length that is not one plain number of at most LENGTH_DIGITS digits (repeated,
negative, a list, or thousands of digits, which int() refuses past Python's digit limit) is 400 and the connection
is closed. Then the body is bounded, whatever the method (a GET, HEAD or OPTIONS body is read and bounded as a
POST's: no request reaches the server before its whole body has come within the bound): over BODY_LIMIT bytes
(RIDGEFILL_MAX_REQUEST_BYTES overrides it) it is 413 and the connection is closed, by its Content-Length, else as
soon as the bytes read pass the bound; no byte past the bound is kept (see DRAIN_FACTOR). Only a body that can set
a RidgeFill option (it holds the dialect's options field, `ridgefill_` where options are top-level, or a backslash,
or is no UTF-8) or that json.loads could raise on (deep nesting, a huge integer: judged on its bytes) is parsed
(needs_parse), at most PARSES at a time off the event loop (others wait their turn); there JSON nested too deeply
for the parser, an integer past Python's digit limit and an options field over XARGS_LIMIT bytes are 400.
Everything else is passed on, the body replayed unchanged (a body that is no JSON object is the server's to
answer); the server's own 4xx refusal in many lines, or echoing what the client sent, goes back as one line
(serve/refusals.py).
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import re
import secrets
import sys
from http import HTTPStatus
from typing import Mapping

import numpy as np

from ridgefill.backends.serving import PREFIX, GuardDialect, check_request_args
from ridgefill.serve.refusals import one_line_errors

ENGINE_ENV = "RIDGEFILL_GUARD_ENGINE"  # the engine whose GuardDialect the guard follows (when not given one)
BODY_LIMIT_ENV = "RIDGEFILL_MAX_REQUEST_BYTES"
# 8 MiB: a 128K-token prompt is about 1 MiB as token ids, 0.5 to 3 MiB as text (JSON escapes included)
BODY_LIMIT = 8 << 20
# An oversized body is read on and dropped, up to DRAIN_FACTOR times the bound, before the 413 goes out: a client
# that sends its whole body before it reads (urllib, requests, httpx) then gets the 413; past that the server closes
# the connection under it. A client that asks `Expect: 100-continue` is answered before it sends the body.
DRAIN_FACTOR = 8
XARGS_LIMIT = 64 << 10  # bytes of JSON in the dialect's options field (RidgeFill's own options take a few dozen)
THREAD_PARSE = 64 << 10  # bodies over this many bytes are parsed in a worker thread, not in the event loop
# Bodies parsed in worker threads at once (json's parser holds the GIL: a second thread would parse no faster, and
# each parse holds up to ~25 bytes of objects per byte of JSON); the next waits for its turn.
PARSES = 1
# The only paths open without the key (under --root-path when one is set; the method is the route's business):
# health probes (GET or POST /health and /ping), Prometheus' counters and the tokenizer. Every other
# path needs it, including /invocations, /version, /load and /v1/models.
OPEN = frozenset({"/health", "/ping", "/metrics", "/tokenize", "/detokenize"})
LENGTH_DIGITS = 18  # the most digits of a Content-Length (up to 10^18 - 1 bytes; int() refuses over 4,300)
# A body json.loads reads as UTF-8 (others are always parsed) can set a RidgeFill option only if it holds the name of
# the dialect's options field or a backslash (an escape can spell any of the key's letters)
ESCAPE = b"\\"
# One that cannot is still parsed where json.loads could raise rather than answer: JSON that may nest over DEEP levels
# (its RecursionError comes at about 1,000) or an integer of over 4,300 digits (Python's int() limit). Both are judged
# on its bytes with its strings cut out (without a backslash a string is a quote, anything but a quote, a quote).
DEEP = 256
STRING = re.compile(rb'"[^"]*"')
DIGITS = bytes.maketrans(bytes(range(256)), bytes(48 if 48 <= b <= 57 else 32 for b in range(256)))  # digit -> "0"
BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff"), bytes(set(range(256)) - set(b"[{]}"))
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # the 401 body of the OpenAI-compatible servers' key middleware
NESTED = ("the request body's JSON nests too deeply to be read: send {field} and the request's other fields "
          "as a flat object")  # .format(field=the dialect's options field)


def inner(app, name: str):
    """The first middleware of class `name` in the stack Starlette built inside `app` (outermost first), or None."""
    node = app
    for _ in range(64):
        if node is None or type(node).__name__ == name:
            return node
        node = getattr(node, "app", None)
    return None


def dialect_of(environ: Mapping[str, str]) -> GuardDialect:
    """The GuardDialect of the server of the engine RIDGEFILL_GUARD_ENGINE names, else of the engine serve runs by
    default (through the registry: the guard imports no engine)."""
    from ridgefill.backends import SERVERS, SERVING_DEFAULT, server_of

    name = environ.get(ENGINE_ENV, "").strip() or SERVING_DEFAULT
    if name not in SERVERS:
        raise ValueError(f"{ENGINE_ENV}={name!r} names no engine with a server: unset it or name one of "
                         f"{', '.join(SERVERS)}")
    return server_of(name).guard


def api_tokens(app, environ: Mapping[str, str], dialect: GuardDialect) -> list[bytes]:
    """The sha256 digests of the API keys the server checks: those of its own key middleware found inside `app`
    (the dialect's auth_middleware: the keys the server itself chose), else the dialect's key variable's;
    none when no key is set."""
    own = inner(app, dialect.auth_middleware) if dialect.auth_middleware else None
    tokens = getattr(own, "api_tokens", None)
    if isinstance(tokens, list):
        return list(tokens)
    key = environ.get(dialect.key_env, "")
    return [hashlib.sha256(key.encode()).digest()] if key else []


def route_path(scope) -> str:
    """The path Starlette routes a request by: its path below --root-path (Starlette's get_route_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


def authorized(scope, tokens: list[bytes]) -> bool:
    """Whether a request may go on: no key set; a path in OPEN; else an `Authorization: Bearer KEY` header with one of
    the keys, checked as the servers' own key middleware checks it, for every method: a CORS preflight (OPTIONS
    asking Access-Control-Request-Method) too, which may declare a body it never sends and would hold a connection
    and a server's admission place without the key."""
    if not tokens or route_path(scope) in OPEN:
        return True
    value = (header(scope, b"authorization") or b"").decode("latin-1")
    scheme, _, param = value.partition(" ")
    if not value or scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode()).digest()
    matched = False
    for token in tokens:  # every key compared, in constant time
        matched |= secrets.compare_digest(digest, token)
    return matched


def body_limit(environ: Mapping[str, str]) -> int:
    """The most bytes of a request body the server reads: RIDGEFILL_MAX_REQUEST_BYTES, else BODY_LIMIT."""
    text = environ.get(BODY_LIMIT_ENV, "").strip()
    if not text:
        return BODY_LIMIT
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{BODY_LIMIT_ENV}={text!r} is not a positive number of bytes: set it to e.g. "
                         f"{BODY_LIMIT} or unset it")
    return int(text)


def header(scope, name: bytes) -> bytes | None:
    """A request header's first value, or None."""
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


def declared_length(scope) -> int | None:
    """The Content-Length a request declares, or None without one. ValueError, one line, for a header that is not
    one plain number of at most LENGTH_DIGITS digits: repeated, negative, a list, not a number, or thousands of
    digits (`000...05`: int() refuses over 4,300)."""
    values = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
    if not values:
        return None
    if len(values) > 1:
        raise ValueError(f"the request has {len(values)} Content-Length headers: send one, the body's length in bytes")
    text = values[0].strip(b" \t")
    if not text.isdigit() or len(text) > LENGTH_DIGITS:  # bytes.isdigit: ASCII digits only
        raise ValueError(f"the request's Content-Length is not a number of bytes of at most {LENGTH_DIGITS} digits: "
                         "send one Content-Length header with the body's length in bytes")
    return int(text)


def needs_parse(body: bytes, field: str) -> bool:
    """Whether a body is parsed: JSON not in UTF-8, one that may set a RidgeFill option (it holds the options field's
    name `field` or an escape), or one on which json.loads could raise (nested over DEEP levels, an integer of over
    4,300 digits). Every other body is passed on unparsed: 2 MiB of `[{},{},...]` are ~50 MiB of objects once
    parsed."""
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig") or (field or PREFIX).encode() in body or \
            ESCAPE in body:
        return True
    bare = STRING.sub(b"", body)
    if b"0" * 4301 in bare.translate(DIGITS):  # a run of 4,301 digits (a regex takes 20x longer)
        return True
    if bare.count(b"[") + bare.count(b"{") <= DEEP:
        return False
    steps = np.frombuffer(bare.translate(*BRACKETS), np.int8)  # +1 for each opening bracket, -1 for each closing one
    depth = 0
    for start in range(0, len(steps), 1 << 18):  # the running depth 256 Ki brackets at a time (1 MiB of int32)
        running = np.cumsum(steps[start:start + (1 << 18)], dtype=np.int32)
        running += depth
        if running.max() > DEEP:
            return True
        depth = int(running[-1])
    return False


def too_large(limit: int) -> str:
    return (f"the request body is over {limit:,} bytes, the most this server reads: send a shorter request, or "
            f"start the server with {BODY_LIMIT_ENV} set higher")


def body_error(body: bytes, field: str) -> str | None:
    """The one-line refusal of a request body (JSON nested too deeply or with an integer of thousands of digits, or
    its options field `field` too large or with a bad RidgeFill option), or None (also for a body that is no JSON
    object: the server answers that itself)."""
    try:
        doc = json.loads(body)
    except RecursionError:
        return NESTED.format(field=field or "RidgeFill's options")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    except ValueError:  # an integer past Python's digit limit (a server would answer outside its error format)
        return (f"the request body holds an integer of over {sys.get_int_max_str_digits():,} digits: send integers "
                "of at most 2147483647 in RidgeFill's options")
    if not field:  # top-level options: the body's ridgefill_* fields (the body limit bounds them)
        return top_level_error(doc) if isinstance(doc, dict) else None
    extra = doc.get(field) if isinstance(doc, dict) else None
    return xargs_error(extra, field) if isinstance(extra, dict) else None


def top_level_error(doc: dict) -> str | None:
    """The one-line refusal of a body's own ridgefill_* fields (a dialect without an options field), or None."""
    try:
        check_request_args(doc)  # it reads the ridgefill_* keys and passes every other
    except ValueError as exc:
        return str(exc)
    return None


def xargs_error(extra: dict, field: str) -> str | None:
    """The one-line refusal of a request's options field (`field`: the dialect's), or None."""
    try:
        size = len(json.dumps(extra).encode())
    except RecursionError:
        return NESTED.format(field=field)
    if size > XARGS_LIMIT:
        return (f"{field} holds {size:,} bytes of JSON, over the {XARGS_LIMIT:,} this server accepts: send only "
                "the extra options the server reads (e.g. ridgefill_tail)")
    try:
        check_request_args(extra)
    except ValueError as exc:
        return str(exc)
    return None


class RequestGuard:
    """Pure ASGI middleware: the server's 401 for a request without a valid API key, 413 for a body over the bound,
    400 for a body whose options field (the dialect's) is refused; anything else goes on to the server."""

    def __init__(self, app, environ: Mapping[str, str] | None = None, dialect: GuardDialect | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.app = app
        self.dialect = dialect or dialect_of(environ)
        self.field = self.dialect.options_field
        self.tokens = api_tokens(app, environ, self.dialect)
        self.limit = body_limit(environ)
        self.cors = inner(app, "CORSMiddleware")  # the server's CORS headers go on our 400 and 413 too
        self.parsing = asyncio.Semaphore(PARSES)

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") == "websocket" and not authorized(scope, self.tokens):
            await deny_websocket(scope, send)
            return
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if not authorized(scope, self.tokens):
            await respond(send, 401, UNAUTHORIZED)
            return
        try:
            declared = declared_length(scope)
        except ValueError as exc:  # the body's end is unknown: nothing more is read on this connection
            await self.refuse(scope, send, 400, str(exc), close=True)
            return
        if declared is not None and declared > self.limit:
            waits = (header(scope, b"expect") or b"").lower() == b"100-continue"  # sends nothing unless asked
            if declared <= DRAIN_FACTOR * self.limit and not waits:
                await drain(receive, declared)
            await self.refuse(scope, send, 413, too_large(self.limit), close=True)
            return
        body, first = await read_body(receive, self.limit)
        if body is None:
            await self.refuse(scope, send, 413, too_large(self.limit), close=True)
            return
        error = None if first is not None else await self.checked(body)
        if error is not None:
            await self.refuse(scope, send, 400, error)
            return
        await self.app(scope, replayed(receive, first or {"type": "http.request", "body": body, "more_body": False}),
                       one_line_errors(send))

    async def checked(self, body: bytes) -> str | None:
        """body_error for a body that needs it (needs_parse; else None, unparsed). A large body is screened and
        parsed in worker threads (2 MiB take ~20 ms to screen, a few MiB of JSON tens of milliseconds to parse), at
        most PARSES parses at once."""
        if len(body) <= THREAD_PARSE:
            return body_error(body, self.field) if needs_parse(body, self.field) else None
        if not await asyncio.to_thread(needs_parse, body, self.field):
            return None
        async with self.parsing:
            return await asyncio.to_thread(body_error, body, self.field)

    async def refuse(self, scope, send, status: int, message: str, close: bool = False) -> None:
        """refuse(), through the server's CORS middleware when it has one (as its own errors are answered)."""
        async def refusal(scope, receive, send) -> None:
            await refuse(send, status, message, close)

        if self.cors is None:
            await refusal(scope, None, send)
            return
        cors = copy.copy(self.cors)
        cors.app = refusal
        await cors(scope, None, send)


async def read_body(receive, limit: int) -> tuple[bytes | None, dict | None]:
    """(the whole body, None); or (None, None) once it passes `limit` bytes (what follows is dropped, up to
    DRAIN_FACTOR times `limit` in all); or (the bytes so far, the message that ended it) when the client went away."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunk = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > limit:
            if more:
                await drain(receive, DRAIN_FACTOR * limit - size)
            return None, None
        chunks.append(chunk)
        if not more:
            return b"".join(chunks), None


async def drain(receive, most: int) -> None:
    """Read and drop the rest of a body, until it ends or `most` bytes have gone."""
    gone = 0
    while gone < most:
        message = await receive()
        gone += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def replayed(receive, first: dict):
    """A receive that gives `first`, then what `receive` gives."""
    done = False

    async def replay():
        nonlocal done
        if not done:
            done = True
            return first
        return await receive()

    return replay


async def refuse(send, status: int, message: str, close: bool = False) -> None:
    """An error in the OpenAI format (message, type, param, code); with `close`, `Connection: close` (the
    server then closes the connection after it, reading no more of the request)."""
    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"  # BadRequestError, RequestEntityTooLargeError
    await respond(send, status, json.dumps({"error": {"message": message, "type": kind, "param": None,
                                                      "code": status}}).encode(), close)


async def respond(send, status: int, payload: bytes, close: bool = False, prefix: str = "") -> None:
    headers = [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
    await send({"type": f"{prefix}http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] * close})
    await send({"type": f"{prefix}http.response.body", "body": payload})


async def deny_websocket(scope, send) -> None:
    """The 401 to a websocket handshake, where the server can send an HTTP answer to one (ASGI's
    websocket.http.response extension), else a close before it is accepted (the server answers 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await respond(send, 401, UNAUTHORIZED, prefix="websocket.")
    else:
        await send({"type": "websocket.close", "code": 1008})
