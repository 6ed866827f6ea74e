"""Rotary position embeddings (rotate-half convention), full or partial.

With rotary_dim r < e only the first r dims of each head rotate (rotate-half within
those r dims); the rest pass through. RecurrentGemma uses r = e / 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                 scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions [...] int -> cos, sin [..., r] f32 (frequencies repeated for both halves).

    `scaling` is linear RoPE scaling: every frequency divided by the factor.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    if scaling != 1.0:
        inv_freq = inv_freq / scaling
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., t, heads, e]; cos, sin [..., t, r] -> rotated x, same dtype as x."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out
