"""JambaForCausalLM: Mamba1 and attention layers, each with a dense MLP or a mixture of experts.

Layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba1; its
channel sub-block is MoE when i % expert_layer_period == expert_layer_offset (and
num_experts > 1), else the dense SwiGLU MLP. Quirks, each handled here:
- the Mamba1 mixer RMS-normalises dt, B and C WITH weights (`dt_layernorm`,
  `b_layernorm`, `c_layernorm`, eps rms_norm_eps), unlike Falcon-Mamba's weightless norms;
- attention without positional encoding (no RoPE), global, GQA, no biases;
- the router: softmax over all experts, the top-k scores used as they are (no
  renormalisation), no shared expert; experts are SwiGLU of width intermediate_size,
  stored per expert (`experts.{j}.{gate,up,down}_proj`) and stacked here;
- pre-norm residuals in the weight dtype; final norm `final_layernorm`; untied head.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.checkpoints.mamba1 import dt_rank
from hybrid_jax.config import (
    AttentionConfig,
    LayerSpec,
    Mamba1Config,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURE = "JambaForCausalLM"


def layer_specs(hf: dict[str, Any]) -> tuple[LayerSpec, ...]:
    ap, ao = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
    ep, eo = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
    experts = hf.get("num_experts", 16)
    return tuple(LayerSpec("attention" if i % ap == ao else "mamba1", moe=experts > 1 and i % ep == eo)
                 for i in range(hf["num_hidden_layers"]))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Jamba (silu only)")
    eps = hf.get("rms_norm_eps", 1e-6)
    layers = layer_specs(hf)
    f = hf.get("intermediate_size", 14336)
    return ModelConfig(
        architecture="jamba",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                                  head_dim=d // heads, rope=False),
        mamba1=Mamba1Config(
            d_inner=hf.get("mamba_expand", 2) * d, state_size=hf.get("mamba_d_state", 16),
            dt_rank=dt_rank(hf.get("mamba_dt_rank", "auto"), d), conv_kernel=hf.get("mamba_d_conv", 4),
            conv_bias=hf.get("mamba_conv_bias", True), proj_bias=hf.get("mamba_proj_bias", False),
            bcdt_norm="weighted", norm_eps=eps),
        mlp=MLPConfig(f, activation="silu") if any(not s.moe for s in layers) else None,
        moe=(MoEConfig(num_experts=hf.get("num_experts", 16), top_k=hf.get("num_experts_per_tok", 2),
                       intermediate_size=f, activation="silu", scores="softmax", norm_topk=False)
             if any(s.moe for s in layers) else None),
        norm_eps=eps,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 262_144),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.final_layernorm.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.vector(f"{p}.input_layernorm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.vector(f"{p}.pre_ff_layernorm.weight", names.layer_path(i, "mlp_norm", "weight"))
        if spec.kind == "attention":
            out |= names.attention(f"{p}.self_attn", names.layer_path(i, "attention"),
                                   qkv_bias=False, o_bias=False)
        else:
            out |= names.mamba1(f"{p}.mamba", names.layer_path(i, "mamba1"), cfg.mamba1)
        ff = f"{p}.feed_forward"
        if not spec.moe:
            out |= names.gated_mlp(ff, names.layer_path(i, "mlp"), bias=False)
            continue
        moe, f = names.layer_path(i, "moe"), cfg.moe.intermediate_size
        out[f"{ff}.router.weight"] = names.Target((*moe, "router"), "linear")
        out |= names.moe_experts(None, f"{ff}.experts", moe, cfg.moe,
                                 {"gate_proj": ("gate_up", 0, f), "up_proj": ("gate_up", f, f),
                                  "down_proj": ("down", 0, cfg.hidden_size)})
    return out
