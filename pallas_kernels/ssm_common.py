"""Argument checks and the dt transform shared by the Mamba2 ops (SSD, decode).

Knows the Mamba2 conventions (raw dt, softplus with bias, clamp to dt_limit,
head i reads group i // (h // g)); knows nothing of kernels or scheduling.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

STATE_DTYPES = (jnp.float32, jnp.bfloat16)


def effective_dt(dt: jax.Array, dt_bias: jax.Array, dt_limit: tuple[float, float]) -> jax.Array:
    """dt = clamp(softplus(dt + dt_bias), *dt_limit) in f32; dt [..., h], dt_bias [h]."""
    lo, hi = dt_limit
    v = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(v, lo, hi)


def silu(v: jax.Array) -> jax.Array:
    return v * jax.nn.sigmoid(v)


def check_mamba_args(x, dt, A, B, C, D, dt_bias, states, slot_ids, z, dt_limit) -> None:
    """Raise ValueError naming the first argument whose shape or dtype is off.

    Token-major layout: x [t, h, p] (or [b, h, p] for decode), dt [t, h],
    B and C [t, g, n], A, D, dt_bias [h], states [num_slots, h, p, n], slot_ids [b].
    """
    if x.ndim != 3:
        raise ValueError(f"{x.shape=} must be [t, h, p]")
    t, h, p = x.shape
    if dt.shape != (t, h):
        raise ValueError(f"{dt.shape=} must be {(t, h)}")
    if B.ndim != 3 or B.shape[0] != t or C.shape != B.shape:
        raise ValueError(f"{B.shape=} and {C.shape=} must both be [t={t}, g, n]")
    g, n = B.shape[1:]
    if h % g:
        raise ValueError(f"heads {h=} must be a multiple of groups {g=}")
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (h,):
            raise ValueError(f"{name}.shape={v.shape} must be {(h,)}")
    if states.ndim != 4 or states.shape[1:] != (h, p, n):
        raise ValueError(f"{states.shape=} must be [num_slots, {h}, {p}, {n}]")
    if states.dtype not in STATE_DTYPES:
        raise ValueError(f"{states.dtype=} must be float32 or bfloat16")
    if slot_ids.ndim != 1 or not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids ({slot_ids.shape}, {slot_ids.dtype}) must be int [b]")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"{z.shape=} must equal {x.shape=}")
    lo, hi = dt_limit
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"{dt_limit=} must satisfy 0 <= lo <= hi")


def check_ragged(cu_seqlens: jax.Array, slot_ids: jax.Array, has_initial: jax.Array) -> int:
    """Check the ragged metadata; return b."""
    if cu_seqlens.ndim != 1 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens ({cu_seqlens.shape}, {cu_seqlens.dtype}) must be int [b+1]")
    b = cu_seqlens.shape[0] - 1
    if b < 1:
        raise ValueError(f"{cu_seqlens.shape=} must hold at least one sequence")
    if slot_ids.shape != (b,):
        raise ValueError(f"{slot_ids.shape=} must be {(b,)}")
    if has_initial.shape != (b,):
        raise ValueError(f"{has_initial.shape=} must be {(b,)}")
    return b
