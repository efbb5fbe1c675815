"""The tiny random-init models every test builds (no downloads): one builder per format.

- in memory: `tiny_model(family)` for every supported family, dense (Llama, Qwen2, Qwen3) and hybrid (Qwen3.5,
  Qwen3-Next), its norms and biases perturbed so the tests exercise them;
- a Hugging Face folder (config, weights, a byte-level BPE tokenizer trained here) that commands load with
  `--model PATH`: `save_tiny_checkpoint`;
- a GGUF file: tests/backends/llamacpp/tiny_gguf.py writes a `tiny_model` as llama.cpp's converter would;

and the text they see (`training_text`, `write_corpus`) and random prompts (`random_ids`). The shared fixtures built
from them live in tests/conftest.py."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config,
                          Qwen3NextConfig)

VOCAB = 128
DENSE_FAMILIES = ["llama", "qwen2", "qwen3"]
HYBRID_FAMILIES = ["qwen3_5", "qwen3_next"]
L, A = "linear_attention", "full_attention"
HYBRID_LAYERS = [L, L, A, L, L, A]  # default: linear layer first (Cache.length reads layer 0), attention last

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
ROPE = {"llama": LLAMA3_ROPE, "qwen2": DEFAULT_ROPE, "qwen3": YARN_ROPE}  # each dense family's rope by default


def tiny_config(family: str, rope: dict | None = None, **overrides):
    """A tiny config of `family` (6 layers, hidden 64, 4 query and 2 K/V heads); `rope` replaces a dense family's
    rope (ROPE), `overrides` any field. Hybrids: Gated DeltaNet and gated full-attention layers (partial RoPE 0.25,
    so 4 of 16 head dims rotate); linear layers have 2 key heads serving 4 value heads; Qwen3-Next's layers use a
    4-expert top-2 MoE with a shared expert except layer 1 (dense MLP)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if family in HYBRID_FAMILIES:
        common.update(intermediate_size=96, layer_types=HYBRID_LAYERS, head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4)
        common.update(overrides)
        common["num_hidden_layers"] = len(common["layer_types"])
        if family == "qwen3_5":
            return Qwen3_5TextConfig(**common)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   mlp_only_layers=[1])
        return Qwen3NextConfig(**{**moe, **common})
    if family not in ROPE:
        raise ValueError(family)
    common.update(intermediate_size=128, rope_parameters=rope or ROPE[family])
    if family == "qwen3":
        common["head_dim"] = 16
    common.update(overrides)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**common)


def tiny_model(family: str, seed: int = 0, rope: dict | None = None, **overrides):
    """A tiny random-init model of `family` (tiny_config) in float32, eval mode, built from `seed`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, rope, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random init leaves norms at 1 and biases at 0 (incl. q/k norms, the gated norm and dt_bias)
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties flipped by rounding
                p.mul_(20.0)
            if ".linear_attn.in_proj" in name or ".linear_attn.conv1d" in name:  # O(1) q/k/v, gates and states
                p.mul_(6.0 if "in_proj" in name else 25.0)
            if name.endswith("A_log"):
                # Moderate decays (init draws A up to 16: a head then sees ~one token, its output q.k v is
                # often near zero, and the gated RMSNorm blows fp32 rounding up ~1e4x). Here a state spans
                # several tokens, as in trained checkpoints.
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
    return model


def random_ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


# --- a Hugging Face folder -------------------------------------------------------------------------------------
WORDS = ("the grass is green sky blue sun yellow here we go there and back again one of special magic number "
         "numbers word words for key value is what are all mentioned in provided text answer question memorize "
         "king queen lord lady castle river night day love war time friend enemy letter").split()


def training_text(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."] * 20
    for _ in range(n):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + ".")
        lines.append(f"One of the special magic numbers for {rng.choice(WORDS)} is: {rng.randint(10**6, 10**7 - 1)}.")
    return lines


def write_corpus(path: Path, seed: int, lines_per_document: int, n: int = 600) -> Path:
    """A .txt corpus of training_text(n, seed) lines, `lines_per_document` to a document (documents are separated
    by two blank lines, as ridgefill's .txt reader splits them)."""
    lines = training_text(n, seed=seed)
    path.write_text("\n\n\n".join(" ".join(lines[i:i + lines_per_document])
                                  for i in range(0, len(lines), lines_per_document)))
    return path


def save_tiny_checkpoint(path: Path, family: str = "llama", vocab: int = 512, dtype=None, **overrides) -> Path:
    """Write config, weights and tokenizer of a tiny model of `family` into `path` (a folder commands load with
    `--model`), its weights in `dtype` (None: float32)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    settings = dict(vocab_size=len(fast), max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    settings.update(overrides)
    model = tiny_model(family, **settings)
    if dtype is not None:
        model = model.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    torch.manual_seed(0)
    return path
