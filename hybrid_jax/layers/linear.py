"""Dense projection and token embedding, with weights laid out [in, out] / [v, d].

Matmuls run in the parameter dtype (bf16 or f32); callers choose where to upcast.
Tensor parallelism (hybrid_jax/tensor_parallel.py) marks a device-local model's layers
with a mesh axis name: a row-parallel Linear sums its partial products over the axis
(`reduce_axis`, before its bias), the LM head gathers its vocabulary shards
(`gather_axis`), a vocabulary-parallel Embed looks up its own rows and sums
(`shard_axis`). Unmarked (the default) they are plain single-device layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """y = x @ kernel (+ bias).  x [..., i] -> y [..., o]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (in_features, out_features),
                                                        dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.reduce_axis: str | None = None  # row-parallel: psum over this mesh axis
        self.gather_axis: str | None = None  # column shards of the output gathered over it

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = jnp.dot(x.astype(kernel.dtype), kernel)
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
