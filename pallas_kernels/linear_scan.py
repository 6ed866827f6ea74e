"""Diagonal linear recurrence h_t = a_t * h_{t-1} + b_t (RG-LRU) over a ragged batch.

Per channel, in f32. A sequence starts from its slot's state (states
[num_slots, c] f32) when has_initial, else from zero, and leaves h at its last
token in the slot. Padding tokens (past cu_seqlens[b]) get h = 0. The decode
step is one token per sequence.

Pallas: one program per (sequence, channel block) walks its tokens in tiles of
`TILE` rows; the rows of a tile are loaded together (independent of h, so
they are in flight at once) and then combined sequentially in registers. This
is the sequential fallback of KERNELS.md (no private scan primitive): its
latency grows with the longest sequence. This module knows nothing of RG-LRU
gates (a and b come in precomputed) or of how slots are allocated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, launch
from pallas_kernels.ragged import segments
from pallas_kernels.ssm_common import check_ragged

TILE = 64  # tokens loaded together per step of the sequential walk; tuned on H100
INTERPRET_TILE = 16  # same logic, fewer unrolled rows: keeps the CPU interpreter quick
CHANNEL_BLOCK = 128


def _check(a, b, states):
    if a.ndim != 2 or b.shape != a.shape:
        raise ValueError(f"{a.shape=} and {b.shape=} must both be [t, c]")
    if states.ndim != 2 or states.shape[1] != a.shape[1] or states.dtype != jnp.float32:
        raise ValueError(f"states ({states.shape}, {states.dtype}) must be f32 [num_slots, c]")


def linear_scan_ragged(a, b, cu_seqlens, states, slot_ids, has_initial, *,
                       impl: Impl | None = None):
    """a, b [t, c]; cu_seqlens int32 [b+1]; states f32 [num_slots, c]; slot_ids int32 [b];
    has_initial bool [b]. Returns (h [t, c] in b.dtype, states)."""
    impl = resolve_impl(impl)
    _check(a, b, states)
    check_ragged(cu_seqlens, slot_ids, has_initial)
    if impl == "reference":
        return linear_scan_ragged_reference(a, b, cu_seqlens, states, slot_ids, has_initial)
    return _ragged_pallas(a, b, cu_seqlens.astype(jnp.int32), states, slot_ids.astype(jnp.int32),
                          has_initial.astype(jnp.int32), impl=impl,
                          tile=TILE if impl == "pallas" else INTERPRET_TILE)


def linear_scan_decode(a, b, states, slot_ids, *, impl: Impl | None = None):
    """One step per sequence: a, b [b, c]; returns (h [b, c] in b.dtype, states)."""
    impl = resolve_impl(impl)
    _check(a, b, states)
    if impl == "reference":
        return linear_scan_decode_reference(a, b, states, slot_ids)
    return _decode_pallas(a, b, states, slot_ids.astype(jnp.int32), impl=impl)


@functools.partial(jax.jit, static_argnames=("impl",))
def linear_scan_ragged_reference(a, b, cu_seqlens, states, slot_ids, has_initial, *,
                                 impl: Impl | None = None):
    """Pure-JAX reference of `linear_scan_ragged`: one associative scan over all tokens."""
    del impl
    t = a.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    f32 = jnp.float32
    # 1. Each token's sequence; the first token of a sequence restarts from h0.
    sg = segments(cu_seqlens, t)
    seq = jnp.minimum(sg.seq, nseq - 1)
    h0 = jnp.where(has_initial[:, None], states[slot_ids], 0.0)  # [b, c]
    first = (sg.pos == 0)[:, None]
    a32, b32 = a.astype(f32), b.astype(f32)
    # 2. (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2) with a = 0 at sequence starts.
    elem_a = jnp.where(first, 0.0, a32)
    elem_b = b32 + jnp.where(first, a32 * h0[seq], 0.0)
    _, h = jax.lax.associative_scan(
        lambda u, v: (u[0] * v[0], v[0] * u[1] + v[1]), (elem_a, elem_b), axis=0
    )
    h = jnp.where((sg.pos >= 0)[:, None], h, 0.0)
    # 3. Final state: h at each sequence's last token, or h0 when it is empty.
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    final = jnp.where((lens > 0)[:, None], h[jnp.maximum(cu_seqlens[1:] - 1, 0)], h0)
    return h.astype(b.dtype), states.at[slot_ids].set(final)


@functools.partial(jax.jit, static_argnames=("impl",))
def linear_scan_decode_reference(a, b, states, slot_ids, *, impl: Impl | None = None):
    """Pure-JAX reference of `linear_scan_decode`."""
    del impl
    h = a.astype(jnp.float32) * states[slot_ids] + b.astype(jnp.float32)
    return h.astype(b.dtype), states.at[slot_ids].set(h)


def _scan_kernel(cu_ref, slot_ref, init_ref, a_ref, b_ref, st_ref, h_ref, st_out, *,
                 nseq, cb, tile):
    s, ci = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(ci * cb, cb)
    start, end = cu_ref[s], cu_ref[s + 1]  # s == nseq: the padding tail, h = 0
    real = s < nseq
    slot = slot_ref[jnp.minimum(s, nseq - 1)]
    keep = real & (init_ref[jnp.minimum(s, nseq - 1)] != 0)
    h0 = jnp.where(keep, st_ref[slot, cols], 0.0)

    def step(i, h):
        rows = [start + i * tile + k for k in range(tile)]
        safe = [jnp.minimum(r, end - 1) for r in rows]
        av = [a_ref[r, cols].astype(jnp.float32) for r in safe]
        bv = [b_ref[r, cols].astype(jnp.float32) for r in safe]
        for r, sr, ak, bk in zip(rows, safe, av, bv, strict=True):
            valid = r < end
            h = jnp.where(valid & real, ak * h + bk, jnp.where(real, h, 0.0))
            plgpu.store(h_ref.at[sr, cols], h.astype(h_ref.dtype),
                        mask=jnp.broadcast_to(valid, (cb,)))
        return h

    final = jax.lax.fori_loop(0, pl.cdiv(end - start, tile), step, h0)

    @pl.when(real)
    def _():
        st_out[slot, cols] = final


@functools.partial(jax.jit, static_argnames=("impl", "tile", "block_c", "warps"))
def _ragged_pallas(a, b, cu, states, slot_ids, has_initial, *, impl, tile=TILE,
                   block_c=CHANNEL_BLOCK, warps=4):
    t, c = a.shape
    nseq = cu.shape[0] - 1
    cb = channel_block(c, block_c)
    cu_ext = jnp.concatenate([cu, jnp.array([t], jnp.int32)])  # padding tail as segment nseq
    return launch(
        functools.partial(_scan_kernel, nseq=nseq, cb=cb, tile=tile), impl=impl,
        grid=(nseq + 1, c // cb),
        out_shape=[jax.ShapeDtypeStruct(a.shape, b.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={5: 1}, num_warps=warps, name="linear_scan",
    )(cu_ext, slot_ids, has_initial, a, b, states)


def _scan_decode_kernel(slot_ref, a_ref, b_ref, st_ref, h_ref, st_out, *, cb):
    s, ci = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(ci * cb, cb)
    slot = slot_ref[s]
    h = a_ref[s, cols].astype(jnp.float32) * st_ref[slot, cols] + b_ref[s, cols].astype(
        jnp.float32
    )
    h_ref[s, cols] = h.astype(h_ref.dtype)
    st_out[slot, cols] = h


@functools.partial(jax.jit, static_argnames=("impl",))
def _decode_pallas(a, b, states, slot_ids, *, impl):
    nb, c = a.shape
    cb = channel_block(c, CHANNEL_BLOCK)
    return launch(
        functools.partial(_scan_decode_kernel, cb=cb), impl=impl, grid=(nb, c // cb),
        out_shape=[jax.ShapeDtypeStruct(a.shape, b.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={3: 1}, name="linear_scan_decode",
    )(slot_ids, a, b, states)
