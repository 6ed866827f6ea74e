set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; date -u
timeout 200 python benchmarks/speculative.py --method draft --model native-1b-parallel --draft-model native-1b-draft --dtype bfloat16 --batches 1,8,64 --out $OUT/spec.jsonl 2>&1 | grep '^{' | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['method'], r['batch'], round(r['decode_tok_s']), [round(x) for x in r['decode_tok_s_runs']], r.get('speedup'), r.get('draft_time_s'), r.get('verify_time_s'), r.get('verify_steps'))"
timeout 150 python benchmarks/startup.py --cache-dir /tmp/xc --out $OUT/startup.jsonl | tail -1 | cut -c1-400
timeout 60 python benchmarks/startup.py --cache-dir /tmp/xc --out $OUT/startup.jsonl | tail -1 | cut -c1-400
for a in "--batch 64 --prompt-len 600" "--batch 1 --prompt-len 2000" "--batch 8 --prompt-len 2000" "--batch 128 --prompt-len 1100 --chunk 2048" "--batch 256 --prompt-len 300"; do timeout 120 python benchmarks/step_anatomy.py $a --out $OUT/anat.jsonl 2>&1 | grep -v -E "Warning|trace planes|^hlo" | tail -1; done
date -u
