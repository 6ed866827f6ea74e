"""Sweep the paged decode kernel's launch configuration at serving shapes (GPU, bf16).

For each (batch, context) the engine decodes at, times `decode_pallas` (the kernel with
its q padding and split merge, as the engine runs it) over tile sizes, splits, warps and
pipeline stages, and prints each configuration's time and share of the copy bandwidth
(in-window K/V bytes / time), the best first, beside the configuration the engine picks
today (`paged_attention_decode`). Knows nothing of the engine.

    PYTHONPATH=. python benchmarks/paged_decode_sweep.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from attention_inputs import decode_inputs, time_fn  # noqa: E402

from pallas_kernels.paged_attention import _tile_config, paged_attention_decode  # noqa: E402
from pallas_kernels.paged_decode import decode_pallas  # noqa: E402
from serving.entrypoints.bench.floor import copy_bandwidth  # noqa: E402

# native-1b-parallel's attention: 16 query heads, 4 KV heads of 128, window 2048.
MODEL = dict(heads=16, kv_heads=4, head_dim=128, page_size=16)
WINDOW = 2048
SHAPES = ((8, 2012), (64, 612), (128, 1112), (256, 312))
SMOKE_SHAPES = ((2, 40),)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shape, interpret mode (CPU check)")
    a = p.parse_args()
    interpret = a.smoke
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    bw = 1e12 if a.smoke else copy_bandwidth()
    tiles = (32,) if a.smoke else (32, 64, 128)
    grid = list(itertools.product(tiles, (1, 2, 4), (4, 8), (1, 2)))
    rng = np.random.default_rng(0)
    rows = []
    for batch, context in shapes:
        q, k, v, lengths, table = decode_inputs(rng, batch=batch, context=context, window=WINDOW, **MODEL)
        seen = min(context, WINDOW)
        nbytes = 2 * batch * seen * MODEL["kv_heads"] * MODEL["head_dim"] * k.dtype.itemsize
        if not a.smoke:
            engine = jax.jit(lambda *x: paged_attention_decode(*x, window=WINDOW))
            t = time_fn(engine, q, k, v, lengths, table)
            rows.append(dict(batch=batch, context=context, config="engine default", us=t * 1e6,
                             pct_copy=100 * nbytes / t / bw))
            print(f"B={batch} ctx={context}: default {t * 1e6:8.1f} us "
                  f"{100 * nbytes / t / bw:5.1f}%", flush=True)
        results = []
        for tile, splits, warps, stages in grid:
            cfg = _tile_config(k, table, WINDOW, None, None, tile_tokens=tile)

            def fn(q, k, v, lengths, table, cfg=cfg, splits=splits, warps=warps, stages=stages):
                return decode_pallas(q, k, v, lengths, table, cfg=cfg, splits=splits, num_warps=warps,
                                     num_stages=stages, interpret=interpret)

            try:
                t = time_fn(fn, q, k, v, lengths, table, rounds=1 if a.smoke else 5,
                            target_s=0.0 if a.smoke else 0.03)
            except Exception as err:  # a configuration Triton refuses (shared memory): skip it
                print(f"  tile={tile} splits={splits} warps={warps} stages={stages}: {type(err).__name__}")
                continue
            results.append(dict(batch=batch, context=context, tile=tile, splits=splits, warps=warps,
                                stages=stages, us=t * 1e6, pct_copy=100 * nbytes / t / bw))
        results.sort(key=lambda r: r["us"])
        for r in results[:6]:
            print(f"  tile={r['tile']:4d} splits={r['splits']} warps={r['warps']} stages={r['stages']}: "
                  f"{r['us']:8.1f} us {r['pct_copy']:5.1f}%", flush=True)
        rows += results
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "copy_Bps": bw, "rows": rows}, f)


if __name__ == "__main__":
    main()
