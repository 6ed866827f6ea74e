"""Pallas pipeline for the gated delta rule over a ragged prefill batch.

Contract: `gated_delta.gated_delta_ragged`; the math (WY / UT-transform chunk form) is
derived in `gated_delta_chunked.py`. Three launches over a chunk table built in XLA
(chunks of l tokens never straddle sequences), as the SSD pipeline (`ssd_kernel.py`):

1. WY transform, grid (hv, c): G = cumsum(g) over the chunk (stored for steps 2 and 3),
   A = beta_i e^{G_i - G_j} (k_i . k_j) [j < i], T = (I + A)^-1 in f32 (forward
   substitution on the 16 x 16 diagonal blocks, 16 x 16 dots for the rest, as
   flash-linear-attention's solve_tril), W = T (beta e^G K) and U~ = T (beta V), stored
   in the dot dtype. No state: every chunk in parallel.
2. State pass, grid (dv / bv, hv, b): a sequential loop over the chunks of one sequence
   from the slot's state (or zero): stores the state entering each chunk, turns U~ into
   the true writes U = U~ - W S in place, and S <- e^{G_l} S + (e^{G_l - G} K)^T U; the
   final state goes to the slot (the state buffer is aliased in place).
3. Chunk output, grid (dv / bvo, hv, c): O = scale (e^G Q S_enter + (Q K^T * e^{G_i - G_j}
   [j <= i]) U), stored to the chunk's rows; padding chunks store 0.

Chunks are read through l-token windows clamped inside [0, t); rows outside the chunk
are masked to g = beta = 0, k = v = q = 0, which leaves the state and the other rows
alone. Dots take the input dtype (bf16 on tensor cores; f32 at HIGHEST), with T, the
entering states and U cast to it as flash-linear-attention's Triton kernels do.

This module knows nothing of argument checking (`gated_delta.py` does it) or models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.launch import channel_block, dot, launch
from pallas_kernels.ragged import chunk_table, pad_tokens

# Launch sweep on an H200, 2026-12-06 (docs/kernels.md, "Gated DeltaNet"): two warps for the WY
# step took the pipeline from 1.46 to 1.18 ms at 4 x 4096 tokens; the other knobs were best as here.
PASS_BLOCK_V = 32  # state columns per program in step 2
OUT_BLOCK_V = 128  # output columns per program in step 3 (Q K^T is recomputed per block)
WARPS = (2, 4, 4)  # num_warps of steps 1, 2, 3
PASS_STAGES = None  # Triton software-pipelining depth of step 2's chunk loop (None: default)
SUB = 16  # rows of the blocks of step 1's triangular inverse (the smallest dot tile)


def gated_delta_prefill_pallas(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                               scale: float, chunk_size: int, impl, pass_block_v=PASS_BLOCK_V,
                               out_block_v=OUT_BLOCK_V, warps=WARPS, pass_stages=PASS_STAGES,
                               stages=3):
    """Checked arguments in; (o [t, hv, dv] in v.dtype, states) out. Pads to >= l tokens.

    Benchmarks time a prefix of the pipeline with `stages` < 3 (the outputs of that step).
    """
    t, dv = v.shape[0], v.shape[2]
    run = _prefill_jit(
        q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
        cu_seqlens.astype(jnp.int32), states, slot_ids.astype(jnp.int32),
        has_initial.astype(jnp.int32), scale=scale, l=chunk_size, impl=impl,
        bv=channel_block(dv, pass_block_v), bvo=channel_block(dv, out_block_v),
        warps=tuple(warps), pass_stages=pass_stages, stages=stages)
    if stages < 3:
        return run
    o, states = run
    return o[:t], states


@functools.partial(jax.jit, static_argnames=(
    "scale", "l", "impl", "bv", "bvo", "warps", "pass_stages", "stages"))
def _prefill_jit(q, k, v, g, beta, cu, states, slot_ids, has_initial, *, scale, l, impl, bv,
                 bvo, warps, pass_stages, stages):
    q, k, v, g, beta = pad_tokens(l, q, k, v, g, beta)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    b = cu.shape[0] - 1
    f32 = jnp.float32
    tab = chunk_table(cu, t, l)
    nc = tab.seq.shape[0]
    table = jnp.stack([tab.seq, tab.start, tab.end, tab.window])  # [4, c] int32
    dd = f32 if v.dtype == f32 else v.dtype  # the dots' operand dtype
    geo = dict(l=l, rep=hv // hk, b=b, dd=dd)

    w, u, cum = launch(
        functools.partial(_wy_kernel, **geo), impl=impl, grid=(hv, nc),
        out_shape=[jax.ShapeDtypeStruct((nc, hv, l, dk), dd),
                   jax.ShapeDtypeStruct((nc, hv, l, dv), dd),
                   jax.ShapeDtypeStruct((hv, nc, l), f32)],
        num_warps=warps[0], name="gated_delta_wy",
    )(table, g, beta, k, v)
    if stages == 1:
        return w, u, cum
    enter, u, states = launch(
        functools.partial(_state_pass_kernel, bv=bv, **geo), impl=impl, grid=(dv // bv, hv, b),
        out_shape=[jax.ShapeDtypeStruct((nc, hv, dk, dv), dd),
                   jax.ShapeDtypeStruct(u.shape, u.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={6: 1, 7: 2}, num_warps=warps[1], num_stages=pass_stages,
        name="gated_delta_state_pass",
    )(table, tab.first, slot_ids, has_initial, cum, k, u, states, w)
    if stages == 2:
        return enter, u, states

    (o,) = launch(
        functools.partial(_chunk_out_kernel, bv=bvo, scale=scale, **geo), impl=impl,
        grid=(dv // bvo, hv, nc), out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
        num_warps=warps[2], name="gated_delta_chunk_out",
    )(table, cum, q, k, enter, u)
    return o, states


def _window(table_ref, c, l):
    """The chunk's l-row window: (first row, which rows belong to the chunk [l])."""
    start, end, win = table_ref[1, c], table_ref[2, c], table_ref[3, c]
    rows = win + jax.lax.broadcasted_iota(jnp.int32, (l,), 0)
    return win, (rows >= start) & (rows < end)


def _masked(ref, win, l, valid, *idx):
    """Rows [win, win + l) of ref[:, *idx], zero outside the chunk."""
    x = ref[(pl.ds(win, l), *idx)]
    mask = valid if x.ndim == 1 else valid[:, None]
    return jnp.where(mask, x, jnp.zeros_like(x))


def _decay(cum, mask):
    """e^{G_i - G_j} where mask [l, l], else 0 (never exp of a positive exponent)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, cum[:, None] - cum[None, :], -jnp.inf)), 0.0)


def _unit_lower_inverse(a, n):
    """(I + a)^-1 for strictly lower triangular a [n, n] f32, by forward substitution:
    row i of T is e_i - a_i T (rows < i already final, a_ik = 0 for k >= i)."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def body(i, tm):  # picking a row with a masked sum: values cannot be sliced
        a_i = jnp.sum(jnp.where(ri == i, a, 0.0), axis=0)  # [n] over k
        r = jnp.sum(a_i[:, None] * tm, axis=0)
        return tm - jnp.where(ri == i, r[None, :], 0.0)

    return jax.lax.fori_loop(1, n, body, jnp.where(ri == ci, 1.0, 0.0).astype(jnp.float32))


def _wy_kernel(table_ref, g_ref, beta_ref, k_ref, v_ref, w_ref, u_ref, cum_ref, *, l, rep, b,
               dd):
    """The chunk in SUB-row blocks I (values cannot be sliced, so each block is loaded from
    its ref): the diagonal blocks of T = (I + A)^-1 by forward substitution on [SUB, SUB]
    tiles, the others by the block recurrence T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ."""
    hd, c = pl.program_id(0), pl.program_id(1)
    f32, nb = jnp.float32, l // SUB

    @pl.when(table_ref[0, c] < b)  # real chunks only
    def _():
        win, valid = _window(table_ref, c, l)
        start, end = table_ref[1, c], table_ref[2, c]
        blocks, total = [], jnp.float32(0.0)
        for i in range(nb):
            w0 = win + i * SUB
            rows = w0 + jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
            ok = (rows >= start) & (rows < end)
            g = _masked(g_ref, w0, SUB, ok, hd)
            cum = total + jnp.cumsum(g)
            total = total + jnp.sum(g)
            bt = _masked(beta_ref, w0, SUB, ok, hd)
            kk = _masked(k_ref, w0, SUB, ok, hd // rep, slice(None)).astype(dd)  # [SUB, dk]
            blocks.append((w0, ok, cum, bt, kk))
            cum_ref[hd, c, pl.ds(i * SUB, SUB)] = cum
        ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
        ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

        def a_block(i, j):  # A_IJ = beta_i e^{G_i - G_j} (k_i . k_j), strictly lower on I = J
            (_, _, cum_i, bt_i, k_i), (_, _, cum_j, _, k_j) = blocks[i], blocks[j]
            if i == j:
                dec = _decay(cum_i, ri > ci)
            else:  # rows of block I follow those of J: G_i - G_j <= 0 everywhere
                dec = jnp.exp(cum_i[:, None] - cum_j[None, :])
            return bt_i[:, None] * dec * dot(k_i, k_j, trans_b=True)

        a = {(i, j): a_block(i, j) for i in range(nb) for j in range(i + 1)}
        t = {(i, i): _unit_lower_inverse(a[i, i], SUB) for i in range(nb)}
        for d in range(1, nb):  # block sub-diagonals, nearest first
            for i in range(d, nb):
                j = i - d
                acc = sum(dot(a[i, m], t[m, j]) for m in range(j, i))
                t[i, j] = -dot(t[i, i], acc)
        # The right-hand sides per block: beta e^G K (kept) and beta V (loaded when used).
        xk = [(blk[4].astype(f32) * (blk[3] * jnp.exp(blk[2]))[:, None]).astype(dd)
              for blk in blocks]
        for i in range(nb):
            w = sum(dot(t[i, j].astype(dd), xk[j]) for j in range(i + 1))
            w_ref[c, hd, pl.ds(i * SUB, SUB), :] = w.astype(w_ref.dtype)
        for i in range(nb):
            u = 0.0
            for j in range(i + 1):
                w0, ok, _, bt, _ = blocks[j]
                vv = _masked(v_ref, w0, SUB, ok, hd, slice(None)).astype(f32) * bt[:, None]
                u = u + dot(t[i, j].astype(dd), vv.astype(dd))
            u_ref[c, hd, pl.ds(i * SUB, SUB), :] = u.astype(u_ref.dtype)


def _state_pass_kernel(table_ref, first_ref, slot_ref, init_ref, cum_ref, k_ref, u_ref, st_ref,
                       w_ref, enter_ref, u_out, st_out, *, l, rep, b, dd, bv):
    """S <- decay(G_l) S + (e^{G_l - G} K)^T (U~ - W S) over a sequence's chunks; the entering
    states stored, the final one to the slot. cum_ref [h, C, l] (a decay per head) or
    [h, C, l, dk] (per key channel: KDA shares this kernel)."""
    vb, hd, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    del b
    cols = pl.ds(vb * bv, bv)
    slot = slot_ref[s]
    f32 = jnp.float32
    start = jnp.where(init_ref[s] != 0, st_ref[slot, hd, :, cols].astype(f32), 0.0)  # [dk, bv]

    def body(c, state):
        enter_ref[c, hd, :, cols] = state.astype(enter_ref.dtype)
        # U = U~ - W S: read and written by this program only, so in place is safe.
        un = u_ref[c, hd, :, cols].astype(f32) - dot(w_ref[c, hd, :, :], state.astype(dd))
        u_out[c, hd, :, cols] = un.astype(u_out.dtype)
        win, valid = _window(table_ref, c, l)
        kd = _masked(k_ref, win, l, valid, hd // rep, slice(None)).astype(f32)
        if len(cum_ref.shape) == 3:  # a decay per head: G [l], G_l a scalar
            cum = cum_ref[hd, c, :]
            last = cum_ref[hd, c, l - 1]
            kd = kd * jnp.exp(last - cum)[:, None]
            return jnp.exp(last) * state + dot(kd.astype(dd), un.astype(dd), trans_a=True)
        # a decay per key channel (KDA, pallas_kernels/kda_prefill.py): G [l, dk], G_l [dk]
        # (masked rows past the end keep G_l)
        cum = cum_ref[hd, c, :, :]
        last = cum_ref[hd, c, l - 1, :]
        kd = kd * jnp.exp(last[None, :] - cum)
        return jnp.exp(last)[:, None] * state + dot(kd.astype(dd), un.astype(dd), trans_a=True)

    final = jax.lax.fori_loop(first_ref[s], first_ref[s + 1], body, start)
    st_out[slot, hd, :, cols] = final.astype(st_out.dtype)


def _chunk_out_kernel(table_ref, cum_ref, q_ref, k_ref, enter_ref, u_ref, o_ref, *, l, rep, b,
                      dd, bv, scale):
    vb, hd, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = table_ref[0, c]
    cols = pl.ds(vb * bv, bv)
    win, valid = _window(table_ref, c, l)
    out = o_ref.at[pl.ds(win, l), hd, cols]
    mask = jnp.broadcast_to(valid[:, None], (l, bv))

    @pl.when(seq == b)  # padding tail: o = 0
    def _():
        plgpu.store(out, jnp.zeros((l, bv), o_ref.dtype), mask=mask)

    @pl.when(seq < b)
    def _():
        qq = _masked(q_ref, win, l, valid, hd // rep, slice(None)).astype(dd)  # [l, dk]
        kk = _masked(k_ref, win, l, valid, hd // rep, slice(None)).astype(dd)
        cum = cum_ref[hd, c, :]
        ri = jax.lax.broadcasted_iota(jnp.int32, (l, l), 0)
        ci = jax.lax.broadcasted_iota(jnp.int32, (l, l), 1)
        o = dot(qq, enter_ref[c, hd, :, cols]) * jnp.exp(cum)[:, None]
        p = dot(qq, kk, trans_b=True) * _decay(cum, ri >= ci)
        o = o + dot(p.astype(dd), u_ref[c, hd, :, cols])
        plgpu.store(out, (scale * o).astype(o_ref.dtype), mask=mask)
