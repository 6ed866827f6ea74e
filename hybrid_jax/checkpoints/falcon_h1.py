"""FalconH1ForCausalLM: the parallel hybrid layer (Mamba2 + global attention, summed).

Quirks that change numerics, each handled here:
- muP multipliers: embedding, lm_head, attention in/out, ssm in/out, mlp gate/down,
  and the in_proj vector from `ssm_multipliers` (five segments z, x, B, C, dt) which
  is NOT stored in the checkpoint: the Mamba2 layer rebuilds it from the config;
- keys are scaled by `key_multiplier` BEFORE rotary;
- head_dim, mamba_d_ssm and mamba_d_head are read from the config (0.5B: head_dim 64,
  not hidden / heads);
- with `mamba_rms_norm` false the mixer output is y * silu(z) (no norm); otherwise the
  grouped gated norm with the gate before or after per `mamba_norm_before_gate`;
- in_proj bias follows `mamba_proj_bias`, out_proj bias `projectors_bias`.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig

ARCHITECTURE = "FalconH1ForCausalLM"


def _mamba(hf: dict[str, Any]) -> Mamba2Config:
    d_ssm = hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * hf["hidden_size"]
    heads = hf["mamba_n_heads"]
    head = hf.get("mamba_d_head", "auto")
    head = d_ssm // heads if head in ("auto", None) else head
    if head * heads != d_ssm:
        raise ValueError(f"mamba_d_head * mamba_n_heads ({head * heads}) must equal mamba_d_ssm ({d_ssm})")
    mult = hf.get("ssm_multipliers") or [1.0] * 5
    return Mamba2Config(
        num_heads=heads, head_dim=head, state_size=hf["mamba_d_state"],
        n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("mamba_chunk_size", 256), conv_bias=hf.get("mamba_conv_bias", True),
        in_proj_bias=hf.get("mamba_proj_bias", False),
        out_proj_bias=hf.get("projectors_bias", False),
        dt_limit=hf_fields.time_step_limit(hf), gated_norm=hf.get("mamba_rms_norm", False),
        norm_before_gate=hf.get("mamba_norm_before_gate", True),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        in_proj_multipliers=tuple(float(m) for m in mult))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    heads = hf["num_attention_heads"]
    bias = hf.get("attention_bias", False)
    gate_m, down_m = hf.get("mlp_multipliers") or [1.0, 1.0]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Falcon-H1")
    return ModelConfig(
        architecture="falcon_h1",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec("hybrid", None) for _ in range(hf["num_hidden_layers"])),
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=hf_fields.rope_theta(hf), qkv_bias=bias, o_bias=bias,
            key_multiplier=hf.get("key_multiplier", 1.0)),
        mamba2=_mamba(hf),
        mlp=MLPConfig(hf["intermediate_size"], activation="silu", bias=hf.get("mlp_bias", False),
                      gate_multiplier=gate_m, down_multiplier=down_m),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        embedding_scale=hf.get("embedding_multiplier", 1.0),
        logits_multiplier=hf.get("lm_head_multiplier", 1.0),
        attention_in_multiplier=hf.get("attention_in_multiplier", 1.0),
        attention_out_multiplier=hf.get("attention_out_multiplier", 1.0),
        ssm_in_multiplier=hf.get("ssm_in_multiplier", 1.0),
        ssm_out_multiplier=hf.get("ssm_out_multiplier", 1.0),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.final_layernorm.weight", cfg)
    att = cfg.attention
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out |= names.vector(f"{p}.input_layernorm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.vector(f"{p}.pre_ff_layernorm.weight", names.layer_path(i, "mlp_norm", "weight"))
        out |= names.attention(f"{p}.self_attn", names.layer_path(i, "attention"),
                               qkv_bias=att.qkv_bias, o_bias=att.o_bias)
        out |= names.mamba2(f"{p}.mamba", names.layer_path(i, "mamba"), cfg.mamba2)
        out |= names.gated_mlp(f"{p}.feed_forward", names.layer_path(i, "mlp"), bias=cfg.mlp.bias)
    return out
