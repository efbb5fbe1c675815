"""The llama.cpp front's admission (app.py's `Admission`, pure ASGI middleware around the proxy to llama-server). A
request to a model route (every route but /health and /metrics) is admitted once its whole body has come within
BODY_LIMIT and passed its checks (requests.py); at most `Queue.bound` at once (llama-server runs `--parallel` of them,
the rest wait in its queue); past that a 503 with Retry-After. A client that goes away has its request cancelled:
the proxy's request to llama-server closes, and llama-server stops the request's work (prefill or generation) and
frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from ridgefill.backends.llamacpp import requests

OPEN_PATHS = ("/health", "/metrics")  # the routes that are not admitted (every other one is)
# the most bytes of a body Admission reads (the guard's bound when it is mounted: RIDGEFILL_MAX_REQUEST_BYTES raises
# both; the stock server has no guard)
BODY_LIMIT = 8 << 20
BODY_LIMIT_ENV = "RIDGEFILL_MAX_REQUEST_BYTES"
RETRY_AFTER_S = 1  # what a 503 asks the client to wait
ADMITTED = "ridgefill_admitted_requests"  # the gauge of the requests admitted now


@dataclass
class Queue:
    """The requests admitted for the model (Admission's), at most `bound`: a gauge on /metrics."""

    bound: int
    active: int = 0

    def text(self) -> str:
        return (f"# HELP {ADMITTED} Requests running or waiting for the model (at most {self.bound})\n"
                f"# TYPE {ADMITTED} gauge\n{ADMITTED} {self.active}\n")


def body_limit() -> int:
    """Admission's bound on a body: BODY_LIMIT, or RIDGEFILL_MAX_REQUEST_BYTES when it sets more (the guard, when
    mounted, refuses a bad value before the server starts and bounds the body first)."""
    text = os.environ.get(BODY_LIMIT_ENV, "").strip()
    return max(BODY_LIMIT, int(text)) if text.isdigit() else BODY_LIMIT


class Admission:
    """Pure ASGI middleware around the proxy: a model route's request admitted once its whole body has come (within
    `limit`) and passed its checks (requests.check), at most `queue.bound` at once; and its client's going away
    (module docstring)."""

    def __init__(self, app, queue: Queue, fill_on: bool, model: requests.Model, limit: int = BODY_LIMIT) -> None:
        self.app, self.queue, self.fill_on, self.model, self.limit = app, queue, fill_on, model, limit

    async def __call__(self, scope, receive, send) -> None:
        path, queue = scope.get("path", ""), self.queue
        if scope.get("type") != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive, self.limit)
        if body is None:  # the client went away before its body ended
            return
        if body is TOO_LARGE:
            await answer(send, 413, f"the request body is over {self.limit:,} bytes, the most this server reads: "
                         "send a shorter request", [(b"connection", b"close")])
            return
        if scope.get("method") == "POST" and path in requests.ROUTES:
            checked = requests.check(body, header(scope, b"content-type"), path, self.model, self.fill_on)
            if checked.error is not None:
                await answer(send, checked.status, checked.error)
                return
            body = checked.body
        if queue.active >= queue.bound:
            await answer(send, 503, f"the server is busy: {queue.bound} requests are running or waiting for the "
                         f"model (the most it admits); retry after {RETRY_AFTER_S} s",
                         [(b"retry-after", b"%d" % RETRY_AFTER_S)])
            return
        queue.active += 1
        try:
            await self.admitted(scope, receive, send, body)
        finally:
            queue.active -= 1

    async def admitted(self, scope, receive, send, body: bytes) -> None:
        """The request run with its body replayed; cancelled when its client goes away (its request to llama-server
        closes: llama-server stops its work)."""
        gone = asyncio.Event()
        replay = replayed_until(body, gone)

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        task = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise
        finally:
            watcher.cancel()
            if not task.done():  # this call itself cancelled (uvicorn's graceful shutdown): its request goes too
                task.cancel()


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
