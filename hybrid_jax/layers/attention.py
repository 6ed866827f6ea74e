"""GQA/MQA attention with rotary embeddings, a per-layer window and optional soft-capping.

The module is split into `project` (q/k/v with rotary, keys scaled before rotary when
`key_multiplier` != 1) and `output` (o_proj), so the full-sequence path here and the
serving path (paged K/V, in `serving`) share the same weights and projections.
Window semantics: a query at position q sees keys at positions k with q - w < k <= q.
Gated attention (`output_gate`, Qwen3-Next / 3.5): q_proj's output holds, per head, the
query then a gate; `project_gated` returns the gate [..., h, e] and `output` multiplies
the attention output by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import AttentionConfig
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norms import RMSNorm
from hybrid_jax.layers.rotary import apply_rope, rope_cos_sin


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """q_pos [..., t], k_pos [..., s] -> bool [..., t, s]: causal, within the window."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                          scale: float, softcap: float | None) -> jax.Array:
    """q [b, t, h, e], k/v [b, s, k, e], mask [b, t, s] -> [b, t, h, e] (q's dtype).

    Scores and softmax in f32; heads h = k * g share KV head h // g.
    """
    b, t, h, e = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, e)
    scores = jnp.einsum("btkge,bske->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # Fully masked rows (padding) give NaN from softmax(-inf); make them zero.
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkgts,bske->btkge", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, e)


class Attention(nnx.Module):
    """x [b, t, d] + positions [b, t] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: AttentionConfig, window: int | None, *, dtype: jnp.dtype,
                 rngs: nnx.Rngs, norm_eps: float = 1e-6, norm_offset: bool = False):
        h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(dim, cfg.q_width, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(dim, k * e, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(dim, k * e, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * e, dim, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        # q/k norms (cfg.qk_norm): one RMS norm over each head's e dims, like the model's norms.
        norm = lambda: RMSNorm(e, eps=norm_eps, offset=norm_offset, dtype=dtype)
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None
        self.cfg = cfg
        self.window = window

    def project(self, x: jax.Array | None, positions: jax.Array,
                raw: tuple[jax.Array, jax.Array, jax.Array] | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., t, d], positions [..., t] -> q [..., t, h, e], k and v [..., t, k, e].

        raw: the q/k/v projections of x already computed (biases included; a layer whose
        projections were fused with its neighbours', hybrid_jax/fusion.py); x is unused then.
        """
        q, k, v, _ = self.project_gated(x, positions, raw)
        return q, k, v

    def project_gated(self, x: jax.Array | None, positions: jax.Array,
                      raw: tuple[jax.Array, jax.Array, jax.Array] | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """`project` plus the output gate [..., t, h, e] (None without `output_gate`)."""
        cfg = self.cfg
        if raw is None:
            raw = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        lead = raw[0].shape[:-1]
        gate = None
        if cfg.output_gate:
            qg = raw[0].reshape(*lead, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = qg[..., :cfg.head_dim], qg[..., cfg.head_dim:]
        else:
            q = raw[0].reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = raw[1].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = raw[2].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        if cfg.key_multiplier != 1.0:
            k = k * cfg.key_multiplier
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not cfg.rope:
            return q, k, v, gate
        theta, scaling = cfg.rope_params(self.window)
        cos, sin = rope_cos_sin(positions, cfg.rope_dim, theta, scaling)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, o: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """o [..., t, h, e] (gate [..., t, h, e] or None) -> [..., t, d]."""
        return self.o_proj(gated_heads(o, gate).reshape(*o.shape[:-2], -1))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v, gate = self.project_gated(x, positions)
        mask = attention_mask(positions, positions, self.window)
        o = dot_product_attention(q, k, v, mask, scale=self.cfg.query_scale,
                                  softcap=self.cfg.softcap)
        return self.output(o, gate)


def gated_heads(o: jax.Array, gate: jax.Array | None) -> jax.Array:
    """o * sigmoid(gate) in o's dtype (transformers: both in the model dtype); o if no gate."""
    return o if gate is None else o * jax.nn.sigmoid(gate.astype(o.dtype))
