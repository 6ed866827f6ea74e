"""RecurrentGemmaForCausalLM (Griffin): (recurrent, recurrent, attention) blocks + local MQA.

Quirks that change numerics, each handled here:
- the embedding is scaled by sqrt(hidden) ROUNDED TO BFLOAT16 (sqrt(2560) = 50.596 -> 50.5);
- RMS norms are x * (1 + w) in f32 (`norm_offset`);
- RoPE on the first half of head_dim only (partial_rotary_factor 0.5), theta 1e4;
- the MLP width is intermediate_size // 2; MLP and recurrent linears have biases, and
  o_proj always has a bias while q/k/v follow `attention_bias`;
- the RG-LRU state resets at position 0 (handled in the layer from positions);
- final logits are soft-capped (logits_soft_cap, 30).
Hub configs name the pattern `_block_types`; transformers 5.x writes `block_types`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, MLPConfig, ModelConfig, RGLRUConfig

ARCHITECTURE = "RecurrentGemmaForCausalLM"


def bf16_sqrt(x: int) -> float:
    """sqrt(x) rounded to bfloat16, as RecurrentGemma's embedding normalizer."""
    return float(np.float32(ml_dtypes.bfloat16(x**0.5)))


def _layer_specs(hf: dict[str, Any]) -> tuple[LayerSpec, ...]:
    pattern = hf.get("block_types") or hf.get("_block_types") or ["recurrent", "recurrent", "attention"]
    n = hf["num_hidden_layers"]
    window = hf.get("attention_window_size", 2048)
    kinds = {"recurrent": LayerSpec("rglru"), "attention": LayerSpec("attention", window)}
    unknown = set(pattern) - set(kinds)
    if unknown:
        raise ValueError(f"block_types contains unknown kinds {sorted(unknown)}")
    return tuple(kinds[pattern[i % len(pattern)]] for i in range(n))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    d = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    head_dim = d // heads
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation={act!r} is not supported for RecurrentGemma")
    rotary = int(head_dim * hf_fields.partial_rotary_factor(hf, default=0.5))
    return ModelConfig(
        architecture="recurrent_gemma",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=_layer_specs(hf),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim, rope_theta=hf_fields.rope_theta(hf), rotary_dim=rotary,
            qkv_bias=hf.get("attention_bias", False), o_bias=True),
        rglru=RGLRUConfig(width=hf.get("lru_width") or d, num_heads=heads,
                          conv_kernel=hf.get("conv1d_width", 4)),
        mlp=MLPConfig(hf["intermediate_size"] // 2, activation="gelu_tanh", bias=True),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_offset=True,
        tie_embeddings=True,
        embedding_scale=bf16_sqrt(d),
        logits_softcap=hf.get("logits_soft_cap", 30.0),
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
        **hf_fields.special_tokens(hf),
    )


def _recurrent(hf: str, path: names.Path) -> names.WeightMap:
    out: names.WeightMap = {}
    for name in ("linear_x", "linear_y", "linear_out"):
        out |= names.linear(f"{hf}.{name}", (*path, name), bias=True)
    out[f"{hf}.conv_1d.weight"] = names.Target((*path, "conv_weight"), "conv")
    out |= names.vector(f"{hf}.conv_1d.bias", (*path, "conv_bias"))
    for name in ("recurrent_param", "input_gate_weight", "input_gate_bias",
                 "recurrent_gate_weight", "recurrent_gate_bias"):
        out |= names.vector(f"{hf}.rg_lru.{name}", (*path, name))
    return out


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.vector("model.embed_tokens.weight", ("embed", "embedding"))
    out |= names.vector("model.final_norm.weight", ("final_norm", "weight"))
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.vector(f"{p}.temporal_pre_norm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.vector(f"{p}.channel_pre_norm.weight", names.layer_path(i, "mlp_norm", "weight"))
        if spec.kind.has_attention:
            out |= names.attention(f"{p}.temporal_block", names.layer_path(i, "attention"),
                                   qkv_bias=cfg.attention.qkv_bias, o_bias=True)
        else:
            out |= _recurrent(f"{p}.temporal_block", names.layer_path(i, "recurrent"))
        out |= names.gated_mlp(f"{p}.mlp_block", names.layer_path(i, "mlp"), bias=True)
    return out
