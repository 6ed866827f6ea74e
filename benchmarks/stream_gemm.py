"""The Mosaic GPU weight-streaming GEMM (pallas_kernels/stream_gemm.py) against cuBLAS.

Shapes: native-1b-parallel's four fused decode projections per layer (weights [n, k] as
the serving model holds them), bf16, at m rows. Each timing is a jit of a chain of 24
products on distinct weights (so they stream from HBM, as in a decode step), compiled
with the step executables' XLA options:

- `cublas`: XLA's dot of x with each layer's own [n, k] weight (what the step runs);
  `cublas_split2`: the depth in two halves, f32 partials (the out- and down-projections'
  form in the step, `Linear.partials`);
- `stream <config>`: the kernel reading layer l's rows of one stacked [24 n, k] array in
  place (row0 = l n), for each launch configuration of the sweep;
- shape `glu`: the gate/up projection and the MLP's silu(gate) * up: `cublas` is XLA's dot
  and its elementwise fusion (two launches, both timed), `stream` is `stream_glu` (one).

Time: GPU kernel time per product from a jax.profiler trace of `--reps` chains; %copy:
the weight bytes over the copy bandwidth measured in the same process. Each kernel
output is checked against the cuBLAS chain's (relative max error printed).

    PYTHONPATH=. python benchmarks/stream_gemm.py [--rows 8 64] [--shapes glu gate_up out] [--quick]
    PYTHONPATH=. python benchmarks/stream_gemm.py --shapes glu --rows 64 8 --only "64,128,4,1,0;64,128,4,1,1"
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.stream_gemm import StreamConfig, check, silu, stream_glu, stream_matmul
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.entrypoints.bench.trace_report import gpu_kernel_events
from serving.runner.step_fns import compile_options

SHAPES = {"in": (7456, 2048), "gate_up": (11264, 2048), "out": (2048, 4096), "down": (2048, 5632),
          "glu": (11264, 2048)}
CHAIN = 24


def _kernel_us(fn, args: tuple, reps: int) -> tuple[float, int, list[str]]:
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        evs = [ev for _, ev in gpu_kernel_events(d)]
    if not evs:
        raise SystemExit("no GPU kernel traced: run on a GPU")
    # Per product: every kernel of a chain (the glu shape's cuBLAS form is two per product).
    return (sum(e.duration_ns for e in evs) * 1e-3 / (reps * CHAIN), len(evs) // reps,
            sorted({e.name[:60] for e in evs}))


def configs(m: int, n: int, k: int, quick: bool) -> list[StreamConfig]:
    """The sweep: every launch configuration `check` accepts for x [m, k] and n outputs."""
    tns = (64, 128) if quick else (64, 128, 256)
    split_opts = (1, 2) if n >= 4096 else (1, 2, 4, 8)
    out = []
    for swap, tn, tk in itertools.product((True, False), tns, (64, 128)):
        for stages, splits in itertools.product((4, 8) if tk == 64 else (3, 4), split_opts):
            c = StreamConfig(tn=tn, tk=tk, stages=stages, splits=splits, swap=swap)
            try:
                check(m, k, n, n, 0, c, 4 if splits > 1 else 2)
            except ValueError:
                continue
            out.append(c)
    return out


def _baselines(name: str, x: jax.Array, ws: list[jax.Array], reps: int, opts) -> tuple[np.ndarray, dict]:
    """cuBLAS (XLA's dot, with the MLP's activation for `glu`) and its depth split in two:
    the reference outputs [CHAIN, m, n'] and their timings."""
    (m, k), n = x.shape, ws[0].shape[0]
    glu = name == "glu"

    def plain(x, ws):
        ys = [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))).astype(jnp.bfloat16) for w in ws]
        if glu:  # the model's form: bf16 GEMM output, then silu(gate) * up
            ys = [silu(y[:, :n // 2]) * y[:, n // 2:] for y in ys]
        return ys

    def split2(x, ws):
        xs = x.reshape(m, 2, k // 2)
        return [jax.lax.dot_general(xs, w.reshape(n, 2, k // 2), (((2,), (2,)), ((1,), (1,))),
                                    preferred_element_type=jnp.float32) for w in ws]

    f_cublas = jax.jit(plain).lower(x, ws).compile(opts)
    ref = np.stack([np.asarray(y, np.float32) for y in f_cublas(x, ws)])
    out = {"cublas": _kernel_us(f_cublas, (x, ws), reps)}
    if not glu:
        out["cublas_split2"] = _kernel_us(jax.jit(split2).lower(x, ws).compile(opts), (x, ws), reps)
    return ref, out


def _stream(name: str, x: jax.Array, stack: jax.Array, n: int, c: StreamConfig, reps: int, opts,
            ref: np.ndarray) -> tuple[float, int, float]:
    """The kernel's chain over the stack with config c: (us per product, kernels, max error)."""
    def chain(x, stack):
        if name == "glu":
            return [stream_glu(x, stack, row0=i * n, n=n // 2, cfg=c) for i in range(CHAIN)]
        return [stream_matmul(x, stack, row0=i * n, n=n, cfg=c) for i in range(CHAIN)]

    f = jax.jit(chain).lower(x, stack).compile(opts)
    got = np.stack([np.asarray(y, np.float32).sum(0) if c.splits > 1 else np.asarray(y, np.float32)
                    for y in f(x, stack)])
    err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9))
    us, kern, _ = _kernel_us(f, (x, stack), reps)
    return us, kern, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--only", default=None, help="configs: tn,tk,stages,splits,swap[;...]")
    a = p.parse_args()
    bw = copy_bandwidth()
    print(json.dumps({"device": str(jax.devices()[0]), "copy_TBps": bw / 1e12,
                      "date": time.strftime("%Y-%m-%d")}), flush=True)
    opts = compile_options()
    key = jax.random.PRNGKey(0)
    for name in a.shapes:
        n, k = SHAPES[name]
        stack = jax.random.normal(key, (CHAIN * n, k), jnp.bfloat16) * (k ** -0.5)
        ws = [stack[i * n:(i + 1) * n] + 0 for i in range(CHAIN)]  # own buffers (+ 0: copies)
        floor_us = 2 * n * k / bw * 1e6
        for m in a.rows:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            ref, base = _baselines(name, x, ws, a.reps, opts)
            row = {"shape": name, "m": m, "n": n, "k": k, "floor_us": floor_us}
            for label, (us, kern, names) in base.items():
                row[label] = [us, 100 * floor_us / us, kern, names]
            print(f"{name} m={m}: floor {floor_us:.2f} us; " + "; ".join(
                f"{label} {v[0]:.2f} us ({v[1]:.0f}%, {v[2]} kernels/chain)" for label, v in row.items()
                if label.startswith("cublas")), flush=True)
            if a.only:
                specs = [[int(v) for v in spec.split(",")] for spec in a.only.split(";")]
                cfgs = [StreamConfig(tn, tk, st, sp, bool(sw)) for tn, tk, st, sp, sw in specs
                        if sw or m % 64 == 0]
            else:
                cfgs = configs(m, n, k, a.quick)
            results = []
            for c in cfgs:
                try:
                    us, kern, err = _stream(name, x, stack, n, c, a.reps, opts, ref)
                except Exception as e:  # noqa: BLE001 - report and go on with the sweep
                    print(f"  {c}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                results.append([c.__dict__, us, 100 * floor_us / us, kern, err])
                print(f"  {c}: {us:.2f} us ({100 * floor_us / us:.0f}%), {kern} kernels/chain, "
                      f"err {err:.1e}", flush=True)
            results.sort(key=lambda r: r[1])
            row["stream"] = results
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
