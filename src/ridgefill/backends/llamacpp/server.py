"""How llama.cpp serves (LlamaCppBackend's serving methods; the front, serve/, runs what this builds): llama-cpp-
python's OpenAI-compatible server with the fill (app.py, run as `python -m ridgefill.backends.llamacpp.app
SPEC`), SPEC a JSON file in serve's scratch folder (the GGUF, the fill settings, threads, context, address, the
admission bound), the API key in the environment (KEY_ENV), the front's request guard named with --guard.
Before it starts: the build (library.py) and llama-cpp-python's server extra, the GGUF and its architecture, the
fill (variant, maps against the model, no lookback, no filled window), the options serve hands on (--api-key and
--n-ctx only: vLLM's options are refused) and the port; each problem one line and exit code 2.

bench-serve's two servers: `Backend.server(...)` (the fill on, the guard mounted) and `Backend.stock_server(plan,
log, guard)` (the same SPEC with --stock: llama-cpp-python's own prefill, no guard, no RidgeFill counter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from ridgefill.backends.serving import MARKER, Launch, check_port, health_url, is_loopback
from ridgefill.defaults import DEFAULT_CHUNK
from ridgefill.errors import RidgefillError

SERVER = "ridgefill.backends.llamacpp.app"
KEY_ENV = "RIDGEFILL_LLAMACPP_API_KEY"  # the server's API key (serve moves --api-key here, off the command line)
API_KEY = "--api-key"
N_CTX = "--n-ctx"
TAKEN = (API_KEY, N_CTX)  # the options of llama-cpp-python's server serve hands on
N_UBATCH = 512  # llama.cpp's default ubatch (as the backend runs it)


def split_args(args: list[str]) -> dict[str, str]:
    """serve's extra arguments as {option: value}: --api-key KEY and --n-ctx N (or --name=value), nothing else."""
    found, i = {}, 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name not in TAKEN:
            what = f"{arg!r} is not an option of serve" if not arg.startswith("-") else f"{name} is not an option"
            raise RidgefillError(f"{what} of --engine llamacpp's server, which takes {API_KEY} KEY and {N_CTX} N "
                                 "(vLLM's options need --engine vllm)")
        if not eq:
            if i + 1 >= len(args):
                raise RidgefillError(f"{name} needs a value: {name} {'KEY' if name == API_KEY else 'N'}")
            value, i = args[i + 1], i + 1
        if name in found:
            raise RidgefillError(f"{name} is given twice: give it once")
        found[name] = value
        i += 1
    if N_CTX in found and (not found[N_CTX].isdigit() or not 1 <= int(found[N_CTX]) <= 1 << 24):
        raise RidgefillError(f"{N_CTX} {found[N_CTX]!r} is not a number of tokens: give e.g. {N_CTX} 4096")
    if API_KEY in found and not found[API_KEY]:
        raise RidgefillError(f"{API_KEY} is empty: give a key, or drop it")
    return found


def check_serve(c, own: list[str]) -> None:
    """What only llama.cpp's server reads, checked before anything starts."""
    from ridgefill.backends.llamacpp import library
    from ridgefill.runtime.models import ALIASES, gguf_file

    split_args(c.vllm_args)
    if c.dtype != "auto":
        raise RidgefillError(f"--dtype {c.dtype} is not supported with --engine llamacpp: it serves the GGUF's own "
                             "weight types (an F16 K/V cache); drop --dtype")
    if c.kv_cache_gib is not None:
        raise RidgefillError(f"--kv-cache-gib is not supported with --engine llamacpp: its K/V cache holds {N_CTX} "
                             "tokens (default: the model's context); drop --kv-cache-gib")
    if gguf_file(c.model) is None:
        raise RidgefillError(f"--engine llamacpp runs GGUF files, not {c.model}: give --model a .gguf file or an "
                             f"embedded alias ({', '.join(ALIASES)})")
    library.check_installed()
    try:
        import llama_cpp.server.app  # noqa: F401  (its server extra: fastapi, sse-starlette, starlette-context, ...)
    except ImportError as exc:
        raise RidgefillError(f"llama-cpp-python's server needs the package {(exc.name or '?').split('.')[0]}, which "
                             f"is not installed: {library.INSTALL}") from None


def serve_plan(cls, c, scratch: Path, log, guard: str | None = None, env: dict | None = None) -> Launch:
    """Everything checked (the GGUF, the fill, the port), then the server's start: its command (the SPEC written in
    `scratch`), environment (the API key, the front's `env`), health URL, banner, log and the /metrics marker."""
    from ridgefill.backends.base import check_plans, refuse
    from ridgefill.backends.llamacpp import driver
    from ridgefill.runtime.models import gguf_file, model_identity

    taken = split_args(c.vllm_args)
    gguf = gguf_file(c.model)
    arch = driver.check_family(gguf)
    identity = model_identity(c.model)
    described = {"shape": dataclasses.asdict(identity.shape), "context_length": identity.context_length,
                 "model_info": {k: v for k, v in identity.info.items() if k != "n_layers"}}
    facts = model_of(described)
    fill = served_fill(c, facts)
    if fill.variant not in cls.caps.variants:
        raise refuse(cls, f"the {fill.variant} variant", f"use {' or '.join(cls.caps.variants)}")
    if fill.filled_window:
        raise refuse(cls, "--filled-window", "drop it")
    plan, meta = fill.plan(facts)
    check_plans(cls, {"served": plan})
    try:
        driver.maps_of(plan.filler)
    except ValueError as exc:
        raise refuse(cls, f"the {fill.variant} variant ({exc})", "use identity, ridge or mean") from None
    n_ctx = int(taken.get(N_CTX, 0)) or facts.context_length or 4096
    check_port(c.host, c.port)
    warn_if_exposed(c, API_KEY in taken or bool(os.environ.get(KEY_ENV)))
    log = log()
    threads = os.cpu_count() or 1
    spec = {"gguf": str(gguf), "arch": arch, "model": described, "name": c.model, "fill": fill.describe(),
            "chunk": DEFAULT_CHUNK, "n_ctx": n_ctx, "n_batch": min(DEFAULT_CHUNK, n_ctx), "n_ubatch": min(N_UBATCH, DEFAULT_CHUNK, n_ctx),
            "threads": threads, "host": c.host, "port": c.port, "queue": c.concurrency}
    if fill.maps is not None:  # the server loads the bytes checked here (their sha256 pinned), or refuses
        from ridgefill.runtime.paths import file_sha256

        spec["fill"]["maps"] = str(Path(fill.maps).resolve())
        spec["fill"]["maps_sha256"] = fill.maps_sha256 or file_sha256(fill.maps)
    path = scratch / "llamacpp-server.json"
    path.write_text(json.dumps(spec, indent=1))
    key = {KEY_ENV: taken[API_KEY]} if API_KEY in taken else {}
    argv = [sys.executable, "-m", SERVER, str(path), *(["--guard", guard] if guard else [])]
    banner = (f"ridgefill serve: {c.model} through llama.cpp at http://{c.host}:{c.port}/v1 with RidgeFill: "
              f"{fill.variant} fill, maps {c.maps or c.serving_config or 'identity'} (split {plan.split} of "
              f"{facts.shape.layers} layers), tail {fill.tail}, keep-first {fill.keep_first}, outlier factor "
              f"{fill.outlier_factor:g}; context {n_ctx} tokens, {c.concurrency} requests admitted at once, "
              f"{threads} threads; the server's log: {log}")
    return Launch(argv, {**os.environ, **key, **(env or {})}, health_url(c.host, c.port), banner, Path(log), MARKER)


def stock_plan(plan: Launch, log: Path, guard: str | None = None) -> Launch:
    """The same server as `plan` with the fill off (--stock: llama-cpp-python's own prefill of the same GGUF, context
    and threads), without the front's guard (its checks are RidgeFill's) and no RidgeFill counter looked for."""
    argv = [a for i, a in enumerate(plan.argv) if a != "--guard" and (i == 0 or plan.argv[i - 1] != "--guard")]
    return replace(plan, argv=[*argv, "--stock"], banner=plan.banner.split(" with RidgeFill")[0] +
                   " (stock llama.cpp)", log=log, marker=None)


def model_of(described: dict):
    """What a plan reads of the model (runtime/session.ModelFacts, no tokenizer: llama.cpp tokenizes), from its
    description in the SPEC (model_identity's: no weights or tokenizer loaded, here or in the server)."""
    import torch

    from ridgefill.runtime.session import ModelFacts
    from ridgefill.torchfill import ModelShape

    shape = {k: tuple(v) if k == "layer_kinds" else v for k, v in described["shape"].items()}
    if shape.get("hybrid") is not None:
        raise RidgefillError("--engine llamacpp fills llama, qwen2 and qwen3 models (not hybrid ones): use --engine "
                             "ridgefill")
    info = described["model_info"]
    return ModelFacts(None, ModelShape(**shape), described["context_length"], info, info["weights_hash"],
                      torch.float32, torch.device("cpu"))


def served_fill(c, facts):
    """The fill to serve: the fill options', or a serving config's (checked against the model)."""
    from ridgefill.method.fill import load_serving

    if c.serving_config is None:
        fill = c.fill()
    else:
        tuned = load_serving(c.serving_config)
        tuned.check_model(facts.fingerprint, c.serving_config)
        fill = tuned.fill
    return fill


def warn_if_exposed(c, keyed: bool) -> None:
    """A warning on stderr when the server listens beyond this machine without an API key."""
    if not keyed and not is_loopback(c.host):
        try:
            sys.stderr.write(f"warning: --host {c.host} accepts requests from other machines and no --api-key is "
                             "set: anyone who reaches this port can use the server\n")
        except (OSError, ValueError):
            pass
