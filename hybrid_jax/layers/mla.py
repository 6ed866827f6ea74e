"""Multi-head latent attention (MLA) as Kimi Linear uses it: NoPE, a latent KV cache.

Shapes: t tokens, d hidden, h heads, r = kv_lora_rank, dn = qk_nope_head_dim,
dr = qk_rope_head_dim (a key slice shared by every head; Kimi Linear applies no rotary
to it: the layer has no positional encoding), dv = v_head_dim, e = dn + dr, L = r + dr.

    q = q_proj(x) [t, h, e]  (or q_b_proj(rms(q_a_proj(x))) with q_lora_rank)
    [c | k_r] = kv_a_proj_with_mqa(x) [t, r + dr];  [k_n | v] = kv_b_proj(rms(c)) [t, h, dn + dv]
    k = [k_n | k_r (every head)] [t, h, e];  softmax(q k^T e^-1/2) v;  o_proj([t, h dv])

That expanded form is the full-sequence forward here (`__call__`, the serving path's
reference). The serving path keeps only the latent: one row [rms(c) | k_r] of width L per
token (`latent`), one "KV head" for all h query heads. With W_uk [r, h, dn] and W_uv
[r, h, dv] the two parts of kv_b_proj, q_n . k_n = (q_n W_uk^T) . rms(c) and
sum_j p_j v_j = (sum_j p_j rms(c_j)) W_uv, so attention runs as multi-query attention in
latent space (`absorb_q`: [q_n W_uk^T | q_r] [t, h, L] against keys [rms(c) | k_r], values
the same rows' first r columns) and `absorbed_output` maps the latent output [t, h, r]
through W_uv and o_proj. The softmax scale stays e^-1/2 (the expanded head width).
This module knows nothing of pages, slots or scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import AttentionConfig, MLAConfig
from hybrid_jax.layers.attention import attention_mask, dot_product_attention
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norms import RMSNorm


class MLAttention(nnx.Module):
    """x [b, t, d] + positions [b, t] -> [b, t, d]. `cfg` is the AttentionConfig the pages
    and the attention kernels see (h KV heads of width e, no rope); `mla` the shapes."""

    # transformers' KimiLinearAttention builds q_a_layernorm and kv_a_layernorm with the
    # RMSNorm default eps, not the config's rms_norm_eps.
    LATENT_NORM_EPS = 1e-6

    def __init__(self, dim: int, mla: MLAConfig, cfg: AttentionConfig, *, dtype: jnp.dtype,
                 rngs: nnx.Rngs, norm_eps: float = LATENT_NORM_EPS):
        h, e = mla.num_heads, mla.qk_head_dim
        lin = lambda i, o, bias=False: Linear(i, o, bias=bias, dtype=dtype, rngs=rngs)  # noqa: E731
        norm = lambda n: RMSNorm(n, eps=norm_eps, offset=False, dtype=dtype)  # noqa: E731
        if mla.q_lora_rank is None:
            self.q_proj = lin(dim, h * e)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = lin(dim, mla.q_lora_rank, mla.bias)
            self.q_a_layernorm = norm(mla.q_lora_rank)
            self.q_b_proj = lin(mla.q_lora_rank, h * e)
        self.kv_a_proj_with_mqa = lin(dim, mla.kv_lora_rank + mla.qk_rope_head_dim, mla.bias)
        self.kv_a_layernorm = norm(mla.kv_lora_rank)
        self.kv_b_proj = lin(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = lin(h * mla.v_head_dim, dim, mla.bias)
        self.mla = mla
        self.cfg = cfg
        self.window = None

    def project(self, x: jax.Array, positions: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., d] -> q, k [..., h, e] and v [..., h, e] (columns dv: zero). No rotary:
        positions are unused (the signature is attention's)."""
        m = self.mla
        h, e, dn = m.num_heads, m.qk_head_dim, m.qk_nope_head_dim
        lead = x.shape[:-1]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*lead, h, e)
        c, k_r = jnp.split(self.kv_a_proj_with_mqa(x), [m.kv_lora_rank], axis=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).reshape(*lead, h, dn + m.v_head_dim)
        k_n, v = kv[..., :dn], kv[..., dn:]
        k = jnp.concatenate([k_n, jnp.broadcast_to(k_r[..., None, :], (*lead, h, m.qk_rope_head_dim))],
                            axis=-1)
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, e - m.v_head_dim)])
        return q, k, v

    def latent(self, x: jax.Array) -> jax.Array:
        """x [..., d] -> the cached row [..., L] = [rms(c) | k_r] (what the pages hold)."""
        c, k_r = jnp.split(self.kv_a_proj_with_mqa(x), [self.mla.kv_lora_rank], axis=-1)
        return jnp.concatenate([self.kv_a_layernorm(c), k_r.astype(c.dtype)], axis=-1)

    def _kv_b(self) -> tuple[jax.Array, jax.Array]:
        """kv_b_proj's kernel split per head: W_uk [r, h, dn], W_uv [r, h, dv]."""
        m, lin = self.mla, self.kv_b_proj
        w = lin.weight()  # [r, h (dn + dv)], or [h (dn + dv), r] held transposed (fusion.py)
        w = (w.T if lin.transposed else w).reshape(m.kv_lora_rank, m.num_heads, -1)
        return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

    def absorb_q(self, x: jax.Array) -> jax.Array:
        """x [t, d] -> queries in latent space [t, h, L] = [q_n W_uk^T | q_r]."""
        m = self.mla
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], m.num_heads, m.qk_head_dim)
        w_uk, _ = self._kv_b()
        q_lat = jnp.einsum("thn,rhn->thr", q[..., :m.qk_nope_head_dim], w_uk.astype(q.dtype),
                           preferred_element_type=jnp.float32).astype(q.dtype)
        return jnp.concatenate([q_lat, q[..., m.qk_nope_head_dim:]], axis=-1)

    def absorbed_output(self, o: jax.Array) -> jax.Array:
        """o [t, h, >= r] (the attended latent rows; columns past r dropped) -> [t, d]."""
        _, w_uv = self._kv_b()
        o = o[..., :self.mla.kv_lora_rank]
        v = jnp.einsum("thr,rhv->thv", o, w_uv.astype(o.dtype),
                       preferred_element_type=jnp.float32).astype(o.dtype)
        return self.o_proj(v.reshape(*v.shape[:-2], -1))

    def output(self, o: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """o [..., h, e] (V's padding columns last) -> [..., d]."""
        assert gate is None
        o = o[..., :self.mla.v_head_dim]
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self.project(x)
        mask = attention_mask(positions, positions, None)
        o = dot_product_attention(q, k, v, mask, scale=self.cfg.query_scale, softcap=None)
        return self.output(o)
