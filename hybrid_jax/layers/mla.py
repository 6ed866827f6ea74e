"""Multi-head latent attention (MLA) as Kimi Linear uses it: NoPE, K/V expanded per head.

Shapes: t tokens, d hidden, h heads, r = kv_lora_rank, dn = qk_nope_head_dim,
dr = qk_rope_head_dim (a key slice shared by every head; Kimi Linear applies no rotary
to it: the layer has no positional encoding), dv = v_head_dim, e = dn + dr.

    q = q_proj(x) [t, h, e]  (or q_b_proj(rms(q_a_proj(x))) with q_lora_rank)
    [c | k_r] = kv_a_proj_with_mqa(x) [t, r + dr];  [k_n | v] = kv_b_proj(rms(c)) [t, h, dn + dv]
    k = [k_n | k_r (every head)] [t, h, e];  softmax(q k^T e^-1/2) v;  o_proj([t, h dv])

`project` returns per-head q, k [t, h, e] and v zero-padded to [t, h, e], and `output`
takes the attention output [t, h, e] and drops the padding: the engine's paged attention
(hybrid_jax/ragged.py, one head width for K and V) then serves it as ordinary global
attention with h KV heads of width e, and the padded V columns only ever hold zeros. The
latent cache (r + dr values per token instead of 2 h e) is the memory-saving next step.
The full-sequence forward here is the reference of that path.
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
