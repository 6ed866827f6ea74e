"""f32 paged prefill: the tuning before 2026-11-23 (128 query rows, 4 warps) against the
current one (`pallas_kernels.paged_attention._prefill_tuning`: 64 rows, 8 warps), on the
default model's and native-1b's attention shapes; prints both times and their difference.

  PYTHONPATH=. python benchmarks/prefill_f32_tuning.py      # GPU, ~2 min
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from attention_inputs import prefill_inputs, time_fn  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_prefill  # noqa: E402
from pallas_kernels.paged_prefill import prefill_pallas  # noqa: E402
from pallas_kernels.paged_tiles import TileConfig  # noqa: E402

rng = np.random.default_rng(0)
for h, nk, e, w in [(4, 2, 64, 128), (16, 4, 128, 2048)]:
    for seqs, n, ctx in [(1, 5, 600), (2, 512, 2048)]:
        args = prefill_inputs(rng, seqs=seqs, new_tokens=n, context=ctx, window=w, heads=h,
                              kv_heads=nk, head_dim=e, dtype=jnp.float32)
        new = jax.jit(functools.partial(paged_attention_prefill, window=w))
        cfg = TileConfig(page_size=16, pages_per_tile=(16384 // (e * 4)) // 16,
                         num_columns=args[5].shape[1], window=w, softcap=None, scale=e**-0.5)
        block_q = min(128, 32768 // (e * 4)) // (h // nk)
        old = jax.jit(functools.partial(prefill_pallas, cfg=cfg, block_q=block_q, num_warps=4,
                                        num_stages=2, interpret=False))
        err = float(jnp.max(jnp.abs(new(*args) - old(*args))))
        before, now = time_fn(old, *args) * 1e6, time_fn(new, *args) * 1e6
        print(f"f32 prefill h={h} kv={nk} e={e} w={w} seqs={seqs} n={n} ctx={ctx}: before "
              f"{before:.0f} us, now {now:.0f} us (max diff {err:.0e})", flush=True)
