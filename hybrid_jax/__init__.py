"""hybrid-jax models: configs, Flax NNX modules, checkpoints, tokenizers.

This package defines hybrid SSM + sliding-window-attention language models and
computes them exactly; it knows nothing of scheduling or serving.
"""

from hybrid_jax.config import (
    AttentionConfig,
    LayerKind,
    LayerSpec,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
    RGLRUConfig,
)
from hybrid_jax.model import CausalLM

__all__ = [
    "AttentionConfig",
    "CausalLM",
    "LayerKind",
    "LayerSpec",
    "MLPConfig",
    "Mamba2Config",
    "ModelConfig",
    "RGLRUConfig",
]
