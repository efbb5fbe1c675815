"""The request guard `ridgefill serve` installs in vLLM (serve/guard.py, with vLLM's dialect: the registry's default), as a pure ASGI app without a
server: vLLM's 401 before any body is read, bodies bounded (413), nested, escaped and oversized `vllm_xargs`
refused (400), everything else replayed unchanged. No vLLM needed, except where a test compares with vLLM's own
authentication middleware."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from ridgefill.serve.guard import BODY_LIMIT, THREAD_PARSE, UNAUTHORIZED, XARGS_LIMIT, body_limit
from ridgefill.serve.guard import NESTED as NESTED_IN
from ridgefill.serve.guard import RequestGuard as RidgeFillRequestArgs
from ridgefill.serve.guard import body_error as guard_body_error

NESTED = NESTED_IN.format(field="vllm_xargs")


def body_error(body: bytes):
    return guard_body_error(body, "vllm_xargs")

KEY = "s3cret-key"
BAD_XARGS = json.dumps({"prompt": "hi", "vllm_xargs": {"ridgefill_tail": 0}}).encode()


class Client:
    """One request through the middleware: what it answered, what the app behind it read, and how many of the
    request's messages were taken from the server."""

    def __init__(self, body: bytes | list[bytes] = b"", method: str = "POST", path: str = "/v1/completions",
                 headers: dict[str, str] | list[tuple[str, str]] | None = None, disconnect: bool = False) -> None:
        self.chunks = [body] if isinstance(body, bytes) else body
        pairs = headers.items() if isinstance(headers, dict) else headers or []  # a list may repeat a header
        self.scope = {"type": "http", "method": method, "path": path, "root_path": "",
                      "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in pairs]}
        self.disconnect = disconnect
        self.taken, self.sent, self.reached = 0, [], None

    async def receive(self) -> dict:
        self.taken += 1
        if self.disconnect and self.taken == len(self.chunks):
            return {"type": "http.disconnect"}
        if self.taken > len(self.chunks):
            await asyncio.sleep(3600)  # a server waits for the client's next bytes or its disconnect
        return {"type": "http.request", "body": self.chunks[self.taken - 1],
                "more_body": self.taken < len(self.chunks)}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def app(self, scope, receive, send) -> None:
        """vLLM behind the middleware: reads the whole body, answers 200."""
        parts, message = [], {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            parts.append(message.get("body", b""))
        self.reached = b"".join(parts) if message["type"] == "http.request" else message
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def run(self, environ: dict[str, str] | None = None, app=None) -> Client:
        middleware = RidgeFillRequestArgs(app or self.app, environ={} if environ is None else environ)
        asyncio.run(middleware(self.scope, self.receive, self.send))
        return self

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def answer(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    def error(self) -> str:
        assert self.sent[0]["headers"][1] == (b"content-type", b"application/json")
        error = json.loads(self.answer)["error"]
        assert error["code"] == self.status and "\n" not in error["message"], error
        return error["message"]


def keyed(**headers) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **headers}


# --- authentication first ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("client", [
    lambda: Client(BAD_XARGS),  # bad RidgeFill options: 401, not ridgefill's 400
    lambda: Client(b"", method="GET", path="/v1/models"),
    lambda: Client(b"x" * 100, headers={"Content-Length": str(1 << 40)}),  # over the body bound: 401, not 413
    lambda: Client([b"[" * 10, b"]" * 10]),  # streamed: not one chunk is taken
    lambda: Client(BAD_XARGS, headers={"Authorization": "Bearer wrong"}),
    lambda: Client(BAD_XARGS, headers={"Authorization": f"Basic {KEY}"}),
    lambda: Client(BAD_XARGS, headers={"Authorization": KEY}),
    lambda: Client(BAD_XARGS, path="/v2/anything"),
    lambda: Client(BAD_XARGS, path="/inference/v1/generate"),
    lambda: Client(BAD_XARGS, path="/cohere/v2/rerank"),
], ids=["bad-xargs", "models", "over-the-bound", "streamed", "wrong-key", "basic", "no-scheme", "v2", "inference",
        "cohere"])
@pytest.mark.parametrize("environ", [{"VLLM_API_KEY": KEY}, {"VLLM_API_KEY": KEY, "RIDGEFILL_MAX_REQUEST_BYTES": "50"}],
                         ids=["default-bound", "small-bound"])
def test_without_the_key_a_guarded_request_is_vllms_401_before_any_body_is_read(client, environ):
    c = client().run(environ)
    assert c.status == 401 and c.answer == UNAUTHORIZED and c.taken == 0 and c.reached is None
    assert c.sent[0]["headers"] == [(b"content-length", b"24"), (b"content-type", b"application/json")]


def test_with_the_key_or_off_the_guarded_paths_the_request_goes_on():
    environ = {"VLLM_API_KEY": KEY}
    ok = json.dumps({"prompt": "hi", "vllm_xargs": {"ridgefill_tail": 3}}).encode()
    assert Client(ok, headers=keyed()).run(environ).reached == ok
    assert Client(ok, headers={"Authorization": f"bearer {KEY}"}).run(environ).reached == ok  # the scheme's case
    assert Client(b"", method="GET", path="/health").run(environ).reached == b""  # vLLM leaves these open
    assert Client(ok, path="/tokenize").run(environ).reached == ok
    assert Client(b"", method="OPTIONS").run(environ).status == 401  # stricter than vLLM
    assert Client(ok, path="/api/v1/completions", headers=keyed()).run(environ).reached == ok
    rooted = Client(BAD_XARGS, path="/api/v1/completions")
    rooted.scope["root_path"] = "/api"  # the path vLLM checks is under the root path
    assert rooted.run(environ).status == 401
    assert Client(ok).run({}).reached == ok  # no key set: nothing to check
    assert Client(ok).run({"VLLM_API_KEY": ""}).reached == ok


OPEN_PATHS = ["/health", "/ping", "/metrics", "/tokenize", "/detokenize"]  # documented in docs/serving.md


@pytest.mark.parametrize("method", ["OPTIONS", "GET", "HEAD"])
def test_a_preflight_or_a_bodyless_method_needs_the_key_and_its_body_is_bounded(method):
    """A CORS preflight (it may declare a body it never sends) is 401 without the key like any request; with the
    key, a GET, HEAD or OPTIONS body is read whole and bounded before the server sees the request: a declared body
    that never comes never reaches it, one over the bound is 413."""
    environ = {"VLLM_API_KEY": KEY, "RIDGEFILL_MAX_REQUEST_BYTES": "100"}
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST", "Content-Length": "50"}
    c = Client([b"x" * 10, b"x" * 10], method=method, headers=preflight).run(environ)
    assert c.status == 401 and c.taken == 0 and c.reached is None
    over = Client(b"x" * 10, method=method, headers=keyed(**{"Content-Length": "1000"})).run(environ)
    assert over.status == 413 and over.reached is None
    streamed = Client([b"x" * 60, b"x" * 60], method=method, headers=keyed()).run(environ)
    assert streamed.status == 413 and streamed.reached is None
    unfinished = Client([b"x" * 10, b"x" * 10], method=method, headers=keyed(**{"Content-Length": "50"}),
                        disconnect=True).run(environ)
    assert unfinished.reached == {"type": "http.disconnect"}  # the app sees only the client's going away
    whole = Client([b"x" * 10, b"x" * 10], method=method, headers=keyed(**{"Content-Length": "20"})).run(environ)
    assert whole.reached == b"x" * 20 and whole.taken == 2


@pytest.mark.parametrize("path", [
    "/invocations",  # SageMaker's: vLLM runs chat and completion requests there, outside its guarded prefixes
    "/version", "/load", "/pooling", "/classify", "/score", "/rerank", "/pause", "/abort_requests",
    "/a/route/vllm/adds/later", "/", "", "/health/", "/healthz", "//health", "/metrics/", "/tokenize/x",
    "/HEALTH", "/health;x", "/v1/../health",
])
def test_every_path_outside_the_open_list_needs_the_key(path):
    """Decided by the open list, not by vLLM's guarded prefixes: a generating route vLLM registers elsewhere
    (/invocations) or adds later, and near-misses of the open paths, are 401 before any body is read."""
    environ = {"VLLM_API_KEY": KEY}
    body = json.dumps({"model": "m", "prompt": "hi", "vllm_xargs": {"ridgefill_tail": 0}}).encode()
    c = Client(body, path=path).run(environ)
    assert c.status == 401 and c.answer == UNAUTHORIZED and c.taken == 0 and c.reached is None
    assert Client(body, path=path, headers=keyed()).run(environ).status == 400  # with the key: checked, refused
    assert Client(body[:-3] + b"3}}", path=path, headers=keyed()).run(environ).reached == body[:-3] + b"3}}"


@pytest.mark.parametrize("path", OPEN_PATHS)
def test_only_the_open_paths_go_on_without_the_key(path):
    environ = {"VLLM_API_KEY": KEY}
    ok = json.dumps({"prompt": "hi"}).encode()
    assert Client(ok, path=path).run(environ).reached == ok
    assert Client(b"", method="GET", path=path).run(environ).reached == b""
    rooted = Client(ok, path="/api" + path)
    rooted.scope["root_path"] = "/api"  # under --root-path, as Starlette routes it
    assert rooted.run(environ).reached == ok
    elsewhere = Client(ok, path="/api" + path)
    elsewhere.scope["root_path"] = "/ap"  # not below the root path: routed as /api/health, guarded
    assert elsewhere.run(environ).status == 401
    bad = Client(BAD_XARGS, path=path).run(environ)  # the body check still runs on an open path
    assert bad.status == 400 and bad.error().startswith("ridgefill_tail=0 is not valid")


def test_a_websocket_without_the_key_is_refused_before_vllm_sees_it():
    """vLLM's 401 where the server can answer a handshake over HTTP, else a close before it is accepted."""
    seen, sent = [], []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def send(message):
        sent.append(message)

    middleware = RidgeFillRequestArgs(app, environ={"VLLM_API_KEY": KEY})
    http_answer = {"type": "websocket", "path": "/v1/realtime", "headers": [],
                   "extensions": {"websocket.http.response": {}}}
    asyncio.run(middleware(http_answer, None, send))
    assert [m["type"] for m in sent] == ["websocket.http.response.start", "websocket.http.response.body"]
    assert sent[0]["status"] == 401 and sent[1]["body"] == UNAUTHORIZED
    sent.clear()
    asyncio.run(middleware({"type": "websocket", "path": "/a/later/socket", "headers": []}, None, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and seen == []


def test_the_401_and_the_keys_are_vllms_own():
    """vLLM's AuthenticationMiddleware answers the same bytes; when vLLM's stack holds one (keys from --api-key),
    its keys are checked, not VLLM_API_KEY's."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX, AuthenticationMiddleware

    for prefix in GUARDED_PREFIX:  # what vLLM guards is guarded here too
        assert Client(BAD_XARGS, path=prefix + "/anything").run({"VLLM_API_KEY": KEY}).status == 401
    for client in (Client(BAD_XARGS), Client(b"", method="GET", path="/v1/models")):
        ours, theirs = client, Client(client.chunks[0], client.scope["method"], client.scope["path"])
        ours.run({"VLLM_API_KEY": KEY})
        asyncio.run(AuthenticationMiddleware(theirs.app, [KEY])(theirs.scope, theirs.receive, theirs.send))
        assert [ours.status, ours.sent[0]["headers"], ours.answer] == [
            theirs.status, theirs.sent[0]["headers"], theirs.answer]
    c = Client(BAD_XARGS)  # an argv key, a stack between the two middlewares, and another key in the environment
    stack = type("XRequestIdMiddleware", (), {})()
    stack.app = AuthenticationMiddleware(c.app, ["argv-key", "second-key"])
    for key, status in (("argv-key", 400), ("second-key", 400), ("env-key", 401)):
        c = Client(BAD_XARGS, headers={"Authorization": f"Bearer {key}"})
        assert c.run({"VLLM_API_KEY": "env-key"}, app=stack).status == status


# --- the body bound ------------------------------------------------------------------------------------------------
def test_a_body_declared_over_the_bound_is_413_and_never_kept():
    """Past 8 times the bound (or when the client waits for `100 Continue`) the 413 comes before a byte is read;
    below that the body is read on and dropped first, so a client that sends it all before it reads sees the 413."""
    c = Client(b"x" * 10, headers=keyed(**{"Content-Length": str(8 * BODY_LIMIT + 1)})).run({"VLLM_API_KEY": KEY})
    assert c.status == 413 and c.taken == 0 and c.reached is None
    assert c.error() == ("the request body is over 8,388,608 bytes, the most this server reads: send a shorter "
                         "request, or start the server with RIDGEFILL_MAX_REQUEST_BYTES set higher")
    assert json.loads(c.answer)["error"]["type"] == "RequestEntityTooLargeError"
    small = {"RIDGEFILL_MAX_REQUEST_BYTES": "100"}
    waiting = Client([b"x" * 50] * 3, headers={"Content-Length": "150", "Expect": "100-continue"}).run(small)
    assert waiting.status == 413 and waiting.taken == 0
    dropped = Client([b"x" * 50] * 16, headers={"Content-Length": "800"}).run(small)
    assert dropped.status == 413 and dropped.taken == 16 and dropped.reached is None  # all read, none kept
    exact = Client(b"x" * 100, headers={"Content-Length": "100"}).run(small)
    assert exact.reached == b"x" * 100  # at the bound: read and passed on


CLOSE = (b"connection", b"close")


def test_a_413_closes_the_connection_and_a_400_after_a_whole_body_keeps_it():
    """`Connection: close` on every 413 (the server then reads no more of the body); a refusal after the whole body
    was read leaves the connection open for the client's next request."""
    small = {"RIDGEFILL_MAX_REQUEST_BYTES": "100"}
    for c in (Client(b"x" * 10, headers={"Content-Length": str(8 * BODY_LIMIT + 1)}).run(),
              Client([b"x" * 50] * 3, headers={"Content-Length": "150", "Expect": "100-continue"}).run(small),
              Client([b"x" * 50] * 16, headers={"Content-Length": "800"}).run(small),
              Client([b"y" * 40] * 1000).run(small)):
        assert c.status == 413 and CLOSE in c.sent[0]["headers"] and c.reached is None
    refused = Client(BAD_XARGS).run()
    assert refused.status == 400 and CLOSE not in refused.sent[0]["headers"]


LENGTH_ERROR = ("the request's Content-Length is not a number of bytes of at most 18 digits: send one "
                "Content-Length header with the body's length in bytes")


@pytest.mark.parametrize("lengths, message", [
    (["0" * 5000 + "5"], LENGTH_ERROR),  # 5,001 digits: int() raises past Python's digit limit
    (["9" * 5001], LENGTH_ERROR), (["1" + "0" * 18], LENGTH_ERROR), (["-5"], LENGTH_ERROR), (["+5"], LENGTH_ERROR),
    (["five"], LENGTH_ERROR), (["0x10"], LENGTH_ERROR), (["1e3"], LENGTH_ERROR), ([""], LENGTH_ERROR),
    (["5, 5"], LENGTH_ERROR), (["5 5"], LENGTH_ERROR), (["\u0665"], LENGTH_ERROR),  # an Arabic-Indic 5 (isdigit)
    (["5", "5"], "the request has 2 Content-Length headers: send one, the body's length in bytes"),
    (["5", "7", "5"], "the request has 3 Content-Length headers: send one, the body's length in bytes"),
], ids=["5001-digits", "huge", "19-digits", "negative", "plus", "word", "hex", "float", "empty", "list", "spaced",
        "unicode-digit", "twice", "thrice"])
@pytest.mark.parametrize("method, path, headers", [
    ("POST", "/v1/completions", keyed()), ("POST", "/tokenize", {}), ("GET", "/health", {}),
], ids=["guarded", "open", "get"])
def test_a_bad_content_length_is_one_400_that_closes_the_connection(lengths, message, method, path, headers):
    """On guarded (with the key) and open paths alike: one 400 in vLLM's format, no exception, not a byte read,
    the connection closed (its body's end is unknown)."""
    pairs = list(headers.items()) + [("Content-Length", n.encode("utf-8").decode("latin-1")) for n in lengths]
    c = Client([b"hello"], method=method, path=path, headers=pairs).run({"VLLM_API_KEY": KEY})
    assert c.status == 400 and c.error() == message and c.taken == 0 and c.reached is None
    assert CLOSE in c.sent[0]["headers"]


def test_a_plain_content_length_goes_on():
    for length in ("5", "005", "0" * 13 + "5", " 5\t"):
        assert Client(b"hello", headers={"Content-Length": length}).run().reached == b"hello"
    assert Client(b"", headers={"Content-Length": "9" * 18}).run().status == 413  # 18 digits: a number, too large
    assert Client(BAD_XARGS, headers={"Content-Length": "-5"}).run({"VLLM_API_KEY": KEY}).status == 401  # key first


def test_a_streamed_body_is_413_once_it_passes_the_bound_and_is_dropped_up_to_8_times_it():
    small = {"RIDGEFILL_MAX_REQUEST_BYTES": "100"}
    c = Client([b"y" * 40] * 10).run(small)  # 400 bytes without a Content-Length
    assert c.status == 413 and c.taken == 10 and c.reached is None and "over 100 bytes" in c.error()
    endless = Client([b"y" * 40] * 1000).run(small)  # 40,000 bytes: the answer after 800 (20 chunks)
    assert endless.status == 413 and endless.taken == 20
    assert Client([b"y" * 40] * 2).run(small).reached == b"y" * 80


@pytest.mark.parametrize("value", ["0", "-5", "8MiB", "1e6", " x "])
def test_a_bad_bound_in_the_environment_is_one_line(value):
    with pytest.raises(ValueError, match=rf"^RIDGEFILL_MAX_REQUEST_BYTES='{value.strip()}' is not a positive number "
                                         r"of bytes: set it to e\.g\. 8388608 or unset it$"):
        body_limit({"RIDGEFILL_MAX_REQUEST_BYTES": value})
    assert body_limit({}) == BODY_LIMIT and body_limit({"RIDGEFILL_MAX_REQUEST_BYTES": " 4096 "}) == 4096


# --- what the body holds -------------------------------------------------------------------------------------------
def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


@pytest.mark.parametrize("body", [
    b'{"vllm_xargs": {"ridgefill_tail": ' + nested(100_000) + b"}}",
    b'{"prompt": "ridgefill_tail", "x": ' + nested(5_000) + b"}",
    b'{"prompt": "\\n", "x": ' + nested(5_000) + b"}",
    b'{"prompt": "' + b"]" * 5_000 + b'", "x": ' + nested(1_000) + b"}",  # closing brackets in a string hide nothing
    nested(100_000, b'{"vllm_xargs": {"ridgefill_tail": 1}}'),
], ids=["in-xargs", "beside", "beside-an-escape", "behind-a-string", "around"])
def test_json_nested_too_deeply_is_400_not_a_recursion_error(body):
    c = Client(body).run()
    assert c.status == 400 and c.error() == NESTED and c.reached is None


@pytest.mark.parametrize("body, match", [
    (b'{"vllm_xargs": {"ridgefill\\u005ftail": true}}', "ridgefill_tail=True is not valid"),
    (b'{"vllm_xargs": {"\\u0072idgefill_tail": 0}}', "ridgefill_tail=0 is not valid"),
    (b'{"vllm\\u005fxargs": {"ridgefill_keep_first": -1}}', "ridgefill_keep_first=-1 is not valid"),
    (b'{"vllm_xargs": {"ridgefill\\u005fsplit": 3}}', "unknown RidgeFill request option 'ridgefill_split'"),
    ('{"vllm_xargs": {"ridgefill_tail": 1.5}}'.encode("utf-16"), "ridgefill_tail=1.5 is not valid"),
    ('{"vllm_xargs": {"ridgefill_tail": false}}'.encode("utf-32-le"), "ridgefill_tail=False is not valid"),
], ids=["escaped-underscore", "escaped-letter", "escaped-field", "escaped-unknown", "utf-16", "utf-32"])
def test_options_the_client_escaped_or_encoded_are_checked_as_json_reads_them(body, match):
    c = Client(body).run()
    assert c.status == 400 and c.error().startswith(match) and c.reached is None


def test_an_oversized_vllm_xargs_is_400_and_a_large_body_is_parsed_off_the_event_loop():
    padded = json.dumps({"prompt": "hi", "vllm_xargs": {"ridgefill_tail": 4, "pad": "p" * XARGS_LIMIT}}).encode()
    c = Client(padded).run()
    assert c.status == 400 and c.reached is None
    assert c.error() == (f"vllm_xargs holds {XARGS_LIMIT + 32:,} bytes of JSON, over the 65,536 this server accepts: "
                         "send only the extra options the server reads (e.g. ridgefill_tail)")
    big = json.dumps({"prompt": "w " * THREAD_PARSE, "vllm_xargs": {"ridgefill_tail": True}}).encode()
    threads = []

    async def watched(client: Client):  # the loop's default executor runs the parse
        loop = asyncio.get_running_loop()
        original = loop.run_in_executor

        def run_in_executor(executor, func, *args):
            threads.append(func)
            return original(executor, func, *args)

        loop.run_in_executor = run_in_executor
        await RidgeFillRequestArgs(client.app, environ={})(client.scope, client.receive, client.send)

    large = Client(big)
    asyncio.run(watched(large))
    assert large.status == 400 and large.error().startswith("ridgefill_tail=True")
    assert [call.args[0].__name__ for call in threads] == ["needs_parse", "body_error"]  # screened, then parsed
    small = Client(BAD_XARGS)
    asyncio.run(watched(small))
    assert small.status == 400 and len(threads) == 2  # a small body is screened and parsed in the loop


def spellings() -> list[bytes]:
    """`{"vllm_xargs": {"ridgefill_tail": true}}` as json.loads reads it: each letter of the key escaped in turn
    (\\uXXXX, upper and lower case hex), in every encoding json.loads detects (UTF-8 with and without a BOM,
    UTF-16 and UTF-32 in either byte order, with and without a BOM)."""
    key = "vllm_xargs"
    keys = [key] + [key[:i] + f"\\u{ord(ch):04{case}}" + key[i + 1:] for i, ch in enumerate(key) for case in "xX"]
    texts = ['{"%s": {"ridgefill_tail": true}}' % k for k in keys]
    codecs = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
    return [text.encode(codec) for text in texts for codec in codecs]


def test_every_spelling_of_vllm_xargs_is_parsed_and_refused():
    """The pre-filter is sound: whatever the escape or encoding, json.loads finds the key, and so does the check."""
    bodies = spellings()
    assert len(bodies) == 21 * 8 and all(json.loads(b) == {"vllm_xargs": {"ridgefill_tail": True}} for b in bodies)
    for body in bodies:
        c = Client(body).run()
        assert c.status == 400 and c.error().startswith("ridgefill_tail=True is not valid"), body


def counted_parses(monkeypatch, delay: float = 0.0) -> dict:
    """Count the middleware's parses (its body_error calls) and the most running at once."""
    import threading
    import time

    from ridgefill.serve import guard as middleware

    original, lock, seen = middleware.body_error, threading.Lock(), {"calls": 0, "now": 0, "most": 0}

    def body_error(body, field):
        with lock:
            seen["calls"] += 1
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            time.sleep(delay)  # holds the parse open, so parses allowed at once overlap
            return original(body, field)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(middleware, "body_error", body_error)
    return seen


EMPTY_OBJECTS = b"[" + b",".join([b"{}"] * ((2 << 20) // 3)) + b"]"  # 2 MiB of [{},{},...]: ~48 MiB once parsed


@pytest.mark.parametrize("body", [
    EMPTY_OBJECTS, b'{"prompt": "hi", "max_tokens": 4}', b'{"x": ' + nested(255) + b"}",
    b'{"prompt": "' + b"[{" * 5_000 + b'", "n": "' + b"7" * 5_000 + b'"}',  # brackets and digits in strings
    b'{"n": 1' + b"0" * 4_299 + b"}",  # 4,300 digits: int() reads them
    json.dumps({"prompt": "w " * THREAD_PARSE, "extra": {"ridgefill_tail": True}}).encode(),
], ids=["empty-objects", "small", "nested-255", "in-strings", "4300-digits", "large"])
def test_a_body_that_cannot_set_an_option_or_break_the_parser_is_passed_on_unparsed(body, monkeypatch):
    seen = counted_parses(monkeypatch)
    assert Client(body).run().reached == body and seen["calls"] == 0


@pytest.mark.parametrize("body, message", [
    (b'{"x": ' + nested(257) + b"}", None),  # parsed (it nests over 256 deep) and passed on
    (b'{"x": ' + nested(5_000) + b"}", NESTED),
    (b'{"n": 1' + b"0" * 4_300 + b"}", "the request body holds an integer of over 4,300 digits"),
    ('{"vllm_xargs": {"ridgefill_tail": true}}'.encode("utf-16"), "ridgefill_tail=True is not valid"),
], ids=["nested-257", "nested-5000", "4301-digits", "utf-16"])
def test_a_body_the_parser_could_raise_on_is_parsed_without_xargs(body, message, monkeypatch):
    """What json.loads would raise on rather than answer (deep nesting, a huge integer), judged on the bytes, is
    still parsed and refused with one line; so is any body that is not UTF-8."""
    seen = counted_parses(monkeypatch)
    c = Client(body).run()
    assert seen["calls"] == 1
    assert (c.reached == body) if message is None else (c.status == 400 and c.error().startswith(message))


def test_the_2_mib_of_empty_objects_cost_no_parse():
    """What the pre-filter saves: the body's bytes are passed on without the ~48 MiB of objects a parse builds."""
    import tracemalloc

    c = Client(EMPTY_OBJECTS)
    tracemalloc.start()
    try:
        c.run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.reached == EMPTY_OBJECTS and peak < 4 * len(EMPTY_OBJECTS), peak  # a parse: ~25 times the body


def test_large_bodies_are_parsed_one_at_a_time_and_every_one_answered(monkeypatch):
    """Four large bodies that can set an option arrive at once: each is parsed, never two at once (the others wait
    their turn), and each gets its answer."""
    seen = counted_parses(monkeypatch, delay=0.2)
    bad = json.dumps({"prompt": "w " * THREAD_PARSE, "vllm_xargs": {"ridgefill_tail": True}}).encode()
    good = json.dumps({"prompt": "w " * THREAD_PARSE, "vllm_xargs": {"ridgefill_tail": 5}}).encode()
    clients = [Client(bad), Client(good), Client(bad), Client(good)]

    async def together():  # one middleware (one server) for all four
        apps = {id(c.scope): c.app for c in clients}
        middleware = RidgeFillRequestArgs(lambda scope, receive, send: apps[id(scope)](scope, receive, send),
                                          environ={})
        await asyncio.gather(*(middleware(c.scope, c.receive, c.send) for c in clients))

    asyncio.run(together())
    assert seen["calls"] == 4 and seen["most"] == 1
    assert [c.status for c in clients] == [400, 200, 400, 200] and [c.reached for c in clients] == [None, good] * 2


def test_the_check_refuses_what_the_client_wrote_and_replays_the_rest():
    ok = json.dumps({"prompt": "hi", "vllm_xargs": {"ridgefill_tail": 3, "other": [1, "a"]}}).encode()
    assert Client(ok).run().reached == ok  # passed on, the body unchanged
    assert Client([ok[:5], ok[5:9], ok[9:]]).run().reached == ok  # a streamed body, reassembled
    for xargs, match in [({"ridgefill_tail": True}, "ridgefill_tail=True is not valid"),
                         ({"ridgefill_keep_first": False}, "ridgefill_keep_first=False is not valid"),
                         ({"ridgefill_tail": 3.0}, "ridgefill_tail=3.0 is not valid"),
                         ({"ridgefill_tail": 2**64}, "ridgefill_tail=18446744073709551616 is not valid"),
                         ({"ridgefill_nope": 1}, "unknown RidgeFill request option 'ridgefill_nope'")]:
        c = Client(json.dumps({"prompt": "hi", "vllm_xargs": xargs}).encode()).run()
        assert c.status == 400 and c.reached is None and c.error().startswith(match)
        assert json.loads(c.answer)["error"]["type"] == "BadRequestError"
    huge = Client(b'{"vllm_xargs": {"ridgefill_tail": 1' + b"0" * 5000 + b"}}").run()  # past int()'s digit limit
    assert huge.status == 400 and huge.error() == ("the request body holds an integer of over 4,300 digits: send "
                                                   "integers of at most 2147483647 in RidgeFill's options")
    for body in (b"not json", b'{"vllm_xargs": [1]}', b'["ridgefill_tail"]', b'{"prompt": "ridgefill_tail"}',
                 b"\xff\xfe\x00", b'{"prompt": "\xff"}'):
        assert Client(body).run().reached == body and body_error(body) is None  # vLLM's to answer


def test_a_client_that_goes_away_is_passed_on_and_other_traffic_untouched():
    c = Client([b'{"prompt": ', b"..."], disconnect=True).run()
    assert c.reached == {"type": "http.disconnect"}  # vLLM sees the disconnect
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    for kind in ("lifespan", "websocket"):  # a websocket with the key goes on to vLLM, untouched
        asyncio.run(RidgeFillRequestArgs(app, environ={"VLLM_API_KEY": KEY})(
            {"type": kind, "path": "/v1/x", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}, None, None))
    assert seen == ["lifespan", "websocket"]
    assert hashlib.sha256(KEY.encode()).digest() in RidgeFillRequestArgs(app, environ={"VLLM_API_KEY": KEY}).tokens


def test_a_refusal_goes_out_through_vllms_cors_middleware_as_vllms_own_errors_do():
    """A browser page of an allowed origin can read the 400 and 413 (vLLM's 401 has no CORS headers: vLLM's key
    check runs outside its CORS middleware)."""
    cors_middleware = pytest.importorskip("starlette.middleware.cors")
    origin = {"Origin": "http://page.example"}
    for client, status in [(Client(BAD_XARGS, headers=origin), 400),
                           (Client(b"x", headers={**origin, "Content-Length": str(BODY_LIMIT + 1)}), 413),
                           (Client(BAD_XARGS, headers={"Origin": "http://other.example"}), 400)]:
        cors = cors_middleware.CORSMiddleware(client.app, allow_origins=["http://page.example"])
        client.run(app=cors)
        allowed = dict(client.sent[0]["headers"]).get(b"access-control-allow-origin")
        assert client.status == status and client.reached is None
        assert allowed == (b"http://page.example" if b"page" in client.scope["headers"][0][1] else None)
    alone = Client(BAD_XARGS, headers={"Origin": "http://page.example"}).run()  # no CORS middleware: no CORS headers
    assert [name for name, _ in alone.sent[0]["headers"]] == [b"content-length", b"content-type"]


def test_a_servers_refusal_in_many_lines_or_with_the_values_sent_goes_back_as_one_line():
    """vLLM's validation errors ("1 validation error:" then pydantic's dicts with the `input` sent): one line of the
    fields and problems, Content-Length updated; a one-line refusal and a 200 pass as they came."""
    vllms = {"error": {"message": "2 validation errors:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
                                  "'Input should be an object', 'input': \"['echo-me']\"}\n  {'type': 'x', 'loc': "
                                  "('body', 'prompt'), 'msg': \"it's bad\", 'input': 5}", "code": 400}}

    def answering(status: int, doc: dict):
        async def app(scope, receive, send):
            payload = json.dumps(doc).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-length", b"%d" % len(payload)), (b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
        return app

    c = Client(b"{}", headers=keyed()).run({"VLLM_API_KEY": KEY}, app=answering(400, vllms))
    assert c.error() == "2 validation errors: body: Input should be an object; body.prompt: it's bad"
    assert dict(c.sent[0]["headers"])[b"content-length"] == str(len(c.answer)).encode()
    media = {"error": {"message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                       "code": 400}}
    c = Client(b"{}", headers=keyed()).run({"VLLM_API_KEY": KEY}, app=answering(400, media))
    assert c.error() == "1 validation error: Unsupported Media Type: Only 'application/json' is allowed"
    plain = {"error": {"message": "prompt is too long", "code": 400}}
    assert json.loads(Client(b"{}", headers=keyed()).run({"VLLM_API_KEY": KEY}, app=answering(400, plain)).answer) \
        == plain
    ok = {"text": "a\nb 'input': x"}
    assert json.loads(Client(b"{}", headers=keyed()).run({"VLLM_API_KEY": KEY}, app=answering(200, ok)).answer) == ok

