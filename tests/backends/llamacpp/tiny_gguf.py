"""Tiny GGUF files written by the tests themselves (the `gguf` package): a transformers model of the Llama, Qwen2
or Qwen3 family with random weights, written as llama.cpp's converter writes it (F32 tensors; Llama's Q/K rows
permuted for llama.cpp's RoPE; a byte-level BPE vocabulary of the model's size), so that llama.cpp and
torchfill run the same weights."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tiny_models import DEFAULT_ROPE, LLAMA3_ROPE, tiny_model  # noqa: F401  (LLAMA3_ROPE: for the tests)

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# what llama.cpp's converter takes of each family: its rope unscaled unless a test asks (Llama-3 scaling: rope=
# LLAMA3_ROPE, written as rope_freqs), Qwen3 with head dim 128 (transformers converts 128 only)
CONVERTIBLE = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}


def build(family: str, path: Path, seed: int = 0, rope: dict | None = None, **overrides):
    """(the tiny model of `family` (tests/tiny_models.py), its GGUF file written at `path`)."""
    m = tiny_model(family, seed, rope or DEFAULT_ROPE, **{**CONVERTIBLE[family], **overrides})
    return m, write(m, path, family)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order of a Llama Q/K projection (convert_hf_to_gguf's permute): each head's halves
    interleaved, for RoPE on adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(k: np.ndarray, heads: int) -> np.ndarray:
    """K rows [n, Hkv·D] in llama.cpp's Llama order back to transformers' order (the inverse of `permute`)."""
    n, width = k.shape
    d = width // heads
    return k.reshape(n, heads, d // 2, 2).swapaxes(2, 3).reshape(n, width)


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def llama3_rope_factors(cfg, head_dim: int) -> np.ndarray | None:
    """llama.cpp's rope_freqs of a Llama-3 rope scaling (None for another rope): per frequency the divisor that
    transformers' llama3 rope applies to it (1 for short wavelengths, `factor` for long ones, smooth between)."""
    rope = cfg.rope_parameters
    if rope.get("rope_type") != "llama3":
        return None
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(m, path: Path, family: str) -> Path:
    """Write transformers model `m` as a GGUF file of architecture `family`."""
    import gguf

    cfg = m.config
    arch = ARCH[family]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # a byte-level BPE vocabulary: the first VOCAB - 2 bytes' characters and two merges
    chars = _bytes_to_unicode()
    tokens = [chars[i] for i in range(cfg.vocab_size - 2)] + [chars[97] + chars[98], chars[99] + chars[100]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges([f"{chars[97]} {chars[98]}", f"{chars[99]} {chars[100]}"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(False)

    def put(name, t):
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    sd = m.state_dict()
    factors = llama3_rope_factors(cfg, head_dim)
    if factors is not None:  # Llama-3 rope scaling, as convert_hf_to_gguf writes it: one tensor of frequency divisors
        w.add_tensor("rope_freqs.weight", factors)
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if family == "llama":
            q, k = permute(q, cfg.num_attention_heads), permute(k, cfg.num_key_value_heads)
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", q)
        put(f"blk.{i}.attn_k.weight", k)
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if family == "qwen2":
            for x in "qkv":
                put(f"blk.{i}.attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"])
        if family == "qwen3":
            put(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            put(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def missing_build() -> str | None:
    """None when the patched llama-cpp-python is installed; else why not (its one line)."""
    from ridgefill.backends.llamacpp.library import check_installed
    from ridgefill.errors import RidgefillError

    try:
        check_installed()
    except RidgefillError as exc:
        return str(exc)
    return None


def embedded_gguf() -> Path:
    """The embedded model's GGUF file (runtime/models.py's alias smollm2-135m)."""
    from ridgefill.runtime.models import ALIASES, _gguf_dir

    return _gguf_dir("smollm2-135m", ALIASES["smollm2-135m"]) / ALIASES["smollm2-135m"].filename


