"""The llama.cpp server's admission (app.py's `Admission`, pure ASGI middleware around llama-cpp-python's app): one
model, one context. A request to a model route is admitted once its whole body has come within BODY_LIMIT and passed
its checks (requests.py); at most `Queue.bound` at once, one running and the rest waiting for llama-cpp-python's model
lock; past that a 503 with Retry-After. Each admitted request has a RequestState its worker thread reads (REQUEST): its
RidgeFill options, its own stop flag, whether it holds the model lock. A client that goes away while its request waits
for the model frees its place at once (the request cancelled: nothing runs for it); one whose request holds the lock
stops it (the driver's prefill before its next llama_decode, the generation before its next token) and its place and
the lock are held until the request has ended, its worker thread returned: a cancel there got past anyio's wait for
the thread and the next request ran on the context beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import threading
from dataclasses import dataclass, field

from ridgefill.backends.llamacpp import requests

MODEL_PATHS = ("/v1/", "/extras/")  # the routes that wait for the model (llama-cpp-python's lock): admitted
# the most bytes of a body Admission reads (the guard's bound when it is mounted: RIDGEFILL_MAX_REQUEST_BYTES raises
# both; the stock server has no guard)
BODY_LIMIT = 8 << 20
BODY_LIMIT_ENV = "RIDGEFILL_MAX_REQUEST_BYTES"
RETRY_AFTER_S = 1  # what a 503 asks the client to wait
ADMITTED = "ridgefill_admitted_requests"  # the gauge of the requests admitted now


@dataclass
class RequestState:
    """A request as the Llama sees it in its worker thread: RidgeFill's options the client gave, whether it went away
    (set by Admission: its prefill stops before its next llama_decode, its generation before its next token), and
    whether it holds llama-cpp-python's model lock (set on the event loop as it takes it: from then on Admission waits
    for the request to end instead of cancelling it)."""

    options: dict = field(default_factory=dict)
    gone: threading.Event = field(default_factory=threading.Event)
    on_model: bool = False

    __hash__ = object.__hash__  # (a set's member, by identity)


REQUEST: contextvars.ContextVar[RequestState] = contextvars.ContextVar("ridgefill_request")


def stop_requested() -> bool:
    """The driver's stop flag: whether the client of the request this thread runs went away (per request: a context
    variable, never a field the next request overwrites)."""
    state = REQUEST.get(None)
    return state is not None and state.gone.is_set()


@dataclass
class Queue:
    """The requests admitted for the model (Admission's), at most `bound`: a gauge on /metrics."""

    bound: int
    active: int = 0
    running: set = field(default_factory=set)  # the RequestStates admitted now (SIGTERM stops each)

    def text(self) -> str:
        return (f"# HELP {ADMITTED} Requests running or waiting for the model (at most {self.bound})\n"
                f"# TYPE {ADMITTED} gauge\n{ADMITTED} {self.active}\n")


def hold_the_model_lock(lapp) -> None:
    """llama-cpp-python's model lock (get_llama_proxy, as its completion routes take it), marking the request that
    holds it (RequestState.on_model, set on the event loop as the lock is taken): Admission never cancels such a
    request, whose worker thread may be running on the context (a cancel got past anyio's wait for the thread and
    released the lock under it)."""
    taken = lapp.get_llama_proxy

    async def get_llama_proxy():
        async with contextlib.asynccontextmanager(taken)() as proxy:
            state = REQUEST.get(None)
            if state is not None:
                state.on_model = True
            yield proxy

    lapp.get_llama_proxy = get_llama_proxy


def body_limit() -> int:
    """Admission's bound on a body: BODY_LIMIT, or RIDGEFILL_MAX_REQUEST_BYTES when it sets more (the guard, when
    mounted, refuses a bad value before the server starts and bounds the body first)."""
    text = os.environ.get(BODY_LIMIT_ENV, "").strip()
    return max(BODY_LIMIT, int(text)) if text.isdigit() else BODY_LIMIT


class Admission:
    """Pure ASGI middleware around llama-cpp-python's app: a model route's request admitted once its whole body has
    come (within `limit`) and passed its checks (requests.check), at most `queue.bound` at once; its RequestState; and
    its client's going away (module docstring)."""

    def __init__(self, app, queue: Queue, fill_on: bool, model: requests.Model, limit: int = BODY_LIMIT) -> None:
        self.app, self.queue, self.fill_on, self.model, self.limit = app, queue, fill_on, model, limit

    async def __call__(self, scope, receive, send) -> None:
        path, queue = scope.get("path", ""), self.queue
        if scope.get("type") != "http" or not path.startswith(MODEL_PATHS):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive, self.limit)
        if body is None:  # the client went away before its body ended
            return
        if body is TOO_LARGE:
            await answer(send, 413, f"the request body is over {self.limit:,} bytes, the most this server reads: "
                         "send a shorter request", [(b"connection", b"close")])
            return
        state = RequestState()
        if scope.get("method") == "POST" and path in requests.ROUTES:
            checked = requests.check(body, header(scope, b"content-type"), path, self.model, self.fill_on)
            if checked.error is not None:
                await answer(send, checked.status, checked.error)
                return
            state.options, body = checked.options or {}, checked.body
        if queue.active >= queue.bound:
            await answer(send, 503, f"the server is busy: {queue.bound} requests are running or waiting for the "
                         f"model (the most it admits); retry after {RETRY_AFTER_S} s",
                         [(b"retry-after", b"%d" % RETRY_AFTER_S)])
            return
        queue.active += 1
        queue.running.add(state)
        try:
            await self.admitted(scope, receive, send, body, state)
        finally:
            queue.active -= 1
            queue.running.discard(state)

    async def admitted(self, scope, receive, send, body: bytes, state: RequestState) -> None:
        """The request run with its body replayed; when its client goes away: cancelled while it waits for the model,
        else stopped (state.gone) and waited for until it ends (its worker thread returned)."""
        gone = asyncio.Event()
        replay = replayed_until(body, gone)

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            state.gone.set()
            gone.set()

        token = REQUEST.set(state)
        try:
            task = asyncio.ensure_future(self.app(scope, replay, send))
        finally:
            REQUEST.reset(token)
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not state.on_model:  # gone while waiting for the model: nothing runs for it
                task.cancel()
            try:
                await task  # on the model: it stops at its next step; its place and the lock held until it ends
            except asyncio.CancelledError:
                if not state.gone.is_set():
                    raise
        finally:
            watcher.cancel()


TOO_LARGE = object()  # read_body's answer for a body over its bound


async def read_body(receive, limit: int):
    """The whole body; TOO_LARGE once it passes `limit` bytes (nothing more is read: the connection is closed after
    the 413); None when the client went away before it ended."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope, name: bytes) -> bytes | None:
    """A request header's first value, or None."""
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


async def answer(send, status: int, message: str, headers: list = ()) -> None:
    """An error in the OpenAI format (message, type, param, code), one line."""
    from http import HTTPStatus

    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


def replayed_until(body: bytes, gone: asyncio.Event):
    """An ASGI receive that gives the whole `body` once, then the client's going away once `gone` is set."""
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive
