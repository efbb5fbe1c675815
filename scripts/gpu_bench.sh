#!/usr/bin/env bash
# One-shot GPU check, NOT YET RUN on a GPU: (1) `calibrate --device cuda` (the statistics accumulate on the GPU)
# and `fit` on a random-init Llama-3.2-3B-shape model (~6.4 GB in bf16); (2) bench-ttft at 8k-32k tokens on
# CUDA bf16, with the fill projection's Triton kernel (and the torch path for comparison).
# Timing does not depend on the weights or on map quality, so the model and its maps are random; they are
# written under $WORK (default /tmp/ridgefill-gpu) and the result JSONs under $OUT (default runs/gpu).
#
#   bash scripts/gpu_bench.sh            # needs: a CUDA GPU with >= 24 GB, torch with CUDA, triton
#   LENGTHS=8192,16384 REPEATS=3 bash scripts/gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-/tmp/ridgefill-gpu}
OUT=${OUT:-runs/gpu}
LENGTHS=${LENGTHS:-8192,16384,32768}
REPEATS=${REPEATS:-5}
SPLIT=${SPLIT:-14}  # of 28 layers
mkdir -p "$WORK" "$OUT"

"$PY" - "$WORK" "$SPLIT" <<'EOF'
"""Write a random-init Llama-3.2-3B-shape checkpoint (bf16, made on the GPU), a small BPE tokenizer, and random
full-rank maps for split S whose weights hash matches the checkpoint."""
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from ridgefill.method.maps import save_maps
from ridgefill.runtime.models import checkpoint_fingerprint
from ridgefill.method.ridge import LayerFit

work, split = Path(sys.argv[1]), int(sys.argv[2])
folder, maps = work / "llama-3b-random", work / f"maps-s{split}.safetensors"
if not (folder / "config.json").exists():
    config = LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
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
    config = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).config
    h, n_layers = config.hidden_size, config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    fits = [LayerFit(l, 1e-3, torch.eye(h) + 0.01 * torch.randn(h, h, generator=g), torch.zeros(h), None,
                     float("nan"), float("nan"), float("nan")) for l in range(split + 1, n_layers)]
    save_maps(maps, split, n_layers, fits, {"model": {"id": str(folder), "weights_hash": checkpoint_fingerprint(folder)},
                                            "rank": None}, "ridge")
(work / "calibration.txt").write_text("\n\n\n".join(
    " ".join(f"word{(i * 7919 + j * 104729) % 5000}" for j in range(400)) for i in range(200)))
print(f"model {folder}, maps {maps}")
EOF

# (1) calibrate on the GPU (statistics on the model's device, then saved from the CPU) and fit: the check is that
# it runs and that fit's held-out table prints; the numbers of a random model mean nothing.
.venv/bin/ridgefill calibrate --model "$WORK/llama-3b-random" --data "$WORK/calibration.txt" --split "$SPLIT" \
  --tokens 16384 --seq-len 2048 --device cuda --dtype bf16 --restart --out "$WORK/stats-cuda.safetensors"
.venv/bin/ridgefill fit --stats "$WORK/stats-cuda.safetensors" --lam 1e-3 --out "$OUT/maps-cuda.safetensors"

# (2) time to first token
for projection in triton torch; do
  .venv/bin/ridgefill bench-ttft --model "$WORK/llama-3b-random" --maps "$WORK/maps-s$SPLIT.safetensors" \
    --tail 256 --lengths "$LENGTHS" --repeats "$REPEATS" --warmup 1 --device cuda --dtype bf16 --data random \
    --projection "$projection" --out "$OUT/ttft-llama3b-bf16-$projection.json"
done
