"""Does the weights' layout change cuBLAS's skinny decode GEMMs? [k, n] against [n, k].

XLA's dot of x [m, k] with a weight stored [k, n] (the model's layout) against the same
weight stored transposed, [n, k], contracted on its last axis (cuBLAS's "TN" case, both
operands k-major), and [k, n] weights sliced out of one flat buffer (as the step reads
its packed parameters). Shapes: native-1b-parallel's four fused projections per layer (the
input projections q|k|v|in_proj, the gate/up projection, the fused out-projection o|out,
the down-projection), bf16, at m rows. Each timing is a jit of a chain of 24 calls on
distinct weights (so they stream from HBM, as in a decode step), x shared, compiled
with the step executables' XLA options (serving/step_fns.compile_options). Time: the GPU
kernel time of `--reps` chains in a jax.profiler trace, per product (GPU only). %copy:
weight bytes over the device's copy bandwidth (serving/entrypoints/bench/floor.copy_bandwidth)
against that time.

`--gemv`: the same products as XLA's dot, as a multiply + reduction over [k, n]
weights (colsum), over [n, k] weights (rowsum: what a one-row decode step runs,
hybrid_jax/layers/linear.py), and as one rowsum per input row (rowsum_rows).
`--split-k S..`: the [n, k] products with their depth split in S parts, one batched GEMM
of f32 partial products (summed by their consumer), against the plain TN product.
`--mlp`: 24 (`--chain`) gated MLPs in sequence, each GEMM's kernel time and launch
shape, to compare with the same kernels inside the decode step (step_anatomy.py's
gemm_kernel_details); `--chain 72` triples the memory the chain streams.

    PYTHONPATH=. python benchmarks/gemm_layout.py [--rows 1 8 64] [--reps 10] [--out r.jsonl]
    PYTHONPATH=. python benchmarks/gemm_layout.py --mlp [--state-mb 68] [--rows 8 64] [--chain 24 72]
    PYTHONPATH=. python benchmarks/gemm_layout.py --gemv [--rows 1 2 4 8] [--forms dot rowsum]
    PYTHONPATH=. python benchmarks/gemm_layout.py --split-k 2 4 8 [--rows 8 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp

from serving.entrypoints.bench.floor import copy_bandwidth
from serving.entrypoints.bench.trace_report import gpu_kernel_events
from serving.runner.step_fns import compile_options

SHAPES = {"in": (2048, 7456), "gate_up": (2048, 11264), "out": (4096, 2048), "down": (5632, 2048)}
CHAIN = 24


def _traced_kernels(fn, args: tuple, reps: int) -> list:
    """The GPU kernel events of `reps` calls of `fn(*args)` (after one untraced call)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        return [ev for _, ev in gpu_kernel_events(d)]


def _chain(transposed: bool):
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))

    def f(x, ws):  # distinct weights, one bf16 product each, as the step's projections
        return [jax.lax.dot_general(x, w, dims).astype(jnp.bfloat16) for w in ws]
    return f


def _flat_chain(transposed: bool, shape: tuple[int, int]):
    """The chain over weights sliced out of one flat buffer, as the step reads its packed
    parameters (serving/runner/packing.py)."""
    inner, size = _chain(transposed), shape[0] * shape[1]

    def f(x, flat):
        return inner(x, [flat[i * size:(i + 1) * size].reshape(shape) for i in range(CHAIN)])
    return f


def _time_products(f, m: int, k: int, shape: tuple[int, int], reps: int,
                   flat: bool = False) -> tuple[float, float, list[str]]:
    """Mean GPU kernel time of one product of the chain `f(x, ws)` (x [m, k], CHAIN bf16
    weights of `shape`; `flat`: the weights as one buffer), kernels per chain and their
    names, from a jax.profiler trace of `reps` chains. Every kernel of a chain counts (XLA
    may emit m = 1 products as a few reduction fusions)."""
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) for i in range(CHAIN)]
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    if flat:
        ws = jnp.concatenate([w.reshape(-1) for w in ws])
    fn = jax.jit(f).lower(x, ws).compile(compile_options())
    events = _traced_kernels(fn, (x, ws), reps)
    if not events:
        raise SystemExit("no GPU kernel traced: run on a GPU")
    names = sorted({ev.name for ev in events})
    return sum(ev.duration_ns for ev in events) * 1e-9 / (reps * CHAIN), len(events) / reps, names


def time_chain(m: int, k: int, n: int, transposed: bool, reps: int,
               flat: bool = False) -> tuple[float, float, list[str]]:
    """`_time_products` of XLA's dot over [k, n] (or `transposed` [n, k]) weights; `flat`:
    the weights are slices of one buffer."""
    shape = (n, k) if transposed else (k, n)
    f = _flat_chain(transposed, shape) if flat else _chain(transposed)
    return _time_products(f, m, k, shape, reps, flat)


def _gemv_chain(form: str):
    """x [m, k] times 24 distinct weights as XLA's dot (cuBLAS) or as a multiply and a
    reduction XLA fuses into one kernel: `colsum` sums the model's [k, n] weights over
    their rows, `rowsum` sums [n, k] weights over their columns (f32 accumulation)."""
    def f(x, ws):
        if form == "dot":
            return [(x @ w).astype(jnp.bfloat16) for w in ws]
        xf = x.astype(jnp.float32)
        if form == "colsum":
            return [jnp.sum(xf[:, :, None] * w.astype(jnp.float32)[None], axis=1).astype(jnp.bfloat16)
                    for w in ws]
        if form == "rowsum":
            return [jnp.sum(xf[:, None, :] * w.astype(jnp.float32)[None], axis=2).astype(jnp.bfloat16)
                    for w in ws]
        # rowsum_rows: one row reduction per input row, siblings over the same weights
        # (XLA may fuse them into one multi-output reduction reading the weights once)
        return [jnp.stack([jnp.sum(xf[i][None, :] * w.astype(jnp.float32), axis=1)
                           for i in range(x.shape[0])]).astype(jnp.bfloat16) for w in ws]
    return f


def time_gemv(m: int, k: int, n: int, form: str, reps: int) -> tuple[float, float, list[str]]:
    """`_time_products` for the forms of `_gemv_chain`."""
    shape = (n, k) if form.startswith("rowsum") else (k, n)
    t, per, names = _time_products(_gemv_chain(form), m, k, shape, reps)
    print(f"    {form} m={m}: {per:.0f} kernels per chain: {names[:4]}")
    return t, per, names


def mlp_chain(m: int, reps: int, barrier: bool = False, state_mb: int = 0,
              chain: int = CHAIN) -> dict[str, list[float]]:
    """24 gated MLPs in sequence as the step runs them (RMS norm, the fused gate/up GEMM,
    silu(gate) * up, the down-projection added to the residual), weights sliced out of
    one flat buffer: GPU time per call of each kernel name, and calls per chain.
    `barrier`: the down-projection's product passes an optimization barrier before the
    residual add, so XLA cannot fold the add into the GEMM (cuBLAS beta = 1). `state_mb`:
    before each MLP an elementwise pass reads and writes an f32 buffer of that size, as
    the step's SSM state update does (68 MB per layer at B = 64)."""
    (k, n2), (f, n) = SHAPES["gate_up"], SHAPES["down"]
    key = jax.random.PRNGKey(1)
    flat = jax.random.normal(key, (chain * (k * n2 + f * n),), jnp.bfloat16) * 0.02
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    state = jnp.zeros((chain, state_mb * (1 << 18)), jnp.float32)  # 2**18 f32 = 1 MB

    def run(x, flat, state):
        off = 0
        for i in range(chain):
            if state_mb:  # written in place; its sum feeds x so the pass stays live
                state = state.at[i].set(state[i] * 0.5 + 1.0)
                x = x + state[i, :1].astype(x.dtype)
            wgu = flat[off:off + k * n2].reshape(k, n2)
            wd = flat[off + k * n2:off + k * n2 + f * n].reshape(f, n)
            off += k * n2 + f * n
            h = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                                   + 1e-5)).astype(jnp.bfloat16)
            gu = h @ wgu
            act = jax.nn.silu(gu[:, :f]) * gu[:, f:]
            y = act @ wd
            x = x + (jax.lax.optimization_barrier(y) if barrier else y)
        return x, state

    fn = jax.jit(run, donate_argnums=2).lower(x, flat, state).compile(compile_options())
    out: dict[str, list[float]] = {}
    for ev in _traced_kernels(lambda *a: fn(x, flat, jnp.zeros_like(state)), (), reps):
        if ev.name not in out and "nvjet" in ev.name:  # launch shape, to compare with the step's
            print(f"    details {ev.name}: {dict((str(a), str(b)) for a, b in ev.stats)}")
        t = out.setdefault(ev.name, [0.0, 0])
        t[0] += ev.duration_ns * 1e-3
        t[1] += 1
    return {name: [us / c, c / reps] for name, (us, c) in out.items()}


def _split_chain(splits: int):
    """The [n, k] products with their depth split in `splits` parts: one batched GEMM over
    the parts, f32 partial products [splits, m, n] (their sum left to the consumer, e.g.
    the residual add's kernel). More output tiles for the GPU's SMs when n is small."""
    def f(x, ws):
        m, k = x.shape
        xs = x.reshape(m, splits, k // splits)
        dims = (((2,), (2,)), ((1,), (1,)))
        return [jax.lax.dot_general(xs, w.reshape(w.shape[0], splits, k // splits), dims,
                                    preferred_element_type=jnp.float32) for w in ws]
    return f


def time_split(m: int, k: int, n: int, splits: int, reps: int) -> tuple[float, float, list[str]]:
    """`_time_products` for `_split_chain`."""
    return _time_products(_split_chain(splits), m, k, (n, k), reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--mlp", action="store_true", help="kernel times of 24 gated MLPs in sequence")
    p.add_argument("--state-mb", type=int, default=0,
                   help="with --mlp, also a chain with an f32 state pass of this size before each MLP")
    p.add_argument("--chain", type=int, nargs="+", default=[CHAIN],
                   help="with --mlp: MLPs per chain (more: a larger memory footprint per call)")
    p.add_argument("--gemv", action="store_true",
                   help="XLA's dot against multiply + reduction fusions (colsum, rowsum)")
    p.add_argument("--forms", nargs="+", default=["dot", "colsum", "rowsum", "rowsum_rows"],
                   help="with --gemv: the forms timed")
    p.add_argument("--split-k", type=int, nargs="+", default=None,
                   help="[n, k] products with the depth split in these many parts (batched GEMM, "
                        "f32 partials) against the plain TN product")
    a = p.parse_args()
    if a.split_k:
        bw = copy_bandwidth()
        for m in a.rows:
            for name, (k, n) in SHAPES.items():
                r = {"m": m, "shape": name, "k": k, "n": n, "copy_TBps": bw / 1e12}
                t, r["nk_kernels"], r["nk_names"] = time_chain(m, k, n, True, a.reps)
                r["nk_us"], r["nk_pct_copy"] = t * 1e6, 100 * (2 * k * n / bw) / t
                for s in a.split_k:
                    if k % s:
                        continue
                    t, r[f"split{s}_kernels"], r[f"split{s}_names"] = time_split(m, k, n, s, a.reps)
                    r[f"split{s}_us"], r[f"split{s}_pct_copy"] = t * 1e6, 100 * (2 * k * n / bw) / t
                print(json.dumps(r), flush=True)
                print(f"m={m} {name}: nk {r['nk_us']:.2f} us ({r['nk_pct_copy']:.0f}%) " + " ".join(
                    f"split{s} {r[f'split{s}_us']:.2f} us ({r[f'split{s}_pct_copy']:.0f}%, "
                    f"{r[f'split{s}_kernels']:.0f} kernels)" for s in a.split_k if not k % s), flush=True)
        return
    if a.gemv:
        bw = copy_bandwidth()
        for m in a.rows:
            for name, (k, n) in SHAPES.items():
                r = {"m": m, "shape": name, "k": k, "n": n, "copy_TBps": bw / 1e12}
                for form in a.forms:
                    t, r[f"{form}_kernels"], r[f"{form}_names"] = time_gemv(m, k, n, form, a.reps)
                    r[f"{form}_us"] = t * 1e6
                    r[f"{form}_pct_copy"] = 100 * (2 * k * n / bw) / t
                print(json.dumps(r), flush=True)
                print(f"m={m} {name}: " + " ".join(f"{f} {r[f'{f}_us']:.2f} us ({r[f'{f}_pct_copy']:.0f}%)"
                                                  for f in a.forms), flush=True)
        return
    if a.mlp:
        for m in a.rows:
            for chain in a.chain:
                for barrier, mb in ((False, 0), (True, 0), *(((False, a.state_mb),) if a.state_mb else ())):
                    res = mlp_chain(m, a.reps, barrier, mb, chain)
                    total = sum(us * per for us, per in res.values())
                    print(f"mlp m={m} chain={chain} barrier={barrier} state_mb={mb}: {total:.1f} us")
                    top = sorted(res.items(), key=lambda x: -x[1][0])
                    gemms = [t for t in top if "gemm" in t[0] or "nvjet" in t[0]]
                    for name, (us, per) in gemms + [t for t in top[:3] if t not in gemms]:
                        print(f"    {us:7.2f} us x{per:.0f}  {name}")
        return
    bw = copy_bandwidth()
    rows = []
    for m in a.rows:
        for name, (k, n) in SHAPES.items():
            r = {"m": m, "shape": name, "k": k, "n": n, "device": str(jax.devices()[0]),
                 "copy_TBps": bw / 1e12}
            for lay, tr, fl in (("kn", False, False), ("nk", True, False), ("kn_flat", False, True)):
                t, r[f"{lay}_kernels"], r[f"{lay}_names"] = time_chain(m, k, n, tr, a.reps, fl)
                r[f"{lay}_us"] = t * 1e6
                r[f"{lay}_pct_copy"] = 100 * (2 * k * n / bw) / t
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("m | shape | [k,n] us (%copy) | [n,k] us (%copy) | [k,n] in a flat buffer us (%copy)")
    for r in rows:
        print(f"{r['m']} | {r['shape']} | {r['kn_us']:.2f} ({r['kn_pct_copy']:.0f}%) | "
              f"{r['nk_us']:.2f} ({r['nk_pct_copy']:.0f}%) | "
              f"{r['kn_flat_us']:.2f} ({r['kn_flat_pct_copy']:.0f}%)")


if __name__ == "__main__":
    main()
