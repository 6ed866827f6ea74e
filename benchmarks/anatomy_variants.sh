#!/usr/bin/env bash
# The issue-10 table on the GPU: step anatomy at several batches (async and sync loop),
# bf16 state, prefill rate, start-up cold and warm. Results appended to $OUT/*.jsonl.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -c "import jax; print(jax.__version__, jax.devices())"
run() { echo "== $1"; timeout ${T:-170} python benchmarks/step_anatomy.py $1 --out "$OUT/anatomy.jsonl" 2>&1 | grep -v -E "Warning|trace planes|^hlo" | tail -${N:-3}; }
N=14 run "--batch 64 --prompt-len 600"
run "--batch 64 --prompt-len 600 --sync"
run "--batch 1 --prompt-len 2000"
run "--batch 8 --prompt-len 2000"
run "--batch 128 --prompt-len 1100"
run "--batch 256 --prompt-len 300"
run "--batch 256 --prompt-len 300 --state-dtype bfloat16"
