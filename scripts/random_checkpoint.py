"""A random-init Llama-shape checkpoint (bf16), a small BPE tokenizer, random full-rank maps for split S whose
weights hash matches it, and a calibration text, for the GPU scripts (timing depends on neither the weights nor
map quality). Usage: python scripts/random_checkpoint.py WORK SPLIT SHAPE [DEVICE] (default cuda: the model is made
there); prints the time to make and to save the weights, then the folder and maps.
SHAPE: llama-3b (Llama-3.2-3B: 28 layers, H 3072) or llama-8b (Llama-3.1-8B: 32 layers, H 4096); tiny (a check
that runs on the CPU); hybrid Qwen3-Next shapes (Gated DeltaNet x3 + gated attention, repeated; MoE MLPs):
qwen3-next-cpu (12 layers, H 512: an 8,192-token prefill takes seconds on 2 CPU cores) and qwen3-next-a3b
(Qwen3-Next-80B-A3B's layers, widths and active experts, 64 experts instead of 512 so it fits one GPU: the compute
per token is the same)."""
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3NextConfig

from ridgefill.method.maps import save_maps
from ridgefill.method.ridge import LayerFit
from ridgefill.runtime.models import checkpoint_fingerprint

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, rope factor, tied embeddings
    "llama-3b": (3072, 8192, 28, 24, 8, 32.0, True),
    "llama-8b": (4096, 14336, 32, 32, 8, 8.0, False),
    "tiny": (256, 512, 4, 4, 2, 8.0, True),
}

HYBRID = {  # hidden, layers, heads, kv heads, head_dim, linear key / value heads, linear head dim, experts,
    # experts per token, expert width, shared expert width, vocabulary
    "qwen3-next-cpu": (512, 12, 8, 2, 64, 4, 8, 64, 8, 2, 256, 512, 32000),
    "qwen3-next-a3b": (2048, 48, 16, 2, 256, 16, 32, 128, 64, 10, 512, 512, 151936),
}


def hybrid_config(shape: str) -> Qwen3NextConfig:
    h, n_layers, heads, kv_heads, head_dim, k_heads, v_heads, dim, experts, top, width, shared, vocab = HYBRID[shape]
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4)
    return Qwen3NextConfig(vocab_size=vocab, hidden_size=h, intermediate_size=4 * width, num_hidden_layers=n_layers,
                           layer_types=kinds, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=head_dim, partial_rotary_factor=0.25,
                           linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dim,
                           linear_value_head_dim=dim, linear_conv_kernel_dim=4, num_experts=experts,
                           num_experts_per_tok=top, moe_intermediate_size=width,
                           shared_expert_intermediate_size=shared, max_position_embeddings=131072,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


work, split, shape = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
folder = work / f"{shape}-random"
maps = work / (f"maps-{shape}-s{split}.safetensors" if shape in HYBRID else f"maps-s{split}.safetensors")
if shape in HYBRID:
    config = hybrid_config(shape)
    h, n_layers = config.hidden_size, config.num_hidden_layers
else:
    h, ffn, n_layers, heads, kv_heads, factor, tied = SHAPES[shape]
    config = LlamaConfig(vocab_size=128256, hidden_size=h, intermediate_size=ffn, num_hidden_layers=n_layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=h // heads,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
if not (folder / "config.json").exists():
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # made where it will run: on a GPU, 8B parameters initialise in seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    made = time.perf_counter()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the grass is green and the sky is blue"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model.save_pretrained(folder)  # the commands load a folder: the weights are written once
    fast.save_pretrained(folder)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"made {size / 2**30:.1f} GiB of bf16 weights on {device} in {made - t0:.1f} s, saved in "
          f"{time.perf_counter() - made:.1f} s")
    del model
if not maps.exists():
    g = torch.Generator().manual_seed(0)
    fits = [LayerFit(layer, 1e-3, torch.eye(h) + 0.01 * torch.randn(h, h, generator=g), torch.zeros(h), None,
                     float("nan"), float("nan"), float("nan")) for layer in range(split + 1, n_layers)]
    save_maps(maps, split, n_layers, fits, {"model": {"id": str(folder), "weights_hash": checkpoint_fingerprint(folder)},
                                            "rank": None}, "ridge")
(work / "calibration.txt").write_text("\n\n\n".join(
    " ".join(f"word{(i * 7919 + j * 104729) % 5000}" for j in range(400)) for i in range(200)))
print(f"model {folder}, maps {maps}")
