"""The trunk shared by the pure-SSM checkpoints: MambaForCausalLM, FalconMambaForCausalLM
(Mamba1 mixers) and Mamba2ForCausalLM.

`h = h + mixer(rmsnorm(h))` per layer with f32 residuals (`residual_in_fp32`, default on),
then `norm_f` and the LM head. Tensors: `backbone.embeddings.weight`,
`backbone.layers.{i}.norm.weight`, the mixer's under `backbone.layers.{i}.mixer`
(names.mamba1 / names.mamba2), `backbone.norm_f.weight`, `lm_head.weight` when untied.
The mixer's config is the caller's (mamba1.py, mamba2.py); this module reads the fields
the families share and knows nothing of the mixers' own.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import LayerSpec, Mamba1Config, Mamba2Config, ModelConfig


def norm_eps(hf: dict[str, Any]) -> float:
    """The residual norms' eps (Mamba2's gated norm uses it too)."""
    return hf.get("layer_norm_epsilon", 1e-5)


def check_activation(hf: dict[str, Any], family: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for {family} (silu only)")


def config_from_hf(hf: dict[str, Any], *, architecture: str, tie_default: bool,
                   mamba1: Mamba1Config | None = None, mamba2: Mamba2Config | None = None) -> ModelConfig:
    """`num_hidden_layers` layers of the one mixer given (`mamba1` or `mamba2`)."""
    assert (mamba1 is None) != (mamba2 is None), "one mixer config"
    kind = "mamba1" if mamba1 is not None else "mamba2"
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec(kind) for _ in range(hf["num_hidden_layers"])),
        mamba1=mamba1,
        mamba2=mamba2,
        norm_eps=norm_eps(hf),
        tie_embeddings=hf.get("tie_word_embeddings", tie_default),
        residual_in_fp32=hf.get("residual_in_fp32", True),
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("backbone.embeddings.weight", "backbone.norm_f.weight", cfg)
    for i in range(cfg.num_layers):
        p = f"backbone.layers.{i}"
        out |= names.vector(f"{p}.norm.weight", names.layer_path(i, "temporal_norm", "weight"))
        if cfg.mamba1 is not None:
            out |= names.mamba1(f"{p}.mixer", names.layer_path(i, "mamba1"), cfg.mamba1)
        else:
            out |= names.mamba2(f"{p}.mixer", names.layer_path(i, "mamba"), cfg.mamba2)
    return out
