#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
date -u
timeout 200 python benchmarks/speculative.py --method ngram --batches 1,8 --profile 10 --out $OUT/spec_profile.jsonl 2>&1 | grep -v "trace planes" | cut -c1-3000
timeout 120 python benchmarks/startup.py --cache-dir /tmp/xc --out $OUT/startup.jsonl 2>&1 | tail -2
timeout 60 python benchmarks/startup.py --cache-dir /tmp/xc --out $OUT/startup.jsonl 2>&1 | tail -2
for sb in 1 8; do
timeout 150 python benchmarks/step_anatomy.py --batch 1 --seq-bucket $sb --prompt-len 2000 --out $OUT/anat_b1_sb$sb.json 2>&1 | grep -v "trace planes" | tail -4
done
