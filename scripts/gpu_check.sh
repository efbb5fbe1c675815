#!/usr/bin/env bash
# One prepared command for a GPU machine without network access whose Python has torch, Triton and transformers but
# not vLLM (and perhaps not pytest): it runs the project from src/ (PYTHONPATH=src python -m ridgefill ...), writes
# every result as JSON and ends with a summary table (scripts/gpu_summary.py). Planned at about 7 minutes on an H200,
# the model's creation included, and bounded by TOTAL (480 s): a step that would start after it is recorded as not
# run, and each step's timeout is cut to what is left (docs/performance.md, "Results: GPU", has the plan, its
# estimated step times and the exact device call):
#   1. env          versions, the GPU (nvidia-smi)
#   2. tests        pytest tests/gpu (-rs, a JUnit summary)
#   3. attention    scripts/attention_check.py (the CUDA attention routes against float32)
#   4. projection   scripts/projection_check.py (fused vs per-layer fill projection, errors and CUDA-event times)
#   5. checkpoint   scripts/random_checkpoint.py: a random-init Llama-3.1-8B-shape checkpoint (bf16, made on the
#                   GPU) and random maps at split 16 (timing depends on neither the weights nor the maps' quality)
#   6. ttft         bench-ttft exact / identity / ridge (and transformers' forward) at 8K and 32K, 3 repeats
#   7. window       the filled window W = 2,048 (identity) at 32K, against exact
#   8. ttft-long    exact / ridge (and transformers' forward) at 128K: one timed round, no warm-up round (a warm-up
#                   round there alone took ~50 s; the first run's one-time costs are those of the first 128K call)
#   9. chunk-*      exact (and identity) at 32K with --chunk 2,048 / 8,192 / 32,768 (the one the ttft step ran with
#                   is taken from it): the CUDA default chunk by measurement
#  10. calibrate    calibrate --device cuda (16K tokens, a quarter held out) + fit: it runs, fit's table prints
# A failed step is recorded (its exit code and log) and the next one runs. After every step the results are bundled
# into $OUT (the device tool returns at most 8 files): $OUT/summary.md, $OUT/results.tar.gz (every JSON and log),
# $OUT/gpu_check.log; the summary and the archive are written to a temporary name and renamed, so a run killed at
# any moment leaves the last whole ones.
#
#   bash scripts/gpu_check.sh                          # on the GPU machine (OUT is set there)
#   DEVICE=cpu SHAPE=tiny bash scripts/gpu_check.sh    # dry run: the same steps on the CPU, tiny shapes (minutes)
#   ONLY="tests attention" bash scripts/gpu_check.sh   # only those steps (a second, short call)
#
# Wheels under .gpu/wheels (`make gpu-carry`: the transformers this project is tested with; the GPU image has 5.17)
# are installed without network into a temporary folder put on PYTHONPATH; the wheels under .gpu/wheels/pytest
# (pytest and what it needs) only when the Python cannot import pytest, and of those only the ones it cannot import.
# Without pip in that Python, wheels are unpacked (pure-Python wheels: the same files). Set PY to choose the Python,
# WHEELS the wheels' folder.
{ # the whole script is one block, read before it runs: editing the file during a run cannot change that run
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-8b}
PY=${PY:-python3}
OUT=${OUT:-$ROOT/runs/gpu-check}
WORK=${WORK:-${TMPDIR:-/tmp}/ridgefill-gpu-check}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}  # seconds: no one step can take the whole run
TOTAL=${TOTAL:-}  # seconds for the whole plan, no step runs past it: 480 (8 min) on the 8B shape, 2,400 tiny (CPU)
ONLY=${ONLY:-}  # step names to run (space- or comma-separated; a name ending in * matches a prefix); empty: all
WHEELS=${WHEELS:-.gpu/wheels}
RESULTS=$WORK/results
mkdir -p "$OUT" "$RESULTS"
rm -f "$RESULTS"/*
LOG=$OUT/gpu_check.log
: >"$LOG"
START=$(date +%s)

if [ "$SHAPE" = 8b ]; then
  CKPT=llama-8b SPLIT=16 LENGTHS=8192,32768 LONG=131072 WLEN=32768 WINDOW=2048 CHUNKS="2048 8192 32768"
  CAL_TOKENS=16384 CAL_SEQ=2048 PSHAPE=8b PREPEATS=20 ATTN_ARGS="" TOTAL=${TOTAL:-480}
elif [ "$SHAPE" = tiny ]; then
  CKPT=tiny SPLIT=2 LENGTHS=512,1024 LONG=2048 WLEN=1024 WINDOW=64 CHUNKS="128 512 2048"
  CAL_TOKENS=2048 CAL_SEQ=256 PSHAPE=tiny PREPEATS=3 ATTN_ARGS="--tiny" TOTAL=${TOTAL:-2400}
else
  echo "SHAPE must be 8b or tiny, got '$SHAPE'" >&2
  exit 2
fi
MODEL=$WORK/$CKPT-random
MAPS=$WORK/maps-s$SPLIT.safetensors

export PYTHONPATH=$ROOT/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rm -rf "$WORK/site"
install_wheels() {  # install_wheels WHEEL...: into $WORK/site, without network (pip; unpacked where there is none)
  [ $# -gt 0 ] || return 0
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$@"
  else
    echo "no pip in $PY: unpacking $*" >&2
    local w
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$WORK/site" || return 1; done
  fi
}
importable() {  # importable MODULE: whether $PY (with the PYTHONPATH so far) finds it
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "$1" 2>/dev/null
}
install_wheels $(compgen -G "$WHEELS/*.whl") 2>&1 | tee -a "$LOG"
export PYTHONPATH=$PYTHONPATH:$WORK/site
if ! importable pytest; then  # the tests step needs it: the carried wheels that this Python lacks
  missing=()
  for w in $(compgen -G "$WHEELS/pytest/*.whl"); do
    mod=$(basename "$w")
    mod=${mod%%-*}
    importable "${mod,,}" || missing+=("$w")
  done
  install_wheels ${missing[@]+"${missing[@]}"} 2>&1 | tee -a "$LOG"
  if importable pytest; then
    echo "pytest: from the carried wheels (${#missing[@]} installed into $WORK/site)" | tee -a "$LOG"
  else
    echo "pytest: not importable and not carried (make gpu-carry puts it under $WHEELS/pytest): the tests step fails" \
      | tee -a "$LOG"
  fi
fi

bundle() {  # everything so far into $OUT: the summary, one archive of the results and logs; each written to a
  # temporary name in $OUT (the same file system) and renamed, so a kill mid-write leaves the last whole one
  "$PY" scripts/gpu_summary.py "$RESULTS" --out "$OUT/.summary.md.partial" >/dev/null 2>>"$LOG" &&
    mv -f "$OUT/.summary.md.partial" "$OUT/summary.md"
  tar -czf "$OUT/.results.tar.gz.partial" -C "$WORK" results 2>>"$LOG" &&
    mv -f "$OUT/.results.tar.gz.partial" "$OUT/results.tar.gz"
}

wanted() {  # wanted NAME: whether ONLY (empty: every step) names it
  [ -z "$ONLY" ] && return 0
  local w
  for w in ${ONLY//,/ }; do
    # shellcheck disable=SC2053  # a name ending in * matches a prefix
    [[ $1 == $w ]] && return 0
  done
  return 1
}

step() {  # step NAME COMMAND...: run it (bounded by STEP_TIMEOUT and what is left of TOTAL), log it, record its
  # exit code and milliseconds; past TOTAL it is recorded as not run (rc 124, 0 ms)
  local name=$1 t0 rc left
  shift
  wanted "$name" || return 0
  left=$((TOTAL - ($(date +%s) - START)))
  if [ "$left" -lt 5 ]; then
    echo "== $name: not run, the plan's $TOTAL s are spent" | tee -a "$LOG" "$RESULTS/$name.log"
    printf '{"step": "%s", "rc": 124, "ms": 0, "skipped": "out of time"}\n' "$name" >>"$RESULTS/steps.jsonl"
    bundle
    return 0
  fi
  [ "$left" -gt "$STEP_TIMEOUT" ] && left=$STEP_TIMEOUT
  t0=$(date +%s%N)
  echo "== $name ($(($(date +%s) - START)) s in, at most $left s): $*" | tee -a "$LOG"
  timeout "$left" "$@" 2>&1 | tee "$RESULTS/$name.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  printf '{"step": "%s", "rc": %d, "ms": %d}\n' "$name" "$rc" "$((($(date +%s%N) - t0) / 1000000))" \
    >>"$RESULTS/steps.jsonl"
  bundle
}

bench() {  # bench NAME ARGS...: bench-ttft on the checkpoint, bf16, tail 256, random prompts, JSON to results/NAME.json
  local name=$1
  shift
  step "$name" "$PY" -m ridgefill bench-ttft --model "$MODEL" --device "$DEVICE" --dtype bf16 --tail 256 --data random \
    --out "$RESULTS/$name.json" "$@"
}

step env "$PY" scripts/gpu_summary.py --env "$RESULTS/env.json"
[ "$DEVICE" = cuda ] && step nvidia-smi nvidia-smi
step tests "$PY" -m pytest -p no:xdist -p no:cacheprovider tests/gpu -q -rs --junitxml="$RESULTS/tests.xml"
if [ -f scripts/attention_check.py ] || [ "$DEVICE" = cuda ]; then  # its absence fails the step on a GPU only
  step attention "$PY" scripts/attention_check.py --device "$DEVICE" --dtype bf16 $ATTN_ARGS \
    --out "$RESULTS/attention.json"
else
  echo "== attention: scripts/attention_check.py is not in this checkout: skipped (dry run)" | tee -a "$LOG"
fi
step projection "$PY" scripts/projection_check.py --device "$DEVICE" --shape "$PSHAPE" --repeats "$PREPEATS" \
  --out "$RESULTS/projection.json"
step checkpoint "$PY" scripts/random_checkpoint.py "$WORK" "$SPLIT" "$CKPT" "$DEVICE"
bench ttft --maps "$MAPS" --variants exact,identity,ridge --lengths "$LENGTHS" --repeats 3 --warmup 1
bench window --split "$SPLIT" --filled-window "$WINDOW" --variants exact,identity --lengths "$WLEN" --repeats 2 \
  --warmup 1
bench ttft-long --maps "$MAPS" --variants exact,ridge --lengths "$LONG" --repeats 1 --warmup 0
# the chunk the ttft step ran with (the CUDA default) is not run again: the summary takes its point from ttft.json
MAIN_CHUNK=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['config']['chunk'])" \
  "$RESULTS/ttft.json" 2>/dev/null || echo none)
for c in $CHUNKS; do
  [ "$c" = "$MAIN_CHUNK" ] && continue
  bench "chunk-$c" --split "$SPLIT" --chunk "$c" --variants exact,identity --lengths "$WLEN" --repeats 1 --warmup 1
done
step calibrate "$PY" -m ridgefill calibrate --model "$MODEL" --data "$WORK/calibration.txt" --split "$SPLIT" \
  --tokens "$CAL_TOKENS" --seq-len "$CAL_SEQ" --holdout 0.25 --device "$DEVICE" --dtype bf16 --restart \
  --out "$WORK/stats.safetensors"
step fit "$PY" -m ridgefill fit --stats "$WORK/stats.safetensors" --lam 1e-3 --out "$WORK/maps-fit.safetensors"
step fit-meta "$PY" scripts/gpu_summary.py --maps-meta "$WORK/maps-fit.safetensors" "$RESULTS/fit.json"

echo "== done in $(($(date +%s) - START)) s" | tee -a "$LOG"
bundle
cat "$OUT/summary.md" | tee -a "$LOG"
exit 0
}
