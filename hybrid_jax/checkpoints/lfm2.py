"""Lfm2ForCausalLM: gated short-conv layers beside global attention layers, each with a SwiGLU MLP.

Quirks that change numerics, each handled here:
- `layer_types` ("conv" / "full_attention"), or in older files `full_attn_idxs` (every
  layer is attention when neither is given, as in transformers);
- the conv layer's in_proj output splits in the order B, C, x: y = C * conv(B * x), no
  activation; `conv_bias` gives in_proj, conv and out_proj biases together;
- attention has per-head q/k RMS norms before rotary (`q_layernorm`, `k_layernorm`),
  no biases, and its output projection is named `out_proj`;
- the MLP width is adjusted when `block_auto_adjust_ff_dim`: int(2 f / 3), times
  `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`;
- the final norm is named `embedding_norm`; RoPE theta defaults to 1e6;
  embeddings tied unless `tie_word_embeddings` (old name `tie_embedding`) is false.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import (
    AttentionConfig,
    LayerSpec,
    MLPConfig,
    ModelConfig,
    ShortConvConfig,
)

ARCHITECTURE = "Lfm2ForCausalLM"
KINDS = {"conv": "short_conv", "full_attention": "attention"}


def layer_kinds(hf: dict[str, Any]) -> tuple[str, ...]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        full = hf.get("full_attn_idxs")
        full = range(n) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    bad = sorted(set(types) - set(KINDS))
    if bad or len(types) != n:
        raise ValueError(f"layer_types={types} must hold {n} entries of {sorted(KINDS)} "
                         f"(unsupported: {bad})")
    return tuple(KINDS[t] for t in types)


def mlp_width(hf: dict[str, Any]) -> int:
    f = hf.get("intermediate_size", hf.get("block_ff_dim", 12288))
    if hf.get("block_auto_adjust_ff_dim", True):
        f = int(2 * f / 3)
        mult = hf.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            m = hf.get("block_multiple_of", 256)
            f = m * ((int(mult * f) + m - 1) // m)
    return f


def attention_config(hf: dict) -> AttentionConfig:
    """LFM2's attention layers (shared by LFM2-MoE): q/k norms, rope theta 1e6 by default."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    return AttentionConfig(num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                           head_dim=hf.get("head_dim") or d // heads,
                           rope_theta=hf_fields.rope_theta(hf, default=1_000_000.0), qk_norm=True)


def short_conv_config(hf: dict) -> ShortConvConfig:
    return ShortConvConfig(conv_kernel=hf.get("conv_L_cache", 3), bias=hf.get("conv_bias", False))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    d = hf["hidden_size"]
    eps = hf.get("norm_eps", 1e-5)
    return ModelConfig(
        architecture="lfm2",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=tuple(LayerSpec(kind) for kind in layer_kinds(hf)),
        attention=attention_config(hf),
        short_conv=short_conv_config(hf),
        mlp=MLPConfig(mlp_width(hf), activation="silu"),
        norm_eps=eps,
        tie_embeddings=hf.get("tie_word_embeddings", hf.get("tie_embedding", True)),
        max_position_embeddings=hf.get("max_position_embeddings", 128_000),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = trunk_map(cfg)
    for i in range(cfg.num_layers):
        out |= dense_mlp_map(f"model.layers.{i}.feed_forward", names.layer_path(i, "mlp"))
    return out


def dense_mlp_map(hf: str, path: names.Path) -> names.WeightMap:
    """LFM2's SwiGLU MLP: w1 gate, w3 up, w2 down."""
    out: names.WeightMap = {}
    for hf_name, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out |= names.linear(f"{hf}.{hf_name}", (*path, ours), bias=False)
    return out


def trunk_map(cfg: ModelConfig) -> names.WeightMap:
    """Everything but the layers' MLPs (shared with LFM2-MoE)."""
    out = names.trunk("model.embed_tokens.weight", "model.embedding_norm.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.vector(f"{p}.operator_norm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.vector(f"{p}.ffn_norm.weight", names.layer_path(i, "mlp_norm", "weight"))
        if spec.kind == "attention":
            out |= _attention(f"{p}.self_attn", names.layer_path(i, "attention"))
        else:
            out |= _short_conv(f"{p}.conv", names.layer_path(i, "conv"), cfg.short_conv.bias)
    return out


def _attention(hf: str, path: names.Path) -> names.WeightMap:
    out: names.WeightMap = {}
    for hf_name, ours in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                          ("out_proj", "o_proj")):
        out |= names.linear(f"{hf}.{hf_name}", (*path, ours), bias=False)
    out |= names.vector(f"{hf}.q_layernorm.weight", (*path, "q_norm", "weight"))
    return out | names.vector(f"{hf}.k_layernorm.weight", (*path, "k_norm", "weight"))


def _short_conv(hf: str, path: names.Path, bias: bool) -> names.WeightMap:
    out = names.linear(f"{hf}.in_proj", (*path, "in_proj"), bias=bias)
    out |= names.linear(f"{hf}.out_proj", (*path, "out_proj"), bias=bias)
    out[f"{hf}.conv.weight"] = names.Target((*path, "conv_weight"), "conv")
    if bias:
        out |= names.vector(f"{hf}.conv.bias", (*path, "conv_bias"))
    return out
