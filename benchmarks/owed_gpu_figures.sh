#!/usr/bin/env bash
# GPU figures owed after session 5 (2026-11-23): changes landed without an H100 measurement
# because the session's device time ran out. One H100, ~9 min; results under $OUT (or ./owed).
#  1. draft-model drafter after chaining its steps on the device: batch 1, 8, 64 (issue 14);
#  2. warm start-up with the executable store deserializing on a thread pool (issue 10);
#  3. batch 1 of native-1b-parallel through the engine's default 8-row decode floor (issue 10);
#  4. the default model's f32 prefill after the prefill kernel's f32 retuning.
# Run from the repository root: bash benchmarks/owed_gpu_figures.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-owed}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python benchmarks/speculative.py --method draft --draft-model default --batches 1,8,64 \
    --output-len 256 --out "$OUT/spec_draft.jsonl" 2>&1 | grep '^{' | cut -c1-600
timeout 150 python benchmarks/startup.py --cache-dir /tmp/owed-xc --out "$OUT/startup.jsonl" | tail -1
timeout 60 python benchmarks/startup.py --cache-dir /tmp/owed-xc --out "$OUT/startup.jsonl" | tail -1
timeout 120 python benchmarks/step_anatomy.py --batch 1 --prompt-len 2000 --out "$OUT/anat_b1.json" | tail -3
timeout 120 python benchmarks/prefill_rate.py --model default --dtype float32 --prompt-len 2048 \
    --chunk 512 --requests 4 2>&1 | tail -3
