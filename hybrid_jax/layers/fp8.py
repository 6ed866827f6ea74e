"""Block-scaled FP8 weights: the Hub's "fine-grained FP8" format, and its products.

A quantized Linear holds its kernel in float8_e4m3fn and one scale per B x B block of
the kernel (`scale`, float32 or bfloat16 as the checkpoint stores it; the Hub calls it
`weight_scale_inv`): the real weight is `kernel * scale` over each block, edge blocks
included when a dimension is not a multiple of B (a [540, 64] kernel with B = 32 has
17 x 2 scales). Both arrays share the Linear's layout, [in, out] or [out, in]
(`Linear.transposed`): scale is [ceil(in/B), ceil(out/B)] or its transpose.

`dequantize` is the reference: exact in f32 (an e4m3 value times an f32 scale is one
rounding, as transformers' own dequantization does), then cast to the compute dtype.
`fp8_matmul` is the product a Linear with an FP8 kernel runs: an FP8 decode kernel for
few rows where the kernel switch picks Pallas (Mosaic GPU on Hopper, else Triton), the
block-scaled FP8 GEMM for many rows where HYBRID_JAX_FP8_GEMM=1 on Hopper, else the
dequantized kernel multiplied in the compute dtype (docs/kernels.md "FP8").
`quantize` makes the format from a float kernel (quantization at load); `quantize_stack`
does the same for a MoE layer's stacked experts, on their device (`quantize_experts`: in
slices of experts). This module knows nothing of checkpoints or serving.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from configs import switches
from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.fp8_gemm import fits as gemm_fits
from pallas_kernels.fp8_gemm import fp8_block_matmul
from pallas_kernels.fp8_gemv import fits as gemv_fits
from pallas_kernels.fp8_gemv import fp8_gemv
from pallas_kernels.fp8_stream import MAX_ROWS as STREAM_MAX_ROWS
from pallas_kernels.fp8_stream import fits as stream_fits
from pallas_kernels.fp8_stream import fp8_stream_matmul

FP8_GEMV = switches.fp8_gemv()  # HYBRID_JAX_FP8_GEMV=0: the dequantize path at every row count
FP8_REDUCE = switches.fp8_reduce()  # HYBRID_JAX_FP8_REDUCE=0: one-row products take the kernels too
FP8_GEMM = switches.fp8_gemm()  # HYBRID_JAX_FP8_GEMM=1: prefill products take the block-scaled FP8 GEMM
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The scales of a kernel of `shape` [r, c]: [ceil(r/B), ceil(c/B)]."""
    return tuple(-(-int(d) // block) for d in shape)


def expand_scale(scale: jax.Array, shape: tuple[int, ...], block: int) -> jax.Array:
    """scale [ceil(r/B), ceil(c/B)] -> [r, c] f32, each block's scale over its elements
    (edge blocks cut to the kernel's extent). XLA fuses the repeat into its consumer."""
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block, axis=0), block, axis=1)
    return s[:shape[0], :shape[1]]


def dequantize(kernel: jax.Array, scale: jax.Array, block: int, dtype) -> jax.Array:
    """The reference: kernel [r, c] e4m3 times its block scales in f32, then `dtype`."""
    if kernel.ndim != 2 or tuple(scale.shape) != scale_shape(kernel.shape, block):
        raise ValueError(f"FP8 kernel {kernel.shape} needs scales {scale_shape(kernel.shape, block)} "
                         f"for block {block}, got {scale.shape}")
    w = kernel.astype(jnp.float32) * expand_scale(scale, kernel.shape, block)
    return w.astype(dtype)


def fp8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, *, block: int, dtype,
               transposed: bool, impl: Impl | None = None) -> jax.Array:
    """x [..., i] times the FP8 kernel [i, o] (or [o, i] when `transposed`) -> [..., o] in
    `dtype`. One row of an [o, i] kernel where one-row products are reductions (a GPU;
    HYBRID_JAX_FP8_REDUCE): `row_reduce`. Few rows (decode: at most 64) with 128 x 128
    blocks and whole blocks, where the kernel switch (`impl`, pallas_kernels/backend.py) picks Pallas and
    HYBRID_JAX_FP8_GEMV is not 0: on a Hopper GPU, for an [o, i] kernel and bf16, the
    Mosaic GPU FP8 stream kernel (pallas_kernels/fp8_stream.py); else the Triton FP8 GEMV
    (pallas_kernels/fp8_gemv.py). Both stream the e4m3 weight once and dequantize in
    registers. Otherwise, and as the reference: the dequantized kernel through the plain
    product (layers/linear.matmul, which also takes the one-row reduction, where XLA fuses
    the dequantization into the read); past 64 rows the dequantized kernel is written
    apart before the GEMM (measured faster than XLA fusing it into the GEMM). Past 64 rows
    with HYBRID_JAX_FP8_GEMM=1 on Hopper, for an [o, i] kernel with 128 x 128 blocks and
    i whole blocks: the block-scaled FP8 GEMM (pallas_kernels/fp8_gemm.py), x quantized
    per token and 128-wide group as the checkpoints' dynamic activation scheme says."""
    from hybrid_jax.layers.linear import matmul, reduction_gemv

    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = kernel.shape[0] if transposed else kernel.shape[1]
    impl = resolve_impl(impl)
    if rows == 1 and transposed and FP8_REDUCE and impl != "reference" and reduction_gemv():
        y = row_reduce(x.reshape(k), kernel, scale, block, dtype=dtype).astype(dtype)
        return y.reshape(*x.shape[:-1], n)
    if (impl == "pallas" and FP8_GEMV and transposed and jnp.dtype(dtype) == jnp.bfloat16
            and stream_fits(rows, k, n, block) and _hopper()):
        y = fp8_stream_matmul(x.reshape(rows, k).astype(dtype), kernel, scale, out_dtype=dtype)
        return y.reshape(*x.shape[:-1], n)
    if impl != "reference" and FP8_GEMV and gemv_fits(rows, k, n, block):
        y = fp8_gemv(x.reshape(rows, k).astype(dtype), kernel, scale, transposed=transposed,
                     interpret=impl == "interpret")
        return y.reshape(*x.shape[:-1], n)
    if (rows > STREAM_MAX_ROWS and impl == "pallas" and FP8_GEMM and transposed
            and gemm_fits(rows, k, n, block) and _hopper()):
        y = fp8_block_matmul(x.reshape(rows, k), kernel, scale, out_dtype=dtype)
        return y.reshape(*x.shape[:-1], n)
    w = dequantize(kernel, scale, block, dtype)
    if rows > STREAM_MAX_ROWS:
        # Prefill: the dequantized weight written apart, then XLA's GEMM reads it. Fused
        # into the GEMM's operand instead, the dequantization slowed it 10-35% (H200,
        # 8192 rows: 513 vs 622 us at 11264 x 2048; bf16 464; docs/kernels.md "FP8").
        w = jax.lax.optimization_barrier(w)
    return matmul(x, w, transposed)


def row_reduce(x: jax.Array, kernel: jax.Array, scale: jax.Array, block: int,
               two_stage: bool = False, dtype=None) -> jax.Array:
    """One row x [k] times the FP8 kernel [n, k] transposed -> y [n] f32, as XLA reductions
    over the e4m3 weight read once (no kernel launch of our own: at one row a product is a
    weight stream, and XLA's row reduction streams 1-byte elements well; the FP8 decode
    kernels' fixed cost per launch is what one-row products lose, docs/kernels.md "FP8").

    One reduction over k of x * (W * its expanded scale), f32 accumulation; with `dtype`
    (the compute dtype) the scaled weight is rounded to it first, as the dequantize path
    and the FP8 kernels round it, so one row and several differ only in the order of the
    sums. `two_stage` (k whole blocks, no `dtype`): sum each 128-wide block of x * W, then
    the block sums times their scales (faster at some shapes, docs/benchmarks.md)."""
    n, k = kernel.shape
    xf = x.astype(jnp.float32)
    if two_stage and k % block == 0 and dtype is None:
        kb = k // block
        part = jnp.sum(kernel.reshape(n, kb, block).astype(jnp.float32) * xf.reshape(kb, block), axis=-1)
        s = jnp.repeat(scale.astype(jnp.float32), block, axis=0)[:n]
        return jnp.sum(part * s, axis=-1)
    w = kernel.astype(jnp.float32) * expand_scale(scale, kernel.shape, block)
    if dtype is not None:
        w = w.astype(dtype).astype(jnp.float32)
    return jnp.sum(w * xf, axis=-1)


def _hopper() -> bool:
    """Whether the default device is a Hopper GPU (wgmma, TMA: pallas_kernels/fp8_stream.py)."""
    return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


def quantize(w: np.ndarray | jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """w [r, c] float -> (kernel [r, c] e4m3, scale [ceil(r/B), ceil(c/B)] f32), the format
    of the Hub's FP8 checkpoints: each block scaled so its largest magnitude is 448
    (an all-zero block gets scale 1). On the host in numpy (load time: no compilation per
    weight shape), the results put on the default device."""
    w = np.asarray(w, np.float32)
    r, c = w.shape
    br, bc = scale_shape(w.shape, block)
    padded = np.pad(w, ((0, br * block - r), (0, bc * block - c)))
    amax = np.abs(padded.reshape(br, block, bc, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:r, :c]
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8)
    return jnp.asarray(q), jnp.asarray(scale)


def _quantize_blocks(w: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """w [e, r, c] -> (e4m3 [e, r, c], f32 scales [e, ceil(r/B), ceil(c/B)]): `quantize`'s rule."""
    e, r, c = w.shape
    br, bc = scale_shape((r, c), block)
    w = w.astype(jnp.float32)
    padded = jnp.pad(w, ((0, 0), (0, br * block - r), (0, bc * block - c)))
    amax = jnp.max(jnp.abs(padded.reshape(e, br, block, bc, block)), axis=(2, 4))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    full = jnp.repeat(jnp.repeat(scale, block, axis=1), block, axis=2)[:, :r, :c]
    return jnp.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8), scale


@functools.partial(jax.jit, static_argnames=("block", "glu"))
def quantize_stack(w: jax.Array, block: int, glu: bool = False) -> tuple[jax.Array, jax.Array]:
    """Stacked experts w [e, k, n_w] float -> (e4m3 [e, k, n_w], f32 scales [e, ceil(k/B), nb]),
    each expert block-wise as `quantize`; `glu`: the gate and up halves each on their own
    block grid (nb = 2 ceil(n_w/2/B), pallas_kernels/grouped_gemm.py). Jitted where w lives:
    a real-size layer's experts are quantized on the GPU, not moved to the host."""
    if not glu:
        return _quantize_blocks(w, block)
    n = w.shape[2] // 2
    (qg, sg), (qu, su) = _quantize_blocks(w[..., :n], block), _quantize_blocks(w[..., n:], block)
    return jnp.concatenate([qg, qu], axis=2), jnp.concatenate([sg, su], axis=2)


def quantize_experts(w: jax.Array, block: int, glu: bool, chunk_bytes: int = 1 << 28
                     ) -> tuple[jax.Array, jax.Array]:
    """`quantize_stack` over slices of at most `chunk_bytes` of experts, concatenated: the
    same values (each expert is quantized on its own), but the f32 temporaries of a slice
    instead of the whole stack's (a 35B-A3B layer's gate/up stack is 1 GiB in bf16, its f32
    temporaries several GiB)."""
    per_expert = max(1, w[0].size * w.dtype.itemsize)
    step = max(1, chunk_bytes // per_expert)
    if step >= w.shape[0]:
        return quantize_stack(w, block, glu=glu)
    parts = [quantize_stack(w[i:i + step], block, glu=glu) for i in range(0, w.shape[0], step)]
    return jnp.concatenate([q for q, _ in parts]), jnp.concatenate([s for _, s in parts])
