"""The llama.cpp front's request checks (requests.py) and its admission (admission.py), without a model or a server:
what llama-server would answer with a 5xx, ignore or echo is one line and a 4xx naming the problem and its fix,
without the body's text; a good body passes as it came, with the served name as `model` when it gives none; a place
taken only once the whole body has come; a client that goes away has its request cancelled. Against a real
llama-server: test_llama_server.py and tests/serve/conformance."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from ridgefill.backends.llamacpp import admission, requests

MODEL = requests.Model(n_vocab=100, name="tiny")
JSON = b"application/json"
SECRET = "do-not-echo-7f3a"  # in every refused object: never in its message
CHAT = {"messages": [{"role": "user", "content": "x"}]}
C, P = "/v1/completions", {"prompt": "x"}
CC, TOK, DETOK = "/v1/chat/completions", "/tokenize", "/detokenize"
BODY = json.dumps(P).encode()
DEPTH = requests.GRAMMAR_DEPTH


def check(route: str, body, content_type: bytes | None = JSON, fill_on: bool = True) -> requests.Checked:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.check(data, content_type, route, MODEL, fill_on)


def refused(route: str, body, status: int = 400, **kw) -> str:
    """A refusal's message, checked: its status, one line, the problem then its fix, no path, none of the body."""
    checked = check(route, {**body, "user": SECRET} if isinstance(body, dict) else body, **kw)
    assert checked.error is not None and checked.status == status, checked
    assert "\n" not in checked.error and ".py" not in checked.error and SECRET not in checked.error
    assert ": " in checked.error
    return checked.error


NOT_JSON, NESTED, NOT_ID, EMPTY = "the request body is not JSON", "the request body's JSON nests too deeply", \
    "is not a token id of this model: give ids in 0..99", "the prompt is empty: send at least one"


@pytest.mark.parametrize("route, body, message", [
    (C, b"", NOT_JSON + " (at line 1 column 1): send a JSON object"), (C, b"\xff\xfe{}", NOT_JSON),
    ("/completion", b'{"prompt": "x"', NOT_JSON + " (at line 1 column 15)"), (TOK, b"null", "the request body is not"),
    (C, b"[" * 100_000 + b"]" * 100_000, NESTED + " to be read: send a flat object"),
    (CC, b'["x"]', "the request body is not a JSON object: send one"),
    (C, {"prompt": ""}, EMPTY + " character of text"), ("/completions", {"prompt": []}, EMPTY + " token id"),
    (C, {"prompt": ["a", ""]}, EMPTY + " character"), (C, {"prompt": ["a", []]}, EMPTY + " token id"),
    (C, {"prompt": [5, 100]}, "the prompt holds 100, not a token id of this model: give ids in 0..99"),
    ("/completion", {"prompt": [-1]}, "the prompt holds -1, not a token id"),
    (C, {"prompt": [1, "a", 200]}, "the prompt holds 200"), (C, {"prompt": ["a", [1, "b", -3]]}, "the prompt holds -3"),
    (C, {"prompt": [True]}, "the prompt is not a list of token ids: give integers"),
    (C, {"prompt": 5}, "the prompt is int: send text or a list of token ids"),
    (CC, {"messages": []}, "messages is empty: send at least one message"), (CC, {}, "messages is empty"),
    (C, {**P, "logit_bias": {"abc": 1}}, "logit_bias key 'abc' " + NOT_ID + " as keys"),
    (C, {**P, "logit_bias": {"-1": 1}}, "logit_bias key '-1' " + NOT_ID),
    (C, {**P, "logit_bias": {"100": 1}}, "logit_bias key '100' " + NOT_ID),
    (C, {**P, "logit_bias": {"٣": 1}}, "logit_bias key '٣' "),  # a digit, not ASCII
    (C, {**P, "logit_bias": [["abc", 1]]}, "logit_bias key 'abc' " + NOT_ID),
    (C, {**P, "logit_bias": [[-1, 1]]}, "logit_bias key -1 " + NOT_ID),
    (CC, {**CHAT, "logit_bias": [[100, 1]]}, "logit_bias key 100 " + NOT_ID),
    (C, {**P, "logit_bias": 5}, "logit_bias is not an object of token ids: give"),
    (C, {**P, "grammar": 5}, "grammar is not text: send a grammar in llama.cpp's GBNF"),
    (C, {**P, "grammar": "root ::= " + "(" * (DEPTH + 1) + '"a"' + ")" * (DEPTH + 1)},
     f"grammar: its groups nest {DEPTH + 1} deep, over the {DEPTH} this server parses"),
    (TOK, {}, "tokenize needs its text: send {\"content\": \"...\"}"), (TOK, {"content": 5}, "tokenize needs its"),
    (DETOK, {"tokens": [5, 100]}, "tokens holds 100, not a token id of this model: give ids in 0..99"),
    (DETOK, {"tokens": "x"}, "tokens is not a list of token ids: give integers"),
    *[(route, {"input": "x"}, "embeddings and reranking are not served by this server") for route in
      ("/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking")],
    (C, {**P, "ridgefill_tail": 0}, "ridgefill_tail=0 is not valid: give an integer in 1.."),
    (C, {**P, "ridgefill_tail": "4"}, "ridgefill_tail='4' is not valid"),
    (CC, {**CHAT, "ridgefill_keep_first": -1}, "ridgefill_keep_first=-1 is not valid: give an integer in 0.."),
    (C, {**P, "ridgefill_keep_first": True}, "ridgefill_keep_first=True is not valid"),
    (C, {**P, "ridgefill_tial": 4}, "unknown RidgeFill request option 'ridgefill_tial': use ridgefill_tail or "
     "ridgefill_keep_first"),
    (TOK, {"content": "x", "ridgefill_tail": 4}, "ridgefill_tail: only completions and chat completions take "
     "RidgeFill's options: drop it"),
    ("/apply-template", {**CHAT, "ridgefill_keep_first": 1}, "ridgefill_keep_first: only completions"),
])
def test_what_llama_server_would_fail_on_or_ignore_is_one_line_and_a_400(route, body, message):
    assert refused(route, body).startswith(message)


def test_options_with_the_fill_off_are_refused_not_ignored_and_a_value_is_shown_short():
    for route, body in ((C, P), (CC, CHAT)):
        assert refused(route, {**body, "ridgefill_tail": 4}, fill_on=False) == (
            "ridgefill_tail: this server runs without RidgeFill (its fill is off): drop it")
    assert check(C, P, fill_on=False).error is None
    message = refused(C, {**P, "logit_bias": {"a" * 1000: 1}})
    assert len(message) < 150 and "a" * requests.SHOWN not in message


def test_a_body_that_is_not_json_by_its_content_type_is_415_without_its_text():
    for content_type in (b"text/plain; charset=utf-8", b"application/x-www-form-urlencoded", b"\xff\xfe"):
        message = refused(C, P, 415, content_type=content_type)
        assert message.endswith("not JSON: send the body as JSON with Content-Type: application/json")
    assert refused(C, P, 415, content_type=b"text/plain").startswith("the request's Content-Type is 'text/plain'")
    for content_type in (None, b"", b"Application/JSON; charset=utf-8", b"application/vnd.x+json"):
        assert check(C, P, content_type).error is None  # none given: read as JSON, as llama-server does


@pytest.mark.parametrize("route, body", [
    (C, {**P, "temperature": 0, "ridgefill_tail": 4, "ridgefill_keep_first": 0}),
    ("/completion", {"prompt": [1, 99], "logit_bias": {"99": -1}, "grammar": 'root ::= "a"'}),
    ("/completions", {"prompt": ["a", [1, "b", 2]], "logit_bias": [[0, 1], [99, False]]}),
    (C, {"prompt": [1, "a"]}),  # llama-server's mixed prompt
    (C, {**P, "grammar": "root ::= " + "(" * DEPTH + '"a"' + ")" * DEPTH + ' "(((" [(((]'}),  # quoted: no groups
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "prompt": ""}),
    (CC, {**CHAT, "ridgefill_tail": 1, "logit_bias": {"7": 2}}),
    ("/chat/completions", {**CHAT, "model": "mine"}),
])
def test_a_good_body_passes_unchanged_but_for_the_served_name(route, body):
    data = json.dumps(body).encode()
    checked = requests.check(data, JSON, route, MODEL, True)
    assert checked.error is None and checked.options == {k: v for k, v in body.items() if k.startswith("ridgefill_")}
    assert checked.body == data if "model" in body else json.loads(checked.body) == {**body, "model": "tiny"}
    assert json.loads(check(route, {**body, "model": None}).body)["model"] == "tiny"


def test_other_routes_pass_as_they_came():
    for route, body in (("/tokenize", {"content": "x y"}), ("/detokenize", {"tokens": [0, 99]}),
                        ("/apply-template", CHAT), ("/detokenize", {})):
        data = json.dumps(body).encode()
        assert requests.check(data, JSON, route, MODEL, True).body == data
    unknown = requests.Model(n_vocab=0, name="tiny")  # a vocabulary not known: ids not checked
    assert requests.check(b'{"tokens": [123456]}', JSON, "/detokenize", unknown, True).error is None


@pytest.mark.parametrize("route, body, named", [  # llama-server (0.3.36's vendored llama.cpp) answers each with a 500
    (C, {}, "prompt"),  # oaicompat_completion_params_parse: "\"prompt\" is required"
    ("/completion", {"prompt": None}, "prompt"),  # tokenize_input_subprompt: "\"prompt\" elements must be ..."
    (C, {"prompt": ["a", None]}, "prompt"),
    ("/tokenize", {"content": [5, 100], "with_pieces": True}, "100"),  # token_to_piece: vector::_M_range_check
])
def test_what_llama_server_answers_with_a_500_is_refused_here(route, body, named):
    assert named in refused(route, body)


def test_a_mixed_prompt_that_starts_with_text_is_one_prompt():  # llama-server's tokenize_input_prompts
    assert check(C, {"prompt": ["a", 5]}).error is None
    assert refused(C, {"prompt": ["a", 200]}).startswith("the prompt holds 200")


def test_one_line_keeps_the_first_line_without_local_paths():
    text = "\n  failed to open /home/user/x/model.gguf: No such file\n  at /usr/lib/libllama.so line 3\n"
    assert requests.one_line(text) == "failed to open <path>: No such file"
    assert requests.one_line("error in ./models/tiny.gguf") == "error in .<path>"
    assert requests.one_line("") == "" and requests.one_line("plain words") == "plain words"
    long = requests.one_line("x" * 1000 + "\nsecond")
    assert len(long) == requests.LONGEST and long.endswith("...")


def test_the_served_name_is_never_a_path(tmp_path):
    from ridgefill.backends.serving import served_name

    assert [served_name(n) for n in ("smollm2-135m", "Org/Model-1B")] == ["smollm2-135m", "Org/Model-1B"]
    assert served_name("/models/tiny-llama.gguf") == "tiny-llama" and served_name("rel/dir/m.gguf") == "m"
    (tmp_path / "llama").mkdir()
    assert served_name(str(tmp_path / "llama")) == "llama" and served_name(f"{tmp_path}/llama/") == "llama"


# --- admission -----------------------------------------------------------------------------------------------------
class Client:
    """A connection: its body's chunks (the last withheld until `release`), then waits or goes away at `gone`."""

    def __init__(self, chunks: list[bytes], release: asyncio.Event | None = None, gone: asyncio.Event | None = None):
        self.chunks, self.release, self.gone, self.sent = list(chunks), release, gone, []

    async def receive(self) -> dict:
        if len(self.chunks) == 1 and self.release is not None:
            await self.release.wait()
        if self.chunks:
            return {"type": "http.request", "body": self.chunks.pop(0), "more_body": len(self.chunks) > 0}
        await (self.gone.wait() if self.gone else asyncio.sleep(3600))
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def error(self) -> tuple[int, dict, str]:
        start, body = self.sent
        doc = json.loads(body["body"])["error"]
        assert doc["code"] == start["status"] and "\n" not in doc["message"]
        return start["status"], dict(start["headers"]), doc["message"]


def in_a_loop(test):
    return functools.wraps(test)(lambda: asyncio.run(test()))


def scope(path: str = C, method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "headers": [(b"content-type", JSON)]}


class Inner:
    """The proxy's stand-in: each request's (method, body, places taken); held till `hold` is set; cancels counted."""

    def __init__(self, queue: admission.Queue, hold: bool) -> None:
        self.queue, self.reached, self.cancelled, self.hold = queue, [], 0, asyncio.Event() if hold else None

    async def __call__(self, scope, receive, send) -> None:
        self.reached.append((scope["method"], (await receive()).get("body"), self.queue.active))
        try:
            if self.hold is not None and scope["path"] not in admission.OPEN_PATHS:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def front(bound: int = 3, limit: int = 1000, hold: bool = False):
    inner = Inner(admission.Queue(bound), hold)
    return admission.Admission(inner, inner.queue, True, MODEL, limit=limit), inner.queue, inner


@in_a_loop
async def test_a_place_is_taken_only_once_the_whole_body_has_come_for_every_method():
    methods = ("POST", "GET", "OPTIONS", "PUT", "DELETE")
    middleware, queue, inner = front(bound=len(methods) + 1)
    release = asyncio.Event()
    slow = [asyncio.ensure_future(middleware(scope(C if m == "POST" else "/v1/models", m),
                                             Client([b'{"prompt": ', b'"x"}'], release).receive, Client([]).send))
            for m in methods]
    await asyncio.sleep(0.05)
    assert queue.active == 0 and not inner.reached  # bodies unfinished: no place taken
    whole = Client([BODY])
    await middleware(scope(), whole.receive, whole.send)
    assert whole.sent[0]["status"] == 200 and inner.reached == [("POST", b'{"prompt": "x", "model": "tiny"}', 1)]
    release.set()
    await asyncio.gather(*slow)
    assert queue.active == 0 and sorted(r[0] for r in inner.reached[1:]) == sorted(methods)
    assert all(r[1] == b'{"prompt": "x"}' for r in inner.reached[1:] if r[0] != "POST")  # not checked: as it came


@in_a_loop
async def test_a_body_past_the_limit_is_413_and_the_connection_closed():
    middleware, queue, inner = front(limit=1000)
    over = Client([b"x" * 600, b"x" * 600, b"never read"])
    await middleware(scope("/v1/models", "GET"), over.receive, over.send)
    status, headers, message = over.error()
    assert status == 413 and headers[b"connection"] == b"close" and over.chunks == [b"never read"]
    assert message == "the request body is over 1,000 bytes, the most this server reads: send a shorter request"
    at = Client([b"x" * 1000])  # exactly the limit: read
    await middleware(scope("/v1/models", "PUT"), at.receive, at.send)
    assert len(inner.reached) == 1 and at.sent[0]["status"] == 200 and queue.active == 0


@in_a_loop
async def test_past_the_bound_a_503_with_retry_after_and_open_routes_are_not_admitted():
    middleware, queue, inner = front(bound=1, hold=True)
    first = asyncio.ensure_future(middleware(scope(), Client([BODY]).receive, Client([]).send))
    await asyncio.sleep(0.05)
    busy = Client([BODY])
    await middleware(scope(), busy.receive, busy.send)
    status, headers, message = busy.error()
    assert status == 503 and headers[b"retry-after"] == b"1" and queue.active == 1
    assert message.startswith("the server is busy: 1 requests are running or waiting") and "retry after" in message
    bad = Client([b'{"prompt": ""}'])  # checked before the bound: its own 400
    await middleware(scope(), bad.receive, bad.send)
    assert bad.error()[0] == 400
    for path in admission.OPEN_PATHS:  # not admitted: the inner app reads the body, no place, never a 503
        client = Client([b""])
        await middleware(scope(path, "GET"), client.receive, client.send)
        assert client.sent[0]["status"] == 200 and inner.reached[-1] == ("GET", b"", 1)
    inner.hold.set()
    await first
    assert queue.active == 0 and len(inner.reached) == 3


@in_a_loop
async def test_a_client_that_goes_away_has_its_request_cancelled_and_its_place_freed_at_once():
    middleware, queue, inner = front(bound=2, hold=True)  # a stream from llama-server that would not end
    leave = asyncio.Event()
    client = Client([BODY], gone=leave)
    task = asyncio.ensure_future(middleware(scope(), client.receive, client.send))
    await asyncio.sleep(0.05)
    assert queue.active == 1 and inner.cancelled == 0
    leave.set()
    await asyncio.wait_for(task, 1)  # no CancelledError out of the front
    assert inner.cancelled == 1 and queue.active == 0 and client.sent == []
    assert asyncio.all_tasks() == {asyncio.current_task()}  # its watcher gone too
    messages = [{"type": "http.request", "body": b'{"prompt":', "more_body": True}, {"type": "http.disconnect"}]
    early = Client([])  # gone before its body ended: nothing admitted, nothing answered
    await asyncio.wait_for(middleware(scope(), lambda: asyncio.sleep(0, messages.pop(0)), early.send), 1)
    assert len(inner.reached) == 1 and queue.active == 0 and early.sent == []


@in_a_loop
async def test_a_front_cancelled_from_outside_cancels_its_request_too():
    """uvicorn cancels the requests still running GRACE_S after SIGTERM (timeout_graceful_shutdown): the inner task
    (the request to llama-server) must not outlive the place Admission frees."""
    middleware, queue, inner = front(hold=True)
    task = asyncio.ensure_future(middleware(scope(), Client([BODY]).receive, Client([]).send))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.01)
    assert queue.active == 0 and inner.cancelled == 1, "the inner task runs on, its place freed"

