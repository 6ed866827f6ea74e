"""Weight-streaming GEMM for few rows: y = x @ w with x [m, k] small (m <= 256), w [k, n].

    y[m, n] = sum_k x[m, k] w[k, n]       f32 accumulation; x cast to w's dtype; y in w's dtype

At decode sizes (m = the decode batch) a projection is bandwidth-bound: its floor is
the time to read w once. So every weight byte is read exactly once. Grid
(n / bn, split_k): program (j, s) owns columns [j bn, (j + 1) bn) and the s-th of
split_k equal ranges of k, which it walks in chunks of bk rows, loading all m rows of
x[:, chunk] (x is small and stays in L2) and w[chunk, columns], and accumulating one
f32 dot per chunk (Triton pipelines the loop over `num_stages` buffers). The column
block varies fastest across programs, so the programs resident at any moment stream
contiguous rows of w. With split_k > 1 each program writes an f32 partial
[split_k, m, n] and XLA sums the splits (fusing the sum into the consumer where it
can); with split_k == 1 the program writes y itself.

Nothing is padded in XLA (in a decode step's CUDA graph each extra kernel costs
microseconds): rows are masked up to a power of 2 >= 16 inside the kernel (Triton
dots need >= 16 rows and every tile a power-of-2 size) and the last column block is
masked when bn does not divide n. k must be a multiple of 16 so that power-of-2
chunks of >= 16 rows divide it.

`skinny_config` picks the launch knobs from (m, k, n): a small table by row block and
a rule for split_k; `SKINNY_OVERRIDES` holds measured exceptions. The backward pass is
plain XLA dots (`jax.custom_vjp`), so a model that trains with few rows on a GPU still
differentiates.

This module knows nothing of models: `hybrid_jax/layers/linear.py` decides where it is used.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, dot, is_pow2, launch

MAX_ROWS = 256
WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")

# ---- Launch heuristic (H100 SXM; not yet tuned by measurement: benchmarks/skinny_gemm.py --sweep).
NUM_SMS = 132
TARGET_PROGRAMS = 2 * NUM_SMS  # split K until about two waves of programs...
MIN_PROGRAM_BYTES = 64 << 10  # ...while each program still streams >= 64 KB of weights;
WAVE_FILL = 0.9  # below 0.9 of one wave, split further...
FILL_PROGRAM_BYTES = 32 << 10  # ...down to 32 KB per program.
PARTIAL_BUDGET = 0.5  # split-K partials written (f32, split_k x m x n) <= this x weight bytes

# Padded row block -> (block_n, block_k, num_warps, num_stages). Shared memory per program
# is about num_stages x (rows + block_n) x block_k x 2 bytes (bf16): 108-144 KB here.
ROW_TILES: dict[int, tuple[int, int, int, int]] = {
    16: (128, 128, 4, 3),
    32: (128, 128, 4, 3),
    64: (128, 64, 4, 4),
    128: (128, 64, 8, 3),
    256: (128, 64, 8, 3),
}

# (row block, k, n) -> knobs replacing the heuristic's, e.g. {(16, 2048, 512): {"split_k": 8}}.
SKINNY_OVERRIDES: dict[tuple[int, int, int], dict[str, int]] = {}


def row_block(m: int) -> int:
    """Rows the kernel computes for m rows of x: a power of 2, at least 16."""
    return max(16, pl.next_power_of_2(m))


def skinny_fits(m: int, k: int, n: int) -> bool:
    """Whether the kernel takes x [m, k] @ w [k, n] (callers fall back to XLA otherwise)."""
    return 1 <= m <= MAX_ROWS and k % 16 == 0 and n >= 1


def skinny_config(m: int, k: int, n: int, *, itemsize: int = 2) -> dict[str, int]:
    """Launch knobs for x [m, k] @ w [k, n] with `itemsize`-byte weights (see the constants above).

    Tiles come from ROW_TILES (clipped to small k and n); split_k is the largest divisor of
    the number of k chunks that keeps programs <= TARGET_PROGRAMS with >= MIN_PROGRAM_BYTES
    each (or, while short of WAVE_FILL of one wave, >= FILL_PROGRAM_BYTES each) and the
    partials within PARTIAL_BUDGET. SKINNY_OVERRIDES[(row block, k, n)] replaces any knob.
    """
    if not skinny_fits(m, k, n):
        raise ValueError(f"x [{m=}, {k=}] @ w [{k=}, {n=}] does not fit the skinny GEMM")
    bm = row_block(m)
    block_n, block_k, num_warps, num_stages = ROW_TILES[bm]
    block_n = min(block_n, max(16, pl.next_power_of_2(n)))
    block_k = channel_block(k, block_k)  # >= 16: k is a multiple of 16
    chunks, n_blocks = k // block_k, pl.cdiv(n, block_n)
    chunk_bytes = block_k * block_n * itemsize
    split_k = 1
    for s in (d for d in range(2, chunks + 1) if chunks % d == 0):
        per_program = chunks // s * chunk_bytes
        if s * m * n * 4 > PARTIAL_BUDGET * k * n * itemsize:
            break
        more = n_blocks * s <= TARGET_PROGRAMS and per_program >= MIN_PROGRAM_BYTES
        fill = n_blocks * split_k < WAVE_FILL * NUM_SMS and per_program >= FILL_PROGRAM_BYTES
        if not (more or fill):
            break
        split_k = s
    config = dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                  num_stages=num_stages)
    config.update(SKINNY_OVERRIDES.get((bm, k, n), {}))
    return config


def _check(x: jax.Array, w: jax.Array) -> None:
    """ValueError naming the first argument whose shape or dtype the kernel does not take."""
    if w.ndim != 2 or jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"w ({w.shape}, {w.dtype}) must be [k, n] bfloat16 or float32")
    if x.ndim != 2 or x.shape[1] != w.shape[0] or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x ({x.shape}, {x.dtype}) must be floating [m, k={w.shape[0]}]")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{m=} rows: the skinny GEMM takes 1 to {MAX_ROWS}")
    if k % 16:
        raise ValueError(f"{k=} must be a multiple of 16")


def _check_config(config: Mapping[str, int], k: int) -> None:
    """ValueError naming the knob that the kernel cannot launch with."""
    if set(config) != set(KNOBS):
        raise ValueError(f"config keys {sorted(config)} must be {sorted(KNOBS)}")
    bn, bk, split_k = config["block_n"], config["block_k"], config["split_k"]
    if not (is_pow2(bn) and bn >= 16 and is_pow2(bk) and bk >= 16):
        raise ValueError(f"block_n={bn} and block_k={bk} must be powers of 2 >= 16")
    if k % bk or split_k < 1 or (k // bk) % split_k:
        raise ValueError(f"block_k={bk} x split_k={split_k} must divide {k=}")
    if not is_pow2(config["num_warps"]) or config["num_stages"] < 1:
        raise ValueError(f"num_warps={config['num_warps']} must be a power of 2 and "
                         f"num_stages={config['num_stages']} >= 1")


def skinny_matmul(x: jax.Array, w: jax.Array, *, impl: Impl | None = None,
                  config: Mapping[str, int] | None = None) -> jax.Array:
    """x [m, k] (any float dtype) @ w [k, n] (bf16 or f32) -> y [m, n] in w's dtype.

    Equals jnp.dot(x.astype(w.dtype), w, preferred_element_type=f32).astype(w.dtype)
    (f32 weights: full f32 products, never TF32). 1 <= m <= 256; k a multiple of 16.
    `config` (all of KNOBS) replaces `skinny_config(m, k, n)`.
    """
    impl = resolve_impl(impl)
    _check(x, w)
    if impl == "reference":
        return skinny_matmul_reference(x, w)
    (m, k), n = x.shape, w.shape[1]
    if config is None:
        config = skinny_config(m, k, n, itemsize=jnp.dtype(w.dtype).itemsize)
    _check_config(config, k)
    return _matmul(x, w, (impl, *(config[name] for name in KNOBS)))


def skinny_matmul_reference(x: jax.Array, w: jax.Array, *, impl: Impl | None = None,
                            config: Mapping[str, int] | None = None) -> jax.Array:
    """Pure-JAX reference, same contract as `skinny_matmul` (impl and config ignored)."""
    del impl, config
    return _reference(x, w)


@jax.jit
def _reference(x: jax.Array, w: jax.Array) -> jax.Array:
    # 1. x in the weights' dtype; 2. products summed in f32 (exact f32 for f32 weights); 3. round.
    xw = x.astype(w.dtype)
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    return jnp.dot(xw, w, precision=precision, preferred_element_type=jnp.float32).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, launch_args: tuple) -> jax.Array:
    impl, block_n, block_k, split_k, num_warps, num_stages = launch_args
    return _skinny_pallas(x, w, impl=impl, block_n=block_n, block_k=block_k, split_k=split_k,
                          num_warps=num_warps, num_stages=num_stages)


def _matmul_fwd(x, w, launch_args):
    return _matmul(x, w, launch_args), (x, w)


def _matmul_bwd(launch_args, residuals, dy):
    """The gradients of the reference (XLA dots): dx = dy w^T, dw = x^T dy."""
    del launch_args
    x, w = residuals
    f32 = jnp.float32
    dx = jnp.dot(dy, w.T, preferred_element_type=f32).astype(x.dtype)
    dw = jnp.dot(x.astype(w.dtype).T, dy, preferred_element_type=f32).astype(w.dtype)
    return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _skinny_body(x_ref, w_ref, y_ref, *, bm: int, bn: int, bk: int, chunks: int):
    """One program: columns [j bn, (j + 1) bn) over k rows [s chunks bk, (s + 1) chunks bk).

    y_ref is y [m, n] (split_k == 1) or the partials [split_k, m, n] f32. Rows >= m and
    columns >= n are masked; the masks are left out statically where there are none.
    """
    j, s = pl.program_id(0), pl.program_id(1)
    m, n = x_ref.shape[0], w_ref.shape[1]
    rows = pl.ds(0, bm)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    iota = lambda size: jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    row_ok = iota(bm) < m if bm != m else None  # [bm]
    col_ok = j * bn + iota(bn) < n if n % bn else None  # [bn]

    def step(i, acc):
        ks = pl.ds(pl.multiple_of((s * chunks + i) * bk, bk), bk)
        xs, ws = x_ref.at[rows, ks], w_ref.at[ks, cols]
        if row_ok is None:
            xc = xs[...]
        else:
            xc = plgpu.load(xs, mask=jnp.broadcast_to(row_ok[:, None], (bm, bk)), other=0)
        if col_ok is None:
            wc = ws[...]
        else:
            wc = plgpu.load(ws, mask=jnp.broadcast_to(col_ok[None, :], (bk, bn)), other=0)
        return acc + dot(xc.astype(wc.dtype), wc)

    acc = jax.lax.fori_loop(0, chunks, step, jnp.zeros((bm, bn), jnp.float32))
    out = y_ref.at[rows, cols] if len(y_ref.shape) == 2 else y_ref.at[s, rows, cols]
    if row_ok is None and col_ok is None:
        out[...] = acc.astype(y_ref.dtype)
        return
    if row_ok is not None and col_ok is not None:
        ok = row_ok[:, None] & col_ok[None, :]
    elif row_ok is not None:
        ok = jnp.broadcast_to(row_ok[:, None], (bm, bn))
    else:
        ok = jnp.broadcast_to(col_ok[None, :], (bm, bn))
    plgpu.store(out, acc.astype(y_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=(
    "impl", "block_n", "block_k", "split_k", "num_warps", "num_stages"))
def _skinny_pallas(x, w, *, impl, block_n, block_k, split_k, num_warps, num_stages):
    (m, k), n = x.shape, w.shape[1]
    chunks = k // block_k // split_k
    kernel = functools.partial(_skinny_body, bm=row_block(m), bn=block_n, bk=block_k,
                               chunks=chunks)
    out = (jax.ShapeDtypeStruct((m, n), w.dtype) if split_k == 1
           else jax.ShapeDtypeStruct((split_k, m, n), jnp.float32))
    (y,) = launch(kernel, impl=impl, grid=(pl.cdiv(n, block_n), split_k), out_shape=[out],
                  num_warps=num_warps, num_stages=num_stages, name="skinny_gemm")(x, w)
    return y if split_k == 1 else jnp.sum(y, axis=0).astype(w.dtype)
