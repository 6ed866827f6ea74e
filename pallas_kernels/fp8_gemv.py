"""FP8 decode GEMV / skinny GEMM (Pallas, Triton lowering): y = x @ W for few rows of x,
W held in float8_e4m3fn with one f32 scale per 128 x 128 block (the Hub's fine-grained
FP8 format, hybrid_jax/layers/fp8.py).

    y[m, n] = sum_kb s[kb, n // 128] * sum_{k in block kb} x[m, k] w[k, n]

At decode sizes a projection is bound by reading its weight once, and FP8 halves those
bytes against bf16 if the weight is read as stored: each program streams a [128, bn]
e4m3 tile of W per step (one byte per value) and its block's scale, widens the tile to
x's dtype in registers, multiplies (f32 accumulation) and scales the partial product by
the block's scale (exact in real arithmetic: a block's scale factors out of its sum).
No dequantized copy of W is ever written.

- Grid (n / bn, splits): program (j, s) owns output columns [j bn, (j + 1) bn) (bn in
  64 / 32 / 16, dividing 128 and n: one scale column, the last one an edge block when n
  is not whole blocks) and the s-th share of the k blocks; splits > 1 (few
  column tiles: small n) write f32 partial sums [splits, m, n] that XLA adds.
- x [m, k] is padded to a power of two of at least 16 rows (Triton's smallest dot).
- `transposed`: W held [n, k] (`Linear.transposed`, the fused copy's layout) with scales
  [n / 128, k / 128]; else [k, n] with scales [k / 128, n / 128].
- Takes k a multiple of 128 and n of 16 (`fits`); the dequantize path (`fp8_reference`)
  takes the rest and is the reference.

Runs compiled on a GPU and in interpret mode on CPU (tests). Knows nothing of models:
hybrid_jax/layers/fp8.fp8_matmul decides where it runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 128  # the scale block this kernel takes
MAX_ROWS = 64  # rows of x it is meant for (decode); more: a GEMM's job
MIN_ROWS = 16
NUM_SMS = 132


def fits(x_rows: int, k: int, n: int, block: int) -> bool:
    """Whether the kernel takes this product: 128 x 128 scale blocks, k whole blocks, n a
    multiple of 16, at most MAX_ROWS rows."""
    return block == BLOCK and 1 <= x_rows <= MAX_ROWS and k % BLOCK == 0 and n % 16 == 0


def fp8_reference(x, w, scale, *, transposed: bool, out_dtype):
    """The dequantize path: W times its expanded block scales in f32, cast to x's dtype,
    then x @ W with f32 accumulation, in `out_dtype`."""
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=0), BLOCK, axis=1)
    wd = (w.astype(jnp.float32) * s[:w.shape[0], :w.shape[1]]).astype(x.dtype)
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    y = lax.dot_general(x, wd, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, bn: int, per_split: int, kb_total: int,
            scale_cols: int, transposed: bool):
    j, sp = pl.program_id(0), pl.program_id(1)
    col_block = j * bn // BLOCK
    prec = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else lax.Precision.DEFAULT
    first = sp * per_split
    last = jnp.minimum(first + per_split, kb_total)

    def step(kb, acc):
        k0 = pl.multiple_of(kb * BLOCK, BLOCK)
        xk = x_ref[:, pl.ds(k0, BLOCK)]
        if transposed:  # w [bn, k]: contract on its last axis
            wk = w_ref[:, pl.ds(k0, BLOCK)].astype(xk.dtype)
            part = lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)
            s = s_ref[col_block * scale_cols + kb]
        else:
            wk = w_ref[pl.ds(k0, BLOCK), :].astype(xk.dtype)
            part = lax.dot_general(xk, wk, (((1,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)
            s = s_ref[kb * scale_cols + col_block]
        return acc + part * s

    acc = lax.fori_loop(first, last, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def default_tiling(m: int, n: int, kb_total: int) -> tuple[int, int]:
    """(bn, splits): 64-column tiles (twice the programs of 128 for the same bytes each),
    and splits of the k blocks until about two programs per SM."""
    bn = next(b for b in (64, 32, 16) if n % b == 0)
    tiles = n // bn
    splits = max(1, min(kb_total, -(-2 * NUM_SMS // tiles)))
    return bn, splits


@functools.partial(jax.jit, static_argnames=("transposed", "out_dtype", "bn", "splits", "interpret",
                                             "num_warps", "num_stages"))
def fp8_gemv(x, w, scale, *, transposed: bool, out_dtype=None, bn: int | None = None,
             splits: int | None = None, interpret: bool = False, num_warps: int = 4,
             num_stages: int = 3):
    """x [m, k] (bf16 / f32) times the FP8 W (module doc) -> [m, n] in out_dtype (x's)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m, k = x.shape
    n = w.shape[0] if transposed else w.shape[1]
    want_w = (n, k) if transposed else (k, n)
    nb = -(-n // BLOCK)
    want_s = (nb, k // BLOCK) if transposed else (k // BLOCK, nb)
    if w.dtype != jnp.float8_e4m3fn or w.shape != want_w or not fits(m, k, n, BLOCK):
        raise ValueError(f"fp8_gemv takes x [m <= {MAX_ROWS}, k] and e4m3 W {want_w} with k a multiple "
                         f"of {BLOCK} and n of 16: got x {x.shape}, W {w.dtype}{w.shape}")
    if scale.shape != want_s:
        raise ValueError(f"scale must be {want_s} ({BLOCK} x {BLOCK} blocks of W), got {scale.shape}")
    kb_total = k // BLOCK
    d_bn, d_splits = default_tiling(m, n, kb_total)
    bn, splits = bn or d_bn, splits or d_splits
    if BLOCK % bn or n % bn or bn < 16:
        raise ValueError(f"bn={bn} must divide {BLOCK} and n={n}, and be >= 16")
    per_split = -(-kb_total // splits)
    rows = max(MIN_ROWS, pl.next_power_of_2(m))
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    # scales flat, padded to a power-of-2 length (every block a Triton kernel loads is)
    flat = scale.astype(jnp.float32).reshape(-1)
    flat = jnp.pad(flat, (0, pl.next_power_of_2(flat.size) - flat.size))
    w_spec = (pl.BlockSpec((bn, k), lambda i, s: (i, 0)) if transposed
              else pl.BlockSpec((k, bn), lambda i, s: (0, i)))
    part_dtype = out_dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, bn=bn, per_split=per_split, kb_total=kb_total,
                          scale_cols=want_s[1], transposed=transposed),
        grid=(n // bn, splits),
        in_specs=[pl.BlockSpec((rows, k), lambda i, s: (0, 0)), w_spec,
                  pl.BlockSpec(flat.shape, lambda i, s: (0,))],
        out_specs=pl.BlockSpec((None, rows, bn), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), part_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(xp, w, flat)
    y = out[0] if splits == 1 else jnp.sum(out, axis=0)
    return y[:m].astype(out_dtype)
