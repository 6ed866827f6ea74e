#!/usr/bin/env bash
# TTFT and TPOT through the OpenAI HTTP API against gRPC, from one server process
# (issue 40 target: HTTP within 10% of gRPC at 16 and 32 req/s, no failures).
# One `hybrid-jax serve` with both fronts; the load generator runs in another process,
# the same Poisson arrivals and prompts for both backends, alternating backends per rate.
# Run from the repository root on the GPU host:
#   bash benchmarks/http_vs_grpc.sh [OUT_DIR]      (default bench_http_vs_grpc)
# Writes OUT/{grpc,openai}-{16,32}/serving.{json,png} and prints the summaries, with the
# server's mean engine step time during each run (from its Prometheus endpoint, :9464).
set -eu
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${1:-bench_http_vs_grpc}
MODEL=${MODEL:-native-1b-parallel}
N=${N:-960}            # requests per run: 60 s at 16 req/s, 30 s at 32 req/s
RATES=${RATES:-16 32}
LENGTHS=${LENGTHS:---input-len 512 --output-len 128}
# a CPU smoke run of this script: MODEL=native-tiny N=24 RATES=8 LENGTHS="--input-len 40 --output-len 8"
#   SIZING="--dtype float32 --max-num-seqs 4 --max-num-batched-tokens 64 --max-prefill-chunk 32 --max-model-len 256"
# PROFILE=DIR: the gRPC run at the first rate is traced (serve --profile-dir, POST /start_profile,
# /stop_profile): DIR's jax.profiler trace and DIR/steps-1.jsonl, the server's per-step log
PROFILE=${PROFILE:-}
# the prefill chunk is the GPU default's (2048): with 512, a prompt of 513-768 tokens took two
# mixed steps, each paying the prefill path's fixed cost (docs/benchmarks.md "Serving under load")
SIZING=${SIZING:---dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-prefill-chunk 2048 --memory-fraction 0.9}
mkdir -p "$OUT"
python -m serving.entrypoints.cli serve --model "$MODEL" $SIZING --no-background-compile \
    --port 50051 --http-port 8000 --metrics-port 9464 \
    ${PROFILE:+--profile-dir "$PROFILE"} \
    --max-waiting 1024 --log-level warning 2> "$OUT.server.log" &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER' EXIT
until curl -sf localhost:8000/health > /dev/null; do
    kill -0 $SERVER || { echo "the server died; see $OUT.server.log"; exit 1; }
    sleep 2
done
LOAD="--num-requests $N $LENGTHS --len-dist uniform --range-ratio 0.5 --seed 0"
# one warm-up run per backend (first-request effects, connection set-up), not recorded
python -m serving.entrypoints.cli bench serving --server localhost:50051 $LOAD --num-requests 16 --request-rate 16 \
    --out "$OUT/warmup-grpc" > /dev/null
python -m serving.entrypoints.cli bench serving --backend openai --server http://localhost:8000 $LOAD \
    --num-requests 16 --request-rate 16 --out "$OUT/warmup-openai" > /dev/null
# the engine's own step time (sum, count of hybrid_jax_engine_step_seconds) around each run:
# whether the front slows the step loop, seen from the server
steps() { curl -s localhost:9464/metrics |
    awk '/^hybrid_jax_engine_step_seconds_sum / {s=$2} /^hybrid_jax_engine_step_seconds_count / {c=$2} END {print s, c}'; }
for RATE in $RATES; do
    echo "$(steps)" > "$OUT.steps.grpc-$RATE"
    TRACE=$([ -n "$PROFILE" ] && [ "$RATE" = "${RATES%% *}" ] && echo 1 || true)
    [ -n "$TRACE" ] && curl -sf -X POST localhost:8000/start_profile > /dev/null
    python -m serving.entrypoints.cli bench serving --server localhost:50051 $LOAD --request-rate $RATE \
        --out "$OUT/grpc-$RATE"
    [ -n "$TRACE" ] && curl -sf -X POST localhost:8000/stop_profile && echo
    echo "$(steps)" >> "$OUT.steps.grpc-$RATE"
    echo "$(steps)" > "$OUT.steps.openai-$RATE"
    python -m serving.entrypoints.cli bench serving --backend openai --server http://localhost:8000 $LOAD \
        --request-rate $RATE --out "$OUT/openai-$RATE"
    echo "$(steps)" >> "$OUT.steps.openai-$RATE"
done
python - "$OUT" $RATES <<'PY'
import json, sys
out, rates = sys.argv[1], sys.argv[2:]
print(f"{'run':>10} {'sent':>5} {'fail':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
      f"{'tok/s':>7} {'step ms':>8}")
for rate in rates:
    for b in ("grpc", "openai"):
        r = json.load(open(f"{out}/{b}-{rate}/serving.json"))
        t, p = r["ttft_ms"], r["tpot_ms"]
        before, after = (list(map(float, line.split())) for line in open(f"{out}.steps.{b}-{rate}"))
        step_ms = 1e3 * (after[0] - before[0]) / max(1.0, after[1] - before[1])  # sum, count
        print(f"{b + '-' + str(rate):>10} {r['sent']:>5} {r['failed']:>5} {t['p50']:>9.1f} {t['p99']:>9.1f} "
              f"{p['p50']:>9.2f} {p['p99']:>9.2f} {r['output_tok_s']:>7.0f} {step_ms:>8.2f}")
PY
