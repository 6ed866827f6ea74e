"""MambaForCausalLM: `h = h + mixer(rmsnorm(h))` with f32 residuals, norm_f, lm_head (tied by default).

The Mamba1 mixer (hybrid_jax/layers/mamba1.py) with no dt/B/C norms. `config_from_hf` is
shared with Falcon-Mamba (hybrid_jax/checkpoints/falcon_mamba.py), which only adds the
weightless RMS norms of dt, B and C. `time_step_rank` "auto" means ceil(hidden / 16).
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import LayerSpec, Mamba1Config, ModelConfig

ARCHITECTURE = "MambaForCausalLM"


def dt_rank(value: int | str, hidden: int) -> int:
    return math.ceil(hidden / 16) if value == "auto" else int(value)


def config_from_hf(hf: dict[str, Any], *, bcdt_norm: str = "none",
                   architecture: str = "mamba1") -> ModelConfig:
    d = hf["hidden_size"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Mamba1 (silu only)")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=tuple(LayerSpec("mamba1") for _ in range(hf["num_hidden_layers"])),
        mamba1=Mamba1Config(
            d_inner=hf.get("intermediate_size") or hf.get("expand", 2) * d,
            state_size=hf.get("state_size", 16),
            dt_rank=dt_rank(hf.get("time_step_rank", "auto"), d),
            conv_kernel=hf.get("conv_kernel", 4), conv_bias=hf.get("use_conv_bias", True),
            proj_bias=hf.get("use_bias", False), bcdt_norm=bcdt_norm,
            norm_eps=hf.get("mixer_rms_eps", 1e-6)),
        norm_eps=eps,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        residual_in_fp32=hf.get("residual_in_fp32", True),
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("backbone.embeddings.weight", "backbone.norm_f.weight", cfg)
    for i in range(cfg.num_layers):
        p = f"backbone.layers.{i}"
        out |= names.vector(f"{p}.norm.weight", names.layer_path(i, "temporal_norm", "weight"))
        out |= names.mamba1(f"{p}.mixer", names.layer_path(i, "mamba1"), cfg.mamba1)
    return out
