"""How much memory vLLM's KV cache gets on a CPU build (`ridgefill serve`): vLLM's own CPU default reserves 92 % of
the machine's memory, so serve sizes the cache from the checkpoint's config.json, the length served and the memory
free at start-up (docs/serving.md, "The KV cache on a CPU build"). No vLLM import.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol

from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.args import option_name, option_value

GIB = 1 << 30
KV_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")  # the user sizes vLLM's KV cache


class KvOptions(Protocol):
    """The options the KV cache is sized from (serve's ServeConfig has them; serve.py imports this module, never the
    other way)."""

    server_args: list[str]
    dtype: str
    kv_cache_gib: float | None
    concurrency: int


@dataclass(frozen=True)
class KvPlan:
    args: list[str]  # vLLM options that size the cache ([] where vLLM sizes it)
    summary: str  # what was chosen, in words (printed at start-up)


def kv_cache_plan(c: KvOptions, config: dict, available: int, cpu: bool, environ=os.environ) -> KvPlan:
    """How much memory vLLM's KV cache gets. On a GPU, and wherever the user sized it (vLLM's --kv-cache-memory-bytes
    or --gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE), vLLM's own rule. On a CPU build: --kv-cache-gib, else room
    for --concurrency requests of the longest length served, capped at half of `available` bytes; refused when not
    even one request of that length fits."""
    length, context = served_length(c.server_args, config), model_context(config)
    if length > context and not environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip():
        raise RidgefillError(f"--max-model-len {length:,} exceeds the model's context of {context:,} tokens: lower it")
    named = {option_name(a) for a in c.server_args}
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


def served_length(server_args: list[str], config: dict) -> int:
    """The longest request vLLM will take: --max-model-len if given (vLLM's 1k / 1K forms too), else the model's."""
    given = option_value(server_args, "--max-model-len")
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
