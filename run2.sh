#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
timeout 280 python benchmarks/speculative.py --method ngram --batches 1,8,64 --profile 10 --out $OUT/spec.jsonl 2>&1 | grep -v "trace planes" | cut -c1-1500
timeout 150 python benchmarks/speculative.py --method draft --draft-model default --batches 1,8 --out $OUT/spec.jsonl 2>&1 | grep -v "trace planes" | cut -c1-1200
timeout 100 python benchmarks/startup.py --cache-dir /tmp/xc2 --out $OUT/startup.jsonl 2>&1 | tail -1
