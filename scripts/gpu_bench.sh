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

"$PY" scripts/random_checkpoint.py "$WORK" "$SPLIT" llama-3b  # model, tokenizer, random maps, calibration text

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
