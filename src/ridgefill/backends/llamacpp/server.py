"""llama.cpp's server behind the serving seam (LlamaCppServer; the front, serve/, runs what it builds): llama-cpp-
python's OpenAI-compatible server with the fill (app.py, run as `python -m ridgefill.backends.llamacpp.app SPEC`),
SPEC a JSON file in serve's scratch folder (the GGUF, the fill settings, threads, context, address, the admission
bound), the API key in the environment (KEY_ENV), the front's request guard named with --guard. Before it starts:
the build (library.py) and llama-cpp-python's server extra, the GGUF and its architecture, the fill in llama.cpp's
form, and the options serve hands on (--api-key and --n-ctx only: vLLM's options are refused); each problem one line
and exit code 2. Stock (fill None, bench-serve's baseline): the same SPEC without a fill and --stock: llama-cpp-
python's own prefill, no guard, no RidgeFill counter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from ridgefill.backends.counters import MARKER
from ridgefill.backends.serving import GuardDialect, Launch, LogDialect, Server, health_url
from ridgefill.defaults import DEFAULT_CHUNK
from ridgefill.errors import RidgefillError

APP = "ridgefill.backends.llamacpp.app"  # the server process's module
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


class LlamaCppServer(Server):
    """llama-cpp-python's OpenAI-compatible server on the patched build, its prompt prefill the driver's fill; or
    stock (fill None: llama-cpp-python's own prefill)."""

    name = "llamacpp"
    title = "llama.cpp"
    # requests carry RidgeFill's options as top-level fields (ridgefill_tail beside prompt); the server reads its key
    # from KEY_ENV (serve moves --api-key there) and llama-cpp-python checks it after the guard
    guard = GuardDialect(options_field="", key_env=KEY_ENV)
    log = LogDialect(fill_fix="rebuild ridgefill's llama.cpp (make install)")

    def check(self, c, own: list[str]) -> None:
        from ridgefill.backends.llamacpp import library
        from ridgefill.runtime.models import ALIASES, gguf_file

        split_args(c.server_args)
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
            import llama_cpp.server.app  # noqa: F401  (its server extra: fastapi, sse-starlette, starlette-context)
        except ImportError as exc:
            raise RidgefillError(f"llama-cpp-python's server needs the package {(exc.name or '?').split('.')[0]}, "
                                 f"which is not installed: {library.INSTALL}") from None

    def served_dtype(self, dtype: str, model: str) -> str:
        return "gguf"  # the GGUF's own weight types (check refuses any --dtype but auto)

    def keyed(self, c) -> bool:
        return API_KEY in split_args(c.server_args) or bool(os.environ.get(KEY_ENV))

    def launch(self, c, fill, scratch: Path, guard: str | None, env: dict) -> Launch:
        """The GGUF's architecture checked (the fill was checked by the front: its variants and maps are the ones the
        driver takes); the SPEC written in `scratch`; the command (--guard, or --stock without a fill) and environment
        (the API key, the front's `env`)."""
        from ridgefill.backends.llamacpp import driver
        from ridgefill.runtime.models import gguf_file, model_identity

        taken = split_args(c.server_args)
        gguf = gguf_file(c.model)
        arch = driver.check_family(gguf)
        identity = model_identity(c.model)
        described = {"shape": dataclasses.asdict(identity.shape), "context_length": identity.context_length,
                     "model_info": {k: v for k, v in identity.info.items() if k != "n_layers"}}
        n_ctx = int(taken.get(N_CTX, 0)) or identity.context_length or 4096
        threads = os.cpu_count() or 1
        spec = {"gguf": str(gguf), "arch": arch, "model": described, "name": c.model,
                "fill": fill.describe() if fill is not None else None, "chunk": DEFAULT_CHUNK, "n_ctx": n_ctx,
                "n_batch": min(DEFAULT_CHUNK, n_ctx), "n_ubatch": min(N_UBATCH, DEFAULT_CHUNK, n_ctx),
                "threads": threads, "host": c.host, "port": c.port, "queue": c.concurrency}
        if fill is not None and fill.maps is not None:  # the server loads the bytes checked here (sha256 pinned)
            from ridgefill.runtime.paths import file_sha256

            spec["fill"]["maps"] = str(Path(fill.maps).resolve())
            spec["fill"]["maps_sha256"] = fill.maps_sha256 or file_sha256(fill.maps)
        path = scratch / ("llamacpp-server.json" if fill is not None else "llamacpp-stock.json")
        path.write_text(json.dumps(spec, indent=1))
        key = {KEY_ENV: taken[API_KEY]} if API_KEY in taken else {}
        mode = ["--guard", guard] if guard else []
        argv = [sys.executable, "-m", APP, str(path), *mode, *(["--stock"] if fill is None else [])]
        return Launch(argv, {**os.environ, **key, **env}, health_url(c.host, c.port),
                      f"context {n_ctx} tokens, {c.concurrency} requests admitted at once, {threads} threads", Path(),
                      MARKER if fill is not None else None, title=self.title, dialect=self.log)

    def context_args(self, tokens: int) -> list[str]:
        return [N_CTX, str(tokens)]  # the server's context (its K/V cache) holds `tokens` tokens

    def bench_concurrency(self, requests: int) -> int | None:
        return requests  # every request of a rate admitted (one runs, the rest wait): none answered 503

    def drive(self, base: str, model: str, tokenizer, prompts: list[list[int]], rate: float, output_tokens: int,
              seed: int, time_limit: float, salt: str = "") -> list[dict]:
        """ridgefill's load client (backends/load.py): llama-cpp-python's server takes text, so each prompt is its
        tokens decoded (the server tokenizes them again with the GGUF's own vocabulary); greedy with no repeat
        penalty and end-of-sequence kept out by a logit bias. `salt` is vLLM's prefix-cache salt: consecutive
        prompts here share no prefix, so llama.cpp's prefix reuse has none to find."""
        from ridgefill.backends.load import drive_completions

        texts = [tokenizer.decode(p) for p in prompts]
        extra = {"repeat_penalty": 1.0}
        if tokenizer.eos_token_id is not None:
            extra["logit_bias"] = {str(tokenizer.eos_token_id): -100.0}
        return drive_completions(base, model, texts, rate, output_tokens, seed, time_limit, extra)


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


SERVER = LlamaCppServer()
