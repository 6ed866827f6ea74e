"""RMS norms: plain (w * x_hat), Gemma's (1 + w) * x_hat, and Mamba2's grouped gated norm.

Statistics are always computed in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _row(weight: nnx.Param, row: int | None) -> jax.Array:
    """A norm's weight: its own array, or its row of a stack shared by several norms (the
    serving engine's fused copy, hybrid_jax/fusion.py: decode kernels read the stack in place)."""
    return weight[...] if row is None else weight[row]


class RMSNorm(nnx.Module):
    """x [..., d] -> [..., d] in x's dtype.

    offset=False (Llama/Mamba2/Falcon-H1): w * cast(x_hat), the cast before the scale.
    offset=True (Gemma family): cast((1 + w) * x_hat), all in f32.
    """

    def __init__(self, dim: int, *, eps: float, offset: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if offset else jnp.ones((dim,), dtype))
        self.eps = eps
        self.offset = offset
        self.stack_row: int | None = None  # weight is a stack [L, dim] of norms' weights

    def value(self) -> jax.Array:
        return _row(self.weight, self.stack_row)

    def __call__(self, x: jax.Array) -> jax.Array:
        x_hat = _rms_normalize(x, self.eps)
        w = self.value()
        if self.offset:
            return (x_hat * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * x_hat.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Mamba2's gated norm over groups of d/g channels.  y, z [..., d] -> [..., d] f32.

    norm_before_gate=False (Mamba2): w * rms_g(y * silu(z)).
    norm_before_gate=True (Falcon-H1 option): w * rms_g(y) * silu(z).
    """

    def __init__(self, dim: int, *, n_groups: int, eps: float, norm_before_gate: bool,
                 dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.n_groups = n_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        # Tensor parallelism with fewer groups than devices: each group's channels are
        # spread over `group_devices` consecutive devices of mesh axis `axis`; the group's
        # statistic sums their partial sums of squares.
        self.axis: str | None = None
        self.group_devices = 1
        self.stack_row: int | None = None  # weight is a stack [L, dim] of norms' weights

    def value(self) -> jax.Array:
        return _row(self.weight, self.stack_row)

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        y = y.astype(jnp.float32)
        gate = jax.nn.silu(z.astype(jnp.float32))
        if not self.norm_before_gate:
            y = y * gate
        *lead, d = y.shape
        if self.group_devices > 1:
            grouped = self._split_group_normalize(y)
        else:
            grouped = _rms_normalize(y.reshape(*lead, self.n_groups, d // self.n_groups), self.eps)
        out = self.value().astype(jnp.float32) * grouped.reshape(*lead, d)
        if self.norm_before_gate:
            out = out * gate
        return out

    def _split_group_normalize(self, y: jax.Array) -> jax.Array:
        """y [..., d]: this device's part of one group spread over `group_devices` devices."""
        k = self.group_devices
        part = jnp.sum(y * y, axis=-1, keepdims=True)
        parts = jax.lax.all_gather(part, self.axis)  # [devices, ..., 1]
        parts = parts.reshape(-1, k, *part.shape).sum(axis=1)  # [groups, ..., 1]
        total = parts[jax.lax.axis_index(self.axis) // k]
        return y * jax.lax.rsqrt(total / (y.shape[-1] * k) + self.eps)
