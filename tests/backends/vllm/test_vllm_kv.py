"""The vLLM plugin's filled K/V: vLLM's RoPE tables in the engine's layout (rope_at), so that the engine's one
projection (torchfill/projection.py layer_kv) rotates keys exactly as vLLM's own rotary embedding does."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

from ridgefill.torchfill.families.base import apply_rope  # noqa: E402
from ridgefill.backends.vllm.plugin.model import rope_at  # noqa: E402


@pytest.mark.parametrize("rotary_dim", [16, 4])  # whole head (Llama, Qwen) and partial (Qwen3-Next)
def test_rope_tables_rotate_keys_as_vllms_rotary_embedding(rotary_dim):
    heads, head_dim = 3, 16
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(head_dim, rotary_dim, 512, 10000.0, True, torch.float32)
    positions = torch.tensor([0, 5, 6, 100, 511])
    keys = torch.randn(positions.numel(), heads * head_dim, generator=torch.Generator().manual_seed(0))
    want, _ = rope.forward_native(positions, keys.clone())  # vLLM rotates its "query" argument
    cos, sin = rope_at(rope, positions, torch.float32)  # [n, Dr]
    got = apply_rope(keys.view(-1, heads, head_dim).transpose(0, 1), cos, sin).transpose(0, 1)
    assert (got.reshape(want.shape) - want).abs().max() <= 1e-6
