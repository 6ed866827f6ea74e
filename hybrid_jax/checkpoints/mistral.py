"""MistralForCausalLM (Llama block; `sliding_window` on every layer, or None for global)."""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, MLPConfig, ModelConfig

ARCHITECTURE = "MistralForCausalLM"


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Mistral")
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="mistral",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec("attention", window) for _ in range(hf["num_hidden_layers"])),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim, rope_theta=hf_fields.rope_theta(hf)),
        mlp=MLPConfig(hf["intermediate_size"], activation="silu"),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.norm.weight", cfg)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out |= names.pre_norms(p, i)
        out |= names.attention(f"{p}.self_attn", names.layer_path(i, "attention"), qkv_bias=False,
                               o_bias=False)
        out |= names.gated_mlp(f"{p}.mlp", names.layer_path(i, "mlp"), bias=False)
    return out
