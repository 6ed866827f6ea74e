#!/usr/bin/env bash
# Run the serving-path and engine tests on a GPU with the Pallas kernels (default impl there).
# f32 dots at full precision so the cached path and the full forward agree exactly in argmax.
# Run from the repository root: bash tests/gpu_engine_check.sh (it is not a pytest module).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -c "import jax; print(jax.__version__, jax.devices())"
python -c "from pallas_kernels import default_impl; print('kernels:', default_impl())"
for f in tests/model/test_ragged_forward.py tests/model/test_decode_glue_paths.py \
         tests/serving/test_engine.py tests/serving/test_penalties.py \
         tests/serving/test_engine_parity.py tests/serving/test_speculative.py; do
  timeout 420 python -m pytest -q -x -p no:cacheprovider "$f" 2>&1 | tee "$OUT/$(basename "$f" .py).log" | tail -15
done
