#!/bin/bash
export PYTHONPATH=.
date -u
timeout 120 python benchmarks/startup.py --cache-dir /tmp/xc3 --out $OUT/startup.jsonl 2>&1 | tail -1
timeout 40 python benchmarks/startup.py --cache-dir /tmp/xc3 --out $OUT/startup.jsonl 2>&1 | tail -1
timeout 300 python benchmarks/speculative.py --method ngram --model native-1b-parallel --dtype bfloat16 --batches 1,8 --profile 10 --out $OUT/spec.jsonl 2>&1 | grep -v "trace planes" | cut -c1-1500
timeout 120 python benchmarks/bench_attention.py --suite verify --out $OUT/verify_attn.json 2>&1 | grep -A80 summary
