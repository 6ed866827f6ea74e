"""Does the weights' layout change cuBLAS's skinny decode GEMMs? [k, n] against [n, k].

XLA's dot of x [m, k] with a weight stored [k, n] (the model's layout) against the same
weight stored transposed, [n, k], contracted on its last axis (cuBLAS's "TN" case, both
operands k-major). Shapes: native-1b-parallel's four fused projections per layer (the
input projections q|k|v|in_proj, the gate/up projection, the fused out-projection o|out,
the down-projection), bf16, at m rows. Each timing is a jit of a chain of 24 calls on
distinct weights (so they stream from HBM, as in a decode step), x shared, compiled
with the step executables' XLA options (serving/step_fns.compile_options). Time: the GPU
kernel time of `--reps` chains in a jax.profiler trace, per product (GPU only). %copy:
weight bytes over the device's copy bandwidth (serving/bench/floor.copy_bandwidth)
against that time.

    PYTHONPATH=. python benchmarks/gemm_layout.py [--rows 1 8 64] [--reps 30] [--out r.jsonl]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp

from serving.bench.floor import copy_bandwidth
from serving.bench.trace_report import gpu_kernel_events
from serving.step_fns import compile_options

SHAPES = {"in": (2048, 7456), "gate_up": (2048, 11264), "out": (4096, 2048), "down": (5632, 2048)}
CHAIN = 24


def _chain(transposed: bool):
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))

    def f(x, ws):  # distinct weights, one bf16 product each, as the step's projections
        return [jax.lax.dot_general(x, w, dims).astype(jnp.bfloat16) for w in ws]
    return f


def time_chain(m: int, k: int, n: int, transposed: bool, reps: int) -> tuple[float, float]:
    """Mean GPU kernel time of one product and kernels per chain (a jax.profiler trace of
    `reps` chains)."""
    key = jax.random.PRNGKey(0)
    shape = (n, k) if transposed else (k, n)
    ws = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) for i in range(CHAIN)]
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    fn = jax.jit(_chain(transposed)).lower(x, ws).compile(compile_options())
    jax.block_until_ready(fn(x, ws))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn(x, ws))
        durs = [ev.duration_ns for _, ev in gpu_kernel_events(d)]
    if not durs:
        raise SystemExit("no GPU kernel traced: run on a GPU")
    # XLA may emit a chain's m = 1 products as a few reduction fusions: the time still
    # counts every kernel of the chain.
    return sum(durs) * 1e-9 / (reps * CHAIN), len(durs) / reps

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    for m in a.rows:
        for name, (k, n) in SHAPES.items():
            r = {"m": m, "shape": name, "k": k, "n": n, "device": str(jax.devices()[0]),
                 "copy_TBps": bw / 1e12}
            for lay, tr in (("kn", False), ("nk", True)):
                t, r[f"{lay}_kernels"] = time_chain(m, k, n, tr, a.reps)
                r[f"{lay}_us"] = t * 1e6
                r[f"{lay}_pct_copy"] = 100 * (2 * k * n / bw) / t
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("m | shape | [k,n] us (%copy) | [n,k] us (%copy)")
    for r in rows:
        print(f"{r['m']} | {r['shape']} | {r['kn_us']:.2f} ({r['kn_pct_copy']:.0f}%) | "
              f"{r['nk_us']:.2f} ({r['nk_pct_copy']:.0f}%)")


if __name__ == "__main__":
    main()
