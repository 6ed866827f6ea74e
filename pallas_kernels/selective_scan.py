"""Mamba1 selective scan over a ragged batch (prefill) and for q tokens per sequence (decode).

Per channel c of d_inner, per state index n (A is [c, n]: per channel, not per head):

    dt_t = softplus(dt_t + dt_bias)                         [c]
    s_t  = exp(dt_t A) * s_{t-1} + (dt_t x_t) (outer) B_t   s [c, n]
    y_t  = s_t . C_t + D x_t          (times silu(z_t) when z is given)

Shapes: t tokens, b sequences, q tokens per sequence (decode), c channels (d_inner),
n state size, S slots. B and C [t, n] are shared by all channels.

`selective_scan_ragged`: sequences packed along the token axis (cu_seqlens [b+1]); a
sequence starts from its slot's state when has_initial, else from zero, and leaves its
final state in its slot; padding tokens (past cu_seqlens[b]) get y = 0. The math is in
f32 whatever the state dtype; the state is rounded to it only when stored.

`selective_scan_step`: x [b, q, c] (q >= 1 consecutive tokens per sequence) from the
slots' states. `candidates=False` (decode) writes the state after the last token back;
`candidates=True` (speculative verification) leaves the slots alone and returns the
state after EACH of the q positions, [q, b, c, n], for the caller to choose from.
Between positions the state is rounded to the state dtype, as q one-token steps store it.

Pallas (Triton lowering): one program per (sequence, block of channels) holds its
[cb, n] block of state in registers and walks the sequence's tokens in order, a tile
of rows loaded together (independent of the state, so their loads are in flight at
once) and then combined one by one, like mamba_ssm's selective-scan kernel; no
dots. The padding tail is one more "sequence" whose rows get y = 0. The step kernel
reads the state once, runs the q tokens, writes it once (or q candidates).

This module knows nothing of Mamba1's projections (dt arrives after dt_proj, without
its bias; B, C after any norms) nor of how slots are allocated (slot 0: the dummy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, is_pow2, launch
from pallas_kernels.ragged import segments
from pallas_kernels.ssm_common import STATE_DTYPES, check_ragged

TILE = 16  # tokens loaded together per step of the sequential walk
INTERPRET_TILE = 4  # the same logic, fewer unrolled rows: keeps the CPU interpreter quick
# The prefill's channels per program. H100, 2026-12-06, Falcon-Mamba-7B's c = 8192, n = 16,
# 4 x 4096 tokens (`benchmarks/mamba1.py --sweep`, 2 x 3 x 3 launches): 128 channels, tiles
# of 16 tokens, 4 warps 2.26 ms against 64 channels' 3.73 ms and mamba_ssm's CUDA
# selective_scan_fn's 2.46 ms in the same call; every other launch was slower than 3.1 ms.
PREFILL_CHANNEL_BLOCK = 128
CHANNEL_BLOCK = 64  # the step kernel's (decode, verification): not re-tuned
F32 = jnp.float32


def _check(x, dt, A, B, C, D, dt_bias, states, z) -> None:
    """ValueError naming the first argument off. x, dt, z [..., c]; B, C [..., n]."""
    c, n = A.shape if A.ndim == 2 else (None, None)
    if A.ndim != 2:
        raise ValueError(f"{A.shape=} must be [c, n]")
    if x.shape[-1] != c or dt.shape != x.shape:
        raise ValueError(f"{x.shape=} and {dt.shape=} must both be [..., c={c}]")
    if B.shape != x.shape[:-1] + (n,) or C.shape != B.shape:
        raise ValueError(f"{B.shape=} and {C.shape=} must both be {x.shape[:-1] + (n,)}")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v.shape != (c,):
            raise ValueError(f"{name}.shape={v.shape} must be {(c,)}")
    if states.ndim != 3 or states.shape[1:] != (c, n):
        raise ValueError(f"{states.shape=} must be [num_slots, {c}, {n}]")
    if states.dtype not in STATE_DTYPES:
        raise ValueError(f"{states.dtype=} must be float32 or bfloat16")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"{z.shape=} must equal {x.shape=}")


def _check_pallas(n: int) -> None:
    if not (is_pow2(n) and n >= 2):
        raise ValueError(f"state size {n=} must be a power of 2 for the Pallas kernels")


def selective_scan_ragged(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial,
                          *, z=None, impl: Impl | None = None):
    """x, dt [t, c] (dt raw, before dt_bias and softplus); A [c, n] f32 (negative); B, C [t, n];
    D, dt_bias [c]; cu_seqlens int32 [b+1]; states [S, c, n] f32 or bf16; slot_ids int32 [b];
    has_initial bool [b]; z [t, c] or None. Returns (y [t, c] in x.dtype, states)."""
    impl = resolve_impl(impl)
    _check(x, dt, A, B, C, D, dt_bias, states, z)
    if x.ndim != 2:
        raise ValueError(f"{x.shape=} must be [t, c]")
    check_ragged(cu_seqlens, slot_ids, has_initial)
    if impl == "reference":
        return selective_scan_ragged_reference(x, dt, A, B, C, D, dt_bias, cu_seqlens, states,
                                               slot_ids, has_initial, z=z)
    _check_pallas(A.shape[1])
    return _ragged_pallas(x, dt, A, B, C, D, dt_bias, z, cu_seqlens.astype(jnp.int32), states,
                          slot_ids.astype(jnp.int32), has_initial.astype(jnp.int32), impl=impl,
                          tile=TILE if impl == "pallas" else INTERPRET_TILE)


def selective_scan_step(x, dt, A, B, C, D, dt_bias, states, slot_ids, *, z=None,
                        candidates: bool = False, impl: Impl | None = None):
    """x, dt [b, q, c]; B, C [b, q, n]; z [b, q, c] or None; the rest as
    `selective_scan_ragged`. Returns (y [b, q, c] in x.dtype, states [S, c, n] with each
    sequence's state after its q tokens) or, with `candidates`, (y, [q, b, c, n] in the
    state dtype: the state after each position; the slots are not written)."""
    impl = resolve_impl(impl)
    _check(x, dt, A, B, C, D, dt_bias, states, z)
    if x.ndim != 3 or slot_ids.shape != x.shape[:1]:
        raise ValueError(f"{x.shape=} must be [b, q, c] with b = {slot_ids.shape=}")
    if impl == "reference":
        return selective_scan_step_reference(x, dt, A, B, C, D, dt_bias, states, slot_ids, z=z,
                                             candidates=candidates)
    _check_pallas(A.shape[1])
    return _step_pallas(x, dt, A, B, C, D, dt_bias, z, states, slot_ids.astype(jnp.int32),
                        candidates=candidates, impl=impl)


def _discretize(x, dt, A, B, dt_bias):
    """(exp(dt A), dt x B) [..., c, n] in f32 from raw dt [..., c], x [..., c], B [..., n]."""
    d = jax.nn.softplus(dt.astype(F32) + dt_bias.astype(F32))
    decay = jnp.exp(d[..., None] * A.astype(F32))
    drive = (d * x.astype(F32))[..., None] * B.astype(F32)[..., None, :]
    return decay, drive


def _readout(s, x, C, D, z):
    """y = s . C + D x (times silu(z)) in f32; s [..., c, n]."""
    y = jnp.sum(s * C.astype(F32)[..., None, :], axis=-1) + D.astype(F32) * x.astype(F32)
    if z is not None:
        y = y * jax.nn.silu(z.astype(F32))
    return y


@jax.jit
def selective_scan_ragged_reference(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids,
                                    has_initial, *, z=None):
    """Pure-JAX reference of `selective_scan_ragged`: one associative scan over all tokens
    of the [t, c, n] recurrence (memory t c n f32: the CPU serving path's tiny models)."""
    t = x.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    # 1. Discretise every token: decay exp(dt A) and drive dt x B, [t, c, n].
    decay, drive = _discretize(x, dt, A, B, dt_bias)
    # 2. Each token's sequence; a sequence's first token restarts from its initial state.
    sg = segments(cu_seqlens, t)
    seq = jnp.minimum(sg.seq, nseq - 1)
    s0 = jnp.where(has_initial[:, None, None], states[slot_ids].astype(F32), 0.0)  # [b, c, n]
    first = (sg.pos == 0)[:, None, None]
    elem_a = jnp.where(first, 0.0, decay)
    elem_b = drive + jnp.where(first, decay * s0[seq], 0.0)
    # 3. (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2): s_t for every token.
    _, s = jax.lax.associative_scan(lambda u, v: (u[0] * v[0], v[0] * u[1] + v[1]),
                                    (elem_a, elem_b), axis=0)
    # 4. Readout; padding rows get 0.
    y = jnp.where((sg.pos >= 0)[:, None], _readout(s, x, C, D, z), 0.0)
    # 5. Final state: s at each sequence's last token, or s0 when it is empty.
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    final = jnp.where((lens > 0)[:, None, None], s[jnp.maximum(cu_seqlens[1:] - 1, 0)], s0)
    return y.astype(x.dtype), states.at[slot_ids].set(final.astype(states.dtype))


@functools.partial(jax.jit, static_argnames=("candidates",))
def selective_scan_step_reference(x, dt, A, B, C, D, dt_bias, states, slot_ids, *, z=None,
                                  candidates: bool = False):
    """Pure-JAX reference of `selective_scan_step`: q one-token updates in order."""
    q = x.shape[1]
    decay, drive = _discretize(x, dt, A, B, dt_bias)  # [b, q, c, n]
    s = states[slot_ids]
    ys, cands = [], []
    for j in range(q):
        v = decay[:, j] * s.astype(F32) + drive[:, j]
        ys.append(_readout(v, x[:, j], C[:, j], D, None if z is None else z[:, j]))
        s = v.astype(states.dtype)
        cands.append(s)
    y = jnp.stack(ys, axis=1).astype(x.dtype)
    if candidates:
        return y, jnp.stack(cands)
    return y, states.at[slot_ids].set(s)


def _softplus(v):
    return jnp.maximum(v, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(v)))


def _token(x, dt, b, c, a, d, bias, z, s):
    """One token of one program: x, dt, d, bias, z [cb]; b, c [n]; a [cb, n]; s [cb, n] f32
    -> (y [cb] f32, new s)."""
    delta = _softplus(dt + bias)
    s = jnp.exp(delta[:, None] * a) * s + (delta * x)[:, None] * b[None, :]
    y = jnp.sum(s * c[None, :], axis=1) + d * x
    if z is not None:
        y = y * (z / (1.0 + jnp.exp(-z)))
    return y, s


def _scan_kernel(cu_ref, slot_ref, init_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, bias_ref,
                 *rest, nseq, cb, n, tile, gated):
    if gated:
        z_ref, st_ref, y_ref, st_out = rest
    else:
        (st_ref, y_ref, st_out), z_ref = rest, None
    s_id, ci = pl.program_id(0), pl.program_id(1)
    cols, ns = pl.ds(ci * cb, cb), pl.ds(0, n)
    start, end = cu_ref[s_id], cu_ref[s_id + 1]  # s_id == nseq: the padding tail, y = 0
    real = s_id < nseq
    last = jnp.minimum(s_id, nseq - 1)
    slot = slot_ref[last]
    keep = real & (init_ref[last] != 0)
    s0 = jnp.where(keep, st_ref[slot, cols, ns].astype(F32), 0.0)
    a = a_ref[cols, ns].astype(F32)
    d, bias = d_ref[cols].astype(F32), bias_ref[cols].astype(F32)

    def step(i, s):
        rows = [start + i * tile + k for k in range(tile)]
        safe = [jnp.minimum(r, end - 1) for r in rows]
        loads = [(x_ref[r, cols].astype(F32), dt_ref[r, cols].astype(F32), b_ref[r, ns].astype(F32),
                  c_ref[r, ns].astype(F32), None if z_ref is None else z_ref[r, cols].astype(F32))
                 for r in safe]
        for r, sr, (x, dt, b, c, z) in zip(rows, safe, loads, strict=True):
            valid = (r < end) & real
            y, v = _token(x, dt, b, c, a, d, bias, z, s)
            s = jnp.where(valid, v, s)
            plgpu.store(y_ref.at[sr, cols], jnp.where(valid, y, 0.0).astype(y_ref.dtype),
                        mask=jnp.broadcast_to(r < end, (cb,)))
        return s

    final = jax.lax.fori_loop(0, pl.cdiv(end - start, tile), step, s0)

    @pl.when(real)
    def _():
        st_out[slot, cols, ns] = final.astype(st_out.dtype)


@functools.partial(jax.jit, static_argnames=("impl", "tile", "block_c", "warps"))
def _ragged_pallas(x, dt, A, B, C, D, dt_bias, z, cu, states, slot_ids, has_initial, *, impl,
                   tile=TILE, block_c=PREFILL_CHANNEL_BLOCK, warps=4):
    t, c = x.shape
    n = A.shape[1]
    nseq = cu.shape[0] - 1
    cb = channel_block(c, block_c)
    cu_ext = jnp.concatenate([cu, jnp.array([t], jnp.int32)])  # padding tail as segment nseq
    args = (cu_ext, slot_ids, has_initial, x, dt, A, B, C, D, dt_bias) + ((z,) if z is not None else ())
    return launch(
        functools.partial(_scan_kernel, nseq=nseq, cb=cb, n=n, tile=tile, gated=z is not None),
        impl=impl, grid=(nseq + 1, c // cb),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={len(args): 1}, num_warps=warps, name="selective_scan",
    )(*args, states)


def _step_kernel(slot_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, bias_ref, *rest, q, cb, n,
                 gated, candidates):
    if gated:
        z_ref, st_ref, y_ref, st_out = rest
    else:
        (st_ref, y_ref, st_out), z_ref = rest, None
    s_id, ci = pl.program_id(0), pl.program_id(1)
    cols, ns = pl.ds(ci * cb, cb), pl.ds(0, n)
    slot = slot_ref[s_id]
    a = a_ref[cols, ns].astype(F32)
    d, bias = d_ref[cols].astype(F32), bias_ref[cols].astype(F32)
    loads = [(x_ref[s_id, j, cols].astype(F32), dt_ref[s_id, j, cols].astype(F32),
              b_ref[s_id, j, ns].astype(F32), c_ref[s_id, j, ns].astype(F32),
              None if z_ref is None else z_ref[s_id, j, cols].astype(F32)) for j in range(q)]
    s = st_ref[slot, cols, ns].astype(F32)
    for j, (x, dt, b, c, z) in enumerate(loads):
        y, s = _token(x, dt, b, c, a, d, bias, z, s)
        s = s.astype(st_ref.dtype)  # stored between positions as q one-token steps store it
        y_ref[s_id, j, cols] = y.astype(y_ref.dtype)
        if candidates:
            st_out[j, s_id, cols, ns] = s
        s = s.astype(F32)
    if not candidates:
        st_out[slot, cols, ns] = s.astype(st_out.dtype)


@functools.partial(jax.jit, static_argnames=("candidates", "impl", "block_c", "warps"))
def _step_pallas(x, dt, A, B, C, D, dt_bias, z, states, slot_ids, *, candidates, impl,
                 block_c=CHANNEL_BLOCK, warps=4):
    nb, q, c = x.shape
    n = A.shape[1]
    cb = channel_block(c, block_c)
    args = (slot_ids, x, dt, A, B, C, D, dt_bias) + ((z,) if z is not None else ())
    st_shape = (q, nb, c, n) if candidates else states.shape
    return launch(
        functools.partial(_step_kernel, q=q, cb=cb, n=n, gated=z is not None, candidates=candidates),
        impl=impl, grid=(nb, c // cb),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(st_shape, states.dtype)],
        aliases={} if candidates else {len(args): 1}, num_warps=warps, name="selective_scan_step",
    )(*args, states)
