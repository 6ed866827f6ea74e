"""FP8 weight-streaming GEMM for decode on Hopper (Mosaic GPU): y = x @ W.T for few rows of
x, W held [n, k] in float8_e4m3fn with one f32 scale per 128 x 128 block (the Hub's
fine-grained FP8 format, hybrid_jax/layers/fp8.py; `Linear.transposed`, the engine's
fused layout).

    y[m, c] = sum_kb s[c // 128, kb] * sum_{k in block kb} x[m, k] w[c, k]

At decode sizes a projection is bound by reading its weight once, and FP8 halves those
bytes against bf16 if the weight is read as stored. This is pallas_kernels/stream_gemm.py's
design with an e4m3 weight:

- Grid (ceil(n / tn), splits): CTA (j, s) owns weight rows [j tn, (j + 1) tn) (tn 64 or
  128: inside one 128-row scale block) and the s-th of `splits` equal ranges of the
  128-wide k blocks, which it walks through a ring of `stages` shared-memory buffers
  filled by TMA (the e4m3 tile [tn, 128] and x's bf16 tile [m, 128]).
- Each step loads the e4m3 tile into registers 64 rows at a time, widens it to f32 (exact),
  multiplies by the block's scale and rounds to bf16 (exactly the dequantize path's
  `(w.astype(f32) * s).astype(bf16)`), and multiplies on the tensor cores with the weight
  as wgmma's A operand (from registers, M = 64 rows of W) and x's tile transposed as B
  (N = m, a multiple of 8): f32 accumulation. A block's scale is a scalar per step (one
  128-row block, one 128-wide k block), read from global memory one step ahead.
- Output: f32 partial sums [splits, ceil(n / tn) tn, m] (the accumulator's own layout,
  untransposed), summed over splits, cut to n and transposed by XLA (one small fusion).
- TMA fills rows past n with zeros, so n need not be a multiple of tn.

Takes x [m, k] bf16 with m a multiple of 8 (`fp8_stream_matmul` pads), k a multiple of
128. Mosaic GPU kernels run on Hopper GPUs only: on CPU `impl="reference"` runs the
dequantize path (`reference`), and benchmarks/fp8_decode.py checks the kernel on a GPU.
Knows nothing of models: hybrid_jax/layers/fp8.fp8_matmul decides where it runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.stream_gemm import smem_transforms

BLOCK = 128  # the scale block this kernel takes (and its k tile)
SMEM_BYTES = 227 * 1024
NUM_SMS = 132
MAX_ROWS = 64


@dataclass(frozen=True)
class Fp8StreamConfig:
    tn: int = 128  # weight rows per CTA: 64 or 128
    stages: int = 4  # shared-memory buffers in the ring
    splits: int = 0  # k ranges; 0: chosen by `default_splits`
    out_tiled: bool = True  # the f32 partial tile staged swizzled (else plain) before its TMA store


def fits(x_rows: int, k: int, n: int, block: int) -> bool:
    """Whether `fp8_matmul` takes this kernel: 128 x 128 scale blocks, k whole blocks, at
    most MAX_ROWS rows (decode; more rows are a GEMM's job)."""
    return block == BLOCK and 1 <= x_rows <= MAX_ROWS and k % BLOCK == 0 and n >= 64


def default_splits(m: int, n: int, kb: int, tn: int) -> int:
    """The largest divisor of the k-block count that keeps CTAs <= ~2 per SM and the f32
    partial sums (splits x n x m x 4 bytes) under a quarter of the weight's bytes."""
    tiles = -(-n // tn)
    best = 1
    for s in range(1, kb + 1):
        if kb % s == 0 and tiles * s <= 2 * NUM_SMS and s * m * 16 <= kb * BLOCK:
            best = s
    return best


def reference(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """The dequantize path: W [n, k] times its expanded block scales in f32, cast to x's
    dtype, then x @ W.T with f32 accumulation."""
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=0), BLOCK, axis=1)
    wd = (w.astype(jnp.float32) * s[:w.shape[0], :w.shape[1]]).astype(x.dtype)
    y = lax.dot_general(x, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def check(m: int, k: int, n: int, cfg: Fp8StreamConfig, splits: int) -> None:
    if cfg.tn not in (64, 128):
        raise ValueError(f"tn={cfg.tn} must be 64 or 128")
    if m % 8 or m > 256:
        raise ValueError(f"m={m} rows must be a multiple of 8 and <= 256")
    if k % BLOCK or (k // BLOCK) % splits:
        raise ValueError(f"k={k} must be a multiple of {BLOCK} whose block count divides by splits={splits}")
    if cfg.stages < 2:
        raise ValueError(f"stages={cfg.stages} must be >= 2")
    need = cfg.stages * (cfg.tn * BLOCK + m * BLOCK * 2) + cfg.tn * m * 4
    if need > SMEM_BYTES:
        raise ValueError(f"{need} bytes of shared memory > {SMEM_BYTES}: lower stages or tn")


def fp8_stream_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *,
                      cfg: Fp8StreamConfig = Fp8StreamConfig(), out_dtype=None,
                      impl: str = "pallas") -> jax.Array:
    """x [m, k] times the e4m3 W [n, k] (scales [ceil(n/128), k/128]) transposed: y [m, n]
    in out_dtype (x's). `impl="reference"`: the dequantize path."""
    m, k = x.shape
    n = w.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if w.dtype != jnp.float8_e4m3fn or w.shape[1] != k:
        raise ValueError(f"W must be e4m3 [n, {k}], got {w.dtype}{w.shape}")
    if scale.shape != (-(-n // BLOCK), k // BLOCK):
        raise ValueError(f"scale must be {(-(-n // BLOCK), k // BLOCK)}, got {scale.shape}")
    if impl == "reference":
        return reference(x, w, scale, out_dtype)
    rows = -(-m // 8) * 8
    splits = cfg.splits or default_splits(rows, n, k // BLOCK, cfg.tn)
    check(rows, k, n, cfg, splits)
    xp = x.astype(jnp.bfloat16)
    if rows != m:
        xp = jnp.pad(xp, ((0, rows - m), (0, 0)))
    part = _kernel(xp, w, scale.astype(jnp.float32), cfg.tn, cfg.stages, splits, cfg.out_tiled)
    return jnp.sum(part, axis=0)[:n, :m].T.astype(out_dtype)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _kernel(x, w, scale, tn: int, stages: int, splits: int, out_tiled: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    n = w.shape[0]
    tk = BLOCK
    steps = k // (tk * splits)
    tiles = pl.cdiv(n, tn)
    kb_last = k // BLOCK - 1

    def body(x_g, w_g, s_g, o_g, w_s, x_s, o_s, w_bar, x_bar):
        j = lax.axis_index("n")
        sp = lax.axis_index("s")
        kb0 = sp * steps
        first = j * tn
        cb = first // BLOCK

        def fetch(i, slot):
            kk = pl.ds((kb0 + i) * tk, tk)
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(first, tn), kk], w_s.at[slot], w_bar.at[slot])
            plgpu.copy_gmem_to_smem(x_g.at[:, kk], x_s.at[slot], x_bar.at[slot])

        for i in range(min(stages, steps)):
            fetch(i, i)

        def scope(acc):
            def step(i, s_cur):
                slot = lax.rem(i, stages)
                # the next step's scale, loaded now so its latency hides behind this step
                s_nxt = s_g[cb, jnp.minimum(kb0 + i + 1, kb_last)]
                plgpu.barrier_wait(w_bar.at[slot])
                plgpu.barrier_wait(x_bar.at[slot])
                xt = plgpu.transpose_ref(x_s.at[slot], (1, 0))
                for r in range(tn // 64):
                    wq = plgpu.load(w_s.at[slot, pl.ds(r * 64, 64)], (), layout=plgpu.Layout.WGMMA)
                    a = (wq.astype(jnp.float32) * s_cur).astype(jnp.bfloat16)
                    plgpu.wgmma(acc if tn == 64 else acc.at[pl.ds(r * 64, 64)], a, xt)
                plgpu.wgmma_wait(0)  # the slot's tiles are read: refill it

                @pl.when(i + stages < steps)
                def _():
                    fetch(i + stages, slot)
                return s_nxt

            lax.fori_loop(0, steps, step, s_g[cb, kb0])
            return acc[...]

        acc = pl.run_scoped(scope, plgpu.ACC((tn, m), jnp.float32))
        o_s[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[sp, pl.ds(first, tn)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = "fp8_stream_gemm"
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, tiles * tn, m), jnp.float32),
        scratch_types=dict(
            w_s=plgpu.SMEM((stages, tn, tk), w.dtype, transforms=smem_transforms(tk, 1)),
            x_s=plgpu.SMEM((stages, m, tk), x.dtype, transforms=smem_transforms(tk, 2)),
            o_s=plgpu.SMEM((tn, m), jnp.float32, transforms=smem_transforms(m, 4) if out_tiled else ()),
            w_bar=plgpu.Barrier(num_barriers=stages),
            x_bar=plgpu.Barrier(num_barriers=stages),
        ),
        grid=(tiles, splits),
        grid_names=("n", "s"),
    )(x, w, scale)
