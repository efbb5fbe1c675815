"""`ridgefill serve`: an engine's OpenAI-compatible server with RidgeFill's filled prefill, configured from the command
line:

    ridgefill serve --model M --maps MAPS [--tail T] [--keep-first K] [--outlier-factor F] [--host H] [--port P]
                    [--dtype D] [--kv-cache-gib G | --concurrency C] [--engine E] [any option of the engine's server]

The front, engine-neutral: it asks the registry for --engine's server (backends.server_of; an engine without one is
one line, exit 2), has it check the options only it reads (Server.check), resolves the fill (the fill options, or a
serving config checked against the model) and checks that the engine runs it (backends/base.check_fill, the check
every measuring command makes), has the server build its start (Server.launch), checks the port and warns when the
server is reachable from other machines without an API key. Into that server it mounts the request guard
(serve/guard.py: the API key before any body, body limits, RidgeFill's request options), then runs it as a child
process (serve/process.py): while it starts, its output goes to a private, bounded log file (serve/log.py); if it
ends before answering, serve prints the reason in one line, read from the log in the engine's dialect (the fix named
where it is known), and exits 2. Once it answers and its /metrics shows RidgeFill's counters (else one line, exit 2:
RidgeFill did not load), serve prints one line saying what is served and relays its log to stderr. SIGINT, SIGTERM
and SIGHUP are forwarded to it, and its exit code is serve's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ridgefill.backends import SERVING_DEFAULT, SERVERS, backend_class, server_args_help, server_of
from ridgefill.backends.serving import Launch, check_port, is_loopback
from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import ServedOptions
from ridgefill.serve.guard import ENGINE_ENV, body_limit
from ridgefill.serve.log import check_log_file, default_log, say
from ridgefill.serve.process import launch

DTYPES = ("fp32", "bf16", "fp16", "auto")  # serve's --dtype (an engine maps each to its own name)
SERVED_DTYPE_HELP = ("auto (the engine's choice for this machine and model: bf16 on a CUDA GPU, fp32 on a CPU, or the "
                     "model file's own types), fp32, bf16 or fp16 (an engine that serves its model's own types only "
                     "refuses them); recorded resolved.")
GUARD = "ridgefill.serve.guard.RequestGuard"  # the request guard every server mounts (its class's import path)
ENGINE_HELP = f"Which engine's server runs the model: {' or '.join(SERVERS)}."


@dataclass
class ServedFill(ServedOptions):
    """What a server serves (`serve`, and the filled server of `bench-serve`): a model and its fill, from the fill
    options or a serving config (one of the two)."""

    model: str = option("smollm2-135m", "Local HF folder, GGUF file (for an engine that runs GGUF files), Hub id, "
                        "or alias 'smollm2-135m' (the model the maps were fitted for).")

    def source_rule(self):
        return (), ""  # one of --maps, --split and --serving-config is needed

    def input_folders(self) -> dict:
        from ridgefill.runtime.models import model_input

        return model_input(self.model)

    def served_fill(self, engine: str):
        """(the fill to serve, its plan): the fill options', or the serving config's checked against the model;
        refused in one line where --engine `engine` cannot run it (backends/base.check_fill)."""
        from ridgefill.backends.base import check_fill
        from ridgefill.method.fill import load_serving
        from ridgefill.runtime.session import model_facts

        facts = model_facts(self.model)
        if self.serving_config is None:
            fill = self.fill()
        else:
            tuned = load_serving(self.serving_config)
            tuned.check_model(facts.fingerprint, self.serving_config)
            fill = tuned.fill
        return fill, check_fill(backend_class(engine), fill, facts)


@dataclass
class ServeConfig(ServedFill):
    host: str = option("127.0.0.1", "Address the server listens on.")
    port: int = option(8000, "Port the server listens on.")
    dtype: str = option("auto", SERVED_DTYPE_HELP)
    kv_cache_gib: float | None = option(None, "KV cache memory in GiB, for an engine whose server sizes its cache by "
                                        "memory on a CPU (default: room for --concurrency requests of the longest "
                                        "length served, at most half the memory free at start-up); an engine that "
                                        "sizes it otherwise refuses it.")
    concurrency: int = option(4, "Requests of the longest length served at once: room for them in a KV cache sized "
                              "by memory, or, for a server that runs one request at a time, requests admitted at "
                              "once (one running, the rest waiting; past them a 503).")
    log_file: Path | None = option(None, "Where the server's log goes (default: serve-<port>.log in "
                                   "~/.local/state/ridgefill, a folder only you can enter); at 32 MiB it moves to "
                                   "<log>.1. Once the server answers, its log is also on stderr.", keyed=False)
    engine: str = option(SERVING_DEFAULT, ENGINE_HELP)
    server_args: list[str] = option([], server_args_help())

    def check(self) -> None:
        super().check()
        if not 1 <= self.port <= 65535:
            raise RidgefillError(f"--port {self.port} is out of range: use 1..65535")
        if not self.host.strip():
            raise RidgefillError("--host is empty: give an address, e.g. 127.0.0.1 (or 0.0.0.0 for every interface)")
        server = server_of(self.engine)
        if self.dtype not in DTYPES:
            raise RidgefillError(f"unknown dtype '{self.dtype}': use one of {', '.join(DTYPES)}")
        if self.kv_cache_gib is not None and not 0 < self.kv_cache_gib < 1 << 20:
            raise RidgefillError(f"--kv-cache-gib {self.kv_cache_gib:g} must be a positive number of GiB")
        if self.concurrency < 1:
            raise RidgefillError(f"--concurrency {self.concurrency} must be at least 1")
        if self.log_file is not None:
            check_log_file(self.log_file)
        server.check(self, serve_options())


def serve_options() -> list[str]:
    """serve's own options, as written on its command line (every field of ServeConfig's but the server's
    arguments)."""
    return [f"--{f.name.replace('_', '-')}" for f in fields(ServeConfig) if f.name != "server_args"]


# --- the command ------------------------------------------------------------------------------------------------
def run(c: ServeConfig) -> int:
    """Check everything, then run the engine's server until it stops; returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="ridgefill-serve-") as scratch:  # identity maps, Prometheus files
        return launch(serve_plan(c, Path(scratch)))


def serve_plan(c: ServeConfig, scratch: Path, log: Path | None = None) -> Launch:
    """The guard's bound, the fill (resolved, checked against the model and the engine), the engine's own checks,
    the port and the log checked; then the server's start with the fill served and the request guard mounted.
    `scratch` holds what the server needs for as long as it runs; `log`: its log (default: --log-file, else
    serve-<port>.log in this user's log folder, made only once everything else passed)."""
    server = server_of(c.engine)
    try:  # the guard reads its body bound from here in the server's process, where a bad one is a 500 a request
        body_limit(os.environ)
    except ValueError as bad:
        raise RidgefillError(str(bad)) from None
    fill, plan = c.served_fill(c.engine)
    started = server.launch(c, fill, scratch, GUARD, {ENGINE_ENV: server.name})
    log = ready(c, server, log)
    what = (f"{fill.variant} fill, maps {c.maps or c.serving_config or 'identity'} (split {plan.split} of "
            f"{plan.filler.n_layers} layers), tail {fill.tail}, keep-first {fill.keep_first}, outlier factor "
            f"{fill.outlier_factor:g}")
    return replace(started, log=log, banner=f"ridgefill serve: {c.model} through {server.title} at "
                   f"http://{c.host}:{c.port}/v1 with RidgeFill: {what}; {started.banner}; the server's log: {log}")


def stock_plan(c: ServeConfig, scratch: Path, log: Path) -> Launch:
    """The same server as serve_plan's (command line, context, threads, options) without RidgeFill: no fill, no
    guard, no RidgeFill counter looked for (bench-serve's baseline)."""
    server = server_of(c.engine)
    started = server.launch(c, None, scratch, None, {})
    log = ready(c, server, log)
    return replace(started, log=log, banner=f"ridgefill serve: {c.model} through stock {server.title} at "
                   f"http://{c.host}:{c.port}/v1; {started.banner}; the server's log: {log}")


def ready(c: ServeConfig, server, log: Path | None) -> Path:
    """The port checked free, a warning when the server is reachable from other machines without an API key, and
    its log's path (the default log folder made only now, once everything else passed)."""
    check_port(c.host, c.port)
    if not server.keyed(c) and not is_loopback(c.host):
        say(f"warning: --host {c.host} accepts requests from other machines and no --api-key is set: anyone who "
            "reaches this port can use the server\n")
    return Path(log or c.log_file or default_log(c.port))


COMMAND = Command("serve", ServeConfig, run, extra_args="server_args")
