"""The llama.cpp server's request checks (requests.py) and its admission (admission.py) without a model: what would
end the process or be a 500 is one line and a 4xx; a body rewritten only where llama-cpp-python's default differs
(repeat_penalty, model); a place taken only once the whole body has come; a request holding the model lock never
cancelled under its worker thread. The same against a real server: tests/serve/conformance."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("llama_cpp.server.types")

from ridgefill.backends.llamacpp import admission, requests  # noqa: E402

MODEL = requests.Model(n_vocab=100, parses=lambda text: text.count("(") == text.count(")"), name="tiny")
JSON = b"application/json"


def check(route: str, body, content_type: bytes | None = JSON, fill_on: bool = True) -> requests.Checked:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.check(data, content_type, route, MODEL, fill_on)


@pytest.mark.parametrize("route, body, status, message", [
    ("/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs are not served"),
    ("/v1/completions", {"prompt": "x", "logprobs": False}, 400, "logprobs are not served"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}, 400,
     "logprobs are not served"),
    ("/v1/completions", {"prompt": ""}, 400, "the prompt is empty"),
    ("/v1/completions", {"prompt": []}, 400, "the prompt is empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "the prompt is a list of 2 prompts"),
    ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n=3: this server answers one choice per request"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of=2"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages is empty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias key 'abc' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100": 1}}, 400, "logit_bias key '100' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias key '-1'"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 40}, 400, "seed=1099511627776 is not valid"),
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= ("a"'}, 400,
     "grammar: llama.cpp's parser does not take it"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= " + "(" * 65 + '"a"' + ")" * 65}, 400,
     "grammar: its groups nest 65 deep"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object", "schema": {"$ref": "#/nope"}}}, 400,
     "response_format.schema cannot be turned into a grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice names 'f', which is not among tools"),
    ("/extras/detokenize", {"tokens": [5, 100]}, 400, "tokens holds 100, not a token id of this model"),
    ("/extras/detokenize", {"tokens": [-1]}, 400, "tokens holds -1"),
    ("/extras/tokenize", {}, 400, "input: Field required"),
    ("/v1/embeddings", {"input": "x"}, 400, "embeddings are not served"),
    ("/v1/completions", b"", 400, "the request body is not JSON"),
    ("/v1/completions", b'["x"]', 400, "the request body is not a JSON object"),
    ("/extras/tokenize", {"input": "x", "ridgefill_tail": 4}, 400, "ridgefill_tail: only completions"),
])
def test_what_llama_cpp_python_would_fail_on_is_one_line_and_a_4xx(route, body, status, message):
    checked = check(route, body)
    assert checked.status == status and checked.error.startswith(message), checked
    assert "\n" not in checked.error and ".py" not in checked.error


def test_a_body_that_is_not_json_by_its_content_type_is_415_without_its_text():
    checked = check("/v1/completions", {"prompt": "secret text"}, b"text/plain; charset=utf-8")
    assert checked.status == 415 and "secret" not in checked.error
    assert checked.error.startswith("the request's Content-Type is 'text/plain', not JSON")
    assert check("/v1/completions", {"prompt": "x"}, None).error is None  # none given: read as JSON
    assert check("/v1/completions", {"prompt": "x"}, b"application/vnd.x+json").error is None


def test_a_good_body_gets_no_repeat_penalty_and_the_served_name_unless_it_says_otherwise():
    checked = check("/v1/completions", {"prompt": "x", "temperature": 0, "ridgefill_tail": 4})
    assert checked.error is None and checked.options == {"ridgefill_tail": 4}
    assert json.loads(checked.body) == {"prompt": "x", "temperature": 0, "ridgefill_tail": 4, "repeat_penalty": 1.0,
                                        "model": "tiny"}
    own = check("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repeat_penalty": 1.3,
                                         "model": "m", "logprobs": False, "n": 1, "logit_bias": {"7": 2}})
    assert own.error is None and json.loads(own.body)["repeat_penalty"] == 1.3 and json.loads(own.body)["model"] == "m"
    tokens = check("/v1/completions", {"prompt": "x", "logit_bias": {"any text": 2}, "logit_bias_type": "tokens"})
    assert tokens.error is None
    assert check("/v1/completions", {"prompt": "x", "ridgefill_tail": 4}, fill_on=False).error.startswith(
        "ridgefill_tail: this server runs without RidgeFill")


def test_the_served_name_is_never_a_path(tmp_path):
    from ridgefill.backends.serving import served_name

    assert served_name("smollm2-135m") == "smollm2-135m" and served_name("HuggingFaceTB/SmolLM2-135M") == \
        "HuggingFaceTB/SmolLM2-135M"  # an alias and a Hub id are names
    assert served_name("/models/tiny-llama.gguf") == "tiny-llama"
    assert served_name("rel/dir/m.gguf") == "m" and served_name("m.gguf") == "m"
    (tmp_path / "llama").mkdir()
    assert served_name(str(tmp_path / "llama")) == "llama" and served_name(f"{tmp_path}/llama/") == "llama"


# --- admission -----------------------------------------------------------------------------------------------------
class Client:
    """A connection's messages, the last one withheld until `release` is set (None: they all come)."""

    def __init__(self, chunks: list[bytes], release: asyncio.Event | None = None, gone_after: bool = False) -> None:
        self.chunks, self.release, self.gone_after, self.sent = list(chunks), release, gone_after, []

    async def receive(self) -> dict:
        if len(self.chunks) == 1 and self.release is not None:
            await self.release.wait()
        if self.chunks:
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}
        if self.gone_after:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def scope(path: str = "/v1/completions", method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "headers": [(b"content-type", JSON)]}


def test_a_place_is_taken_only_once_the_whole_body_has_come_for_every_method():
    async def run():
        queue = admission.Queue(3)
        reached = []

        async def app(scope, receive, send):
            reached.append((scope["method"], (await receive())["body"], queue.active))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        middleware = admission.Admission(app, queue, True, MODEL, limit=1000)
        release = asyncio.Event()
        body = json.dumps({"prompt": "x"}).encode()
        slow = [asyncio.ensure_future(middleware(scope(path, method), Client([b'{"prompt": ', b'"x"}'],
                                                                             release).receive, Client([]).send))
                for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET"),
                                     ("/v1/completions", "OPTIONS"))]
        await asyncio.sleep(0.05)
        assert queue.active == 0  # three bodies unfinished: no place taken
        whole = Client([body])
        await middleware(scope(), whole.receive, whole.send)
        assert whole.sent[0]["status"] == 200 and reached[-1][2] == 1  # admitted alone
        over = Client([b"x" * 600, b"x" * 600])
        await middleware(scope("/v1/models", "GET"), over.receive, over.send)
        assert over.sent[0]["status"] == 413 and (b"connection", b"close") in over.sent[0]["headers"]
        release.set()
        await asyncio.gather(*slow)
        assert queue.active == 0 and sorted(r[0] for r in reached[1:]) == ["GET", "OPTIONS", "POST"]

    asyncio.run(run())


def test_a_client_gone_from_a_request_on_the_model_is_waited_for_and_one_still_waiting_is_cancelled():
    """A request that holds the model lock (its worker thread running) is told to stop and its place is held until
    it ends, never cancelled; one still waiting for the lock is cancelled at once and frees its place."""
    async def run():
        queue = admission.Queue(2)
        worker_done, lock = threading.Event(), asyncio.Lock()
        states = []

        async def app(scope, receive, send):
            await receive()
            state = admission.REQUEST.get()
            states.append(state)
            async with lock:  # llama-cpp-python's model lock, as hold_the_model_lock marks its holder
                state.on_model = True
                await asyncio.to_thread(lambda: (state.gone.wait(10), worker_done.set()))

        middleware = admission.Admission(app, queue, True, MODEL)
        body = json.dumps({"prompt": "x"}).encode()
        leave_first, leave_second = asyncio.Event(), asyncio.Event()
        running = asyncio.ensure_future(middleware(scope(), admission.replayed_until(body, leave_first), Client([]).send))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(middleware(scope(), admission.replayed_until(body, leave_second), Client([]).send))
        await asyncio.sleep(0.05)
        assert queue.active == 2
        leave_second.set()  # the waiting client goes: cancelled, its place free at once
        await asyncio.wait_for(waiting, 5)
        assert queue.active == 1 and not worker_done.is_set()
        leave_first.set()  # the running client goes: its worker told to stop, its place held until it returned
        await asyncio.wait_for(running, 5)
        assert worker_done.is_set() and states[0].gone.is_set() and queue.active == 0

    asyncio.run(run())
