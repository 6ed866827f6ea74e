"""Causal depthwise conv1d over a ragged batch, with per-slot conv states.

    y_t = act(sum_j weight[:, j] * x_{t - k + 1 + j} + bias)        k taps, c channels

Inputs before a sequence's first token come from its slot (conv_states
[num_slots, k-1, c], the last k-1 inputs oldest first) when has_initial, else
zero. After the call the slot holds the sequence's last k-1 inputs (older ones
taken from the state when the chunk is shorter than k-1). Padding tokens get 0.

Pallas: the prefill kernel loads each tap as a gather of shifted rows (rows
before a sequence start come from the slot), over (channel block, row block)
programs whose row windows are clamped inside [0, t) (overlapping rows are
rewritten with identical values); a second small kernel writes the states in
place. Decode rolls the state in one kernel. This module knows nothing of how
slots are allocated (slot 0 is the dummy for padding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, launch
from pallas_kernels.ragged import segments
from pallas_kernels.ssm_common import check_ragged, silu

ACTIVATIONS = ("silu", None)
ROW_BLOCK = 16  # token rows per program (prefill); tuned on H100


def _check(x, weight, bias, conv_states, activation) -> None:
    if x.ndim != 2:
        raise ValueError(f"{x.shape=} must be [t, c]")
    c = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"{weight.shape=} must be [c={c}, k>=2]")
    k = weight.shape[1]
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"{bias.shape=} must be {(c,)}")
    if conv_states.ndim != 3 or conv_states.shape[1:] != (k - 1, c):
        raise ValueError(f"{conv_states.shape=} must be [num_slots, {k - 1}, {c}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")


def _act(v, activation):
    return silu(v) if activation == "silu" else v


def conv1d_ragged(x, weight, bias, cu_seqlens, conv_states, slot_ids, has_initial, *,
                  activation="silu", impl: Impl | None = None):
    """x [t, c]; weight [c, k]; bias [c] | None; cu_seqlens int32 [b+1];
    conv_states [num_slots, k-1, c]; slot_ids int32 [b]; has_initial bool [b].
    Returns (y [t, c] in x.dtype, conv_states)."""
    impl = resolve_impl(impl)
    _check(x, weight, bias, conv_states, activation)
    check_ragged(cu_seqlens, slot_ids, has_initial)
    bias = jnp.zeros((x.shape[1],), jnp.float32) if bias is None else bias
    if impl == "reference":
        return conv1d_ragged_reference(x, weight, bias, cu_seqlens, conv_states, slot_ids,
                                       has_initial, activation=activation)
    return _ragged_pallas(x, weight, bias, cu_seqlens.astype(jnp.int32), conv_states,
                          slot_ids.astype(jnp.int32), has_initial.astype(jnp.int32),
                          activation=activation, impl=impl)


def conv1d_decode(x, weight, bias, conv_states, slot_ids, *, activation="silu",
                  impl: Impl | None = None, col0: int | None = None, row: int | None = None):
    """One token per sequence: x [b, c]; returns (y [b, c], conv_states rolled by one).

    `col0`: x may be wider than c, its channels then being columns [col0, col0 + c)
    (e.g. the xBC part of a Mamba2 in_proj output, read in place: no slice copy).
    `row`: weight [L, c, k] and bias [L, c] are stacks (every layer's, hybrid_jax/fusion.py)
    and the kernel reads row `row` of them in place: slicing them out in XLA would copy
    both before the custom call, two small kernels per layer and step.
    """
    impl = resolve_impl(impl)
    if row is not None:
        if weight.ndim != 3 or not 0 <= row < weight.shape[0] or (
                bias is not None and bias.shape != weight.shape[:2]):
            raise ValueError(f"{row=}: weight {weight.shape} must be [L > row, c, k] and bias "
                             f"{None if bias is None else bias.shape} [L, c]")
        if impl == "reference":
            weight, bias, row = weight[row], None if bias is None else bias[row], None
    # One layer's weight and bias as shapes (a stack's row: no slice in the traced graph).
    one = (lambda a: a) if row is None else (
        lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype))
    w1, b1 = one(weight), one(bias)
    c = w1.shape[0] if w1.ndim == 2 else -1
    if col0 is not None and x.ndim == 2:
        if not 0 <= col0 <= x.shape[1] - c:
            raise ValueError(f"{col0=}: columns [{col0}, {col0 + c}) outside x of width {x.shape[1]}")
        if impl == "reference" or x.shape[1] == c:
            x, col0 = x[:, col0:col0 + c], None
    # Checked as the [b, c] view it reads (a shape only: no slice in the traced graph).
    view = x if col0 is None or x.ndim != 2 else jax.ShapeDtypeStruct((x.shape[0], c), x.dtype)
    _check(view, w1, b1, conv_states, activation)
    if impl == "reference":
        bias = jnp.zeros((c,), jnp.float32) if bias is None else bias
        return conv1d_decode_reference(x, weight, bias, conv_states, slot_ids,
                                       activation=activation)
    return _decode_pallas(x, weight, bias, conv_states, slot_ids.astype(jnp.int32),
                          activation=activation, impl=impl, col0=col0 or 0, row=row)


@functools.partial(jax.jit, static_argnames=("activation", "impl"))
def conv1d_ragged_reference(x, weight, bias, cu_seqlens, conv_states, slot_ids, has_initial,
                            *, activation="silu", impl: Impl | None = None):
    """Pure-JAX reference of `conv1d_ragged` (bias required here; pass zeros for none)."""
    del impl
    t, c = x.shape
    k, b = weight.shape[1], cu_seqlens.shape[0] - 1
    f32 = jnp.float32
    # 1. Each token's sequence, position, slot and previous inputs (k-1 rows).
    sg = segments(cu_seqlens, t)
    seq = jnp.minimum(sg.seq, b - 1)
    init = has_initial[seq] & (sg.pos >= 0)
    prev = jnp.where(init[:, None, None], conv_states[slot_ids[seq]].astype(f32), 0.0)
    # 2. Tap j reads x at t - d (d = k-1-j) inside the sequence, else the state.
    acc = jnp.broadcast_to(bias.astype(f32), (t, c))
    for j in range(k):
        d = k - 1 - j
        inside = x[jnp.maximum(jnp.arange(t) - d, 0)].astype(f32)
        before = prev[jnp.arange(t), jnp.clip(k - 1 + sg.pos - d, 0, k - 2)]
        acc = acc + weight[:, j].astype(f32) * jnp.where((sg.pos >= d)[:, None], inside, before)
    y = jnp.where((sg.pos >= 0)[:, None], _act(acc, activation), 0.0)
    # 3. New state: the last k-1 inputs of each sequence (older ones from the state).
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    q = lens[:, None] - (k - 1) + jnp.arange(k - 1)  # [b, k-1] positions
    from_x = x[jnp.clip(cu_seqlens[:-1, None] + q, 0, t - 1)].astype(f32)
    old = conv_states[slot_ids[:, None], jnp.clip(k - 1 + q, 0, k - 2)].astype(f32)
    old = jnp.where(has_initial[:, None, None], old, 0.0)
    new = jnp.where((q >= 0)[..., None], from_x, old)
    return y.astype(x.dtype), conv_states.at[slot_ids].set(new.astype(conv_states.dtype))


@functools.partial(jax.jit, static_argnames=("activation", "impl"))
def conv1d_decode_reference(x, weight, bias, conv_states, slot_ids, *, activation="silu",
                            impl: Impl | None = None):
    """Pure-JAX reference of `conv1d_decode` (bias required here)."""
    del impl
    f32 = jnp.float32
    window = jnp.concatenate([conv_states[slot_ids].astype(f32), x[:, None].astype(f32)], 1)
    y = jnp.einsum("bkc,ck->bc", window, weight.astype(f32), precision="highest") + bias
    new = window[:, 1:].astype(conv_states.dtype)
    return _act(y, activation).astype(x.dtype), conv_states.at[slot_ids].set(new)


def _conv_rows_kernel(pos_ref, slot_ref, init_ref, x_ref, w_ref, bias_ref, st_ref, y_ref, *,
                      k, tb, cb, activation):
    ci, ti = pl.program_id(0), pl.program_id(1)
    r0 = jnp.minimum(ti * tb, x_ref.shape[0] - tb)
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (tb,), 0)
    cols = pl.ds(ci * cb, cb)
    pos_v = pos_ref[pl.ds(r0, tb)]  # no value slicing on Triton: keep the vector too
    pos = pos_v[:, None]
    init = init_ref[pl.ds(r0, tb)][:, None] != 0
    slot = slot_ref[pl.ds(r0, tb)]
    acc = jnp.broadcast_to(bias_ref[cols][None, :], (tb, cb))
    for j in range(k):
        d = k - 1 - j
        v = x_ref[jnp.maximum(rows - d, 0), cols].astype(jnp.float32)
        if d:
            srow = slot * (k - 1) + jnp.clip(k - 1 + pos_v - d, 0, k - 2)
            old = jnp.where(init, st_ref[srow, cols].astype(jnp.float32), 0.0)
            v = jnp.where(pos >= d, v, old)
        acc = acc + w_ref[j, cols][None, :] * v
    y = jnp.where(pos >= 0, _act(acc, activation), 0.0)
    y_ref[pl.ds(r0, tb), cols] = y.astype(y_ref.dtype)


def _conv_state_kernel(cu_ref, slot_ref, init_ref, x_ref, st_ref, st_out, *, k, cb):
    s, ci = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(ci * cb, cb)
    start, slot = cu_ref[s], slot_ref[s]
    length = cu_ref[s + 1] - start
    new = []
    for i in range(k - 1):  # load everything before storing: rows overlap in place
        q = length - (k - 1) + i
        v = x_ref[jnp.clip(start + q, 0, x_ref.shape[0] - 1), cols].astype(jnp.float32)
        old = st_ref[slot * (k - 1) + jnp.clip(k - 1 + q, 0, k - 2), cols].astype(jnp.float32)
        old = jnp.where(init_ref[s] != 0, old, 0.0)
        new.append(jnp.where(q >= 0, v, old))
    for i, v in enumerate(new):
        st_out[slot * (k - 1) + i, cols] = v.astype(st_out.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "impl", "row_block", "warps"))
def _ragged_pallas(x, weight, bias, cu, conv_states, slot_ids, has_initial, *, activation, impl,
                   row_block=ROW_BLOCK, warps=4):
    t, c = x.shape
    k, b = weight.shape[1], cu.shape[0] - 1
    cb, tb = channel_block(c), min(row_block, 1 << (t.bit_length() - 1))
    sg = segments(cu, t)
    seq = jnp.minimum(sg.seq, b - 1)
    tok_slot = slot_ids[seq]
    tok_init = jnp.where(sg.pos >= 0, has_initial[seq], 0)
    flat = conv_states.reshape(-1, c)  # [(num_slots * (k-1)), c], row = slot * (k-1) + i
    w_t, bias32 = weight.astype(jnp.float32).T, bias.astype(jnp.float32)
    (y,) = launch(
        functools.partial(_conv_rows_kernel, k=k, tb=tb, cb=cb, activation=activation),
        impl=impl, grid=(c // cb, pl.cdiv(t, tb)), out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
        num_warps=warps, name="conv1d_rows",
    )(sg.pos, tok_slot, tok_init, x, w_t, bias32, flat)
    (flat,) = launch(
        functools.partial(_conv_state_kernel, k=k, cb=cb), impl=impl, grid=(b, c // cb),
        out_shape=[jax.ShapeDtypeStruct(flat.shape, flat.dtype)], aliases={4: 0},
        name="conv1d_state",
    )(cu, slot_ids, has_initial, x, flat)
    return y, flat.reshape(conv_states.shape)


def decode_window(x_ref, w_ref, bias_ref, st_ref, *, s, row, slot, ch0, nch: int, k: int, col0: int):
    """Inside a kernel: sequence s's decode conv over channels [ch0, ch0 + nch) -> (the f32
    sums before the activation, the window: the slot's k - 1 state rows (flat rows slot *
    (k - 1) + i), then the new input x[s, col0 + ch0 + ...]). Weight [L, c, k] and bias
    [L, c] | None read at `row`. Also the Mamba2 update's folded conv (ssm_decode.py)."""
    cols = pl.ds(ch0, nch)
    window = [st_ref[slot * (k - 1) + i, cols].astype(jnp.float32) for i in range(k - 1)]
    window.append(x_ref[s, pl.ds(col0 + ch0, nch)].astype(jnp.float32))
    f32 = jnp.float32
    acc = bias_ref[row, cols].astype(f32) if bias_ref is not None else jnp.zeros((nch,), f32)
    for j in range(k):
        acc = acc + w_ref[row, cols, j].astype(jnp.float32) * window[j]
    return acc, window


def _conv_decode_kernel(row_ref, slot_ref, x_ref, w_ref, *refs, k, cb, col0, activation, has_bias):
    # The weight [L, c, k] and bias [L, c] (L = 1 for one layer's) come in their stored
    # dtype and layout: converting or slicing them in XLA would be more kernels per layer.
    bias_ref, st_ref, y_ref, st_out = refs if has_bias else (None, *refs)
    s, ci = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(ci * cb, cb)
    slot = slot_ref[s]
    acc, window = decode_window(x_ref, w_ref, bias_ref, st_ref, s=s, row=row_ref[0], slot=slot,
                                ch0=ci * cb, nch=cb, k=k, col0=col0)
    y_ref[s, cols] = _act(acc, activation).astype(y_ref.dtype)
    for i in range(k - 1):
        st_out[slot * (k - 1) + i, cols] = window[i + 1].astype(st_out.dtype)


def _decode_pallas(x, weight, bias, conv_states, slot_ids, *, activation, impl, col0=0, row=None):
    if row is None:  # one layer's [c, k] / [c]: a stack of one (reshapes: no copies)
        weight, bias, row = weight[None], None if bias is None else bias[None], 0
    # The row is an operand, not a static: every layer's call is one function, lowered
    # once per executable (cold start-up; decode_glue._row_arg).
    return _decode_rows(jnp.full((1,), row, jnp.int32), x, weight, bias, conv_states, slot_ids,
                        activation=activation, impl=impl, col0=col0)


@functools.partial(jax.jit, static_argnames=("activation", "impl", "col0"))
def _decode_rows(row, x, weight, bias, conv_states, slot_ids, *, activation, impl, col0):
    b = x.shape[0]
    _, c, k = weight.shape
    cb = channel_block(math.gcd(c, col0) if col0 else c)  # blocks aligned to col0 too
    flat = conv_states.reshape(-1, c)
    args = (row, slot_ids, x, weight) + ((bias,) if bias is not None else ()) + (flat,)
    y, flat = launch(
        functools.partial(_conv_decode_kernel, k=k, cb=cb, col0=col0, activation=activation,
                          has_bias=bias is not None),
        impl=impl, grid=(b, c // cb),
        out_shape=[jax.ShapeDtypeStruct((b, c), x.dtype),
                   jax.ShapeDtypeStruct(flat.shape, flat.dtype)],
        aliases={len(args) - 1: 1}, name="conv1d_decode",
    )(*args)
    return y, flat.reshape(conv_states.shape)
