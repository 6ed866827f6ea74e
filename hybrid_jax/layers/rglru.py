"""Griffin's recurrent block with the RG-LRU (RecurrentGemma's temporal block).

y = gelu_tanh(linear_y(x)); u = conv1d(linear_x(x)) (width k, with bias);
i = sigmoid(u W_i + b_i), r = sigmoid(u W_r + b_r) with block-diagonal W [H, bw, bw];
log a = -8 r softplus(recurrent_param); x~ = u i sqrt(1 - a^2);
at position 0 the state resets: a = 0 and the multiplier is 1;
h_t = a_t h_{t-1} + x~_t in f32; out = linear_out(h * y).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import RGLRUConfig
from hybrid_jax.layers.linear import Linear
from hybrid_jax.recurrence import causal_conv1d, linear_recurrence

gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)


class RecurrentBlock(nnx.Module):
    """x [b, t, d] + positions [b, t] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: RGLRUConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        c, nh = cfg.width, cfg.num_heads
        bw = c // nh
        self.linear_y = Linear(dim, c, bias=True, dtype=dtype, rngs=rngs)
        self.linear_x = Linear(dim, c, bias=True, dtype=dtype, rngs=rngs)
        self.linear_out = Linear(c, dim, bias=True, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(rngs.params(), (c, cfg.conv_kernel),
                                                             dtype))
        self.conv_bias = nnx.Param(jnp.zeros((c,), dtype))
        std = bw**-0.5
        self.input_gate_weight = nnx.Param(std * jax.random.normal(rngs.params(), (nh, bw, bw), dtype))
        self.input_gate_bias = nnx.Param(jnp.zeros((nh, bw), dtype))
        self.recurrent_gate_weight = nnx.Param(
            std * jax.random.normal(rngs.params(), (nh, bw, bw), dtype))
        self.recurrent_gate_bias = nnx.Param(jnp.zeros((nh, bw), dtype))
        self.recurrent_param = nnx.Param(jnp.full((c,), 2.0, dtype))
        self.cfg = cfg

    def branches(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., d] -> gate branch y = gelu(linear_y x) and conv input u = linear_x x."""
        return gelu_tanh(self.linear_y(x)), self.linear_x(x)

    def gates(self, u: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Conv output u [..., c] -> recurrence coefficients (a, x~) [..., c] f32."""
        nh = self.cfg.num_heads
        uh = u.astype(jnp.float32).reshape(*u.shape[:-1], nh, -1)
        hi = jax.lax.Precision.HIGHEST

        def gate(w: nnx.Param, bias: nnx.Param) -> jax.Array:
            z = jnp.einsum("...hi,hij->...hj", uh, w[...].astype(jnp.float32), precision=hi)
            return jax.nn.sigmoid(z + bias[...].astype(jnp.float32)).reshape(u.shape)

        i = gate(self.input_gate_weight, self.input_gate_bias)
        r = gate(self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * r * jax.nn.softplus(self.recurrent_param[...].astype(jnp.float32))
        reset = (positions == 0)[..., None]
        multiplier = jnp.where(reset, 1.0, jnp.sqrt(1.0 - jnp.exp(2.0 * log_a)))
        a = jnp.where(reset, 0.0, jnp.exp(log_a))
        return a, u.astype(jnp.float32) * i * multiplier

    def output(self, h: jax.Array, y: jax.Array) -> jax.Array:
        return self.linear_out(h.astype(y.dtype) * y)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        y, u = self.branches(x)
        u = causal_conv1d(u, self.conv_weight[...], self.conv_bias[...])
        a, xt = self.gates(u, positions)
        h, _ = linear_recurrence(a, xt)
        return self.output(h, y)
