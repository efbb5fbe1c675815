"""Model families: one adapter per Hugging Face `model_type`, registered here (see docs/adding-a-family.md).

base.py holds the `Adapter` interface and the shared pieces (RoPE, RMSNorm, K/V weights); dense.py the
Llama-shaped families; hybrid.py the Gated DeltaNet hybrids, with their delta rule in delta_rule.py.
"""

from __future__ import annotations

from torch import nn

from ridgefill.torchfill.families.base import Adapter
from ridgefill.torchfill.families.dense import DenseAdapter, Qwen2Adapter, Qwen3Adapter
from ridgefill.torchfill.families.hybrid import HybridAdapter, Qwen3_5Adapter, Qwen3NextAdapter
from ridgefill.errors import RidgefillError

_FAMILIES: dict[str, type[Adapter]] = {
    "llama": DenseAdapter,
    "qwen2": Qwen2Adapter,
    "qwen3": Qwen3Adapter,
    "qwen3_5": Qwen3_5Adapter,  # AutoModelForCausalLM gives the text model (model_type qwen3_5_text)
    "qwen3_5_text": Qwen3_5Adapter,
    "qwen3_next": Qwen3NextAdapter,
}


def supported_families() -> tuple[str, ...]:
    """The transformers `model_type`s that have an adapter."""
    return tuple(sorted(_FAMILIES))


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a loaded transformers causal LM, or a one-line error naming the supported families."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _FAMILIES:
        raise RidgefillError(
            f"unsupported architecture '{model_type}': ridgefill supports {', '.join(supported_families())}; "
            "pick a checkpoint of one of those families (docs/adding-a-family.md explains how to add one)"
        )
    return _FAMILIES[model_type](model)


__all__ = ["Adapter", "DenseAdapter", "HybridAdapter", "Qwen2Adapter", "Qwen3Adapter", "Qwen3_5Adapter",
           "Qwen3NextAdapter", "adapter_for", "supported_families"]
