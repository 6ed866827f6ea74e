"""Mamba2's recurrent core for q >= 1 consecutive tokens per sequence, in one kernel.

Per sequence, per token j (k conv taps, c = h p + 2 g n channels, oldest input first):

    u_j  = silu(sum_i w[:, i] * window_j[i] + bias)     window_j: the k inputs ending at j
    x, B, C = split(u_j)                                 x [h, p], B and C [g, n]
    dt_j = clamp(softplus(dt_j + dt_bias), *dt_limit)
    s    = exp(dt_j A) s + dt_j x (outer) B_group        s [h, p, n] per sequence
    y_j  = s . C_group + D x                             (not gated: the gate stays with the layer)

`candidates=False` (decode, q == 1) updates the slots' conv and SSM states;
`candidates=True` (speculative verification) leaves the slots alone and returns the
states after EACH of the q positions, [q, b, ...], for the caller to choose from.

Pallas: one program per (block of p rows, head, sequence), consecutive programs
walking one slot's contiguous SSM state (ssm_decode's "phs" order). A program
convolves its own bp x channels and, redundantly (k + q - 1 rows of 2n values), its
group's B and C channels, then runs its [bp, n] block of state through the q tokens:
the state is read once and written once (in place) or q times (candidates). dt's
softplus is done in the kernel. Values between steps are rounded exactly where the
unfused path (conv1d_decode, then ssm_decode, q times) stores them: u to the input
dtype, the SSM state to the state dtype, past inputs to the conv-state dtype, so the
fused step reproduces it.

The slots' conv states are never written by the kernel: a (sequence, group)'s B/C
channels are read by every program of the group, and programs have no order, so an
in-place write by any one of them would race with the others' reads. The kernel
writes the new conv rows (decode, [b, k-1, c]) or their q candidates to separate
outputs instead (each channel by one program); decode then scatters the rows into
the slots with one small XLA scatter (in place when the pool is donated at the jit
boundary; its updates come from a separate buffer, so XLA needs no copy of the pool).

This module knows nothing of how slots are allocated (slot 0 is the dummy for padding)
nor of the layer's projections: xbc and dt come in raw, y goes out ungated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.conv1d import conv1d_decode_reference
from pallas_kernels.launch import channel_block, is_pow2, launch
from pallas_kernels.ssm_common import STATE_DTYPES, effective_dt, silu
from pallas_kernels.ssm_decode import ssm_decode_reference

# Launch knobs by state dtype: ssm_decode's H100 tuning (DECODE_TUNING, same state
# traffic per program), not re-measured for the fused kernel.
STEP_TUNING = {
    "float32": dict(block_p=32, num_warps=4, evict=None),
    "bfloat16": dict(block_p=32, num_warps=4, evict="evict_first"),
}


def mamba2_step_fits(head_dim: int, state_size: int) -> bool:
    """Whether the Pallas kernel takes these shapes (its blocks must be powers of 2)."""
    return is_pow2(head_dim) and is_pow2(state_size)


def _check(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states, slot_ids,
           n_groups, head_dim, dt_limit, candidates) -> None:
    """ValueError naming the first argument whose shape, dtype or value is off."""
    if ssm_states.ndim != 4 or ssm_states.dtype not in STATE_DTYPES:
        raise ValueError(f"ssm_states ({ssm_states.shape}, {ssm_states.dtype}) must be "
                         "[num_slots, h, p, n] float32 or bfloat16")
    num_slots, h, p, n = ssm_states.shape
    if p != head_dim or h % n_groups:
        raise ValueError(f"{ssm_states.shape=} needs p = {head_dim=} and h a multiple of {n_groups=}")
    c = h * p + 2 * n_groups * n
    if xbc.ndim != 3 or xbc.shape[2] != c:
        raise ValueError(f"{xbc.shape=} must be [b, q, conv_dim={c}]")
    b, q = xbc.shape[:2]
    if q < 1 or (not candidates and q != 1):
        raise ValueError(f"{q=} tokens per sequence: must be >= 1, and 1 unless candidates")
    if dt.shape != (b, q, h):
        raise ValueError(f"{dt.shape=} must be {(b, q, h)}")
    if conv_w.ndim != 2 or conv_w.shape[0] != c or conv_w.shape[1] < 2:
        raise ValueError(f"{conv_w.shape=} must be [conv_dim={c}, k>=2]")
    k = conv_w.shape[1]
    if conv_b is not None and conv_b.shape != (c,):
        raise ValueError(f"{conv_b.shape=} must be {(c,)}")
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (h,):
            raise ValueError(f"{name}.shape={v.shape} must be {(h,)}")
    if conv_states.shape != (num_slots, k - 1, c):
        raise ValueError(f"{conv_states.shape=} must be {(num_slots, k - 1, c)}")
    if slot_ids.shape != (b,) or not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids ({slot_ids.shape}, {slot_ids.dtype}) must be int [{b}]")
    lo, hi = dt_limit
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"{dt_limit=} must satisfy 0 <= lo <= hi")


def mamba2_step(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states, slot_ids, *,
                n_groups: int, head_dim: int, dt_limit=(0.0, float("inf")), candidates: bool,
                impl: Impl | None = None):
    """Conv + split + SSM for q tokens per sequence.

    xbc [b, q, c] raw (pre-conv), c = h p + 2 g n in the order [x | B | C]; dt [b, q, h] raw;
    conv_w [c, k]; conv_b [c] | None; A [h] (negative); D, dt_bias [h];
    conv_states [num_slots, k-1, c]; ssm_states [num_slots, h, p, n] f32 or bf16; slot_ids [b].
    Returns y [b, q, h, p] in xbc.dtype (ungated) and
      candidates=False (q == 1): (conv_states, ssm_states) with rows slot_ids advanced;
      candidates=True: (conv [q, b, k-1, c], ssm [q, b, h, p, n]) after each position, in
      the slot arrays' dtypes; the slot arrays are not written.
    """
    impl = resolve_impl(impl)
    dt_limit = tuple(map(float, dt_limit))
    _check(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states, slot_ids,
           n_groups, head_dim, dt_limit, candidates)
    conv_b = jnp.zeros((xbc.shape[2],), jnp.float32) if conv_b is None else conv_b
    kw = dict(n_groups=n_groups, head_dim=head_dim, dt_limit=dt_limit, candidates=candidates)
    if impl == "reference":
        return mamba2_step_reference(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states,
                                     ssm_states, slot_ids, **kw)
    if not mamba2_step_fits(head_dim, ssm_states.shape[3]):
        raise ValueError(f"head dim p={head_dim} and state dim n={ssm_states.shape[3]} "
                         "must be powers of 2")
    tuning = dict(STEP_TUNING[jnp.dtype(ssm_states.dtype).name])
    tuning["block_p"] = channel_block(head_dim, tuning["block_p"])
    return _step_pallas(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states,
                        slot_ids.astype(jnp.int32), impl=impl, **kw, **tuning)


@functools.partial(jax.jit, static_argnames=(
    "n_groups", "head_dim", "dt_limit", "candidates", "impl"))
def mamba2_step_reference(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states,
                          slot_ids, *, n_groups: int, head_dim: int,
                          dt_limit=(0.0, float("inf")), candidates: bool,
                          impl: Impl | None = None):
    """Pure-JAX reference, same contract as `mamba2_step` (conv_b required: zeros for none):
    the unfused ops' references run q times, one token each."""
    del impl
    b, q, _ = xbc.shape
    h, n = ssm_states.shape[1], ssm_states.shape[3]
    hp, gn = h * head_dim, n_groups * n
    # 1. Candidates run on the slots' gathered states (rows 0..b-1); decode on the slots.
    if candidates:
        conv, ssm = conv_states[slot_ids], ssm_states[slot_ids]
        rows = jnp.arange(b, dtype=jnp.int32)
    else:
        conv, ssm, rows = conv_states, ssm_states, slot_ids
    ys, convs, ssms = [], [], []
    for j in range(q):
        # 2. u = silu(conv(state, token)); the state rolls by one input.
        u, conv = conv1d_decode_reference(xbc[:, j], conv_w, conv_b, conv, rows, activation="silu")
        # 3. Split [x | B | C]; one SSM step (the state is stored between tokens).
        x = u[:, :hp].reshape(b, h, head_dim)
        B = u[:, hp:hp + gn].reshape(b, n_groups, n)
        C = u[:, hp + gn:].reshape(b, n_groups, n)
        y, ssm = ssm_decode_reference(x, dt[:, j], A, B, C, D, dt_bias, ssm, rows,
                                      dt_limit=dt_limit)
        ys.append(y)
        convs.append(conv)
        ssms.append(ssm)
    y = jnp.stack(ys, axis=1)
    if candidates:
        return y, jnp.stack(convs), jnp.stack(ssms)
    return y, conv, ssm


def _conv_tokens(xbc_ref, conv_ref, w_ref, bias_ref, s, slot, cols, *, q: int, k: int):
    """silu(conv) of channels `cols` of sequence s for its q tokens: (q f32 vectors rounded
    to the input dtype as the unfused path stores them, the k-1+q inputs [state, tokens]
    as the conv state stores them; a token is stored before it is reused)."""
    f32 = jnp.float32
    raw = [xbc_ref[s, j, cols] for j in range(q)]
    seq = [conv_ref[slot, i, cols].astype(f32) for i in range(k - 1)]
    seq += [v.astype(conv_ref.dtype).astype(f32) for v in raw]
    w = [w_ref[i, cols] for i in range(k)]
    out = []
    for j in range(q):
        window = seq[j:j + k - 1] + [raw[j].astype(f32)]  # Python lists: no value slicing
        acc = bias_ref[cols]
        for i in range(k):
            acc = acc + w[i] * window[i]
        out.append(silu(acc).astype(xbc_ref.dtype).astype(f32))
    return out, seq


def _store_conv_rows(cv_out, seq, s, cols, *, q: int, k: int, candidates: bool):
    """The conv state (last k-1 inputs) after each position (candidates) or the last one."""
    for j in range(q) if candidates else (q - 1,):
        for i in range(k - 1):
            v = seq[j + 1 + i].astype(cv_out.dtype)
            if candidates:
                cv_out[j, s, i, cols] = v
            else:
                cv_out[s, i, cols] = v


def _step_body(slot_ref, dt_ref, a_ref, d_ref, dtb_ref, w_ref, bias_ref, xbc_ref, conv_ref,
               st_ref, y_ref, cv_out, st_out, *, q: int, k: int, hpg: int, bp: int, dt_limit,
               evict: str | None):
    """One program: rows [pb bp, (pb + 1) bp) of head hd of sequence s, through q tokens.

    st_out is the slot array (aliased to st_ref) or the candidates [q, b, h, p, n];
    cv_out the new conv rows [b, k-1, c] or their candidates [q, b, k-1, c] (never the
    slot array: see the module doc). The program writes the conv rows of its x channels;
    its group's first head's first row block also writes the group's B and C channels.
    Only whole-ref slicing with pl.ds, scalar loads and 1-D/2-D power-of-2 vectors.
    """
    pb, hd, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, p, n = st_ref.shape[1:]
    g, gi = h // hpg, hd // hpg
    candidates = len(st_out.shape) == 5
    f32 = jnp.float32
    slot = slot_ref[s]
    rows = pl.ds(pb * bp, bp)
    conv = functools.partial(_conv_tokens, xbc_ref, conv_ref, w_ref, bias_ref, s, slot, q=q, k=k)
    store_rows = functools.partial(_store_conv_rows, cv_out, s=s, q=q, k=k, candidates=candidates)
    x_cols = pl.ds(hd * p + pb * bp, bp)
    b_cols, c_cols = pl.ds(h * p + gi * n, n), pl.ds(h * p + (g + gi) * n, n)
    xs, x_seq = conv(x_cols)  # q x [bp]
    Bs, b_seq = conv(b_cols)  # q x [n]
    Cs, c_seq = conv(c_cols)
    store_rows(x_seq, cols=x_cols)

    @pl.when((hd % hpg == 0) & (pb == 0))
    def _():
        store_rows(b_seq, cols=b_cols)
        store_rows(c_seq, cols=c_cols)

    a, dv, dtb = a_ref[hd], d_ref[hd], dtb_ref[hd]
    block = (slot, hd, rows, slice(None))
    state = (st_ref[block] if evict is None
             else plgpu.load(st_ref.at[block], eviction_policy=evict)).astype(f32)  # [bp, n]

    def store(idx, v):
        if evict is None:
            st_out[idx] = v
        else:
            plgpu.store(st_out.at[idx], v, eviction_policy=evict)

    for j in range(q):
        dte = effective_dt(dt_ref[s, j, hd], dtb, dt_limit)  # scalar
        x = xs[j]
        state = jnp.exp(dte * a) * state + (dte * x)[:, None] * Bs[j][None, :]
        y = jnp.sum(state * Cs[j][None, :], axis=1) + dv * x
        y_ref[s, j, hd, rows] = y.astype(y_ref.dtype)
        stored = state.astype(st_out.dtype)
        if candidates:
            store((jnp.int32(j), s, hd, rows, slice(None)), stored)  # a Python int fails in interpret
        state = stored.astype(f32)
    if not candidates:
        store(block, stored)


@functools.partial(jax.jit, static_argnames=(
    "n_groups", "head_dim", "dt_limit", "candidates", "impl", "block_p", "num_warps", "evict"))
def _step_pallas(xbc, dt, conv_w, conv_b, A, D, dt_bias, conv_states, ssm_states, slot_ids, *,
                 n_groups, head_dim, dt_limit, candidates, impl, block_p, num_warps, evict):
    b, q, c = xbc.shape
    h, p, n = ssm_states.shape[1:]
    k = conv_w.shape[1]
    if p % block_p:
        raise ValueError(f"{block_p=} must divide {p=}")
    f32 = jnp.float32
    kernel = functools.partial(_step_body, q=q, k=k, hpg=h // n_groups, bp=block_p,
                               dt_limit=dt_limit, evict=evict)
    lead = (q, b) if candidates else (b,)
    out_shape = [
        jax.ShapeDtypeStruct((b, q, h, p), xbc.dtype),
        jax.ShapeDtypeStruct((*lead, k - 1, c), conv_states.dtype),
        jax.ShapeDtypeStruct((q, b, h, p, n) if candidates else ssm_states.shape, ssm_states.dtype),
    ]
    y, conv, ssm = launch(
        kernel, impl=impl, grid=(p // block_p, h, b), out_shape=out_shape,
        aliases=None if candidates else {9: 2}, num_warps=num_warps, name="mamba2_step",
    )(slot_ids, dt, A.astype(f32), D.astype(f32), dt_bias.astype(f32), conv_w.astype(f32).T,
      conv_b.astype(f32), xbc, conv_states, ssm_states)
    if candidates:
        return y, conv, ssm
    # The new conv rows reach the slots through one scatter (see the module doc).
    return y, conv_states.at[slot_ids].set(conv), ssm
