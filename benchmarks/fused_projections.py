"""Time one decode step's projection GEMMs, separate against fused, on a GPU.

native-1b-parallel has nine projections per layer (q, k, v, Mamba2 in_proj; o, Mamba2
out_proj; MLP gate, up, down). Four of them share an input (q/k/v/in_proj), two more
(gate/up), and o/out_proj are summed into the residual. The variants:

- `separate`: nine GEMMs per layer, as the model's modules run them.
- `fused_in`: q/k/v/in_proj as one GEMM [d, 7456] and gate/up as one [d, 11264]
  (weights concatenated once, at load): five GEMMs per layer.
- `fused_all`: also o_proj and out_proj as one GEMM over the concatenated inputs
  [b, 4096] @ [[Wo]; [Wout]]: four GEMMs per layer.

Each variant is one executable running the 24 layers' GEMMs in a dependent chain
(distinct weights, 2.9 GB in all, so they stream from HBM as in a decode step), compiled
with the step executables' XLA options (cuBLAS GEMMs). Reported: the median wall time
per call (CUDA-graph launched; at >1 ms per call the host is not the limit) against
the GEMM kernels' time in a jax.profiler trace, against the weight bytes over the copy
bandwidth measured in the same run (the table prints GEMM ms and % of that floor).

    PYTHONPATH=. python benchmarks/fused_projections.py [--rows 1 8 64 128 256] [--out r.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.step_anatomy import trace_kernels
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.runner.step_fns import compile_options

BF16 = jnp.bfloat16
GEMM = re.compile(r"nvjet|gemm|cutlass|sm90_xmma", re.I)
D, QW, KVW, INW, F, LAYERS = 2048, 2048, 512, 4384, 5632, 24


def weights(variant: str, key: jax.Array) -> list[dict[str, jax.Array]]:
    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(BF16)

    layers = []
    for i in range(LAYERS):
        ks = jax.random.split(jax.random.fold_in(key, i), 9)
        if variant == "separate":
            layers.append(dict(q=w(ks[0], (D, QW)), k=w(ks[1], (D, KVW)), v=w(ks[2], (D, KVW)),
                               i=w(ks[3], (D, INW)), o=w(ks[4], (QW, D)), out=w(ks[5], (QW, D)),
                               g=w(ks[6], (D, F)), u=w(ks[7], (D, F)), down=w(ks[8], (F, D))))
        else:
            lw = dict(qkvi=w(ks[0], (D, QW + 2 * KVW + INW)), gu=w(ks[6], (D, 2 * F)),
                      down=w(ks[8], (F, D)))
            if variant == "fused_in":
                lw |= dict(o=w(ks[4], (QW, D)), out=w(ks[5], (QW, D)))
            else:
                lw |= dict(oout=w(ks[4], (2 * QW, D)))
            layers.append(lw)
    return layers


def step(variant: str, x: jax.Array, layers: list[dict[str, jax.Array]]) -> jax.Array:
    """The GEMMs of one decode step with cheap stand-ins for everything between them."""
    h = x
    for lw in layers:
        if variant == "separate":
            q, k, v, i = (h @ lw[n] for n in ("q", "k", "v", "i"))
        else:
            qkvi = h @ lw["qkvi"]
            q, k, v, i = jnp.split(qkvi, [QW, QW + KVW, QW + 2 * KVW], axis=-1)
        a = q + (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(BF16)  # "attention"
        m = i[:, :QW] * i[:, QW:2 * QW]  # "mamba"
        if variant == "fused_all":
            t = jnp.concatenate([a, m], axis=-1) @ lw["oout"]
        else:
            t = a @ lw["o"] + m @ lw["out"]
        h = h + t
        if variant == "separate":
            g, u = h @ lw["g"], h @ lw["u"]
        else:
            g, u = jnp.split(h @ lw["gu"], 2, axis=-1)
        h = h + (jax.nn.silu(g) * u) @ lw["down"]
    return h


def time_call(exe, *args, reps: int) -> float:
    jax.block_until_ready(exe(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 256])
    p.add_argument("--variants", nargs="+", default=["separate", "fused_in", "fused_all"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args()
    bw = copy_bandwidth()
    results = []
    for variant in args.variants:
        layers = weights(variant, jax.random.PRNGKey(0))
        nbytes = sum(a.nbytes for lw in layers for a in lw.values())
        for m in args.rows:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, D), jnp.float32).astype(BF16)
            fn = jax.jit(lambda x, ls, variant=variant: step(variant, x, ls))
            exe = fn.lower(x, layers).compile(compile_options())
            s = time_call(exe, x, layers, reps=args.reps)
            kernel_ms, count, top, _ = trace_kernels(functools.partial(exe, x, layers), 5, keep=0)
            gemm_ms = sum(t for name, t, _ in top if GEMM.search(name))
            r = dict(variant=variant, rows=m, ms=s * 1e3, kernel_ms=kernel_ms, gemm_ms=gemm_ms,
                     kernels=count, weight_GB=nbytes / 1e9,
                     floor_ms=nbytes / bw * 1e3, pct_floor=100 * nbytes / bw / (gemm_ms / 1e3),
                     copy_TBps=bw / 1e12, device=str(jax.devices()[0]))
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'variant':<10} " + " ".join(f"{'m=' + str(m):>14}" for m in args.rows))
    for variant in args.variants:
        cells = [next(r for r in results if r["variant"] == variant and r["rows"] == m)
                 for m in args.rows]
        print(f"{variant:<10} " + " ".join(f"{c['gemm_ms']:7.3f} ({c['pct_floor']:3.0f}%)" for c in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
