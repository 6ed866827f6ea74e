"""LFM2's gated short convolution: the recurrent mixer of its `conv` layers.

    B, C, x = split(in_proj(u), 3)                 each [..., d]
    y = C * causal_depthwise_conv_k(B * x)          k = conv_kernel taps, no activation
    out = out_proj(y)

The only state is the conv's last k-1 inputs (B * x) per sequence, which the serving
path keeps in the slot pool like Mamba2's conv state. Pieces are methods so the serving
path swaps the conv for the slot-indexed kernels while sharing the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import ShortConvConfig
from hybrid_jax.layers.linear import Linear
from hybrid_jax.recurrence import causal_conv1d


class ShortConv(nnx.Module):
    """x [b, t, d] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: ShortConvConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = cfg.channels or dim
        self.in_proj = Linear(dim, 3 * c, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(c, dim, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(rngs.params(), (c, cfg.conv_kernel),
                                                             dtype))
        self.conv_bias = nnx.Param(jnp.zeros((c,), dtype)) if cfg.bias else None
        self.cfg = cfg

    def gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., d] -> (conv input B * x, output gate C), each [..., d]."""
        B, C, xs = jnp.split(self.in_proj(x), 3, axis=-1)
        return B * xs, C

    def conv_bias_value(self) -> jax.Array | None:
        return None if self.conv_bias is None else self.conv_bias[...]

    def output(self, conv_out: jax.Array, C: jax.Array) -> jax.Array:
        return self.out_proj(C * conv_out.astype(C.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        bx, C = self.gates(x)
        return self.output(causal_conv1d(bx, self.conv_weight[...], self.conv_bias_value()), C)
