"""Gated MLP: down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier.

SiLU (Llama, Mistral, Falcon-H1 with its muP multipliers) or GELU-tanh (RecurrentGemma).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import MLPConfig
from hybrid_jax.layers.linear import Linear

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class GatedMLP(nnx.Module):
    """x [..., d] -> [..., d]; hidden width f = cfg.intermediate_size."""

    def __init__(self, dim: int, cfg: MLPConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        f = cfg.intermediate_size
        self.gate_proj = Linear(dim, f, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(dim, f, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, dim, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.act = ACTIVATIONS[cfg.activation]
        self.gate_multiplier = cfg.gate_multiplier
        self.down_multiplier = cfg.down_multiplier

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        y = self.down_proj(self.act(gate) * self.up_proj(x))
        if self.down_multiplier != 1.0:
            y = y * self.down_multiplier
        return y
