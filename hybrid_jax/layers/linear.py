"""Dense projection and token embedding, with weights laid out [in, out] / [v, d].

Matmuls run in the parameter dtype (bf16 or f32); callers choose where to upcast.
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

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = jnp.dot(x.astype(kernel.dtype), kernel)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """Token embedding table [v, d]; `attend` gives tied logits x @ table.T."""

    def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, dim), dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...]
        return jnp.dot(x.astype(table.dtype), table.T)
