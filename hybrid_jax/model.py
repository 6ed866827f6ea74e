"""The causal LM: embedding, a stack of residual layers built from the layer pattern, head.

Each layer: u = norm(h); h = h + sum of its mixers on u (attention, Mamba2, RG-LRU;
HYBRID layers run attention and Mamba2 in parallel, each with in/out multipliers);
then, if the model has an MLP, h = h + mlp(norm(h)). `__call__` is the full-sequence
forward ([b, t], no cache) used for training and as the serving path's reference.
The model knows nothing of pages, slots or scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import LayerKind, LayerSpec, ModelConfig
from hybrid_jax.layers.attention import Attention
from hybrid_jax.layers.linear import Embed, Linear
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.layers.mlp import GatedMLP
from hybrid_jax.layers.norms import RMSNorm
from hybrid_jax.layers.rglru import RecurrentBlock


class Block(nnx.Module):
    """One residual layer.  h [b, t, d] (+ positions [b, t]) -> [b, t, d]."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(d, eps=cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype)

        kind = spec.kind
        self.temporal_norm = norm()
        self.attention = (Attention(d, cfg.attention, spec.window, dtype=dtype, rngs=rngs)
                          if kind.has_attention else None)
        self.mamba = Mamba2Mixer(d, cfg.mamba2, dtype=dtype, rngs=rngs) if kind.has_mamba2 else None
        self.recurrent = (RecurrentBlock(d, cfg.rglru, dtype=dtype, rngs=rngs)
                          if kind == LayerKind.RGLRU else None)
        self.mlp_norm = norm() if cfg.mlp is not None else None
        self.mlp = GatedMLP(d, cfg.mlp, dtype=dtype, rngs=rngs) if cfg.mlp is not None else None
        self.spec = spec
        self.cfg = cfg
        self.dtype = dtype

    def norm_input(self, h: jax.Array) -> jax.Array:
        # With f32 residuals (Mamba2) the norm sees the stream cast to the weight dtype.
        return self.temporal_norm(h.astype(self.dtype))

    def mix(self, h: jax.Array, temporal: jax.Array) -> jax.Array:
        """Residual add of the temporal output, then the MLP sub-block."""
        if self.cfg.residual_in_fp32:
            h = h.astype(jnp.float32) + temporal.astype(jnp.float32)
        else:
            h = h + temporal.astype(h.dtype)
        if self.mlp is not None:
            h = h + self.mlp(self.mlp_norm(h)).astype(h.dtype)
        return h

    def __call__(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        u = self.norm_input(h)
        out = jnp.zeros_like(u)
        if self.attention is not None:
            out = out + self.attention(_scale(u, cfg.attention_in_multiplier), positions) \
                * cfg.attention_out_multiplier
        if self.mamba is not None:
            out = out + self.mamba(_scale(u, cfg.ssm_in_multiplier)) * cfg.ssm_out_multiplier
        if self.recurrent is not None:
            out = out + self.recurrent(u, positions)
        return self.mix(h, out)


def _scale(x: jax.Array, m: float) -> jax.Array:
    return x if m == 1.0 else x * jnp.asarray(m, x.dtype)


class CausalLM(nnx.Module):
    """tokens [b, t] int32 -> logits [b, t, v] f32."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, spec, dtype=dtype, rngs=rngs) for spec in cfg.layers])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, offset=cfg.norm_offset,
                                  dtype=dtype)
        self.lm_head = (None if cfg.tie_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))
        self.cfg = cfg
        self.dtype = dtype

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.cfg.embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embedding_scale, x.dtype)
        return x

    def logits(self, h: jax.Array) -> jax.Array:
        """Final hidden states [..., d] -> logits [..., v] f32 (norm, head, multiplier, cap)."""
        cfg = self.cfg
        h = self.final_norm(h.astype(self.dtype))
        logits = self.embed.attend(h) if self.lm_head is None else self.lm_head(h)
        logits = logits.astype(jnp.float32)
        if cfg.logits_multiplier != 1.0:
            logits = logits * cfg.logits_multiplier
        if cfg.logits_softcap is not None:
            logits = cfg.logits_softcap * jnp.tanh(logits / cfg.logits_softcap)
        return logits

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, positions)
        return self.logits(h)
