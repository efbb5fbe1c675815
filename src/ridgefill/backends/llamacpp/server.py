"""llama.cpp's server behind the serving seam (LlamaCppServer; the front, serve/, runs what it builds): llama.cpp's own
`llama-server`, patched (patches/server.patch: the fill per slot) and installed by `make install` beside ridgefill
(build.py), behind a small front (app.py, run as `python -m ridgefill.backends.llamacpp.app SPEC`: the guard,
admission, the proxy). SPEC is a JSON file in serve's scratch folder (the binary, the GGUF, the maps as a GGUF adapter
and the fill's settings, threads, context, slots, address, the admission bound); the API key is in the environment
(KEY_ENV), the front's request guard named with --guard. Before it starts: the build (library.py) and llama-server,
the GGUF and its architecture, the fill (ridge maps, .gguf as they are, .safetensors converted to an F32 adapter in the
scratch folder; identity fill as an adapter without maps), and the options serve hands on (--api-key, --n-ctx and
--parallel only: vLLM's options are refused); each problem one line and exit code 2. Stock (fill None, bench-serve's
baseline): the same llama-server without --ridgefill, no guard.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ridgefill.backends.counters import MARKER
from ridgefill.backends.serving import GuardDialect, Launch, LogDialect, Server, health_url, served_name
from ridgefill.defaults import DEFAULT_CHUNK
from ridgefill.errors import RidgefillError

APP = "ridgefill.backends.llamacpp.app"  # the server process's module
KEY_ENV = "RIDGEFILL_LLAMACPP_API_KEY"  # the server's API key (serve moves --api-key here, off the command line)
API_KEY = "--api-key"
N_CTX = "--n-ctx"
PARALLEL = "--parallel"
TAKEN = (API_KEY, N_CTX, PARALLEL)  # the options of llama-server serve hands on
VALUES = {API_KEY: "KEY", N_CTX: "N", PARALLEL: "N"}
SERVER_ENV = "RIDGEFILL_LLAMA_SERVER"  # another llama-server binary of the same patches (a developer's build)
N_UBATCH = 512  # llama.cpp's default ubatch (as the backend runs it)


def split_args(args: list[str]) -> dict[str, str]:
    """serve's extra arguments as {option: value}: --api-key KEY, --n-ctx N and --parallel N (or --name=value),
    nothing else."""
    found, i = {}, 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name not in TAKEN:
            what = f"{arg!r} is not an option of serve" if not arg.startswith("-") else f"{name} is not an option"
            raise RidgefillError(f"{what} of --engine llamacpp's server, which takes {API_KEY} KEY, {N_CTX} N and "
                                 f"{PARALLEL} N (vLLM's options need --engine vllm)")
        if not eq:
            if i + 1 >= len(args):
                raise RidgefillError(f"{name} needs a value: {name} {VALUES[name]}")
            value, i = args[i + 1], i + 1
        if name in found:
            raise RidgefillError(f"{name} is given twice: give it once")
        found[name] = value
        i += 1
    if N_CTX in found and (not found[N_CTX].isdigit() or not 1 <= int(found[N_CTX]) <= 1 << 24):
        raise RidgefillError(f"{N_CTX} {found[N_CTX]!r} is not a number of tokens: give e.g. {N_CTX} 4096")
    if PARALLEL in found and (not found[PARALLEL].isdigit() or not 1 <= int(found[PARALLEL]) <= 64):
        raise RidgefillError(f"{PARALLEL} {found[PARALLEL]!r} is not a number of slots: give 1..64, e.g. {PARALLEL} 2")
    if API_KEY in found and not found[API_KEY]:
        raise RidgefillError(f"{API_KEY} is empty: give a key, or drop it")
    return found


def llama_server() -> Path:
    """The patched llama-server `make install` put beside this interpreter (RIDGEFILL_LLAMA_SERVER names another
    build of the same patches); one line when it is not there."""
    from ridgefill.backends.llamacpp import library

    found = Path(os.environ.get(SERVER_ENV) or Path(sys.executable).parent / "llama-server")
    if not os.access(found, os.X_OK):
        raise RidgefillError(f"llama.cpp's llama-server is not installed beside ridgefill ({found.parent}): "
                             f"{library.INSTALL}")
    return found


class LlamaCppServer(Server):
    """llama.cpp's llama-server with the fill per slot, behind the front (app.py); or stock (fill None: no
    --ridgefill)."""

    name = "llamacpp"
    title = "llama.cpp"
    # requests carry RidgeFill's options as top-level fields (ridgefill_tail beside prompt); the front reads its key
    # from KEY_ENV (serve moves --api-key there)
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
                                 "tokens per slot (default: the model's context); drop --kv-cache-gib")
        if gguf_file(c.model) is None:
            raise RidgefillError(f"--engine llamacpp runs GGUF files, not {c.model}: give --model a .gguf file or an "
                                 f"embedded alias ({', '.join(ALIASES)})")
        library.check_installed()
        llama_server()

    def served_dtype(self, dtype: str, model: str) -> str:
        return "gguf"  # the GGUF's own weight types (check refuses any --dtype but auto)

    def keyed(self, c) -> bool:
        return API_KEY in split_args(c.server_args) or bool(os.environ.get(KEY_ENV))

    def launch(self, c, fill, scratch: Path, guard: str | None, env: dict) -> Launch:
        """The GGUF's architecture checked (the fill was checked by the front); the maps as a GGUF adapter; the SPEC
        written in `scratch`; the command (--guard, or --stock without a fill) and environment (the API key, the
        front's `env`)."""
        from ridgefill.backends.llamacpp.gguf_header import check_family
        from ridgefill.runtime.models import gguf_file, model_identity

        taken = split_args(c.server_args)
        gguf = gguf_file(c.model)
        check_family(gguf)
        identity = model_identity(c.model)
        n_ctx = int(taken.get(N_CTX, 0)) or identity.context_length or 4096
        parallel = int(taken.get(PARALLEL, 1))
        threads = os.cpu_count() or 1
        spec = {"binary": str(llama_server()), "gguf": str(gguf), "name": served_name(c.model), "fill": None,
                "n_ctx": n_ctx, "parallel": parallel, "n_batch": min(DEFAULT_CHUNK, n_ctx),
                "n_ubatch": min(N_UBATCH, DEFAULT_CHUNK, n_ctx), "threads": threads, "host": c.host, "port": c.port,
                "queue": c.concurrency}
        if fill is not None:
            spec["fill"] = {"adapter": str(adapter_of(fill, c.model, identity, scratch)), "tail": fill.tail,
                            "keep_first": fill.keep_first, "outlier_factor": fill.outlier_factor}
        path = scratch / ("llamacpp-server.json" if fill is not None else "llamacpp-stock.json")
        path.write_text(json.dumps(spec, indent=1))
        key = {KEY_ENV: taken[API_KEY]} if API_KEY in taken else {}
        mode = ["--guard", guard] if guard else []
        argv = [sys.executable, "-m", APP, str(path), *mode, *(["--stock"] if fill is None else [])]
        return Launch(argv, {**os.environ, **key, **env}, health_url(c.host, c.port),
                      f"llama-server, {parallel} slot{'s' * (parallel > 1)} of {n_ctx} tokens, {c.concurrency} "
                      f"requests admitted at once, {threads} threads", Path(),
                      MARKER if fill is not None else None, title=self.title, dialect=self.log)

    def context_args(self, tokens: int) -> list[str]:
        return [N_CTX, str(tokens)]  # the server's context (its K/V cache) holds `tokens` tokens

    def bench_concurrency(self, requests: int) -> int | None:
        return requests  # every request of a rate admitted (one runs, the rest wait): none answered 503

    def drive(self, base: str, model: str, tokenizer, prompts: list[list[int]], rate: float, output_tokens: int,
              seed: int, time_limit: float, salt: str = "") -> list[dict]:
        """ridgefill's load client (backends/load.py): each prompt is its tokens decoded (llama-server tokenizes them
        again with the GGUF's own vocabulary); greedy with no repeat penalty and end-of-sequence kept out by a logit
        bias. `salt` is vLLM's prefix-cache salt: consecutive prompts here share no prefix, so llama-server's prefix
        reuse has none to find."""
        from ridgefill.backends.load import drive_completions

        texts = [tokenizer.decode(p) for p in prompts]
        extra = {"repeat_penalty": 1.0}
        if tokenizer.eos_token_id is not None:
            extra["logit_bias"] = {str(tokenizer.eos_token_id): -100.0}
        return drive_completions(base, model, texts, rate, output_tokens, seed, time_limit, extra)


def adapter_of(fill, model: str, identity, scratch: Path) -> Path:
    """The fill's maps as the GGUF adapter llama-server reads (--ridgefill): a .gguf as it is; .safetensors maps
    written as an F32 adapter in `scratch` (the same numbers as the file); identity fill an adapter without maps."""
    from ridgefill.method.maps import load_maps, write_maps
    from ridgefill.method.maps_gguf import is_gguf

    if fill.variant not in ("ridge", "identity"):
        raise RidgefillError(f"--engine llamacpp's server fills with ridge maps or identity fill, not {fill.variant}: "
                             "serve ridge maps (--maps) or identity fill")
    if fill.maps is not None and is_gguf(fill.maps):
        return Path(fill.maps).resolve()
    out = scratch / "maps.gguf"
    if fill.maps is not None:
        tensors, meta, _ = load_maps(fill.maps)
        write_maps(out, tensors, meta, "f32", model=model)
    else:
        meta = {"kind": "identity", "split": fill.split, "n_layers": identity.shape.layers,
                "model": dict(identity.info)}
        write_maps(out, {}, meta, "f32", model=model)
    return out


SERVER = LlamaCppServer()
