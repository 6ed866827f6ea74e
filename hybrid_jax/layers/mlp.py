"""Gated MLP: down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier.

SiLU (Llama, Mistral, Falcon-H1 with its muP multipliers, LFM2), GELU-tanh (RecurrentGemma) or
exact GELU (Zamba2's shared blocks). Non-gated down(relu(up(x))^2) for Nemotron-H
(gated=False); Granite's shared MLP keeps gate and up in one fused projection
(`gate_up_proj` [d, 2f], gate first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import MLPConfig
from hybrid_jax.layers.linear import Linear

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu": functools.partial(jax.nn.gelu, approximate=False),
               "relu2": lambda x: jnp.square(jax.nn.relu(x))}


class GatedMLP(nnx.Module):
    """x [..., d] -> [..., d]; hidden width f = cfg.intermediate_size."""

    def __init__(self, dim: int, cfg: MLPConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        f = cfg.intermediate_size
        fused, split_gate = cfg.fused_gate_up, cfg.gated and not cfg.fused_gate_up
        self.gate_up_proj = (Linear(dim, 2 * f, bias=cfg.bias, dtype=dtype, rngs=rngs)
                             if fused else None)
        self.gate_proj = Linear(dim, f, bias=cfg.bias, dtype=dtype, rngs=rngs) if split_gate else None
        self.up_proj = None if fused else Linear(dim, f, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, dim, bias=cfg.bias, dtype=dtype, rngs=rngs)
        self.act = ACTIVATIONS[cfg.activation]
        self.silu = cfg.activation == "silu"
        self.gate_multiplier = cfg.gate_multiplier
        self.down_multiplier = cfg.down_multiplier

    def _gate_up(self, x: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        if self.gate_up_proj is not None:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
            return gate, up
        return (None if self.gate_proj is None else self.gate_proj(x)), self.up_proj(x)

    def hidden(self, x: jax.Array) -> jax.Array:
        """down_proj's input: act(gate(x) * gate_multiplier) * up(x), or act(up(x))."""
        if self.silu and self.gate_up_proj is not None:  # one launch where the stream GEMM takes it
            h = self.gate_up_proj.glu(x, self.gate_multiplier)
            if h is not None:
                return h
        gate, up = self._gate_up(x)
        if gate is None:
            return self.act(up)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        return self.act(gate) * up

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.down_proj(self.hidden(x))
        if self.down_multiplier != 1.0:
            y = y * self.down_multiplier
        return y
