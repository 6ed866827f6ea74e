#!/usr/bin/env bash
# Issue 14's GPU table in two device calls (each under 10 minutes on an H100):
#   bash benchmarks/spec_figures.sh ngram   # n-gram: shipped code model B1/8/64, native-1b B1/8/64
#   bash benchmarks/spec_figures.sh draft   # draft model: default drafting itself, native-1b-draft for native-1b
# JSON lines appended to $OUT/spec.jsonl (one per batch and mode; see benchmarks/speculative.py).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
run() { echo "== $*"; timeout ${T:-290} python benchmarks/speculative.py "$@" --out "$OUT/spec.jsonl" 2>&1 \
    | grep '^{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['method'], r['model'], 'B', r['batch'], 'tok/s %.0f' % r['decode_tok_s'], 'tpot %.2f ms' % r['tpot_ms'],
          'accept %s' % r.get('acceptance_rate'), 'len %s' % r.get('mean_accepted_length'), 'speedup %s' % r.get('speedup'), 'outputs==off %s' % r.get('outputs_equal_off'))"; }
case "${1:-ngram}" in
  ngram)
    run --method ngram --batches 1,8,64
    run --method ngram --model native-1b-parallel --dtype bfloat16 --batches 1,8,64 ;;
  draft)
    run --method draft --draft-model default --batches 1,8,64 --output-len 256
    run --method draft --model native-1b-parallel --draft-model native-1b-draft --dtype bfloat16 --batches 1,8,64 ;;
esac
date -u
