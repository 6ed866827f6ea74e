"""Time the on-device sampling pieces of the engine step at serving shapes (GPU).

  PYTHONPATH=. python benchmarks/bench_sampling.py --batch 256 --vocab 32000
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.sample.penalties import apply_penalties, init_token_stats, update_token_stats
from serving.sample.sampling import SamplingArrays, filter_logits, sample


def bench(name: str, fn, *args, reps: int = 50) -> None:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    print(f"{name:>28}: {1e6 * float(np.median(times)):9.1f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    b, v = a.batch, a.vocab
    logits = jax.random.normal(jax.random.key(0), (b, v)) * 3
    greedy = SamplingArrays.from_rows([{}] * b)
    nucleus = SamplingArrays.from_rows([{"temperature": 0.8, "top_p": 0.9, "seed": i} for i in range(b)])
    stats = init_token_stats(b + 1, v)
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    toks = jnp.zeros(b, jnp.int32)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    bench("sample greedy", jax.jit(sample), logits, greedy)
    bench("sample top-p", jax.jit(sample), logits, nucleus)
    bench("filter_logits", jax.jit(filter_logits), logits, nucleus)
    bench("top_k 20 of log_softmax", jax.jit(lambda x: jax.lax.top_k(jax.nn.log_softmax(x), 20)), logits)
    bench("update_token_stats", jax.jit(update_token_stats), stats, toks, toks + 300, cu, slots,
          jnp.ones(b, bool), toks)
    ones = jnp.ones(b)
    bench("apply_penalties", jax.jit(apply_penalties), logits, stats, slots, ones, ones, ones)


if __name__ == "__main__":
    main()
