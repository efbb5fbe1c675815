"""RidgeFill's request options checked in the JSON a client sent, before vLLM's request models read it (an ASGI
middleware `ridgefill serve` installs with vLLM's --middleware; no vLLM import).

vLLM's admission check (serve/vllm_admission.py) sees `vllm_xargs` after pydantic has coerced it: a JSON `true`
has become the integer 1 there. This middleware reads the body of every POST whose JSON carries `vllm_xargs` and
answers 400 in vLLM's error format for a bad `ridgefill_*` key (vllm_requests.check_request_args on the values as
the client wrote them), so `{"ridgefill_tail": true}` is refused like any other non-integer. Everything else is
passed on, the body replayed unchanged.
"""

from __future__ import annotations

import json

from ridgefill.serve.vllm_requests import PREFIX, check_request_args


def body_error(body: bytes) -> str | None:
    """The one-line refusal of a request body's RidgeFill options, or None (also for a body that is no JSON object:
    vLLM answers that itself)."""
    if PREFIX.encode() not in body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    extra = doc.get("vllm_xargs") if isinstance(doc, dict) else None
    if not isinstance(extra, dict):
        return None
    try:
        check_request_args(extra)
    except ValueError as exc:
        return str(exc)
    return None


class RidgeFillRequestArgs:
    """Pure ASGI middleware: refuses (400) a POST whose `vllm_xargs` holds a bad RidgeFill option."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more, first = [], True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                first = message
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        error = None if first is not None else body_error(body)
        if error is not None:
            await _refuse(send, error)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
