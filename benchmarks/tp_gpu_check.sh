#!/usr/bin/env bash
# Tensor parallelism checks that need no second GPU (docs/tensor_parallel.md):
#  1. the 4-CPU-device engine checks on this machine's jax (API of jax.shard_map etc.);
#  2. on the GPU, with the Pallas kernels: the sharded runner path (packed shards,
#     shard_map, explicit shardings) on a one-device mesh gives the plain path's tokens;
#  3. native-1b-parallel decode at batch 64: plain vs sharded path (the overhead of TP=1
#     through shard_map; should be ~0).
# Run from the repository root: bash benchmarks/tp_gpu_check.sh
set -u
export PYTHONPATH=.
python -c "import jax; print(jax.__version__, jax.devices())"
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 timeout 400 \
    python tests/serving/tensor_parallel_child.py ssm | grep RESULTS
cat > /tmp/tp_gpu_parity.py <<'PY'
import json, os
import numpy as np
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams
rng = np.random.default_rng(0)
ps = [rng.integers(3, 259, int(n)).tolist() for n in (5, 30, 70, 130)]
P = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
llm = LLM("native-tiny", max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=32,
          max_model_len=256, page_size=16, seq_buckets=(4,), token_buckets=(64,), show_progress=False)
out = llm.generate(prompt_token_ids=ps, sampling_params=P)
print("PARITY", os.environ.get("HYBRID_JAX_SHARDED_RUNNER", "0"), json.dumps([o.token_ids for o in out]),
      json.dumps([[round(max(d.values()), 5) for d in o.logprobs] for o in out]))
PY
python /tmp/tp_gpu_parity.py 2>&1 | grep -E "PARITY|Error"
HYBRID_JAX_SHARDED_RUNNER=1 python /tmp/tp_gpu_parity.py 2>&1 | grep -E "PARITY|Error"
for s in 0 1; do  # plain path, then the TP path on one device
  HYBRID_JAX_SHARDED_RUNNER=$s timeout 300 python benchmarks/tensor_parallel.py --presets native-1b-parallel \
      --tp 1 --batch 64 --context 1024 --steps 10 --trace-steps 3 2>&1 | grep -E '^\{|Error' | cut -c1-700
done
