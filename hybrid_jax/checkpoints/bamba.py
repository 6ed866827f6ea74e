"""BambaForCausalLM: Mamba2 layers with global attention at `attn_layer_indices`.

Every layer is `h = h + mixer(norm(h)); h = h + mlp(norm(h))` with a SwiGLU MLP.
Quirks that change numerics, each handled here:
- RoPE on the first half of head_dim (transformers hard-codes partial_rotary_factor
  0.5 for Bamba; `rope_parameters` carries it);
- the Mamba2 mixer: `mamba_d_head` "auto" = mamba_expand * hidden / mamba_n_heads;
  grouped gated RMS norm with the gate applied first (like Mamba2); in_proj and
  out_proj biases follow `mamba_proj_bias`; dt clamped to `time_step_limit`.
The `mamba_*` field reading is shared with Granite-4.0-H (granite_hybrid.py).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig

ARCHITECTURE = "BambaForCausalLM"


def mamba_config(hf: dict[str, Any], *, eps: float = 1e-5) -> Mamba2Config:
    """The Mamba2 mixer from the `mamba_*` fields (Bamba, Granite-4.0-H)."""
    d_inner = hf.get("mamba_expand", 2) * hf["hidden_size"]
    heads = hf.get("mamba_n_heads", 128)
    head = hf.get("mamba_d_head", "auto")
    head = d_inner // heads if head in ("auto", None) else head
    if head * heads != d_inner:
        raise ValueError(f"mamba_d_head * mamba_n_heads ({head * heads}) must equal "
                         f"mamba_expand * hidden_size ({d_inner})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    bias = hf.get("mamba_proj_bias", False)
    return Mamba2Config(
        num_heads=heads, head_dim=head, state_size=hf.get("mamba_d_state", 256),
        n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("mamba_chunk_size", 256), conv_bias=hf.get("mamba_conv_bias", True),
        in_proj_bias=bias, out_proj_bias=bias, dt_limit=hf_fields.time_step_limit(hf),
        gated_norm=True, norm_before_gate=False, norm_eps=hf.get("rms_norm_eps", eps))


def attention_shape(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    bias = hf.get("attention_bias", False)
    return {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "qkv_bias": bias, "o_bias": bias}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    n = hf["num_hidden_layers"]
    attn = set(hf.get("attn_layer_indices") or ())
    if not attn <= set(range(n)):
        raise ValueError(f"attn_layer_indices={sorted(attn)} must lie in [0, {n})")
    shape = attention_shape(hf)
    rotary = int(shape["head_dim"] * hf_fields.partial_rotary_factor(hf, default=0.5))
    return ModelConfig(
        architecture="bamba",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec("attention") if i in attn else LayerSpec("mamba2")
                     for i in range(n)),
        attention=AttentionConfig(**shape, rope_theta=hf_fields.rope_theta(hf), rotary_dim=rotary)
        if attn else None,
        mamba2=mamba_config(hf),
        mlp=MLPConfig(hf["intermediate_size"], activation="silu", bias=hf.get("mlp_bias", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
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
        if spec.kind.has_attention:
            att = cfg.attention
            out |= names.attention(f"{p}.self_attn", names.layer_path(i, "attention"),
                                   qkv_bias=att.qkv_bias, o_bias=att.o_bias)
        else:
            out |= names.mamba2(f"{p}.mamba", names.layer_path(i, "mamba"), cfg.mamba2)
        out |= names.gated_mlp(f"{p}.feed_forward", names.layer_path(i, "mlp"), bias=cfg.mlp.bias)
    return out
