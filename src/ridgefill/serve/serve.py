"""`ridgefill serve`: an engine's OpenAI-compatible server with RidgeFill's filled prefill (vLLM's, with ridgefill's
vLLM plugin; or llama-cpp-python's on a GGUF file, --engine llamacpp: backends/llamacpp/server.py), configured from
the command line:

    ridgefill serve --model M --maps MAPS [--tail T] [--keep-first K] [--outlier-factor F] [--host H] [--port P]
                    [--dtype D] [--kv-cache-gib G | --concurrency C] [--engine E] [any option of the engine's server]

The front, engine-neutral: it asks the registry for --engine's backend (backends/__init__.py), refuses one line (exit
2) when that engine cannot serve (its capabilities: caps.serving), and has it check the arguments only it reads and
build its server's start (Backend.server: for vLLM, backends/vllm/server.py, which checks the installation, the
model, the fill, the KV cache and the port, each problem one line and exit code 2). Into that server it mounts the
request guard (serve/guard.py: the API key before any body, body limits, RidgeFill's request options), then runs it
as a child process (serve/process.py): while it starts, its output goes to a private, bounded log file
(serve/log.py); if it ends before answering, serve prints the reason in one line (the fix named where it is known)
and exits 2. Once it answers and its /metrics shows RidgeFill's counters (else one line, exit 2: RidgeFill did not
load), serve prints one line saying what is served and relays its log to stderr. SIGINT, SIGTERM and SIGHUP are
forwarded to it, and its exit code is serve's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from ridgefill.backends import SERVING_DEFAULT, backend_class
# (free_port, running and startup_error are imported here for bench-serve and the tests, which read them as serve's)
from ridgefill.backends.serving import Launch, free_port  # noqa: F401
from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import ServedOptions
from ridgefill.serve.guard import ENGINE_ENV, body_limit
from ridgefill.serve.log import check_log_file, default_log
from ridgefill.serve.process import launch, running, startup_error  # noqa: F401

DTYPES = ("fp32", "bf16", "fp16", "auto")  # serve's --dtype (an engine maps each to its own name)
SERVED_DTYPE_HELP = ("auto (bf16 where vLLM runs on a CUDA GPU, fp32 on a CPU build, bf16 there for a hybrid model), "
                     "fp32, bf16 or fp16; recorded resolved.")
GUARD = "ridgefill.serve.guard.RequestGuard"  # the request guard every server mounts (its class's import path)
MIDDLEWARE = GUARD  # (the name serve gave it before the guard was the front's)


def serving_backend(engine: str):
    """The Backend class of --engine `engine`, refused in one line (exit 2) unless it serves (caps.serving), in the
    form of every engine command's refusal of a capability it lacks (backends/base.check_needs)."""
    from ridgefill.backends.base import check_needs

    cls = backend_class(engine)
    check_needs(cls, ("serving",), SERVING_DEFAULT)
    return cls


@dataclass
class ServedFill(ServedOptions):
    """What a vLLM server serves (`serve`, and both servers of `bench-serve`): a model and its fill, from the fill
    options or a serving config (one of the two)."""

    model: str = option("smollm2-135m", "Local HF folder, Hub id, or alias 'smollm2-135m' (the model the maps "
                        "were fitted for).")

    def source_rule(self):
        return (), ""  # one of --maps, --split and --serving-config is needed

    def input_folders(self) -> dict:
        from ridgefill.runtime.models import model_input

        return model_input(self.model)


@dataclass
class ServeConfig(ServedFill):
    host: str = option("127.0.0.1", "Address the server listens on.")
    port: int = option(8000, "Port the server listens on.")
    dtype: str = option("auto", SERVED_DTYPE_HELP)
    kv_cache_gib: float | None = option(None, "KV cache memory in GiB, on a CPU build of vLLM (default: room for "
                                        "--concurrency requests of the longest length served, at most half the "
                                        "memory free at start-up).")
    concurrency: int = option(4, "Requests of the longest length served that the default CPU KV cache holds at "
                              "once (vLLM); requests admitted at once, one running and the rest waiting, past them a "
                              "503 (llama.cpp: one model, one context).")
    log_file: Path | None = option(None, "Where vLLM's log goes (default: serve-<port>.log in "
                                   "~/.local/state/ridgefill, a folder only you can enter); at 32 MiB it moves to "
                                   "<log>.1. Once the server answers, its log is also on stderr.", keyed=False)
    engine: str = option(SERVING_DEFAULT, "Which engine's server runs the model (one that serves: vllm, or llamacpp "
                         "on a GGUF file).")
    vllm_args: list[str] = option([], "options of `vllm serve` (see `vllm serve --help=all`), e.g. "
                                  "--max-model-len 4096 --tensor-parallel-size 2 --api-key KEY "
                                  "--no-enable-prefix-caching --enforce-eager. A request sets its own tail: vllm_xargs "
                                  "ridgefill_tail. With --engine llamacpp: --api-key KEY and --n-ctx N only; a request "
                                  "sets its tail as a top-level ridgefill_tail.")

    def check(self) -> None:
        super().check()
        if not 1 <= self.port <= 65535:
            raise RidgefillError(f"--port {self.port} is out of range: use 1..65535")
        if not self.host.strip():
            raise RidgefillError("--host is empty: give an address, e.g. 127.0.0.1 (or 0.0.0.0 for every interface)")
        serving_backend(self.engine)
        if self.dtype not in DTYPES:
            raise RidgefillError(f"unknown dtype '{self.dtype}': use one of {', '.join(DTYPES)}")
        if self.kv_cache_gib is not None and not 0 < self.kv_cache_gib < 1 << 20:
            raise RidgefillError(f"--kv-cache-gib {self.kv_cache_gib:g} must be a positive number of GiB")
        if self.concurrency < 1:
            raise RidgefillError(f"--concurrency {self.concurrency} must be at least 1")
        if self.log_file is not None:
            check_log_file(self.log_file)
        serving_backend(self.engine).check_serve(self, serve_options())



def serve_options() -> list[str]:
    """serve's own options, as written on its command line (every field of ServeConfig's but the vLLM arguments)."""
    return [f"--{f.name.replace('_', '-')}" for f in fields(ServeConfig) if f.name != "vllm_args"]


# --- the command ------------------------------------------------------------------------------------------------
def run(c: ServeConfig) -> int:
    """Check everything, then run the engine's server until it stops; returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="ridgefill-serve-") as scratch:  # identity maps, Prometheus files
        return launch(serve_plan(c, Path(scratch)))


def serve_plan(c: ServeConfig, scratch: Path) -> Launch:
    """The guard's bound checked, then the engine's server start (Backend.server: everything it needs checked; its
    command, environment, health URL, banner, log and the counter on /metrics that says RidgeFill runs) with the
    request guard mounted; `scratch` holds what the server needs for as long as it runs."""
    backend = serving_backend(c.engine)
    try:  # the guard reads its body bound from here in the server's process, where a bad one is a 500 a request
        body_limit(os.environ)
    except ValueError as bad:
        raise RidgefillError(str(bad)) from None
    return backend.server(c, scratch, lambda: Path(c.log_file or default_log(c.port)), GUARD,
                          {ENGINE_ENV: backend.name})


def stock_plan(plan: Launch, log: Path, engine: str = SERVING_DEFAULT) -> Launch:
    """The same server as `plan` without RidgeFill (bench-serve's baseline): no RidgeFill setting, no guard."""
    return serving_backend(engine).stock_server(plan, log, GUARD)


COMMAND = Command("serve", ServeConfig, run, extra_args="vllm_args")
