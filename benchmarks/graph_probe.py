"""Does XLA capture a step into CUDA graphs (command buffers) here, and what does a launch cost?

A chain of N small kernels (optimization barriers keep them apart), with and without a
Pallas (Triton) kernel in the chain, compiled with several command-buffer settings;
prints the host time to enqueue one call and the time per call back to back.

  PYTHONPATH=. python benchmarks/graph_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

N = 200


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0001


def pallas_scale(x):
    return pl.pallas_call(_scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def chain(x, w, with_pallas: bool):
    for i in range(N):
        x = jnp.tanh(x * w[i % w.shape[0]]) + 0.5
        if with_pallas and i % 10 == 0:
            x = pallas_scale(x)
        x = jax.lax.optimization_barrier(x)
    return x


def measure(opts: dict | None, with_pallas: bool, donate: bool) -> tuple[float, float]:
    f = jax.jit(lambda x, w: chain(x, w, with_pallas), donate_argnums=(0,) if donate else ())
    x = jnp.ones((64, 1024), jnp.float32)
    w = jnp.ones((8, 1024), jnp.float32)
    exe = f.lower(x, w).compile(compiler_options=opts) if opts is not None else f.lower(x, w).compile()
    x = exe(x, w)
    x.block_until_ready()
    enq = []
    for _ in range(20):
        x.block_until_ready()
        t = time.perf_counter()
        x = exe(x if donate else jnp.ones((64, 1024), jnp.float32) + 0, w)
        enq.append(time.perf_counter() - t)
    x.block_until_ready()
    per = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            x = exe(x, w)
        x.block_until_ready()
        per.append((time.perf_counter() - t) / 20)
    return 1e6 * statistics.median(enq) / N, 1e6 * statistics.median(per) / N


def measure_outputs(mode: str) -> tuple[float, float]:
    """Donated state + a fresh small output per call (mode 'fresh_out'), or fixed non-donated
    inputs with the previous outputs dropped before each call (mode 'same_in')."""
    if mode == "fresh_out":
        f = jax.jit(lambda x, w: (lambda y: (y, y[0, :8] * 2))(chain(x, w, True)), donate_argnums=(0,))
    else:
        f = jax.jit(lambda x, w: chain(x, w, True))
    x = jnp.ones((64, 1024), jnp.float32)
    w = jnp.ones((8, 1024), jnp.float32)
    exe = f.lower(x, w).compile()
    enq = []
    for _ in range(30):
        t = time.perf_counter()
        out = exe(x, w)
        enq.append(time.perf_counter() - t)
        if mode == "fresh_out":
            x, small = out
            small.block_until_ready()
            del small
        else:
            out.block_until_ready()
            del out
    return 1e6 * statistics.median(enq[5:]) / N, 0.0


def measure_args(k: int, donate_many: bool) -> float:
    """Host enqueue time of a 200-kernel chain that takes k extra weight arrays (us per call)."""
    ws = [jnp.full((1024,), 1.0 + i * 1e-6, jnp.float32) for i in range(k)]

    def f(x, ws):
        for i in range(N):
            x = jax.lax.optimization_barrier(jnp.tanh(x * ws[i % k]) + 0.5)
        return x, ws

    g = jax.jit(f, donate_argnums=(0, 1) if donate_many else (0,))
    x = jnp.ones((64, 1024), jnp.float32)
    exe = g.lower(x, ws).compile()
    enq = []
    for _ in range(30):
        t = time.perf_counter()
        x, ws2 = exe(x, ws)
        enq.append(time.perf_counter() - t)
        if donate_many:
            ws = ws2
        x.block_until_ready()
    return 1e6 * statistics.median(enq[5:])


def main() -> None:
    for k in (8, 100, 500):
        for dm in (False, True):
            print(f"args={k} donate_all={dm}: enqueue {measure_args(k, dm):.0f} us per call", flush=True)
    for mode in ("fresh_out", "same_in"):
        print(mode, f"enqueue us/kernel {measure_outputs(mode)[0]:.2f}", flush=True)
    print(jax.__version__, jax.devices(), "XLA_FLAGS=", os.environ.get("XLA_FLAGS", ""))
    variants = {"default": None,
                "cb_off": {"xla_gpu_enable_command_buffer": ""},
                "cb_fusion_custom": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT",
                                     "xla_gpu_graph_min_graph_size": 1}}
    print("variant | pallas | donate | enqueue us/kernel | call us/kernel")
    for name, opts in variants.items():
        for with_pallas in (False, True):
            for donate in (True, False):
                try:
                    e, c = measure(opts, with_pallas, donate)
                    print(f"{name} | {with_pallas} | {donate} | {e:.2f} | {c:.2f}", flush=True)
                except Exception as err:  # report and go on
                    print(f"{name} | {with_pallas} | {donate} | failed: {str(err)[:200]}", file=sys.stdout)


if __name__ == "__main__":
    main()
