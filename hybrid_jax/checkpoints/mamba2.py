"""Mamba2ForCausalLM: `h = h + mixer(rmsnorm(h))` with f32 residuals, norm_f, lm_head.

Quirks: original checkpoints name the embedding `backbone.embedding.weight`
(transformers renames it on load to `embeddings`); both are accepted. The gated
norm multiplies by silu(z) BEFORE normalising (norm_before_gate=False).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import LayerSpec, Mamba2Config, ModelConfig

ARCHITECTURE = "Mamba2ForCausalLM"
ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d = hf["hidden_size"]
    heads, head_dim = hf["num_heads"], hf["head_dim"]
    if hf.get("expand", 2) * d != heads * head_dim:
        raise ValueError(f"expand * hidden_size ({hf.get('expand', 2) * d}) must equal "
                         f"num_heads * head_dim ({heads * head_dim})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Mamba2")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    return ModelConfig(
        architecture="mamba2",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=tuple(LayerSpec("mamba2") for _ in range(hf["num_hidden_layers"])),
        mamba2=Mamba2Config(
            num_heads=heads, head_dim=head_dim, state_size=hf["state_size"],
            n_groups=hf.get("n_groups", 1), conv_kernel=hf.get("conv_kernel", 4),
            chunk_size=hf.get("chunk_size", 256), conv_bias=hf.get("use_conv_bias", True),
            in_proj_bias=hf.get("use_bias", False), out_proj_bias=hf.get("use_bias", False),
            dt_limit=hf_fields.time_step_limit(hf), gated_norm=True, norm_before_gate=False,
            norm_eps=eps),
        norm_eps=eps,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        residual_in_fp32=hf.get("residual_in_fp32", True),
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("backbone.embeddings.weight", "backbone.norm_f.weight", cfg)
    for i in range(cfg.num_layers):
        p = f"backbone.layers.{i}"
        out |= names.vector(f"{p}.norm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.mamba2(f"{p}.mixer", names.layer_path(i, "mamba"), cfg.mamba2)
    return out
