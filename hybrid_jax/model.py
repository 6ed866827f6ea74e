"""The causal LM: embedding, a stack of residual layers built from the layer pattern, head.

Each layer: u = norm(h); h = h + sum of its mixers on u (attention, Mamba2, Mamba1, RG-LRU,
short conv, Gated DeltaNet or KDA, MLA; HYBRID layers run attention and Mamba2 in parallel, each with in/out
multipliers); then, if the layer has an MLP, h = h + mlp(norm(h)). MLP-kind layers
(Nemotron-H) have only the MLP sub-block. A layer's channel sub-block is the dense MLP or
the mixture of experts (layers/moe.py), per its `LayerSpec.moe`. With sandwich norms (Gemma) each sub-block's
output is normed before its add; Granite scales both by `residual_multiplier`. SHARED_BLOCK layers
(Zamba2) first run one of the model's shared attention + MLP blocks on (h, embeddings)
and normalise h + its output instead of h: u = norm(h + s). `__call__` is the full-sequence
forward ([b, t], no cache) used for training and as the serving path's reference.
The model knows nothing of pages, slots or scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import LayerKind, LayerSpec, ModelConfig
from hybrid_jax.layers.attention import Attention
from hybrid_jax.layers.gated_deltanet import GatedDeltaNet
from hybrid_jax.layers.kda import KimiDeltaAttention
from hybrid_jax.layers.linear import Embed, Linear
from hybrid_jax.layers.mamba1 import Mamba1Mixer
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.layers.mla import MLAttention
from hybrid_jax.layers.mlp import GatedMLP
from hybrid_jax.layers.moe import MoE
from hybrid_jax.layers.mtp import MTPHead
from hybrid_jax.layers.norms import RMSNorm
from hybrid_jax.layers.rglru import RecurrentBlock
from hybrid_jax.layers.shared_block import DepthAdapters, SharedBlock
from hybrid_jax.layers.short_conv import ShortConv


class Block(nnx.Module):
    """One residual layer.  h [b, t, d] (+ positions [b, t]) -> [b, t, d]."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 shared_ordinal: int | None = None, fp8_experts: int | None = None):
        d = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(d, eps=cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype)

        kind = spec.kind
        self.temporal_norm = norm() if kind != LayerKind.MLP else None
        own_attention = kind.has_attention and kind != LayerKind.SHARED_BLOCK
        attention = None
        if own_attention and cfg.mla is not None:  # Kimi Linear: MLA, K/V expanded per head
            attention = MLAttention(d, cfg.mla, cfg.attention, dtype=dtype, rngs=rngs)
        elif own_attention:
            attention = Attention(d, cfg.attention, spec.window, dtype=dtype, rngs=rngs,
                                  norm_eps=cfg.norm_eps, norm_offset=cfg.norm_offset)
        self.attention = attention
        self.mamba = Mamba2Mixer(d, cfg.mamba2, dtype=dtype, rngs=rngs) if kind.has_mamba2 else None
        self.mamba1 = (Mamba1Mixer(d, cfg.mamba1, dtype=dtype, rngs=rngs)
                       if kind == LayerKind.MAMBA1 else None)
        self.recurrent = (RecurrentBlock(d, cfg.rglru, dtype=dtype, rngs=rngs)
                          if kind == LayerKind.RGLRU else None)
        self.conv = (ShortConv(d, cfg.short_conv, dtype=dtype, rngs=rngs)
                     if kind == LayerKind.SHORT_CONV else None)
        gdn = cfg.gated_deltanet
        gdn_cls = KimiDeltaAttention if gdn is not None and gdn.kimi_delta else GatedDeltaNet
        self.gdn = (gdn_cls(d, gdn, dtype=dtype, rngs=rngs)
                    if kind == LayerKind.GATED_DELTANET else None)
        # SHARED_BLOCK: this layer's adapters of shared block j % num_blocks.
        sb = cfg.shared_block
        self.depth = (DepthAdapters(d, cfg.attention, sb, shared_ordinal % sb.num_blocks,
                                    dtype=dtype, rngs=rngs)
                      if kind == LayerKind.SHARED_BLOCK else None)
        # The channel sub-block: the dense MLP, or the mixture of experts where spec.moe.
        dense, moe = cfg.layer_has_mlp(spec), spec.moe
        has_mlp = dense or moe
        self.mlp_norm = norm() if has_mlp else None
        self.mlp = GatedMLP(d, cfg.mlp, dtype=dtype, rngs=rngs) if dense else None
        self.moe = MoE(d, cfg.moe, dtype=dtype, rngs=rngs, fp8_block=fp8_experts) if moe else None
        sandwich = cfg.sandwich_norm
        self.post_temporal_norm = norm() if sandwich and self.temporal_norm is not None else None
        self.post_mlp_norm = norm() if sandwich and has_mlp else None
        # Serving-time fused projections (hybrid_jax/fusion.py); None in a model as built.
        self.fused_in: Linear | None = nnx.data(None)
        self.fused_out: Linear | None = nnx.data(None)
        self.spec = spec
        self.cfg = cfg
        self.dtype = dtype

    def norm_input(self, h: jax.Array, shared: jax.Array | None = None) -> jax.Array:
        # With f32 residuals (Mamba2) the norm sees the stream cast to the weight dtype.
        # `shared`: a SHARED_BLOCK layer's shared-block output, added to the mixer input only.
        if shared is not None:
            h = h + shared.astype(h.dtype)
        return self.temporal_norm(h.astype(self.dtype))

    def mix(self, h: jax.Array, temporal: jax.Array | None) -> jax.Array:
        """Residual add of the temporal output (None: MLP-kind layer), then the MLP sub-block."""
        if temporal is not None:
            h = self._add(h, temporal, self.post_temporal_norm, fp32=self.cfg.residual_in_fp32)
        channel = self.mlp if self.mlp is not None else self.moe
        if channel is not None:
            h = self._add(h, channel(self.mlp_norm(h)), self.post_mlp_norm, fp32=False)
        return h

    def _add(self, h: jax.Array, branch: jax.Array, post_norm: RMSNorm | None, *,
             fp32: bool) -> jax.Array:
        if post_norm is not None:
            branch = post_norm(branch)
        if self.cfg.residual_multiplier != 1.0:  # in f32, like torch's python-scalar multiply
            branch = (branch.astype(jnp.float32) * self.cfg.residual_multiplier).astype(branch.dtype)
        if fp32:
            return h.astype(jnp.float32) + branch.astype(jnp.float32)
        return h + branch.astype(h.dtype)

    def __call__(self, h: jax.Array, positions: jax.Array,
                 shared: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        if self.fused_in is not None or self.fused_out is not None:
            raise ValueError("a model with fused projections (hybrid_jax/fusion.py) runs the "
                             "serving path only (hybrid_jax/ragged.py)")
        if self.temporal_norm is None:  # MLP-kind layer
            return self.mix(h, None)
        u = self.norm_input(h, shared)
        out = jnp.zeros_like(u)
        if self.attention is not None:
            out = out + self.attention(_scale(u, cfg.attention_in_multiplier), positions) \
                * cfg.attention_out_multiplier
        if self.mamba is not None:
            out = out + self.mamba(_scale(u, cfg.ssm_in_multiplier)) * cfg.ssm_out_multiplier
        if self.mamba1 is not None:
            out = out + self.mamba1(u)
        if self.recurrent is not None:
            out = out + self.recurrent(u, positions)
        if self.conv is not None:
            out = out + self.conv(u)
        if self.gdn is not None:
            out = out + self.gdn(u)
        return self.mix(h, out)


def _scale(x: jax.Array, m: float) -> jax.Array:
    return x if m == 1.0 else x * jnp.asarray(m, x.dtype)


class CausalLM(nnx.Module):
    """tokens [b, t] int32 -> logits [b, t, v] f32.

    `fp8_experts`: the decoder layers' MoE expert stacks are quantized to FP8 with this
    block as they are drawn (layers/moe.py; quantization="fp8" of a preset: the rest is
    quantized after construction, hybrid_jax/quantization.py). The MTP head's stay in `dtype`."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs,
                 fp8_experts: int | None = None):
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, spec, dtype=dtype, rngs=rngs, shared_ordinal=j,
                                      fp8_experts=fp8_experts)
                                for spec, j in zip(cfg.layers, shared_ordinals(cfg), strict=True)])
        sb = cfg.shared_block
        self.shared_blocks = None if sb is None else nnx.List([
            SharedBlock(cfg.hidden_size, cfg.attention, sb, norm_eps=cfg.norm_eps, dtype=dtype,
                        rngs=rngs) for _ in range(sb.num_blocks)])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, offset=cfg.norm_offset,
                                  dtype=dtype)
        self.lm_head = (None if cfg.tie_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))
        # The multi-token-prediction head (hybrid_jax/layers/mtp.py), built from this model's
        # own layer factory; the forward passes never read it (speculative_method="mtp" does).
        self.mtp = (MTPHead(cfg, lambda spec: Block(cfg, spec, dtype=dtype, rngs=rngs), dtype=dtype,
                            rngs=rngs) if cfg.mtp_num_hidden_layers else None)
        self.cfg = cfg
        self.dtype = dtype

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.cfg.embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embedding_scale, x.dtype)
        return x

    def logits(self, h: jax.Array) -> jax.Array:
        """Final hidden states [..., d] -> logits [..., v] f32 (norm, head, multiplier, cap)."""
        return self.head(self.final_norm(h.astype(self.dtype)))

    def head(self, h: jax.Array) -> jax.Array:
        """Normed hidden states [..., d] -> logits [..., v] f32 (head, multiplier, cap): the
        target's own and the MTP head's (hybrid_jax/layers/mtp.py)."""
        cfg = self.cfg
        logits = self.embed.attend(h) if self.lm_head is None else self.lm_head(h)
        logits = logits.astype(jnp.float32)
        if cfg.logits_multiplier != 1.0:
            logits = logits * cfg.logits_multiplier
        if cfg.logits_softcap is not None:
            logits = cfg.logits_softcap * jnp.tanh(logits / cfg.logits_softcap)
        return logits

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        return self.logits(self.hidden(tokens, positions))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The last layer's output [b, t, d], before the final norm."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h = e = self.embed_tokens(tokens)
        for layer in self.layers:
            shared = None
            if layer.depth is not None:
                shared = self.shared_blocks[layer.depth.block](h, e, positions, layer.depth)
            h = layer(h, positions, shared)
        return h


def shared_ordinals(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Per layer: its rank among the SHARED_BLOCK layers (None for other kinds)."""
    out, j = [], 0
    for spec in cfg.layers:
        out.append(j if spec.kind == LayerKind.SHARED_BLOCK else None)
        j += spec.kind == LayerKind.SHARED_BLOCK
    return tuple(out)
