"""A server's own refusals made one line (the request guard, serve/guard.py, passes each response of the server
through `one_line_errors`): a 4xx JSON error in the OpenAI format whose message spans lines or holds the `input` the
client sent (FastAPI's validation errors as some servers word them: "1 validation error:" and then each error as
pydantic's dict, the value sent in it) goes out as one line naming each field and its problem, without the values.
Engine-neutral: it reads only the error format every server answers in."""

from __future__ import annotations

import json
import re

# A server's own refusal in many lines (FastAPI's validation errors as some word them: "1 validation error:" then
# one line per error, each pydantic's dict with the `input` the client sent): one line of its errors' fields and
# problems, without the values sent
LOC = re.compile(r"""'loc': (?:'([^']*)'|\(([^)]*)\))""")
MSG = re.compile(r"""'msg': (?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")""")
ERROR_BODY = 1 << 16  # the most bytes of an error body rewritten (a larger one goes out as it came)


def one_line(message: str) -> str:
    """A server's refusal as one line: its first line, then each error's field and problem (pydantic's dicts, their
    `input` left out), at most three."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["the request was refused"]
    parts = []
    for line in lines:
        loc, msg = LOC.search(line), MSG.search(line)
        if loc and msg:
            where = loc.group(1) or ".".join(p.strip().strip("'\"") for p in loc.group(2).split(",") if p.strip())
            parts.append(f"{where or 'the body'}: {msg.group(1) or msg.group(2)}")
    if not parts:  # lines of its own: the first, then the rest (at most three), each without a value sent
        rest = [line.split(", 'input':")[0] for line in lines[1:4]]
        return f"{lines[0].rstrip(':')}: {'; '.join(rest)}" if rest else lines[0].split(", 'input':")[0]
    head = lines[0].rstrip(":") if not LOC.search(lines[0]) else "the request is not valid"
    return f"{head}: {'; '.join(parts[:3])}"


def one_line_errors(send):
    """`send`, with a server's 4xx JSON refusal whose message spans lines or holds the `input` the client sent
    rewritten by one_line (its Content-Length updated); every other message passed on as it comes."""
    held: dict | None = None
    chunks: list[bytes] = []

    async def wrapped(message) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and 400 <= message.get("status", 200) < 500 and \
                b"json" in (dict(message.get("headers", [])).get(b"content-type") or b""):
            held = message
            return
        if held is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False) and sum(map(len, chunks)) <= ERROR_BODY:
            return
        start, body, more = held, b"".join(chunks), message.get("more_body", False)
        held = None
        chunks.clear()
        body = body if more else rewritten(body)
        headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                   for k, v in start.get("headers", [])]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": more})

    return wrapped


def rewritten(body: bytes) -> bytes:
    """An error body in the OpenAI format with its message made one line (one_line), or the body as it was."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or ("\n" not in message and "'input':" not in message):
        return body
    error["message"] = one_line(message)
    return json.dumps(doc).encode()
