"""Mamba2ForCausalLM: `h = h + mixer(rmsnorm(h))` with f32 residuals, norm_f, lm_head.

The pure-SSM trunk (hybrid_jax/checkpoints/ssm_trunk.py) of Mamba2 mixers. Quirks:
original checkpoints name the embedding `backbone.embedding.weight` (transformers
renames it on load to `embeddings`); both are accepted. The gated norm multiplies by
silu(z) BEFORE normalising (norm_before_gate=False).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, ssm_trunk
from hybrid_jax.config import Mamba2Config, ModelConfig

ARCHITECTURE = "Mamba2ForCausalLM"
ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}
weight_map = ssm_trunk.weight_map


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d = hf["hidden_size"]
    heads, head_dim = hf["num_heads"], hf["head_dim"]
    if hf.get("expand", 2) * d != heads * head_dim:
        raise ValueError(f"expand * hidden_size ({hf.get('expand', 2) * d}) must equal "
                         f"num_heads * head_dim ({heads * head_dim})")
    ssm_trunk.check_activation(hf, "Mamba2")
    mixer = Mamba2Config(
        num_heads=heads, head_dim=head_dim, state_size=hf["state_size"],
        n_groups=hf.get("n_groups", 1), conv_kernel=hf.get("conv_kernel", 4),
        chunk_size=hf.get("chunk_size", 256), conv_bias=hf.get("use_conv_bias", True),
        in_proj_bias=hf.get("use_bias", False), out_proj_bias=hf.get("use_bias", False),
        dt_limit=hf_fields.time_step_limit(hf), gated_norm=True, norm_before_gate=False,
        norm_eps=ssm_trunk.norm_eps(hf))
    return ssm_trunk.config_from_hf(hf, architecture="mamba2", tie_default=False, mamba2=mixer)
