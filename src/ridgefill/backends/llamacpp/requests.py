"""The llama.cpp server's checks of a request before llama-cpp-python 0.3.36's routes read it (app.py's Admission runs
them once the whole body has come): each thing llama-cpp-python would answer with a 500 or that would end the
process is one line and a 4xx here. The body as the route's request model reads it; RidgeFill's own options
(backends/serving.check_request_args; with the fill off refused, not ignored); a Content-Type that is not JSON (the
route would read the body as a string and echo it in a 500); what the model cannot serve: logprobs (filled rows have
no logits), embeddings (a generation context), more than one prompt or choice (llama-cpp-python asserts one prompt and
silently answers one choice); token ids outside the vocabulary (to /extras/detokenize and as `logit_bias` keys:
std::out_of_range ends the process); a grammar llama.cpp does not parse (llama-cpp-python adds its NULL sampler: the
process ends) or a JSON schema it cannot turn into one; an empty prompt. A body that passes may be rewritten: no
`repeat_penalty` given is 1.0, not llama-cpp-python's 1.1 (greedy is greedy, as in vLLM and llama.cpp's own
llama-server), and no `model` given is the served name (llama-cpp-python answers the GGUF's path otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from ridgefill.backends.serving import PREFIX, check_request_args

COMPLETION, CHAT = "CreateCompletionRequest", "CreateChatCompletionRequest"
ROUTES = {"/v1/completions": COMPLETION, "/v1/engines/copilot-codex/completions": COMPLETION,
          "/v1/chat/completions": CHAT, "/v1/embeddings": "CreateEmbeddingRequest",
          "/extras/tokenize": "TokenizeInputRequest", "/extras/tokenize/count": "TokenizeInputRequest",
          "/extras/detokenize": "DetokenizeInputRequest"}  # POST route -> llama-cpp-python's request model
GENERATING = (COMPLETION, CHAT)
GRAMMAR_DEPTH = 64  # the most nested groups of a grammar: llama.cpp's parser recurses once per group
SEED_MAX = (1 << 32) - 1  # llama.cpp's seeds are uint32
SHOWN = 40  # characters of a client's value a message shows at most


@dataclass(frozen=True)
class Model:
    """What the checks read of the served model: its vocabulary size, whether llama.cpp parses a grammar, its name."""

    n_vocab: int
    parses: Callable[[str], bool]  # GBNF text -> llama.cpp's parser takes it (root rule "root")
    name: str


@dataclass
class Checked:
    """A request's check: `error` (one line) and its `status`, or None; RidgeFill's options it gives; its body as
    the route will read it."""

    error: str | None = None
    status: int = 400
    options: dict | None = None
    body: bytes = b""


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type names JSON (none given: FastAPI reads the body as JSON too)."""
    if not content_type:
        return True
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def check(body: bytes, content_type: bytes | None, route: str, model: Model, fill_on: bool) -> Checked:
    """The check of a POST to `route` (a key of ROUTES) with `body`."""
    import pydantic
    from llama_cpp.server import types

    kind = ROUTES[route]
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
    try:
        request = getattr(types, kind).model_validate(doc)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))[:SHOWN] or "the body"
        return Checked(f"{where}: {first.get('msg', 'invalid')} (the request's {kind})")
    except (RecursionError, ValueError) as exc:
        return Checked(f"the request body cannot be read ({type(exc).__name__}): send a flat JSON object")
    if kind == "CreateEmbeddingRequest":  # llama-cpp-python would fail on a generation context (a 500)
        return Checked("embeddings are not served by this server (a generation context, prompts filled): use a server "
                       "started for embeddings")
    if kind == "DetokenizeInputRequest":
        error = token_error(request.tokens, "tokens", model)
        return Checked(error) if error else Checked(body=body)
    if kind not in GENERATING:
        return Checked(body=body)
    error = generation_error(request, doc, kind, model)
    if error is not None:
        return Checked(error)
    if "repeat_penalty" not in doc:
        doc["repeat_penalty"] = 1.0
    if doc.get("model") is None:
        doc["model"] = model.name
    return Checked(options=options, body=json.dumps(doc).encode())


def token_error(tokens, where: str, model: Model) -> str | None:
    bad = next((t for t in tokens if not 0 <= t < model.n_vocab), None)
    if bad is None:
        return None
    return f"{where} holds {shown(bad)}, not a token id of this model: give ids in 0..{model.n_vocab - 1}"


def generation_error(request, doc: dict, kind: str, model: Model) -> str | None:
    """The one-line refusal of a completion or chat completion the model cannot serve, or None."""
    if kind == COMPLETION and request.logprobs is not None or kind == CHAT and (request.logprobs or
                                                                                 request.top_logprobs is not None):
        return ("logprobs are not served with --engine llamacpp (llama-cpp-python computes them from every prompt "
                "row's logits; filled rows have none): drop logprobs")
    for field in ("n", "best_of"):
        value = doc.get(field)
        if value is not None and value != 1:
            return (f"{field}={shown(value)}: this server answers one choice per request: drop {field}, or send "
                    "the request that many times")
    if kind == COMPLETION:
        prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if len(prompts) > 1:
            return (f"the prompt is a list of {len(prompts)} prompts: this server answers one prompt per request: "
                    "send them one by one")
        if not prompts or not prompts[0]:
            return "the prompt is empty: send at least one character of text"
    elif not request.messages:
        return "messages is empty: send at least one message"
    if request.seed is not None and not 0 <= request.seed <= SEED_MAX:
        return f"seed={shown(request.seed)} is not valid: give an integer in 0..{SEED_MAX}"
    if request.logit_bias and request.logit_bias_type != "tokens":
        for key in request.logit_bias:
            if not (key.isascii() and key.isdigit() and int(key) < model.n_vocab):
                return (f"logit_bias key {shown(key)} is not a token id of this model: give ids in "
                        f"0..{model.n_vocab - 1} as keys")
    if request.grammar is not None:
        error = grammar_error(request.grammar, model)
        if error:
            return f"grammar: {error}: send a grammar in llama.cpp's GBNF with a root rule"
    if kind == CHAT:
        return schema_error(request, model)
    return None


def grammar_error(text: str, model: Model) -> str | None:
    """Why llama.cpp would not take a GBNF grammar (nested past GRAMMAR_DEPTH groups, or its parser refuses it), or
    None."""
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
        return f"its groups nest {deepest} deep, over the {GRAMMAR_DEPTH} this server parses"
    if not model.parses(text):
        return "llama.cpp's parser does not take it"
    return None


def schema_error(request, model: Model) -> str | None:
    """The refusal of a chat request's JSON schema (response_format's, or the chosen tool's parameters) that
    llama-cpp-python cannot turn into a grammar llama.cpp parses, or of a tool_choice naming no tool; or None."""
    from llama_cpp import llama_grammar

    schemas = []
    if request.response_format is not None and "schema" in request.response_format:
        schemas.append(("response_format.schema", request.response_format["schema"]))
    choice, tools = request.tool_choice, request.tools or [{"type": "function", "function": f}
                                                           for f in request.functions or []]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            return f"tool_choice names {shown(name)}, which is not among tools: name one of them"
        schemas.append(("the chosen tool's parameters", tool["function"].get("parameters", {})))
    for where, schema in schemas:
        try:
            grammar = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except (Exception, RecursionError) as exc:  # noqa: BLE001  (the converter raises what it meets)
            return (f"{where} cannot be turned into a grammar ({type(exc).__name__}): send a JSON schema "
                    "llama.cpp's converter takes")
        error = grammar_error(grammar, model)
        if error:
            return f"{where} gives a grammar llama.cpp cannot use ({error}): send a simpler JSON schema"
    return None
