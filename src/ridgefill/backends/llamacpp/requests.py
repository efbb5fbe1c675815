"""The llama.cpp front's checks of a request before llama-server reads it (app.py's Admission runs them once the whole
body has come): what llama-server would answer with a 5xx, silently ignore or echo is one line and a 4xx here. The
body must be a JSON object sent as JSON (llama-server reads a text/plain body as JSON and answers it, malformed JSON
with a 500); RidgeFill's own options are checked (backends/serving.check_request_args; with the fill off refused,
not ignored, and only on generating routes); token ids outside the vocabulary are refused where llama-server would
ignore them (`logit_bias` keys) or fail on them (/detokenize: a 500 naming a C++ range check); an empty prompt, a
tokenize without its text and a grammar nested past what llama.cpp's recursive parser is safe with are refused;
embeddings and reranking are not served (a generation server whose prompts are filled). A body that passes is sent
on as it came, with the served name as `model` when it gives none. Every message from llama-server is made one line
(`one_line`) before a client sees it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ridgefill.backends.serving import PREFIX, check_request_args

GENERATE, CHAT, TOKENIZE, DETOKENIZE, OTHER, REFUSED = "generate", "chat", "tokenize", "detokenize", "other", "refused"
ROUTES = {"/completion": GENERATE, "/completions": GENERATE, "/v1/completions": GENERATE, "/infill": GENERATE,
          "/chat/completions": CHAT, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE,
          "/apply-template": OTHER, "/embedding": REFUSED, "/embeddings": REFUSED, "/v1/embeddings": REFUSED,
          "/rerank": REFUSED, "/reranking": REFUSED, "/v1/rerank": REFUSED, "/v1/reranking": REFUSED}
GENERATING = (GENERATE, CHAT)
GRAMMAR_DEPTH = 64  # the most nested groups of a grammar: llama.cpp's parser recurses once per group
SHOWN = 40  # characters of a client's value a message shows at most
LONGEST = 300  # characters of a message from llama-server a client sees at most
PATH = re.compile(r"(?:/[\w.+-]+){2,}")


@dataclass(frozen=True)
class Model:
    """What the checks read of the served model: its vocabulary size (0: unknown, ids not checked) and its name."""

    n_vocab: int
    name: str


@dataclass
class Checked:
    """A request's check: `error` (one line) and its `status`, or None; RidgeFill's options it gives; its body as
    llama-server will read it."""

    error: str | None = None
    status: int = 400
    options: dict | None = None
    body: bytes = b""


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def one_line(message: str) -> str:
    """A message as a client sees it: its first line, no local path, at most LONGEST characters."""
    first = (message.strip().splitlines() or [""])[0]
    first = PATH.sub("<path>", first)
    return first if len(first) <= LONGEST else first[:LONGEST - 3] + "..."


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type names JSON (none given: read as JSON, as llama-server does)."""
    if not content_type:
        return True
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def check(body: bytes, content_type: bytes | None, route: str, model: Model, fill_on: bool) -> Checked:
    """The check of a POST to `route` (a key of ROUTES) with `body`."""
    kind = ROUTES[route]
    if kind == REFUSED:
        return Checked("embeddings and reranking are not served by this server (a generation server, its prompts "
                       "filled): start a llama-server for them")
    if not is_json(content_type):
        return Checked(f"the request's Content-Type is {content_type.split(b';')[0].decode('latin-1')[:SHOWN]!r}, "
                       "not JSON: send the body as JSON with Content-Type: application/json", 415)
    try:
        doc = json.loads(body)
    except RecursionError:
        return Checked("the request body's JSON nests too deeply to be read: send a flat object")
    except ValueError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "its bytes"
        return Checked(f"the request body is not JSON (at {where}): send a JSON object")
    if not isinstance(doc, dict):
        return Checked("the request body is not a JSON object: send one")
    options = {k: v for k, v in doc.items() if isinstance(k, str) and k.startswith(PREFIX)}
    try:
        check_request_args(options)
    except ValueError as exc:
        return Checked(str(exc))
    if options and not fill_on:
        return Checked(f"{next(iter(options))}: this server runs without RidgeFill (its fill is off): drop it")
    if options and kind not in GENERATING:
        return Checked(f"{next(iter(options))}: only completions and chat completions take RidgeFill's options: drop "
                       "it")
    error = {GENERATE: lambda doc, model: prompt_error(doc, model, route), CHAT: chat_error,
             TOKENIZE: tokenize_error, DETOKENIZE: detokenize_error, OTHER: lambda doc, model: None}[kind](doc, model)
    if error is None and kind in GENERATING:
        error = logit_bias_error(doc.get("logit_bias"), model) or grammar_error(doc.get("grammar"))
    if error is not None:
        return Checked(error)
    if kind in GENERATING and doc.get("model") is None:
        doc["model"] = model.name
        body = json.dumps(doc).encode()
    return Checked(options=options, body=body)


def token_error(tokens, where: str, model: Model) -> str | None:
    """Why a list of token ids is not this model's, or None."""
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return f"{where} is not a list of token ids: give integers"
    bad = next((t for t in tokens if t < 0 or (model.n_vocab and t >= model.n_vocab)), None)
    if bad is None:
        return None
    return f"{where} holds {shown(bad)}, not a token id of this model: give ids in 0..{model.n_vocab - 1}"


def prompt_error(doc: dict, model: Model, route: str = "") -> str | None:
    """A completion's prompt as llama-server reads it (tokenize_input_prompts): text, token ids, text and ids mixed
    (a list holding an integer is one prompt), or a list of those; none empty, every id in the vocabulary. /infill may
    leave it out or empty (its input_prefix and input_suffix are the prompt)."""
    prompt = doc.get("prompt")
    if route == "/infill" and prompt in (None, ""):
        return None
    if prompt is None:
        return "the prompt is missing: send \"prompt\" (text or token ids)"
    if prompt == []:
        return "the prompt is empty: send at least one token id"
    one = isinstance(prompt, list) and any(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
    for part in ([prompt] if one or not isinstance(prompt, list) else prompt):
        error = part_error(part, model)
        if error:
            return error
    return None


def part_error(part, model: Model) -> str | None:
    """One prompt: text, or a list of token ids and text."""
    if isinstance(part, str):
        return None if part else "the prompt is empty: send at least one character of text"
    if isinstance(part, bool) or not isinstance(part, (list, int)):
        what = "not a list of token ids: give integers" if isinstance(part, bool) else \
            f"{type(part).__name__}: send text or a list of token ids"
        return f"the prompt is {what}"
    if isinstance(part, int):
        return "the prompt is int: send text or a list of token ids"
    if not part:
        return "the prompt is empty: send at least one token id"
    return token_error([p for p in part if not isinstance(p, str)], "the prompt", model)


def chat_error(doc: dict, model: Model) -> str | None:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages is empty: send at least one message"
    return None


def tokenize_error(doc: dict, model: Model) -> str | None:
    """/tokenize's content: text, or text and token ids (llama-server looks each id up: one outside the vocabulary
    is a C++ range error there)."""
    content = doc.get("content")
    if not isinstance(content, (str, list)):
        return "tokenize needs its text: send {\"content\": \"...\"}"
    if isinstance(content, list):
        return token_error([c for c in content if not isinstance(c, str)], "content", model)
    return None


def detokenize_error(doc: dict, model: Model) -> str | None:
    return token_error(doc.get("tokens", []), "tokens", model)


def logit_bias_error(bias, model: Model) -> str | None:
    """logit_bias as {id: bias} or [[id, bias], ...]: every id a token of this model (llama-server skips others)."""
    if bias is None:
        return None
    if isinstance(bias, dict):  # {"id": bias}: JSON keys are text, of digits
        keys, ok = list(bias), lambda k: k.isascii() and k.isdigit()
    elif isinstance(bias, list) and all(isinstance(pair, list) and pair for pair in bias):  # [[id, bias], ...]
        keys, ok = [pair[0] for pair in bias], lambda k: isinstance(k, int) and not isinstance(k, bool) and k >= 0
    else:
        return "logit_bias is not an object of token ids: give {\"id\": bias}"
    for key in keys:
        if not ok(key) or (model.n_vocab and int(key) >= model.n_vocab):
            return (f"logit_bias key {shown(key)} is not a token id of this model: give ids in "
                    f"0..{model.n_vocab - 1} as keys")
    return None


def grammar_error(text) -> str | None:
    """Why llama.cpp should not be given a GBNF grammar (not text, or nested past GRAMMAR_DEPTH groups), or None
    (llama-server's own parser answers for the rest, in one line)."""
    if text is None:
        return None
    if not isinstance(text, str):
        return "grammar is not text: send a grammar in llama.cpp's GBNF"
    depth, deepest, quote, i = 0, 0, None, 0
    while i < len(text):  # the groups' nesting outside quoted strings and character classes
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"[":
            quote = "]" if c == "[" else c
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    if deepest > GRAMMAR_DEPTH:
        return f"grammar: its groups nest {deepest} deep, over the {GRAMMAR_DEPTH} this server parses"
    return None
