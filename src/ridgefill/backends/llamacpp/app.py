"""The process `ridgefill serve --engine llamacpp` runs (`python -m ridgefill.backends.llamacpp.app SPEC [--guard
CLASS] [--stock]`): llama-cpp-python 0.3.36's own OpenAI-compatible server (llama_cpp.server.app.create_app: its
routes /v1/completions, /v1/chat/completions with the GGUF's chat template, /v1/models, streaming) on a `FilledLlama`,
the patched build's `Llama` whose prompt prefill goes through the driver's fill (driver.LlamaCpp.attach on the
Llama's own context: the rows the plan fills filled, the tail, keep-first and outliers in full) and whose decode
steps stay llama-cpp-python's (the whole model). SPEC is the JSON server.py writes (the GGUF, the fill, threads,
context, address, the admission bound); the API key comes by the environment (serving.KEY_ENV), never the command
line.

Prefix reuse: llama-cpp-python keeps the longest common prefix of the previous prompt in its context; the prompt's
rows then go to driver.LlamaCpp.prefill with `reuse` that prefix, and the driver keeps only the rows a fresh prefill
of the new prompt would compute the same way (driver.LlamaCpp.reusable), so an answer never depends on what was
asked before.

Around the app: `Admission` (one model, one context: at most `queue` requests admitted at once, one running and the
rest waiting for llama-cpp-python's lock; past that a 503 with Retry-After; a client that goes away frees its place
and stops its generation, also mid-prefill), the request's checks before llama-cpp-python's (its body as the route's
model reads it, else 400, not llama-cpp-python's 500; logprobs refused: filled rows have no logits; RidgeFill's own
options, top-level `ridgefill_tail` / `ridgefill_keep_first`, by backends/serving.check_request_args), and, outermost,
the front's request guard (`--guard`: the API key before any body, body limits). /health answers once the model is
loaded; /metrics gives RidgeFill's counters (serving.COUNTERS: filled, full, cached and outlier prompt tokens, each
prompt token counted once in filled, full or cached). `--stock`: the same server with the fill off (plain
llama-cpp-python prefill, no guard, no RidgeFill counter): bench-serve's baseline.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import importlib
import json
import os
import sys
import threading
from dataclasses import dataclass, field

from ridgefill.backends.llamacpp.server import KEY_ENV, model_of
from ridgefill.backends.serving import (COUNTERS, KEEP_FIRST_ARG, PREFIX, TAIL_ARG, check_request_args)
from ridgefill.errors import RidgefillError

MODEL_PATHS = ("/v1/", "/extras/")  # the routes that wait for the model (llama-cpp-python's lock): admitted
CHECKED = {"/v1/completions": "CreateCompletionRequest", "/v1/engines/copilot-codex/completions":
           "CreateCompletionRequest", "/v1/chat/completions": "CreateChatCompletionRequest",
           "/v1/embeddings": "CreateEmbeddingRequest"}
RETRY_AFTER_S = 1  # what a 503 asks the client to wait
SERVED = ("filled", "full", "cached", "outliers")  # the counters this server shows (serving.COUNTERS' names)
ADMITTED = "ridgefill_admitted_requests"  # the gauge of the requests admitted now
# serving.COUNTERS' help, where llama.cpp's counter means something of its own
HELP = {"cached": "Prompt tokens kept from the context's previous prompt (llama-cpp-python's prefix match, cut where a "
                  "fresh prefill would compute a row otherwise): each prompt token is counted once, in filled, full or "
                  "cached"}


@dataclass
class RequestState:
    """A request as the Llama sees it in its worker thread: RidgeFill's options the client gave, and whether it went
    away (set by Admission; the generation stops at its next step)."""

    options: dict = field(default_factory=dict)
    gone: threading.Event = field(default_factory=threading.Event)


REQUEST: contextvars.ContextVar[RequestState] = contextvars.ContextVar("ridgefill_request")


class Counters:
    """RidgeFill's prompt-token counters (COUNTERS' names), shared by the worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(SERVED, 0)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                self.values[k] += v

    def text(self) -> str:
        """The Prometheus text exposition of the counters."""
        with self.lock:
            values = dict(self.values)
        lines = []
        for key in SERVED:
            name, help_ = COUNTERS[key][0], HELP.get(key, COUNTERS[key][1])
            lines += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter", f"{name}_total {values[key]}"]
        return "\n".join(lines) + "\n"


@dataclass
class Queue:
    """The requests admitted for the model (Admission's), at most `bound`: a gauge on /metrics."""

    bound: int
    active: int = 0

    def text(self) -> str:
        return (f"# HELP {ADMITTED} Requests running or waiting for the model (at most {self.bound})\n"
                f"# TYPE {ADMITTED} gauge\n{ADMITTED} {self.active}\n")


@dataclass
class Fill:
    """What the server fills by: the plan of its fill settings (per request its tail and keep-first replaced), the
    maps in llama.cpp's form, the chunk the outliers are judged by, and the counters."""

    plan: object  # torchfill.FillPlan
    maps: object  # driver.Maps
    chunk: int
    counters: Counters
    arch: str  # the GGUF's architecture (serve checked it: driver.check_family)

    def plan_for(self, options: dict):
        """The plan with the request's own tail and keep-first (checked at admission)."""
        if not options:
            return self.plan
        return dataclasses.replace(self.plan, tail=options.get(TAIL_ARG, self.plan.tail),
                                   keep_first=options.get(KEEP_FIRST_ARG, self.plan.keep_first))


def filled_llama_class():
    """FilledLlama, defined where llama_cpp is imported (only backends/llamacpp imports it)."""
    from llama_cpp import Llama

    from ridgefill.backends.llamacpp import driver

    class FilledLlama(Llama):
        """llama-cpp-python's Llama whose prompt prefill is the driver's (fill None: its own, the fill off); every
        generation stops when its client goes away."""

        def __init__(self, *args, fill: Fill | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.fill, self.driver, self._prompt = fill, None, False
            if fill is not None:
                self.driver = driver.LlamaCpp.attach(fill.arch, self.model, self.ctx, self.n_ctx(), self.n_batch)
                self._stack.callback(self.driver.close)
                self.driver.set_maps(fill.maps)

        def generate(self, tokens, *args, **kwargs):
            request = REQUEST.get(None) or RequestState()
            # never sample from a cached prompt's last logits: its rows may have run another request's plan
            self._requires_eval = True
            self._prompt = self.driver is not None
            if self.driver is not None:
                self.driver.stop = request.gone.is_set
            inner = super().generate(tokens, *args, **kwargs)
            try:
                for token in inner:
                    if request.gone.is_set():
                        return
                    yield token
            except driver.Stopped:  # the client went away mid-prefill: the cache holds nothing known
                self.reset()
                self.driver.clear()
            finally:
                inner.close()
                if self.driver is not None and self.driver.stop == request.gone.is_set:  # (not a later request's)
                    self.driver.stop = None

        def eval(self, tokens) -> None:
            if not self._prompt:
                return super().eval(tokens)
            self._prompt = False
            request = REQUEST.get(None) or RequestState()
            reuse = self.n_tokens  # llama-cpp-python's prefix match: these rows hold the prompt's first tokens
            prompt = [*self.input_ids[:reuse].tolist(), *tokens]
            n = len(prompt)
            plan = self.fill.plan_for(request.options)
            done = self.driver.prefill(prompt, plan.full_rows(n).tolist(), [n - 1], plan.outlier_factor,
                                       self.fill.chunk, reuse=reuse)
            self.input_ids[:n] = prompt
            self.n_tokens = n
            self._requires_eval = False
            self.fill.counters.add(filled=done.filled, full=n - done.reused - done.filled, cached=done.reused,
                                   outliers=done.outliers)

    return FilledLlama


# --- the app -------------------------------------------------------------------------------------------------------
def build_app(spec: dict, key: str | None, guard: str | None, stock: bool):
    """llama-cpp-python's app on a FilledLlama (spec: server.py's), with Admission, /health, /metrics and, when
    `guard` names one, the front's request guard mounted outermost."""
    import llama_cpp.server.app as lapp
    from fastapi.responses import PlainTextResponse
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    fill = None if stock else served_fill(spec)
    llama_class = filled_llama_class()

    class Proxy(LlamaProxy):  # llama-cpp-python's model holder, loading the FilledLlama with serve's settings
        @staticmethod
        def load_llama_from_model_settings(settings):
            return llama_class(model_path=spec["gguf"], n_gpu_layers=0, n_ctx=spec["n_ctx"], n_batch=spec["n_batch"],
                               n_ubatch=spec["n_ubatch"], n_threads=spec["threads"],
                               n_threads_batch=spec["threads"], flash_attn=True, type_k=1, type_v=1,
                               logits_all=False, embedding=False, verbose=False, fill=fill)

    server = ServerSettings(host=spec["host"], port=spec["port"], api_key=key, interrupt_requests=False,
                            disable_ping_events=False, root_path="", ssl_keyfile=None, ssl_certfile=None)
    models = [ModelSettings(model=spec["gguf"], model_alias=spec["name"])]
    lapp.set_llama_proxy = lambda model_settings: setattr(lapp, "_llama_proxy", Proxy(models=model_settings))
    app = lapp.create_app(server_settings=server, model_settings=models)
    counters, queue = fill.counters if fill is not None else None, Queue(spec["queue"])

    @app.get("/health", include_in_schema=False)
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return PlainTextResponse((counters.text() if counters is not None else "") + queue.text())

    app.add_middleware(Admission, queue=queue, fill_on=fill is not None)
    if guard:
        module, _, name = guard.rpartition(".")
        app.add_middleware(getattr(importlib.import_module(module), name))
    return app


def served_fill(spec: dict) -> Fill:
    """The fill of `spec` on its model: the plan (maps loaded and checked against the model) and the maps in
    llama.cpp's form."""
    import torch

    from ridgefill.backends.llamacpp import driver
    from ridgefill.method.fill import FillSettings

    # torch's work here is small (plans, outlier medians) and its OpenMP threads, spinning after each op, took cores
    # from llama.cpp's own: decode steps were 40 % slower than the stock server's on 2 cores (13 against 9 ms per
    # token, nothing filled), equal with torch on one thread
    torch.set_num_threads(1)
    settings = FillSettings(**spec["fill"])
    plan, _ = settings.plan(model_of(spec["model"]))
    return Fill(plan, driver.maps_of(plan.filler), spec["chunk"], Counters(), spec["arch"])


# --- admission -----------------------------------------------------------------------------------------------------
class Admission:
    """Pure ASGI middleware around llama-cpp-python's app: the bounded queue of requests for the model, each
    request's checks (request_error) and its RequestState, and its client's going away."""

    def __init__(self, app, queue: Queue, fill_on: bool) -> None:
        self.app, self.queue, self.fill_on = app, queue, fill_on

    async def __call__(self, scope, receive, send) -> None:
        path, queue = scope.get("path", ""), self.queue
        if scope.get("type") != "http" or not path.startswith(MODEL_PATHS):
            await self.app(scope, receive, send)
            return
        if queue.active >= queue.bound:
            await answer(send, 503, f"the server is busy: {queue.bound} requests are running or waiting for the "
                         f"model (the most it admits); retry after {RETRY_AFTER_S} s",
                         [(b"retry-after", b"%d" % RETRY_AFTER_S)])
            return
        queue.active += 1
        try:
            await self.admitted(scope, receive, send, path)
        finally:
            queue.active -= 1

    async def admitted(self, scope, receive, send, path: str) -> None:
        body, ended = b"", None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body ended
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        state = RequestState()
        if scope.get("method") == "POST" and path in CHECKED:
            error, state.options = request_error(body, CHECKED[path], self.fill_on)
            if error is not None:
                await answer(send, 400, error)
                return
        gone = asyncio.Event()

        async def replay():
            nonlocal ended
            if ended is None:
                ended = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not gone.is_set():
                await gone.wait()
            return {"type": "http.disconnect"}

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
            if not task.done():  # the client went away: its place is free now, its generation stops at its next step
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not watcher.done():
                    raise
        finally:
            watcher.cancel()


def request_error(body: bytes, model: str, fill_on: bool) -> tuple[str | None, dict]:
    """(one line refusing the request, or None; RidgeFill's options it gives): its body as llama-cpp-python's request
    model `model` reads it, no logprobs (llama-cpp-python computes them from every prompt row's logits), and
    RidgeFill's options (backends/serving.check_request_args; with the fill off they are refused, not ignored)."""
    import pydantic
    from llama_cpp.server import types

    try:
        doc = json.loads(body)
    except RecursionError:
        return "the request body's JSON nests too deeply to be read: send a flat object", {}
    except ValueError as exc:
        return f"the request body is not JSON ({str(exc).splitlines()[0][:200]}): send a JSON object", {}
    if not isinstance(doc, dict):
        return "the request body is not a JSON object: send one", {}
    options = {k: v for k, v in doc.items() if isinstance(k, str) and k.startswith(PREFIX)}
    try:
        check_request_args(options)
    except ValueError as exc:
        return str(exc), {}
    if options and not fill_on:
        return f"{next(iter(options))}: this server runs without RidgeFill (its fill is off): drop it", {}
    try:
        request = getattr(types, model).model_validate(doc)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the body"
        return f"{where}: {first.get('msg', 'invalid')} (the request's {model})", {}
    except (RecursionError, ValueError) as exc:
        return f"the request body cannot be read ({type(exc).__name__}): send a flat JSON object", {}
    if model == "CreateEmbeddingRequest":  # llama-cpp-python would fail on a generation context (a 500)
        return ("embeddings are not served by this server (a generation context, prompts filled): use a server "
                "started for embeddings"), {}
    if getattr(request, "logprobs", None) not in (None, False) or getattr(request, "top_logprobs", None):
        return ("logprobs are not served with --engine llamacpp (llama-cpp-python computes them from every prompt "
                "row's logits; filled rows have none): drop logprobs"), {}
    return None, options


async def answer(send, status: int, message: str, headers: list = ()) -> None:
    """An error in the OpenAI format (message, type, param, code), one line."""
    from http import HTTPStatus

    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


# --- the process ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ridgefill.backends.llamacpp.app")
    parser.add_argument("spec")
    parser.add_argument("--guard", default=None)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args(argv)
    os.environ.pop("CONFIG_FILE", None)  # llama-cpp-python's create_app would read its settings from it
    try:
        with open(args.spec) as f:
            spec = json.load(f)
        app = build_app(spec, os.environ.get(KEY_ENV) or None, args.guard, args.stock)
    except RidgefillError as exc:  # the front prints it as serve's one line (serve/process.startup_error)
        print(f"ridgefill.errors.RidgefillError: {exc}", flush=True)
        return 2
    import uvicorn

    uvicorn.run(app, host=spec["host"], port=spec["port"], log_level="info", timeout_keep_alive=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
