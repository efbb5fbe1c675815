"""The engines that run a fill, behind one seam (backends/base.py): name -> (the module holding its Backend class as
BACKEND, imported only when that engine is asked for, so `--help` and torchfill never import another engine's
code; what --engine's help says of it). Adding an engine: its module, one line here, its row in docs."""

from __future__ import annotations

import importlib

from ridgefill.errors import RidgefillError

DEFAULT_ENGINE = "torchfill"  # the engine a command runs without --engine (and those without the option)

ENGINES = {
    "torchfill": ("ridgefill.backends.torchfill", "ridgefill's own torch engine"),
    "vllm": ("ridgefill.backends.vllm.backend", "vLLM: stock vLLM for exact, ridgefill's vLLM plugin for fills; needs "
             "the vllm extra"),
    "llamacpp": ("ridgefill.backends.llamacpp.backend", "llama.cpp with ridgefill's patch on the GGUF file of --model; "
                 "make install builds it"),
}


# the engines with an OpenAI-compatible server (`serve`, `bench-serve`): name -> (the module holding its
# backends/serving.Server as SERVER, imported only when that engine is asked for; what serve hands on to it)
SERVERS = {
    "vllm": ("ridgefill.backends.vllm.server", "any option of `vllm serve` (`vllm serve --help=all`), e.g. "
             "--max-model-len 4096 --api-key KEY; a request sets its own tail in vllm_xargs: ridgefill_tail"),
    "llamacpp": ("ridgefill.backends.llamacpp.server", "llama.cpp's llama-server with ridgefill's patches: --api-key "
                 "KEY, --n-ctx N (each slot's context in tokens) and --parallel N (slots, default 1); a request sets "
                 "its own tail as a top-level ridgefill_tail"),
}
# the engine `serve` and `bench-serve` run, and whose dialect a mounted request guard follows, unless told otherwise
SERVING_DEFAULT = "vllm"


def backend_class(name: str):
    """The Backend class of engine `name`; an unknown name is one line."""
    if name not in ENGINES:
        raise RidgefillError(f"unknown --engine '{name}': use one of {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[name][0]).BACKEND


def server_of(name: str):
    """The Server of engine `name`; an unknown engine, or one without a server, is one line."""
    backend_class(name)  # an unknown name: one line
    if name not in SERVERS:
        raise RidgefillError(f"serving is not supported with --engine {name}: use --engine "
                             f"{' or '.join(SERVERS)}")
    return importlib.import_module(SERVERS[name][0]).SERVER


def engine_help() -> str:
    """--engine's help, from the registry."""
    return "Which engine runs the model: " + "; ".join(f"{name} ({what})" for name, (_, what) in ENGINES.items()) + "."


def server_args_help() -> str:
    """What serve hands on to each engine's server (the help of its --server-args), from the registry."""
    return "Options handed on to the engine's server: " + "; ".join(f"{name}: {what}" for name, (_, what) in
                                                                     SERVERS.items()) + "."
