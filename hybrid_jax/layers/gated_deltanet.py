"""Gated DeltaNet (Qwen3-Next / Qwen3.5 `linear_attention` layers).

Shapes: t tokens, d hidden, hk key heads of dk, hv value heads of dv (hv a multiple of
hk; value head i reads key head i // (hv / hk)), c = 2 hk dk + hv dv conv channels.

    qkv = in_proj_qkv(x) [t, c]  ->  silu(causal depthwise conv, no bias)
    q, k [t, hk, dk] L2-normalised (f32, eps 1e-6, as FLA); v [t, hv, dv]
    beta = sigmoid(in_proj_b(x)) [t, hv];  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}' ^T k_t)^T,  o_t = dk^-1/2 S_t^T q_t
    out = out_proj(rms_norm_per_head(o) * w * silu(in_proj_z(x)))

The layout is Qwen3.5's (q, k, v in one projection, z, b, a apart); Qwen3-Next's fused
`in_proj_qkvz` / `in_proj_ba`, grouped per key head, are reordered into it by its loader
(hybrid_jax/checkpoints/qwen3_next.py). The recurrence runs through
`pallas_kernels.gated_delta` (its ragged prefill, also for the full-sequence forward here,
and its q-token step in serving). Pieces are methods so the serving path
(hybrid_jax/ragged.py) swaps the conv for slot-indexed kernels while sharing the weights.
This module knows nothing of pages, slots or scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs import switches
from hybrid_jax.config import GatedDeltaNetConfig
from hybrid_jax.layers.linear import Linear
from hybrid_jax.recurrence import causal_conv1d
from pallas_kernels.backend import Impl
from pallas_kernels.gated_delta import gated_delta_ragged
from pallas_kernels.launch import is_pow2

F32 = jnp.float32
L2_EPS = 1e-6  # transformers' / FLA's l2norm: x * rsqrt(sum x^2 + eps)


# KDA's prefill (a per-channel g) runs the Pallas `kda_prefill` pipeline where the process
# runs kernels (a GPU, or HYBRID_JAX_KERNELS=interpret), unless HYBRID_JAX_KDA_KERNEL=0 asks
# for the pure-JAX `kda_chunked` (the reference; on an H100 3.4-4.0x slower, 2026-12-06).
# Gated DeltaNet's per-head prefill is not affected.
KDA_KERNEL = switches.kda_kernel()


def prefill_impl(g: jax.Array, dk: int, dv: int) -> Impl | None:
    """The `impl` of the rule's ragged prefill for a decay g [t, h] or [t, h, dk]: None (the
    process default) per head, and per channel with KDA_KERNEL and head dims the kernel
    tiles (powers of 2 >= 16); else "reference" (kda_chunked)."""
    if g.ndim == 2:
        return None
    fits = all(is_pow2(d) and d >= 16 for d in (dk, dv))
    return None if KDA_KERNEL and fits else "reference"


def l2_normalize(x: jax.Array) -> jax.Array:
    """x [..., n] -> x / ||x|| in f32 (eps inside the root), back in x's dtype."""
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """x [b, t, d] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: GatedDeltaNetConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hv = cfg.num_v_heads
        lin = lambda n: Linear(dim, n, bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
        if cfg.grouped_projections:  # Qwen3-Next: [q k v z] and [b a] per key head
            self.in_proj_qkvz = lin(cfg.conv_dim + cfg.value_dim)
            self.in_proj_ba = lin(2 * hv)
        else:  # Qwen3.5
            self.in_proj_qkv = lin(cfg.conv_dim)
            self.in_proj_z = lin(cfg.value_dim)
            self.in_proj_b = lin(hv)
            self.in_proj_a = lin(hv)
        key = rngs.params()
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(key, (cfg.conv_dim, cfg.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.ones((hv,), F32))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, hv, dtype=F32)))
        self.norm_weight = nnx.Param(jnp.ones((cfg.head_v_dim,), dtype))
        self.out_proj = Linear(cfg.value_dim, dim, bias=False, dtype=dtype, rngs=rngs)
        self.cfg = cfg

    @property
    def scale(self) -> float:
        return self.cfg.head_k_dim ** -0.5

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [..., d] -> qkv [..., c] (before the conv), z [..., hv dv], b and a [..., hv]."""
        cfg = self.cfg
        if not cfg.grouped_projections:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        # transformers' fix_query_key_value_ordering: per key head h, [q_h | k_h | v | z]
        # and [b | a] over its r = hv / hk value heads; value head h r + j is its j-th.
        hk, dk, dv = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
        r = cfg.num_v_heads // hk
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        lead = qkvz.shape[:-1]
        qkvz = qkvz.reshape(*lead, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        b, a = jnp.split(ba.reshape(*lead, hk, 2 * r), [r], axis=-1)
        flat = lambda y: y.reshape(*lead, -1)  # noqa: E731
        return jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1), flat(z), flat(b), flat(a)

    def split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated conv output [..., c] -> q, k [..., hk, dk] (L2-normalised), v [..., hv, dv]."""
        cfg = self.cfg
        q, k, v = jnp.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        lead = qkv.shape[:-1]
        q = l2_normalize(q.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim))
        k = l2_normalize(k.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim))
        return q, k, v.reshape(*lead, cfg.num_v_heads, cfg.head_v_dim)

    def gates(self, b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        """b, a [..., hv] -> (log decay g f32 <= 0, write strength beta f32)."""
        g = -jnp.exp(self.A_log[...].astype(F32)) * jax.nn.softplus(a.astype(F32) + self.dt_bias[...])
        return g, jax.nn.sigmoid(b.astype(F32))

    def output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """Rule output o [..., hv, dv] and gate z [..., hv dv] -> [..., d].

        transformers' RMSNormGated: w * cast(rms(o)) in o's dtype, times silu(z) in f32."""
        cfg = self.cfg
        dtype = z.dtype
        o = o.astype(dtype)
        of = o.astype(F32)
        normed = (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + cfg.norm_eps)).astype(dtype)
        y = (self.norm_weight[...] * normed).astype(F32)
        zf = z.reshape(*z.shape[:-1], cfg.num_v_heads, cfg.head_v_dim).astype(F32)
        y = (y * jax.nn.silu(zf)).astype(dtype)
        return self.out_proj(y.reshape(*y.shape[:-2], -1))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Full-sequence forward from zero state: the batch rows become sequences of one
        ragged call of the prefill rule (slot i + 1 for row i; slot 0 the dummy)."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        qkv, z, b, a = self.project(x)
        qkv = jax.nn.silu(causal_conv1d(qkv, self.conv_weight[...], None).astype(F32)).astype(x.dtype)
        q, k, v = self.split_qkv(qkv)
        g, beta = self.gates(b, a)
        flat = lambda y: y.reshape(bsz * t, *y.shape[2:])  # noqa: E731
        states = jnp.zeros((bsz + 1, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), F32)
        cu = jnp.arange(bsz + 1, dtype=jnp.int32) * t
        slots = jnp.arange(1, bsz + 1, dtype=jnp.int32)
        o, _ = gated_delta_ragged(flat(q), flat(k), flat(v), flat(g), flat(beta), cu, states, slots,
                                  jnp.zeros((bsz,), bool), scale=self.scale, chunk_size=cfg.chunk_size,
                                  impl=prefill_impl(flat(g), cfg.head_k_dim, cfg.head_v_dim))
        return self.output(o.reshape(bsz, t, *o.shape[1:]), z)
