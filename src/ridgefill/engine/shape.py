"""The shape of a loaded model, as the commands that count its work read it (evals/flops.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.engine.families.base import Adapter


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
        return cls(adapter.n_layers, adapter.hidden_size, adapter.n_heads, adapter.n_kv_heads, adapter.head_dim,
                   getattr(c, "intermediate_size", None), c.vocab_size, kinds)
