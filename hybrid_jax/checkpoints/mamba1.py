"""MambaForCausalLM: `h = h + mixer(rmsnorm(h))` with f32 residuals, norm_f, lm_head (tied by default).

The Mamba1 mixer (hybrid_jax/layers/mamba1.py) with no dt/B/C norms, on the pure-SSM
trunk (hybrid_jax/checkpoints/ssm_trunk.py). `config_from_hf` is shared with
Falcon-Mamba (hybrid_jax/checkpoints/falcon_mamba.py), which only adds the weightless RMS
norms of dt, B and C. `time_step_rank` "auto" means ceil(hidden / 16).
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_jax.checkpoints import ssm_trunk
from hybrid_jax.config import Mamba1Config, ModelConfig

ARCHITECTURE = "MambaForCausalLM"
weight_map = ssm_trunk.weight_map


def dt_rank(value: int | str, hidden: int) -> int:
    return math.ceil(hidden / 16) if value == "auto" else int(value)


def config_from_hf(hf: dict[str, Any], *, bcdt_norm: str = "none",
                   architecture: str = "mamba1") -> ModelConfig:
    d = hf["hidden_size"]
    ssm_trunk.check_activation(hf, "Mamba1")
    mixer = Mamba1Config(
        d_inner=hf.get("intermediate_size") or hf.get("expand", 2) * d,
        state_size=hf.get("state_size", 16),
        dt_rank=dt_rank(hf.get("time_step_rank", "auto"), d),
        conv_kernel=hf.get("conv_kernel", 4), conv_bias=hf.get("use_conv_bias", True),
        proj_bias=hf.get("use_bias", False), bcdt_norm=bcdt_norm,
        norm_eps=hf.get("mixer_rms_eps", 1e-6))
    return ssm_trunk.config_from_hf(hf, architecture=architecture, tie_default=True, mamba1=mixer)
