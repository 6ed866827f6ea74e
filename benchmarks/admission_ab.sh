#!/usr/bin/env bash
# TPOT tail against TTFT for admission intervals (EngineConfig.admission_interval_steps):
# one `hybrid-jax serve` per interval (gRPC; the load generator in another process; the
# http_vs_grpc.sh load: native-1b-parallel bf16, 512 +-50% in, 128 +-50% out, Poisson).
#   ADMIT="1 16" N=320 bash benchmarks/admission_ab.sh OUT
# Writes OUT/admit-A-RATE/serving.json per interval A and rate, and prints a table.
set -eu
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${1:-bench_admission}
MODEL=${MODEL:-native-1b-parallel}
N=${N:-320}
RATES=${RATES:-16 32}
ADMIT=${ADMIT:-1 16}
LENGTHS=${LENGTHS:---input-len 512 --output-len 128}
SIZING=${SIZING:---dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-prefill-chunk 512 --memory-fraction 0.9}
mkdir -p "$OUT"
LOAD="--num-requests $N $LENGTHS --len-dist uniform --range-ratio 0.5 --seed 0"
for A in $ADMIT; do
    python -m serving.entrypoints.cli serve --model "$MODEL" $SIZING --admission-interval-steps "$A" --no-background-compile \
        --port 50051 --log-level warning 2> "$OUT/server-$A.log" &
    SERVER=$!
    until python -c "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
sys.exit(g.HealthStub(grpc.insecure_channel('localhost:50051')).Check(h.HealthCheckRequest(), timeout=1).status != 1)" \
            2> /dev/null; do
        kill -0 $SERVER || { echo "the server died; see $OUT/server-$A.log"; exit 1; }
        sleep 2
    done
    python -m serving.entrypoints.cli bench serving --server localhost:50051 $LOAD --num-requests 16 \
        --request-rate 16 --out "$OUT/warmup-$A" > /dev/null
    for RATE in $RATES; do
        python -m serving.entrypoints.cli bench serving --server localhost:50051 $LOAD --request-rate $RATE \
            --out "$OUT/admit-$A-$RATE" > /dev/null
    done
    kill -TERM $SERVER; wait $SERVER || true
done
python - "$OUT" "$ADMIT" "$RATES" <<'PY'
import json, sys
out, admit, rates = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
rows = []
for a in admit:
    for rate in rates:
        r = json.load(open(f"{out}/admit-{a}-{rate}/serving.json"))
        t, p = r["ttft_ms"], r["tpot_ms"]
        rows.append({"admit": int(a), "rate": float(rate), "sent": r["sent"], "failed": r["failed"],
                     "ttft_p50": t["p50"], "ttft_p99": t["p99"], "tpot_p50": p["p50"], "tpot_p99": p["p99"],
                     "tpot_ratio": p["p99"] / p["p50"], "output_tok_s": r["output_tok_s"]})
        print(json.dumps(rows[-1]))
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
PY
