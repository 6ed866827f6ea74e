#!/usr/bin/env bash
# The shipped default model (configs/default_model), as trained on one H100 (docs/training.md).
#
#   OUT=/tmp/out bash benchmarks/train_default_model.sh            # model + logs in $OUT
#   ABLATION=1 OUT=/tmp/out bash benchmarks/train_default_model.sh # + benchmarks/hybrid_ablation.py
#     (its language-modelling part; the recall part: benchmarks/recall.py, docs/training.md)
#
# Corpus: this Python's standard library plus the .py files of a fixed list of installed
# packages (those present); corpus.json records every file name and the sha256 of the
# file list and of the text, and this script prints the package versions.
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
RUN=${RUN:-/tmp/hybrid-jax-default-run}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SP=$($PY -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
PKGS="numpy scipy pandas sklearn networkx matplotlib setuptools requests urllib3 jinja2 click rich"
DATA=(--data stdlib)
for p in $PKGS; do [ -d "$SP/$p" ] && DATA+=(--data "$SP/$p"); done
$PY - "$PKGS" <<'PYEOF'
import sys, sysconfig
from importlib import metadata
names = {"sklearn": "scikit-learn"}
print("python", sys.version.split()[0], sysconfig.get_paths()["stdlib"])
for p in sys.argv[1].split():
    try:
        print(p, metadata.version(names.get(p, p)))
    except metadata.PackageNotFoundError:
        print(p, "absent")
PYEOF
$PY -m hybrid_jax.train "${DATA[@]}" --preset native-py-5m --out "$RUN" \
    --steps 1500 --batch-size 128 --seq-len 512 --lr 2e-3 --warmup-steps 100 --min-lr-ratio 0.1 \
    --weight-decay 0.1 --clip-norm 1.0 --vocab-size 4096 --eval-fraction 0.02 --eval-every 250 \
    --eval-rows 256 --ckpt-every 500 --log-every 50 --seed 0 --export-dtype bfloat16 --max-seconds 240
tar cf "$OUT/model.tar" -C "$RUN" model
cp "$RUN/train_log.jsonl" "$RUN/corpus.json" "$OUT/"
if [ "${ABLATION:-0}" = 1 ]; then
  $PY benchmarks/hybrid_ablation.py "${DATA[@]}" --tokenizer "$RUN/tokenizer.json" --out "$OUT" \
      --steps 200 --batch-size 128 --lm-seconds 60 --no-recall
fi
