"""Mamba2 decode: one token per sequence updates its slot's SSM state in place.

    h   = exp(dt * A) h + dt * x (outer) B        state [p, n] per (sequence, head)
    y   = h . C + D x     (times silu(z) if z is given)

The kernel is purely bandwidth-bound: each program owns one (sequence, head,
block of p rows), reads that block of the state once and writes it once; no
dots. States are f32 or bf16 in memory, f32 in arithmetic. The state buffer is
aliased to the output, so a caller that jits with donation updates it in place.

This module knows nothing of how slots are allocated: slot_ids index the state
buffer directly (slot 0 is the dummy for padded rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, is_pow2, launch
from pallas_kernels.ssm_common import check_mamba_args, effective_dt, silu

# Tuned on H100 (docs/benchmarks.md): (rows of the [p, n] state per program, warps),
# by state dtype.
DECODE_TUNING = {"float32": (16, 1), "bfloat16": (16, 4)}


def ssm_decode(
    x, dt, A, B, C, D, dt_bias, states, slot_ids, *,
    z=None, dt_limit=(0.0, float("inf")), impl: Impl | None = None,
):
    """One Mamba2 recurrence step per sequence.

    x [b, h, p]; dt [b, h] raw; A [h] (negative); B, C [b, g, n]; D, dt_bias [h];
    states [num_slots, h, p, n] f32 or bf16; slot_ids int [b]; z [b, h, p] or None.
    Returns (y [b, h, p] in x.dtype, states with rows slot_ids updated).
    """
    impl = resolve_impl(impl)
    check_mamba_args(x, dt, A, B, C, D, dt_bias, states, slot_ids, z, dt_limit)
    if impl == "reference":
        return ssm_decode_reference(
            x, dt, A, B, C, D, dt_bias, states, slot_ids, z=z,
            dt_limit=tuple(map(float, dt_limit)),
        )
    p, n = x.shape[2], B.shape[2]
    if not (is_pow2(p) and is_pow2(n)):
        raise ValueError(f"head dim {p=} and state dim {n=} must be powers of 2")
    dte = effective_dt(dt, dt_bias, dt_limit)
    block_p, warps = DECODE_TUNING[jnp.dtype(states.dtype).name]
    return _decode_pallas(
        x, dte, A, B, C, D, states, slot_ids.astype(jnp.int32), z,
        impl=impl, block_p=channel_block(p, block_p), num_warps=warps,
    )


@functools.partial(jax.jit, static_argnames=("dt_limit", "impl"))
def ssm_decode_reference(
    x, dt, A, B, C, D, dt_bias, states, slot_ids, *, z=None, dt_limit=(0.0, float("inf")),
    impl: Impl | None = None,
):
    """Pure-JAX reference, same signature and contract as `ssm_decode`."""
    del impl
    h, g = x.shape[1], B.shape[1]
    f32 = jnp.float32
    # 1. dt = clamp(softplus(dt + dt_bias)); per-head decay exp(dt A).
    dte = effective_dt(dt, dt_bias, dt_limit)  # [b, h]
    decay = jnp.exp(dte * A.astype(f32))
    # 2. Heads read their group's B and C.
    Bh = jnp.repeat(B.astype(f32), h // g, axis=1)  # [b, h, n]
    Ch = jnp.repeat(C.astype(f32), h // g, axis=1)
    # 3. h = exp(dt A) h + dt x (outer) B.
    s = states[slot_ids].astype(f32)  # [b, h, p, n]
    xf = x.astype(f32)
    s = decay[..., None, None] * s + (dte[..., None] * xf)[..., None] * Bh[:, :, None, :]
    # 4. y = h . C + D x, gated.
    y = jnp.einsum("bhpn,bhn->bhp", s, Ch, precision="highest") + D.astype(f32)[:, None] * xf
    if z is not None:
        y = y * silu(z.astype(f32))
    return y.astype(x.dtype), states.at[slot_ids].set(s.astype(states.dtype))


def _decode_body(*refs, hpg: int, bp: int, gated: bool):
    if gated:
        slot_ref, dt_ref, a_ref, d_ref, x_ref, b_ref, c_ref, st_ref, z_ref, y_ref, st_out = refs
    else:
        slot_ref, dt_ref, a_ref, d_ref, x_ref, b_ref, c_ref, st_ref, y_ref, st_out = refs
    s, hh, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pb * bp, bp)
    slot = slot_ref[s]
    g = hh // hpg
    f32 = jnp.float32
    dt = dt_ref[s, hh]
    state = st_ref[slot, hh, rows, :].astype(f32)  # [bp, n]
    x = x_ref[s, hh, rows].astype(f32)  # [bp]
    bv = b_ref[s, g, :].astype(f32)  # [n]
    cv = c_ref[s, g, :].astype(f32)
    state = jnp.exp(dt * a_ref[hh]) * state + (dt * x)[:, None] * bv[None, :]
    y = jnp.sum(state * cv[None, :], axis=1) + d_ref[hh] * x
    if gated:
        y = y * silu(z_ref[s, hh, rows].astype(f32))
    y_ref[s, hh, rows] = y.astype(y_ref.dtype)
    st_out[slot, hh, rows, :] = state.astype(st_out.dtype)


@functools.partial(jax.jit, static_argnames=("impl", "block_p", "num_warps"))
def _decode_pallas(x, dte, A, B, C, D, states, slot_ids, z, *, impl, block_p, num_warps):
    b, h, p = x.shape
    g = B.shape[1]
    f32 = jnp.float32
    args = [slot_ids, dte, A.astype(f32), D.astype(f32), x, B, C, states]
    if z is not None:
        args.append(z)
    kernel = functools.partial(_decode_body, hpg=h // g, bp=block_p, gated=z is not None)
    out_shape = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(states.shape, states.dtype),
    ]
    call = launch(
        kernel, impl=impl, grid=(b, h, p // block_p), out_shape=out_shape,
        aliases={7: 1}, num_warps=num_warps, name="ssm_decode",
    )
    return call(*args)
