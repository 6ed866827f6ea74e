"""Mamba2 SSD (state-space duality) chunked scan over a ragged packed batch.

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t (outer) B_t      per head, S [p, n]
    y_t = C_t . S_t + D x_t       (times silu(z_t) if z is given)

Sequences are packed along the token axis (cu_seqlens [b+1]); each is cut into
chunks of `chunk_size` tokens that never straddle a sequence. A sequence starts
from its slot's state when has_initial, else from zero, and leaves its final
state in its slot. Padding tokens (past cu_seqlens[b]) get y = 0. A sequence whose
`active` entry is False is skipped: its slot is neither read nor written and its y
rows are unspecified (a mixed step serves its one-token sequences with the decode
update instead: hybrid_jax/ragged.py).

`ssd_ragged` dispatches on the impl switch; `ssd_ragged_reference` below is the
pure-JAX chunked SSD (it is what serving runs on CPU); the Pallas pipeline lives
in `ssd_kernel.py`. This module knows nothing of models or of how slots are
allocated (slot 0 is the dummy that padded sequences use).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import is_pow2
from pallas_kernels.ragged import chunk_table, pad_tokens, segments
from pallas_kernels.ssd_kernel import ssd_pallas
from pallas_kernels.ssm_common import check_mamba_args, check_ragged, effective_dt, silu

_HI = jax.lax.Precision.HIGHEST


def ssd_ragged(
    x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial, *,
    z=None, dt_limit=(0.0, float("inf")), chunk_size=256, impl: Impl | None = None, active=None,
):
    """Chunked SSD over a ragged batch; returns (y [t, h, p] in x.dtype, states).

    x [t, h, p]; dt [t, h] raw (softplus(dt + dt_bias), clamped to dt_limit, is
    applied here); A [h] negative; B, C [t, g, n] (head i reads group i // (h//g));
    D, dt_bias [h]; cu_seqlens int32 [b+1]; states [num_slots, h, p, n] f32 or
    bf16 (math in f32); slot_ids int32 [b]; has_initial bool [b]; z [t, h, p];
    active bool [b] or None (all): False skips the sequence (slot untouched, y unspecified).
    """
    impl = resolve_impl(impl)
    _check(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial, z, dt_limit,
           chunk_size)
    if active is not None and active.shape != slot_ids.shape:
        raise ValueError(f"{active.shape=} must be {slot_ids.shape}")
    if impl == "reference":
        return ssd_ragged_reference(
            x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial,
            z=z, dt_limit=tuple(map(float, dt_limit)), chunk_size=chunk_size, active=active,
        )
    p, n = x.shape[2], B.shape[2]
    if not (is_pow2(p) and is_pow2(n) and p >= 16 and n >= 16):
        raise ValueError(f"head dim {p=} and state dim {n=} must be powers of 2 >= 16")
    return ssd_pallas(
        x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial,
        z=z, dt_limit=dt_limit, chunk_size=chunk_size, impl=impl, active=active,
    )


def _check(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial, z, dt_limit,
           chunk_size):
    check_mamba_args(x, dt, A, B, C, D, dt_bias, states, slot_ids, z, dt_limit)
    check_ragged(cu_seqlens, slot_ids, has_initial)
    if not (is_pow2(chunk_size) and chunk_size >= 16):
        raise ValueError(f"{chunk_size=} must be a power of 2 >= 16")


@functools.partial(jax.jit, static_argnames=("dt_limit", "chunk_size", "impl"))
def ssd_ragged_reference(
    x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial, *,
    z=None, dt_limit=(0.0, float("inf")), chunk_size=256, impl: Impl | None = None, active=None,
):
    """Pure-JAX chunked SSD (mamba's ssd_minimal, made ragged); contract of `ssd_ragged`.

    Shapes: t tokens, b sequences, h heads, g groups (h = g j), p head dim,
    n state dim, l = chunk_size, c chunks (static bound t // l + b + 1).
    """
    del impl
    t = x.shape[0]
    h, p, g, n, l = x.shape[1], x.shape[2], B.shape[1], B.shape[2], chunk_size
    b, j = cu_seqlens.shape[0] - 1, h // g
    f32 = jnp.float32
    x, dt, B, C = pad_tokens(l, x, dt, B, C)
    tab = chunk_table(cu_seqlens, x.shape[0], l)
    nc = tab.seq.shape[0]
    real = tab.seq < b
    seg = jnp.minimum(tab.seq, b - 1)

    # 1. Gather tokens into chunks [c, l]; rows outside the chunk are zero (dt = 0).
    idx = tab.start[:, None] + jnp.arange(l)
    valid = (idx < tab.end[:, None]) & real[:, None]
    idx = jnp.minimum(idx, x.shape[0] - 1)
    xc = jnp.where(valid[..., None, None], x[idx].astype(f32), 0.0).reshape(nc, l, g, j, p)
    dtc = jnp.where(valid[..., None], effective_dt(dt, dt_bias, dt_limit)[idx], 0.0)  # [c,l,h]
    Bc, Cc = B[idx].astype(f32), C[idx].astype(f32)  # [c, l, g, n]

    # 2. Within-chunk cumulative decay: cum[c, l, h] = sum_{s <= l} dt_s A.
    cum = jnp.cumsum(dtc * A.astype(f32), axis=1)
    cum_g = cum.reshape(nc, l, g, j)
    dt_g = dtc.reshape(nc, l, g, j)

    # 3. Diagonal blocks: y[l] = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s.
    causal = jnp.tril(jnp.ones((l, l), bool))[None, :, :, None, None]
    segsum = cum_g[:, :, None] - cum_g[:, None, :]  # [c, l, s, g, j]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, segsum, -jnp.inf)), 0.0)
    cb = jnp.einsum("clgn,csgn->clsg", Cc, Bc, precision=_HI)
    mix = cb[..., None] * decay * dt_g[:, None]  # [c, l, s, g, j]
    y_diag = jnp.einsum("clsgj,csgjp->clgjp", mix, xc, precision=_HI)

    # 4. Chunk states from zero: S_c = sum_s exp(cum_last - cum_s) dt_s x_s (outer) B_s.
    w = jnp.exp(cum_g[:, -1:] - cum_g) * dt_g  # [c, l, g, j]
    s_chunk = jnp.einsum("clgj,clgjp,clgn->cgjpn", w, xc, Bc, precision=_HI).reshape(nc, h, p, n)

    # 5. Each sequence's initial state (zero unless has_initial), per chunk.
    init_seq = jnp.where(has_initial[:, None, None, None], states[slot_ids].astype(f32), 0.0)
    init_c = init_seq[seg]  # [c, h, p, n]
    first = real & (jnp.arange(nc) == tab.first[seg])

    # 6. Inter-chunk passing F_c = a_c F_{c-1} + S_c, reset at sequence starts, as an
    #    associative scan over chunks: (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2).
    a_c = jnp.exp(cum[:, -1])[..., None, None]  # [c, h, 1, 1]
    elem_a = jnp.where(first[:, None, None, None], 0.0, a_c)
    elem_b = jnp.where(real[:, None, None, None], s_chunk, 0.0)
    elem_b = elem_b + jnp.where(first[:, None, None, None], a_c * init_c, 0.0)
    _, final_c = jax.lax.associative_scan(
        lambda u, v: (u[0] * v[0], v[0] * u[1] + v[1]), (elem_a, elem_b), axis=0
    )
    prev = jnp.concatenate([jnp.zeros_like(final_c[:1]), final_c[:-1]])
    enter = jnp.where(first[:, None, None, None], init_c, prev).reshape(nc, g, j, p, n)

    # 7. Off-diagonal part: y[l] += exp(cum_l) C_l . S_enter.
    y_off = jnp.einsum("clgn,cgjpn->clgjp", Cc, enter, precision=_HI) * jnp.exp(cum_g)[..., None]

    # 8. y = y_diag + y_off + D x, back to token order, gated; padding gets 0.
    yc = (y_diag + y_off + D.astype(f32).reshape(g, j, 1) * xc).reshape(nc * l, h, p)
    sg = segments(cu_seqlens, t)
    flat = (tab.first[jnp.maximum(sg.seq, 0)] + sg.pos // l) * l + sg.pos % l
    y = yc[jnp.where(sg.pos >= 0, flat, 0)]
    if z is not None:
        y = y * silu(z.astype(f32))
    y = jnp.where((sg.pos >= 0)[:, None, None], y, 0.0)

    # 9. Final state: the last chunk's F, or the initial state of an empty sequence.
    counts = tab.first[1 : b + 1] - tab.first[:b]
    last = jnp.maximum(tab.first[1 : b + 1] - 1, 0)
    final = jnp.where((counts > 0)[:, None, None, None], final_c[last], init_seq)
    if active is None:
        return y.astype(x.dtype), states.at[slot_ids].set(final.astype(states.dtype))
    keep = jnp.where(active, slot_ids, states.shape[0])  # skipped sequences: dropped
    return y.astype(x.dtype), states.at[keep].set(final.astype(states.dtype), mode="drop")
