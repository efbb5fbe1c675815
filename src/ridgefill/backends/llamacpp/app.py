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

Around the app: `Admission` (admission.py: a request admitted once its whole body has come and passed its checks,
requests.py, at most `queue` at once; a client that goes away stops its request, whose place and the model lock are
held until its worker thread has returned) and, outermost, the front's request guard (`--guard`: the API key before
any body, body limits). The served name (`model` in answers, /v1/models) is serve's --model, or the GGUF's stem when
that is a path. /health answers once the model is loaded; /metrics gives RidgeFill's counters (backends/counters.py:
filled, full, cached and outlier prompt tokens, each prompt token counted once in filled, full or cached). `--stock`:
the same server with the fill off (plain llama-cpp-python prefill, no guard, no RidgeFill counter): bench-serve's
baseline. The port is bound before the model loads: one taken is one line (RidgefillError's, which serve prints as its
reason), not uvicorn's exit code 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import socket
import sys
from dataclasses import dataclass

from ridgefill.backends.llamacpp import requests
from ridgefill.backends.llamacpp.admission import (REQUEST, Admission, Queue, RequestState, body_limit,
                                                    hold_the_model_lock, stop_requested)
from ridgefill.backends.llamacpp.server import KEY_ENV, model_of
from ridgefill.backends.counters import FillCounters
from ridgefill.backends.serving import KEEP_FIRST_ARG, TAIL_ARG, served_name
from ridgefill.errors import RidgefillError

GRACE_S = 5  # seconds SIGTERM waits for running requests (each told to stop) before the server closes them
# the counters this server keeps (backends/counters.py; each prompt token once: filled, full, or cached, the rows
# kept from the context's previous prompt by llama-cpp-python's prefix match, cut where a fresh prefill would compute
# a row otherwise)
SERVED = ("filled_tokens", "full_tokens", "cached_prompt_tokens", "outlier_tokens")


@dataclass
class Fill:
    """What the server fills by: the plan of its fill settings (per request its tail and keep-first replaced), the
    maps in llama.cpp's form, the chunk the outliers are judged by, and the counters."""

    plan: object  # torchfill.FillPlan
    maps: object  # driver.Maps
    chunk: int
    counters: FillCounters
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
                self.driver.stop = stop_requested

        def generate(self, tokens, *args, **kwargs):
            request = REQUEST.get(None) or RequestState()
            # never sample from a cached prompt's last logits: its rows may have run another request's plan
            self._requires_eval = True
            self._prompt = self.driver is not None
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
            self.fill.counters.count(filled_tokens=done.filled, full_tokens=n - done.reused - done.filled,
                                     cached_prompt_tokens=done.reused, outlier_tokens=done.outliers)

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
    name = served_name(spec["name"])
    models = [ModelSettings(model=spec["gguf"], model_alias=name)]
    lapp.set_llama_proxy = lambda model_settings: setattr(lapp, "_llama_proxy", Proxy(models=model_settings))
    app = lapp.create_app(server_settings=server, model_settings=models)
    hold_the_model_lock(lapp)
    counters, queue = fill.counters if fill is not None else None, Queue(spec["queue"])
    llama = lapp._llama_proxy(name)
    model = requests.Model(llama.n_vocab(), lambda text: grammar_parses(llama, text), name)

    @app.get("/health", include_in_schema=False)
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        from prometheus_client import generate_latest

        ours = generate_latest(counters.registry).decode() if counters is not None else ""
        return PlainTextResponse(ours + queue.text())

    app.state.queue = queue
    app.add_middleware(Admission, queue=queue, fill_on=fill is not None, model=model, limit=body_limit())
    if guard:
        module, _, middleware = guard.rpartition(".")
        app.add_middleware(getattr(importlib.import_module(module), middleware))
    return app


def grammar_parses(llama, text: str) -> bool:
    """Whether llama.cpp's grammar parser takes `text` (root rule "root") on this model's vocabulary: the sampler it
    builds, freed at once (llama-cpp-python would add a NULL one to its chain, and the process ends)."""
    import llama_cpp

    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        return False
    sampler = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, data, b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


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
    from prometheus_client import CollectorRegistry

    counters = FillCounters(publish=True, registry=CollectorRegistry(), kept=SERVED)  # this server's own /metrics
    return Fill(plan, driver.maps_of(plan.filler), spec["chunk"], counters, spec["arch"])


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
        sock = listening(spec["host"], spec["port"])  # before the model loads: a taken port ends the start at once
        app = build_app(spec, os.environ.get(KEY_ENV) or None, args.guard, args.stock)
    except RidgefillError as exc:  # the front prints it as serve's one line (serve/process.startup_error)
        print(f"ridgefill.errors.RidgefillError: {exc}", flush=True)
        return 2
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM, SIGINT: every admitted request stops at its next step
            for state in list(app.state.queue.running):
                state.gone.set()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # a stop asked for is a clean exit (0), not uvicorn's signal raised again (143)
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="info", timeout_keep_alive=5, timeout_graceful_shutdown=GRACE_S)
    Server(config).run(sockets=[sock])
    # stopped: nothing is left to write, and tearing down the model, llama.cpp and torch took seconds on a busy
    # machine (SIGTERM's answer must not wait for them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def listening(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (as uvicorn binds it); RidgefillError, one line, when the port is
    taken (something took it after serve's check: uvicorn would log it and exit with code 3, the reason lost)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RidgefillError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port, or stop "
                             "what uses it") from None
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
