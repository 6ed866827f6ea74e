#!/bin/bash
export PYTHONPATH=.
date -u
timeout 100 python benchmarks/bench_attention.py --suite verify --out $OUT/verify_attn.json 2>&1 | grep -A30 summary
timeout 200 python benchmarks/startup.py --cache-dir /tmp/xc4 --out $OUT/startup.jsonl 2>&1 | tail -1
timeout 60 python benchmarks/startup.py --cache-dir /tmp/xc4 --out $OUT/startup.jsonl 2>&1 | tail -1
timeout 200 python benchmarks/speculative.py --method ngram --batches 64 --output-len 256 --out $OUT/spec.jsonl 2>&1 | grep -v "trace planes" | cut -c1-900
