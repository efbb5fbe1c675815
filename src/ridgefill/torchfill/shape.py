"""The shape of a loaded model, as the commands that count its work read it (evals/flops.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.torchfill.families.base import Adapter


@dataclass(frozen=True)
class HybridShape:
    """What a hybrid model's layers (Qwen3.5 / Qwen3-Next, docs/hybrid.md) have beyond a dense layer's shape."""

    q_gate: bool  # the attention layers' q_proj also emits the output gate (another Hq·D outputs)
    key_heads: int  # Gated DeltaNet: key (and query) heads
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int
    moe_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE MLP (else the dense MLP of `intermediate`)
    experts: int = 0  # routed experts (the router's outputs)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert's width (0: none)

    @classmethod
    def from_config(cls, config: dict, layers: int) -> "HybridShape":
        """From a hybrid checkpoint's (text) config, as a dict (config.json, or a config's to_dict())."""
        experts = int(config.get("num_experts") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        moe = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
        return cls(bool(config.get("attn_output_gate", True)), config["linear_num_key_heads"],
                   config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"],
                   config["linear_conv_kernel_dim"], moe, experts, int(config.get("num_experts_per_tok") or 0),
                   int(config.get("moe_intermediate_size") or 0), int(config.get("shared_expert_intermediate_size")
                                                                      or 0))


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int | None  # the MLP's width (None: the config names none)
    vocab: int
    layer_kinds: tuple[str, ...] = ()  # per layer ("attention", "linear", ...); () : every layer attention
    hybrid: HybridShape | None = None  # a hybrid model's linear layers, output gate and MoE MLPs

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", ("attention",) * self.layers)

    @property
    def dense(self) -> bool:
        """Every layer is an attention layer."""
        return all(kind == "attention" for kind in self.layer_kinds)

    @classmethod
    def of(cls, adapter: Adapter) -> "ModelShape":
        c = adapter.config
        kinds = tuple(adapter.layer_kind(i) for i in range(adapter.n_layers))
        hybrid = None if all(k == "attention" for k in kinds) else HybridShape.from_config(c.to_dict(),
                                                                                           adapter.n_layers)
        return cls(adapter.n_layers, adapter.hidden_size, adapter.n_heads, adapter.n_kv_heads, adapter.head_dim,
                   getattr(c, "intermediate_size", None), c.vocab_size, kinds, hybrid)
