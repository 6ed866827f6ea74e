"""Kimi Delta Attention (KDA): Kimi Linear's `linear_attention` layers.

Shapes: t tokens, d hidden, h heads of dk = dv (q, k and v share the heads), c = 3 h dk
conv channels, r the low-rank gates' width (the checkpoints: r = dk).

    qkv = [q_proj(x) | k_proj(x) | v_proj(x)] [t, c]  ->  silu(causal depthwise conv, no bias)
    q, k [t, h, dk] L2-normalised (f32, eps 1e-6); v [t, h, dv]
    beta = sigmoid(b_proj(x)) [t, h]
    g = -exp(A_log_h) * softplus(f_b(f_a(x)) + dt_bias)  [t, h, dk]    per-channel log decay
    S_t = diag(e^{g_t}) S_{t-1} + beta_t k_t (v_t - S'^T k_t)^T,  o_t = dk^-1/2 S_t^T q_t
    out = o_proj(rms_norm_per_head(o) * w * sigmoid(g_b(g_a(x))))   (the norm in f32)

It is Gated DeltaNet (layers/gated_deltanet.py) with a per-channel decay: the same state
[h, dk, dv] and conv state in the slot pools, the same rule kernels
(`pallas_kernels.gated_delta`, which take a per-channel g) and the same serving path
(`ragged_recurrent.gated_deltanet`): this module only overrides the projections, the
gates and the output. The checkpoint's separate q/k/v convs are one conv here (their
weights concatenated by the loader, hybrid_jax/checkpoints/kimi_linear.py).
This module knows nothing of pages, slots or scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import GatedDeltaNetConfig
from hybrid_jax.layers.gated_deltanet import GatedDeltaNet
from hybrid_jax.layers.linear import Linear

F32 = jnp.float32


class KimiDeltaAttention(GatedDeltaNet):
    """x [b, t, d] -> [b, t, d]; `project` / `gates` / `output` as GatedDeltaNet's, with
    `a` the forget gate's pre-activation [..., h dk] and `z` the output gate's input."""

    def __init__(self, dim: int, cfg: GatedDeltaNetConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, dk, r = cfg.num_v_heads, cfg.head_k_dim, cfg.low_rank
        lin = lambda i, o: Linear(i, o, bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj = lin(dim, cfg.key_dim), lin(dim, cfg.key_dim)
        self.v_proj = lin(dim, cfg.value_dim)
        self.f_a_proj, self.f_b_proj = lin(dim, r), lin(r, cfg.key_dim)
        self.g_a_proj, self.g_b_proj = lin(dim, r), lin(r, cfg.value_dim)
        self.b_proj = lin(dim, h)
        key = rngs.params()
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(key, (cfg.conv_dim, cfg.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.ones((h * dk,), F32))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, h, dtype=F32)))
        self.norm_weight = nnx.Param(jnp.ones((cfg.head_v_dim,), dtype))
        self.o_proj = lin(cfg.value_dim, dim)
        self.cfg = cfg

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [..., d] -> qkv [..., c] (before the conv), output-gate input z [..., h dv],
        b [..., h], forget-gate pre-activation a [..., h dk]."""
        qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        return qkv, self.g_b_proj(self.g_a_proj(x)), self.b_proj(x), self.f_b_proj(self.f_a_proj(x))

    def gates(self, b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        """b [..., h], a [..., h dk] -> (log decay g [..., h, dk] f32 <= 0, beta [..., h] f32).

        transformers' KimiLinearForgetGate: softplus(y) = y above 20 (torch's threshold)."""
        cfg = self.cfg
        y = a.astype(F32) + self.dt_bias[...].astype(F32)
        y = y.reshape(*y.shape[:-1], cfg.num_v_heads, cfg.head_k_dim)
        soft = jnp.where(y > 20.0, y, jnp.log1p(jnp.exp(jnp.minimum(y, 20.0))))
        g = -jnp.exp(self.A_log[...].astype(F32))[:, None] * soft
        return g, jax.nn.sigmoid(b.astype(F32))

    def output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """Rule output o [..., h, dv] and gate input z [..., h dv] -> [..., d].

        transformers' KimiLinearRMSNormGated: rms(o) * w * sigmoid(z), all in f32, then cast."""
        cfg = self.cfg
        dtype = z.dtype
        of = o.astype(dtype).astype(F32)
        y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + cfg.norm_eps)
        y = y * self.norm_weight[...].astype(F32)
        zf = z.reshape(*z.shape[:-1], cfg.num_v_heads, cfg.head_v_dim).astype(F32)
        y = (y * jax.nn.sigmoid(zf)).astype(dtype)
        return self.o_proj(y.reshape(*y.shape[:-2], -1))
