"""FalconMambaForCausalLM: Mamba1 whose dt, B and C are RMS-normalised before use.

transformers' FalconMambaMixer normalises x_proj's dt (width time_step_rank), B and C
(width state_size) by their RMS in f32 with eps `mixer_rms_eps`, WITHOUT weights (its
norm modules hold non-persistent ones-buffers, never in checkpoints). Everything else
is MambaForCausalLM's (hybrid_jax/checkpoints/mamba1.py), same tensor names.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import mamba1
from hybrid_jax.config import ModelConfig

ARCHITECTURE = "FalconMambaForCausalLM"
weight_map = mamba1.weight_map


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return mamba1.config_from_hf(hf, bcdt_norm="unweighted", architecture="falcon_mamba")
