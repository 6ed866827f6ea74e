"""Routed-expert GEMMs at Granite-4.0-H-Small shapes: the engine's ragged_dot path against
its floors and a batched-GEMM anchor.

Shapes (granite-4.0-h-small, one MoE layer, bf16): d 4096, 72 experts of width f 768
(gate/up stack [72, 4096, 1536], down stack [72, 768, 4096]: 1.36 GB), top-10 routing.
Tokens: prefill 4096, decode batch 1 / 8 / 64. Each token's 10 experts are drawn
uniformly without repetition (seeded), so the touched experts are those of a random router.

Variants (each compiled with the step executables' XLA options, inputs on device):
- `engine`: `hybrid_jax.layers.moe.routed_experts`, the serving path: sort the t*k
  assignments by expert, gather the rows, `jax.lax.ragged_dot` for gate/up and for down,
  unsort, weight and sum;
- `ragged_gemms`: the two `ragged_dot`s alone on rows already sorted (the GEMMs' share);
- `gathered` (decode only): each assignment's expert weights gathered, [t*k, d, 2f], and
  batched mat-vecs: reads exactly t*k experts (repeats included), what a decode kernel
  reading only the touched experts could do at batch 1;
- `batched_anchor`: cuBLAS batched GEMM over all experts with every group padded to the
  largest group (`einsum` over [e, capacity, d]): the grouped-GEMM anchor available in
  XLA (vLLM's fused-MoE Triton kernel is the issue's other anchor; not in this process).

Figures: GPU kernel time per call from a jax.profiler trace (wall time on a CPU, for the
smoke run); the byte floor = bytes of the touched experts' weights at the copy bandwidth
measured in the same process (decode); TFLOP/s of the routed FLOPs (2 * t * k * 3 d f).
Outputs are checked against `routed_reference` (dense, every expert) at small sizes only.

    PYTHONPATH=. python benchmarks/moe.py                      # GPU: prefill 4096 + decode 1/8/64
    PYTHONPATH=. python benchmarks/moe.py --tokens 1 8 --reps 20
    PYTHONPATH=. python benchmarks/moe.py --smoke              # CPU: tiny shapes, wall time
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.layers.moe import routed_experts, routed_reference
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.entrypoints.bench.trace_report import gpu_kernel_events
from serving.runner.step_fns import compile_options

GRANITE_SMALL = dict(d=4096, e=72, f=768, k=10)
SMOKE = dict(d=64, e=8, f=32, k=2)


def _time_us(fn, args: tuple, reps: int) -> tuple[float, int]:
    """(us per call, kernels per call): GPU kernel time from a trace, else wall time."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(reps):
                    jax.block_until_ready(fn(*args))
            evs = [ev for _, ev in gpu_kernel_events(d)]
        return sum(e.duration_ns for e in evs) * 1e-3 / reps, len(evs) // reps
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) * 1e6 / reps, 0


def routing(t: int, e: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform top-k routing: experts [t, k] without repetition, weights [t, k] summing to 1."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    return experts, w / w.sum(1, keepdims=True)


def variants(t: int, e: int, k: int, decode: bool):
    def engine(x, w, ex, gu, dn):
        return routed_experts(x, w, ex, gu, dn, activation="silu", gated=True)

    def ragged_gemms(rows, sizes, gu, dn):
        h = jax.lax.ragged_dot(rows, gu, sizes)
        g, u = jnp.split(h, 2, axis=-1)
        return jax.lax.ragged_dot(jax.nn.silu(g) * u, dn, sizes)

    def gathered(x, w, ex, gu, dn):
        flat = ex.reshape(-1)
        xs = jnp.repeat(x, k, axis=0)  # [t*k, d], assignment order
        h = jnp.einsum("ad,adw->aw", xs, jnp.take(gu, flat, axis=0))
        g, u = jnp.split(h, 2, axis=-1)
        y = jnp.einsum("af,afd->ad", jax.nn.silu(g) * u, jnp.take(dn, flat, axis=0))
        return jnp.einsum("tkd,tk->td", y.reshape(t, k, -1).astype(jnp.float32), w)

    def batched_anchor(padded, gu, dn):  # [e, capacity, d]
        h = jnp.einsum("ecd,edw->ecw", padded, gu)
        g, u = jnp.split(h, 2, axis=-1)
        return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, dn)

    out = {"engine": engine, "ragged_gemms": ragged_gemms, "batched_anchor": batched_anchor}
    if decode:
        out["gathered"] = gathered
    return out


def run_case(t: int, shapes: dict, gu, dn, bw: float, reps: int, check: bool, opts) -> dict:
    d, e, f, k = shapes["d"], shapes["e"], shapes["f"], shapes["k"]
    decode = t <= 64
    experts, weights = routing(t, e, k, seed=t)
    x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
    sizes = np.bincount(experts.reshape(-1), minlength=e).astype(np.int32)
    order = np.argsort(experts.reshape(-1), kind="stable")
    rows = jnp.take(x, jnp.asarray(order // k), axis=0)
    cap = int(sizes.max())
    padded = jnp.zeros((e, cap, d), jnp.bfloat16)
    touched = int((sizes > 0).sum())
    expert_bytes = (d * 2 * f + f * d) * 2
    floor_us = touched * expert_bytes / bw * 1e6
    flops = 2 * t * k * 3 * d * f
    args = {"engine": (x, jnp.asarray(weights), jnp.asarray(experts), gu, dn),
            "gathered": (x, jnp.asarray(weights), jnp.asarray(experts), gu, dn),
            "ragged_gemms": (rows, jnp.asarray(sizes), gu, dn),
            "batched_anchor": (padded, gu, dn)}
    row = {"tokens": t, "touched_experts": touched, "floor_us": floor_us,
           "routed_tflop": flops / 1e12, "max_group": cap}
    for name, fn in variants(t, e, k, decode).items():
        compiled = jax.jit(fn).lower(*args[name]).compile(opts)
        us, kernels = _time_us(compiled, args[name], reps)
        row[name] = {"us": us, "floor_ratio": us / floor_us, "tflops": flops / us / 1e6,
                     "kernels": kernels}
        print(f"t={t} {name}: {us:.1f} us, {us / floor_us:.2f}x the byte floor of {touched} "
              f"experts ({floor_us:.1f} us), {flops / us / 1e6:.1f} TFLOP/s, {kernels} kernels",
              flush=True)
    if check:
        got = jax.jit(variants(t, e, k, decode)["engine"])(*args["engine"])
        want = routed_reference(*args["engine"], activation="silu", gated=True)
        err = float(jnp.abs(got - want).max() / (jnp.abs(want).max() + 1e-9))
        row["engine_rel_err"] = err
        print(f"t={t} engine vs dense reference: relative error {err:.1e}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 1, 8, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    a = p.parse_args()
    shapes = SMOKE if a.smoke else GRANITE_SMALL
    bw = copy_bandwidth(1 << 24 if a.smoke else 1 << 30)
    print(json.dumps({"device": str(jax.devices()[0]), "copy_TBps": bw / 1e12, "shapes": shapes,
                      "date": time.strftime("%Y-%m-%d")}), flush=True)
    d, e, f = shapes["d"], shapes["e"], shapes["f"]
    key = jax.random.key(0)
    gu = jax.random.normal(key, (e, d, 2 * f), jnp.bfloat16) * d**-0.5
    dn = jax.random.normal(jax.random.fold_in(key, 1), (e, f, d), jnp.bfloat16) * f**-0.5
    opts = compile_options()
    for t in a.tokens:
        row = run_case(t, shapes, gu, dn, bw, a.reps, check=a.smoke, opts=opts)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
