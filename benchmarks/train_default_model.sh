#!/usr/bin/env bash
# The shipped default model (configs/default_model), as trained on one GPU (docs/training.md).
#
#   OUT=/tmp/out bash benchmarks/train_default_model.sh            # model + logs in $OUT
#   ABLATION=1 OUT=/tmp/out bash benchmarks/train_default_model.sh # + benchmarks/hybrid_ablation.py
#     (its language-modelling part at the default model's shape; the recall part:
#     benchmarks/recall.py, docs/training.md)
#
# Two stages made the shipped model (docs/training.md): stage 1 is this script's defaults
# (random initialisation, a BPE tokenizer trained on the corpus); stage 2 continues from
# stage 1's exported model with a new schedule:
#   INIT_FROM=configs/default_model STEPS=3000 LR=1e-3 WARMUP=100 SEED=1 MAX_SECONDS=300 \
#       OUT=/tmp/out bash benchmarks/train_default_model.sh
# (INIT_FROM: `hybrid-jax train --init-from`, its config and tokenizer; fresh optimizer state.)
# SIGCHECK=0 skips the signature check, EVAL_OLD=0 the held-out score of the shipped model,
# DEADLINE=<epoch seconds> bounds the ablation (it is skipped or cut short past it).
#
# Corpus: this Python's standard library plus the .py files (each <= 500 kB) of a fixed
# list of installed packages (those present); corpus.json records every file name and the
# sha256 of the file list and of the text; packages.json (also in the model directory)
# the version and licence of each package. The held-out files are fixed: those of
# $HELD_OUT, so successive default models are
# compared on the same text (benchmarks/default_model_held_out.json: the 111 files the first
# shipped model held out). After training, benchmarks/code_eval.py scores the new and
# the shipped model on those files (bits per byte).
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
RUN=${RUN:-/tmp/hybrid-jax-default-run}
PY=${PYTHON:-python3}
HELD_OUT=${HELD_OUT:-benchmarks/default_model_held_out.json}
MAX_SECONDS=${MAX_SECONDS:-330}
STEPS=${STEPS:-2800}
LR=${LR:-2e-3}
WARMUP=${WARMUP:-150}
SEED=${SEED:-0}
INIT=()
[ -n "${INIT_FROM:-}" ] && INIT=(--init-from "$INIT_FROM")
mkdir -p "$OUT" "$RUN"
cp "$HELD_OUT" "$RUN/held_out_manifest.json"  # the shipped model may be replaced meanwhile
SP=$($PY -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
# The first twelve are the previous default model's corpus (its held-out files live there).
PKGS="numpy scipy pandas sklearn networkx matplotlib setuptools requests urllib3 jinja2 click rich
torch transformers jax flax optax orbax chex equinox diffrax optimistix lineax jaxtyping numpyro
sympy mpmath statsmodels patsy skimage xarray seaborn torchvision torchaudio torchmetrics
torch_geometric lightning pytorch_lightning lightning_utilities accelerate peft timm
sentence_transformers huggingface_hub safetensors botorch gpytorch linear_operator e3nn einops
triton onnx onnxscript onnx_ir numba cupy pygments hypothesis _pytest pip werkzeug aiohttp httpx
httpcore anyio h11 yarl multidict yaml dateutil fsspec pyarrow joblib cloudpickle toolz
pyparsing packaging markdown markdown_it tqdm typer tabulate sacrebleu narwhals formulaic
multipledispatch sortedcontainers psutil tensorboard imageio tifffile"
DATA=(--data stdlib)
for p in $PKGS; do [ -d "$SP/$p" ] && DATA+=(--data "$SP/$p"); done
$PY - "$PKGS" "$OUT/packages.json" <<'PYEOF'
import json, sys, sysconfig
from importlib import metadata
dists = metadata.packages_distributions()
out = {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
       "stdlib_licence": "PSF-2.0", "packages": {}}
for p in sys.argv[1].split():
    names = dists.get(p)
    if not names:
        out["packages"][p] = "absent"
        continue
    md = metadata.metadata(names[0])
    lic = md.get("License-Expression") or md.get("License") or ""
    if not lic or len(lic) > 80:
        cls = [c.split(" :: ")[-1] for c in md.get_all("Classifier") or [] if c.startswith("License ::")]
        lic = "; ".join(cls) or (lic.splitlines()[0][:80] if lic else "unknown")
    out["packages"][p] = {"distribution": names[0], "version": md["Version"], "licence": lic}
    print(p, names[0], md["Version"], lic)
json.dump(out, open(sys.argv[2], "w"), indent=1)
PYEOF
T0=$(date +%s)
$PY -m hybrid_jax.train "${DATA[@]}" --model-config benchmarks/default_model_config.json --out "$RUN" \
    --held-out "$RUN/held_out_manifest.json" --max-file-bytes 500000 --vocab-size 8192 "${INIT[@]}" \
    --steps "$STEPS" --batch-size 128 --seq-len 512 --lr "$LR" --warmup-steps "$WARMUP" --min-lr-ratio 0.1 \
    --weight-decay 0.1 --clip-norm 1.0 --eval-every $(( STEPS / 4 )) --eval-rows 512 --ckpt-every 1000 \
    --log-every 50 --seed "$SEED" --export-dtype bfloat16 --max-seconds "$MAX_SECONDS" --quiet
echo "train command: $(( $(date +%s) - T0 )) s wall"
cp "$OUT/packages.json" "$RUN/model/"
# at most 16 MiB a file comes back from the GPU machine: the bf16 model is ~21 MB
tar cf - -C "$RUN" model | split -b 15m - "$OUT/model.tar.part-"
cp "$RUN/train_log.jsonl" "$OUT/"  # corpus.json is in the model directory
# The signatures of benchmarks/code_eval.py must not be training text: count the files holding one.
[ "${SIGCHECK:-1}" = 1 ] && timeout 60 $PY - "$RUN/corpus.json" "${DATA[@]}" <<'PYEOF' | tee "$OUT/signature_check.txt" || true
import json, sys
sys.path.insert(0, "benchmarks")
from code_eval import read_signatures
from hybrid_jax.train.corpus import resolve_data
from hybrid_jax.train.data import collect_files
m = json.load(open(sys.argv[1]))
held = set(m["held_out_files"])
roots = resolve_data([a for a in sys.argv[2:] if a != "--data"])
sigs = read_signatures()
hits = {s: 0 for s in sigs}
for d in collect_files(roots, max_file_bytes=500000).docs:
    if d.name in held:
        continue
    for s in sigs:
        if s in d.text:
            hits[s] += 1
print(json.dumps({"signatures": len(sigs), "found_in_training_files": {s: n for s, n in hits.items() if n}}))
PYEOF
[ "$?" = 0 ] || echo "signature check failed or timed out"
MODELS=("$RUN/model")
[ "${EVAL_OLD:-1}" = 1 ] && MODELS=(default "$RUN/model")
for m in "${MODELS[@]}"; do
  timeout 90 $PY benchmarks/code_eval.py --model "$m" --no-generate --held-out "$RUN/held_out_manifest.json" \
      --batch 64 || echo "code_eval of $m failed or timed out"
done | tee "$OUT/held_out_eval.txt"
if [ "${ABLATION:-0}" = 1 ]; then
  # at the default model's shape, on the previous default's corpus (the stdlib and the first
  # twelve packages: ~45M tokens, so 200 steps of 65,536 tokens stay under one epoch)
  ABL_DATA=(--data stdlib)
  for p in $(echo $PKGS | cut -d' ' -f1-12); do [ -d "$SP/$p" ] && ABL_DATA+=(--data "$SP/$p"); done
  LEFT=$(( ${DEADLINE:-$(( $(date +%s) + 600 ))} - $(date +%s) ))
  if [ "$LEFT" -gt 90 ]; then
    timeout "$LEFT" $PY benchmarks/hybrid_ablation.py "${ABL_DATA[@]}" --tokenizer "$RUN/tokenizer.json" \
        --model-config benchmarks/default_model_config.json --out "$OUT" \
        --steps 200 --batch-size 128 --lm-seconds 40 --no-recall || echo "ablation failed or cut at the deadline"
  else
    echo "ablation skipped: ${LEFT} s left before DEADLINE"
  fi
fi
