"""Zamba2's shared attention + MLP blocks and the per-depth adapters that specialise them.

A SHARED_BLOCK layer (the j-th of the model) runs shared block j % num_blocks on
x = rmsnorm_2d(concat(h, e)), where e are the token embeddings before the first layer:

    q, k, v = W_{q,k,v} x + lora_{q,k,v}^j(x)        (the loras only with attention_adapters)
    a = o_proj(attention(q, k, v))                    global, causal; scale (head_dim / 2)^-0.5
    u = rmsnorm(a);  g, v = split(W_gu u + lora_gu^j(u));  m = down(act(g) * v)
    s = linear^j(m)                                   added to the layer's Mamba2 input

There is no residual inside the shared block: `s` goes to the Mamba2 sub-block (see
model.Block). The weights of the shared blocks live once in the model; the adapters and
`linear` live in each layer (`DepthAdapters`). `DepthAttention` binds the two into the
project / output interface of `Attention`, which the serving path's paged attention uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import AttentionConfig, SharedBlockConfig
from hybrid_jax.layers.attention import attention_mask, dot_product_attention
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.mlp import ACTIVATIONS
from hybrid_jax.layers.norms import RMSNorm
from hybrid_jax.layers.rotary import apply_rope, rope_cos_sin


class LoRA(nnx.Module):
    """x [..., i] -> up(down(x)) [..., o] through rank r, no biases."""

    def __init__(self, i: int, o: int, r: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.down = Linear(i, r, bias=False, dtype=dtype, rngs=rngs)
        self.up = Linear(r, o, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.up(self.down(x))


class DepthAdapters(nnx.Module):
    """The per-depth weights of a SHARED_BLOCK layer; `block` says which shared block it uses."""

    def __init__(self, dim: int, att: AttentionConfig, cfg: SharedBlockConfig, block: int, *,
                 dtype: jnp.dtype, rngs: nnx.Rngs):
        r, f = cfg.adapter_rank, cfg.intermediate_size
        on = cfg.attention_adapters
        if on and att.num_heads != att.num_kv_heads:
            raise ValueError(f"attention_adapters need num_heads == num_kv_heads; got {att}")
        # Zamba2 has num_heads * head_dim == 2 * hidden_size; a tensor-parallel shard holds
        # its devices' heads only, so the adapters' output width is the projections'.
        lora = lambda: LoRA(2 * dim, att.num_heads * att.head_dim, r, dtype=dtype, rngs=rngs) if on else None
        self.q, self.k, self.v = lora(), lora(), lora()
        self.gate_up = LoRA(dim, 2 * f, r, dtype=dtype, rngs=rngs)
        self.linear = Linear(dim, dim, bias=False, dtype=dtype, rngs=rngs)
        self.block = block


class SharedBlock(nnx.Module):
    """One shared block: h, e [..., d] (+ positions) -> [..., d], given a layer's adapters."""

    def __init__(self, dim: int, att: AttentionConfig, cfg: SharedBlockConfig, *, norm_eps: float,
                 dtype: jnp.dtype, rngs: nnx.Rngs):
        h, k, e, f = att.num_heads, att.num_kv_heads, att.head_dim, cfg.intermediate_size
        self.input_norm = RMSNorm(2 * dim, eps=norm_eps, offset=False, dtype=dtype)
        self.q_proj = Linear(2 * dim, h * e, bias=False, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(2 * dim, k * e, bias=False, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(2 * dim, k * e, bias=False, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * e, dim, bias=False, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(dim, eps=norm_eps, offset=False, dtype=dtype)
        self.gate_up_proj = Linear(dim, 2 * f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, dim, bias=False, dtype=dtype, rngs=rngs)
        self.att = att
        self.cfg = cfg

    def attention_input(self, h: jax.Array, e: jax.Array) -> jax.Array:
        """h, e [..., d] -> rmsnorm(concat(h, e)) [..., 2d]."""
        return self.input_norm(jnp.concatenate([h, e.astype(h.dtype)], axis=-1))

    def project(self, x: jax.Array, positions: jax.Array,
                depth: DepthAdapters) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., t, 2d] -> q [..., t, h, e], k and v [..., t, k, e] (rotary if cfg.rope)."""
        att = self.att
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if depth.q is not None:
            q, k, v = q + depth.q(x), k + depth.k(x), v + depth.v(x)
        lead = x.shape[:-1]
        q = q.reshape(*lead, att.num_heads, att.head_dim)
        k = k.reshape(*lead, att.num_kv_heads, att.head_dim)
        v = v.reshape(*lead, att.num_kv_heads, att.head_dim)
        if self.cfg.rope:
            cos, sin = rope_cos_sin(positions, att.rope_dim, att.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def output(self, o: jax.Array) -> jax.Array:
        """Attention output o [..., t, h, e] -> [..., t, d]."""
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def mlp(self, a: jax.Array, depth: DepthAdapters) -> jax.Array:
        """Attention output a [..., d] -> linear^j(down(act(gate) * up)) [..., d]."""
        u = self.mlp_norm(a)
        gate, up = jnp.split(self.gate_up_proj(u) + depth.gate_up(u), 2, axis=-1)
        return depth.linear(self.down_proj(ACTIVATIONS[self.cfg.activation](gate) * up))

    def __call__(self, h: jax.Array, e: jax.Array, positions: jax.Array,
                 depth: DepthAdapters) -> jax.Array:
        view = DepthAttention(self, depth)
        q, k, v = view.project(self.attention_input(h, e), positions)
        mask = attention_mask(positions, positions, None)
        o = dot_product_attention(q, k, v, mask, scale=self.att.query_scale, softcap=self.att.softcap)
        return self.mlp(view.output(o), depth)


class DepthAttention:
    """A shared block's attention specialised by one layer's adapters (Attention's interface)."""

    window = None  # Zamba2's shared attention is global

    def __init__(self, block: SharedBlock, depth: DepthAdapters):
        self.block, self.depth, self.cfg = block, depth, block.att

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.block.project(x, positions, self.depth)

    def output(self, o: jax.Array) -> jax.Array:
        return self.block.output(o)
