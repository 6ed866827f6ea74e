"""Checkpoints: Hugging Face directories (per-architecture name maps) and native orbax."""

from hybrid_jax.checkpoints.hf import CheckpointError, load_hf, read_hf_config, supported_architectures

__all__ = ["CheckpointError", "load_hf", "read_hf_config", "supported_architectures"]
