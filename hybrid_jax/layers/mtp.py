"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 and DeepSeek-V3.

Given the target's hidden state at position t (the input of its LM head: after the
final norm, as vLLM and SGLang feed it) and the embedding of token t + 1, the head
predicts token t + 2:

    x = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))  # 2d -> d
    x = layer_j(x) for each of its mtp_num_hidden_layers decoder layers
    g = norm(x)                       # the next draft's hidden state
    logits = the target's LM head(g)  # shared embedding and head; no final norm of the target

Its decoder layers are full-attention layers of the target's own kind (same attention,
dense MLP or mixture of experts), built by the model's own layer factory; they attend
over their own K/V at the same positions as the target (serving: own pages, shared page
tables; see serving/spec_decode/mtp.py). Tensor names (`mtp.fc.weight`, `mtp.pre_fc_norm_*`,
`mtp.layers.J.*`, `mtp.norm.weight`) are mapped in hybrid_jax/checkpoints/mtp.py.
This module knows nothing of pages or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import LayerKind, LayerSpec, ModelConfig
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norms import RMSNorm


def mtp_layer_spec(cfg: ModelConfig) -> LayerSpec:
    """The MTP decoder layer's spec: the target's pure attention layer (a global one when it
    has one), else an attention layer with the window and channel sub-block of its first
    attention-bearing layer. Its window picks the KV group whose page tables it shares."""
    attn = [s for s in cfg.layers if s.kind == LayerKind.ATTENTION]
    if attn:
        return next((s for s in attn if s.window is None), attn[0])
    carrier = next((s for s in cfg.layers if s.kind.has_attention), None)
    if carrier is None or cfg.attention is None:
        raise ValueError(f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}: the MTP head's "
                         "attention layer needs a model with attention layers")
    return LayerSpec(LayerKind.ATTENTION, carrier.window, carrier.moe)


class MTPHead(nnx.Module):
    """The MTP module's own weights (embedding and LM head are the target's)."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[LayerSpec], nnx.Module], *,
                 dtype: jnp.dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(d, eps=cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype)

        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = Linear(2 * d, d, bias=False, dtype=dtype, rngs=rngs)
        spec = mtp_layer_spec(cfg)
        self.layers = nnx.List([make_block(spec) for _ in range(cfg.mtp_num_hidden_layers)])
        self.norm = norm()
        self.spec = spec
        self.dtype = dtype

    def combine(self, embedded: jax.Array, hidden: jax.Array) -> jax.Array:
        """[..., d] embeddings of x_{t+1} and target hidden states h_t -> the layer input [..., d]."""
        e = self.pre_fc_norm_embedding(embedded.astype(self.dtype))
        h = self.pre_fc_norm_hidden(hidden.astype(self.dtype))
        return self.fc(jnp.concatenate([e, h], axis=-1))

    def __call__(self, embedded: jax.Array, hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """Full-sequence reference ([b, t, d], no cache): the normed output g [b, t, d]; the
        target's `head(g)` gives the logits of token t + 2."""
        x = self.combine(embedded, hidden)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x.astype(self.dtype))
