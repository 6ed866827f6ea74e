"""Dense projection and token embedding, with weights laid out [in, out] / [v, d].

Matmuls run in the parameter dtype (bf16 or f32); callers choose where to upcast.
Tensor parallelism (hybrid_jax/tensor_parallel.py) marks a device-local model's layers
with a mesh axis name: a row-parallel Linear sums its partial products over the axis
(`reduce_axis`, before its bias), the LM head gathers its vocabulary shards
(`gather_axis`), a vocabulary-parallel Embed looks up its own rows and sums
(`shard_axis`). Unmarked (the default) they are plain single-device layers.

A Linear may hold its kernel transposed, [out, in] (`transposed`; the serving engine's
fused copy of a model does, hybrid_jax/fusion.py). Its products contract both operands'
last axes (cuBLAS's TN case, as fast as [in, out] at 8-128 rows on the H100). With one
row on a GPU (a batch-1 decode step) the product is a multiply and a sum over each
kernel row, which XLA emits as one reduction fusion reading the weights once at
95-102% of copy bandwidth, against 67-90% for cuBLAS's GEMV kernels (17% for one
shape; H100, docs/history/benchmarks-2026.md, ninth pass). `REDUCTION_GEMV_ANY_BACKEND` lets
tests run it on the CPU.

A Pallas skinny GEMM for few-row products was tried and removed: read in place it
streamed weights no faster than cuBLAS (docs/history/benchmarks-2026.md, second pass).

A Linear may hold an FP8 kernel with block scales (`scale`, `block`; the Hub's
fine-grained FP8 format, hybrid_jax/layers/fp8.py): its product runs `fp8_matmul` (the FP8
decode GEMV kernel for few rows on a GPU, else the kernel dequantized to the compute dtype
`dtype`). The fused paths that would read the kernel
raw (the stream GEMM, split-K) are bypassed for it by rule (`glu`, `split_k_parts`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from configs import switches
from hybrid_jax.layers.fp8 import dequantize, fp8_matmul, is_fp8, scale_shape
from pallas_kernels.stream_gemm import StreamConfig, stream_glu

REDUCTION_GEMV_ANY_BACKEND = False  # tests: the one-row reduction on any backend


# Decode products whose consumer sums depth parts (`Linear.partials`); env
# HYBRID_JAX_SPLIT_K=0 turns it off. SPLIT_K_ANY_BACKEND: tests run it on the CPU.
SPLIT_K = switches.split_k()
SPLIT_K_ANY_BACKEND = False


# A gated MLP's gate/up product and its silu(gate) * up in one launch of the Mosaic GPU
# weight-streaming GEMM (pallas_kernels/stream_gemm.stream_glu, `Linear.glu`) for decode
# steps of STREAM_GEMM_ROWS rows, reading the layer's rows of the gate/up kernels' stack
# (hybrid_jax/fusion.py) in place. H100, native-1b-parallel: 0.03-0.05 ms less kernel
# time per step at B = 8, 0.02-0.03 ms at B = 64 (docs/history/benchmarks-2026.md, fifteenth
# pass). Env
# HYBRID_JAX_STREAM_GEMM=0 turns it off. STREAM_GEMM_IMPL: None runs it on Hopper GPUs
# only; tests set "reference" to take the same path through XLA on any backend.
STREAM_GEMM = switches.stream_gemm()
STREAM_GEMM_IMPL: str | None = None
STREAM_GEMM_ROWS = (8, 16, 32, 64)
STREAM_GEMM_MIN_N = 2048  # gate/up outputs per half: narrower MLPs stay with cuBLAS


def glu_config(rows: int, n: int, k: int) -> StreamConfig | None:
    """The launch configuration of `stream_glu` for x [rows, k] and a gate/up kernel of
    2n rows, None where it does not take it (benchmarks/stream_gemm.py --shapes glu; a
    partial last tile would make the kernel write a padded output whose slice XLA copies,
    0.034 ms per step for 24 layers on the H200)."""
    if rows not in STREAM_GEMM_ROWS or n < STREAM_GEMM_MIN_N or k % 128:
        return None
    override = switches.stream_gemm_config()  # tuning experiments
    if override:
        tn, tk, stages, swap = override
        cfg = StreamConfig(tn=tn, tk=tk, stages=stages, splits=1, swap=bool(swap))
    else:
        cfg = StreamConfig(tn=64, tk=128, stages=4, splits=1, swap=rows != 64)
    return None if n % cfg.tn else cfg


def _hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


def stream_gemm_active() -> bool:
    """Whether gated MLPs' decode products take the stream GEMM here (fusion.py stacks
    the gate/up kernels only then)."""
    return STREAM_GEMM and (STREAM_GEMM_IMPL is not None or _hopper())


def reduction_gemv() -> bool:
    """Whether one-row products of transposed kernels are reductions here (module doc)."""
    return REDUCTION_GEMV_ANY_BACKEND or jax.default_backend() == "gpu"


def matmul(x: jax.Array, kernel: jax.Array, transposed: bool = False) -> jax.Array:
    """x [..., i] @ kernel [i, o] (or kernel [o, i] contracted on its last axis when
    `transposed`) in the kernel's dtype, f32 accumulation: the one-row reduction where it
    applies (module doc), else XLA's dot."""
    rows = math.prod(x.shape[:-1])
    if transposed:
        x = x.astype(kernel.dtype)
        if rows == 1 and reduction_gemv():
            y = jnp.sum(x.astype(jnp.float32)[..., None, :] * kernel.astype(jnp.float32), axis=-1)
            return y.astype(kernel.dtype)
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
    return jnp.dot(x.astype(kernel.dtype), kernel)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias).  x [..., i] -> y [..., o].  kernel [i, o], or [o, i] when
    `transposed` (module doc)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (in_features, out_features),
                                                        dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.dtype = jnp.dtype(dtype)  # the compute dtype (an FP8 kernel's products run in it)
        # FP8: kernel float8_e4m3fn and one scale per `block` x `block` block of it, in the
        # kernel's layout (hybrid_jax/layers/fp8.py); None: the kernel is in `dtype`.
        self.scale: nnx.Param | None = nnx.data(None)
        self.block: int | None = None
        self.reduce_axis: str | None = None  # row-parallel: psum over this mesh axis
        self.gather_axis: str | None = None  # column shards of the output gathered over it
        self.transposed = False  # kernel held [o, i] (hybrid_jax/fusion.py)
        # kernel is a stack [L, o, i] of transposed kernels shared by L Linears; this one's
        # is row `stack_row` (hybrid_jax/fusion.py: the stream GEMM reads the stack in place)
        self.stack_row: int | None = None

    def weight(self) -> jax.Array:
        """This Linear's kernel: its own array, or its row of the shared stack; an FP8
        kernel dequantized to the compute dtype."""
        if self.scale is not None:
            return dequantize(self.kernel[...], self.scale[...], self.block, self.dtype)
        return self.kernel[...] if self.stack_row is None else self.kernel[self.stack_row]

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def set_fp8(self, kernel: jax.Array, scale: jax.Array, block: int) -> None:
        """Hold an FP8 kernel (float8_e4m3fn, this Linear's layout) and its block scales."""
        if not is_fp8(kernel.dtype) or tuple(scale.shape) != scale_shape(kernel.shape, block):
            raise ValueError(f"an FP8 kernel needs float8_e4m3fn and scales "
                             f"{scale_shape(kernel.shape, block)}, got {kernel.dtype} {kernel.shape} "
                             f"and scales {scale.shape}")
        self.kernel, self.scale, self.block = nnx.Param(kernel), nnx.Param(scale), block

    def set_dense(self, kernel: jax.Array) -> None:
        """Hold `kernel` (this Linear's layout, the compute dtype) instead of an FP8 kernel."""
        if tuple(kernel.shape) != tuple(self.kernel[...].shape):
            raise ValueError(f"a dense kernel must keep the shape {tuple(self.kernel[...].shape)}, "
                             f"got {tuple(kernel.shape)}")
        self.kernel, self.scale, self.block = nnx.Param(kernel.astype(self.dtype)), None, None

    def glu(self, x: jax.Array, gate_multiplier: float) -> jax.Array | None:
        """silu(gate * gate_multiplier) * up of this fused gate/up Linear (gate's outputs
        first) in one stream GEMM launch, or None where it does not apply: the caller then
        runs the product and the activation apart."""
        # Fusion stacks only bias-free, unsharded gate/up kernels, and only where the kernel runs.
        if self.stack_row is None or self.quantized or x.ndim != 2 or not stream_gemm_active():
            return None
        stack = self.kernel[...]
        layers, n2, k = stack.shape
        cfg = None if n2 % 2 else glu_config(x.shape[0], n2 // 2, k)
        if cfg is None or (STREAM_GEMM_IMPL is None and jnp.dtype(stack.dtype) != jnp.dtype(jnp.bfloat16)):
            return None
        return stream_glu(x, stack.reshape(layers * n2, k), row0=self.stack_row * n2, n=n2 // 2,
                          gate_multiplier=gate_multiplier, cfg=cfg, out_dtype=stack.dtype,
                          impl=STREAM_GEMM_IMPL or "pallas")

    def product_rows(self, x: jax.Array, start: int) -> jax.Array:
        """x [..., w] times the kernel's input rows [start, start + w): a part of the product
        whose input is the concatenation of several (no bias, no reduction)."""
        w, kernel = x.shape[-1], self.weight()
        if self.transposed:
            return matmul(x, kernel[:, start:start + w], transposed=True)
        return matmul(x, kernel[start:start + w])

    def partials(self, x: jax.Array, parts: int) -> jax.Array:
        """x [b, i] -> [parts, b, o] f32: the product with its depth split into `parts`
        equal parts, one batched GEMM; their sum is x @ kernel (no bias, no reduction).
        For decode products with a narrow output, whose consumer sums the parts
        (pallas_kernels/decode_glue.add_rms_norm): cuBLAS then runs `parts` times the
        tiles (`split_k_parts`)."""
        kernel = self.weight()
        if not self.transposed or x.ndim != 2 or x.shape[1] % parts:
            raise ValueError(f"partials need a transposed kernel and x [b, i] with i divisible by "
                             f"{parts=}, got {x.shape}")
        (b, i), o = x.shape, kernel.shape[0]
        return jax.lax.dot_general(
            x.astype(kernel.dtype).reshape(b, parts, i // parts), kernel.reshape(o, parts, i // parts),
            (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)

    def split_k_parts(self, rows: int) -> int:
        """How many depth parts `partials` should use for `rows` rows: 2 for a transposed,
        bias-free plain kernel with at most 2048 outputs at 2-64 rows on a GPU, else 1
        (H100, docs/history/benchmarks-2026.md, tenth pass: the out- and down-projections of
        native-1b-parallel 58-67% -> 64-74% of copy bandwidth; wider outputs lose). An FP8
        kernel takes 1: its product is `fp8_matmul`, the place its GEMM kernel goes."""
        if self.quantized:
            return 1

        kernel = self.weight()
        ok = (SPLIT_K and (SPLIT_K_ANY_BACKEND or jax.default_backend() == "gpu") and self.transposed
              and self.bias is None and self.reduce_axis is None and self.gather_axis is None
              and 2 <= rows <= 64 and kernel.shape[0] <= 2048 and kernel.shape[1] % 2 == 0)
        return 2 if ok else 1

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.quantized:
            y = fp8_matmul(x, self.kernel[...], self.scale[...], block=self.block, dtype=self.dtype,
                           transposed=self.transposed)
        else:
            y = matmul(x, self.weight(), self.transposed)
        if self.reduce_axis is not None:
            y = jax.lax.psum(y, self.reduce_axis)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.gather_axis is not None:
            y = jax.lax.all_gather(y, self.gather_axis, axis=y.ndim - 1, tiled=True)
        return y


class Embed(nnx.Module):
    """Token embedding table [v, d]; `attend` gives tied logits x @ table.T."""

    def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, dim), dtype))
        self.shard_axis: str | None = None  # vocabulary-parallel over this mesh axis

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if self.shard_axis is None:
            return jnp.take(table, tokens, axis=0)
        # This device holds rows [i * v, (i + 1) * v); others' tokens give zeros, summed.
        v = table.shape[0]
        local = tokens - jax.lax.axis_index(self.shard_axis) * v
        mine = (local >= 0) & (local < v)
        rows = jnp.take(table, jnp.clip(local, 0, v - 1), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros_like(rows)), self.shard_axis)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...]
        logits = jnp.dot(x.astype(table.dtype), table.T)
        if self.shard_axis is not None:
            logits = jax.lax.all_gather(logits, self.shard_axis, axis=logits.ndim - 1, tiled=True)
        return logits
