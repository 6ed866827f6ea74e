"""Pallas pipeline for Kimi Delta Attention (the gated delta rule with a per-channel decay)
over a ragged prefill batch.

Contract: `gated_delta.gated_delta_ragged` with g [t, hv, dk]; the math (the chunk form with
per-channel decays inside the pair products, and why they are taken in sub-chunks) is
derived in `kda_chunked.py`. The launches and the chunk table are those of Gated DeltaNet's
pipeline (`gated_delta_prefill.py`), with G = cumsum(g) a [l, dk] tile per chunk and head:

1. WY transform, grid (hv, c): G (stored, f32 [hv, c, l, dk], for steps 2 and 3), then
   A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc} (j < i) in SUB-row blocks I, J:
   J < I through the row r - 1 just before block I (R = G_{r-1}): one dot of
   (K_I e^{G_I - R}) and (K_J e^{R - G_J}), both exponents <= 0; J = I per pair (a loop
   over the block's rows j, [SUB, dk] elementwise, the exponent masked to -inf above the
   diagonal before exp). T = (I + A)^-1 as gated_delta_prefill (forward substitution on
   the diagonal blocks, the block recurrence below), W = T (beta e^G K), U~ = T (beta V).
2. State pass, grid (dv / bv, hv, b): per chunk, the entering state is stored, U = U~ - W S
   in place, S <- diag(e^{G_l}) S + (e^{G_l - G} K)^T U (G_l - G <= 0); the final state goes
   to the slot (aliased in place). The kernel is gated_delta_prefill's `_state_pass_kernel`,
   which takes a per-channel G as well as a per-head one.
3. Chunk output, grid (dv / bvo, hv, c): per SUB-row block I,
   O_I = scale ((e^{G_I} Q_I) S_enter + sum_{J <= I} P_IJ U_J) with P_IJ the decayed q.k
   products (j <= i), taken as A's.
Every exponent handed to exp is <= 0 (or -inf), so strong decays (g of -30 per token)
underflow to 0 where the true factor is below f32's range, and nothing overflows.

Chunk windows, masking (g = beta = k = v = q = 0 outside the chunk) and the dot dtype policy
(the input dtype, f32 accumulation; f32 inputs at HIGHEST) are gated_delta_prefill's.
This module knows nothing of argument checking (`gated_delta.py` does it) or models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_prefill import _masked, _state_pass_kernel, _unit_lower_inverse, _window
from pallas_kernels.launch import channel_block, dot, launch
from pallas_kernels.ragged import chunk_table, pad_tokens

# Not compiled or tuned on a GPU yet (docs/kernels.md, "Kimi Delta Attention").
PASS_BLOCK_V = 32  # state columns per program in step 2
OUT_BLOCK_V = 64  # output columns per program in step 3 (the P blocks are recomputed per block)
WARPS = (4, 4, 4)  # num_warps of steps 1, 2, 3
SUB = 16  # rows of a sub-chunk (the smallest dot tile; pairs inside one are taken per pair)


def kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                       scale: float, chunk_size: int, impl, pass_block_v=PASS_BLOCK_V,
                       out_block_v=OUT_BLOCK_V, warps=WARPS):
    """Checked arguments in (g [t, hv, dk]); (o [t, hv, dv] in v.dtype, states) out."""
    t, dv = v.shape[0], v.shape[2]
    o, states = _prefill_jit(
        q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
        cu_seqlens.astype(jnp.int32), states, slot_ids.astype(jnp.int32),
        has_initial.astype(jnp.int32), scale=scale, l=chunk_size, impl=impl,
        bv=channel_block(dv, pass_block_v), bvo=channel_block(dv, out_block_v),
        warps=tuple(warps))
    return o[:t], states


@functools.partial(jax.jit, static_argnames=("scale", "l", "impl", "bv", "bvo", "warps"))
def _prefill_jit(q, k, v, g, beta, cu, states, slot_ids, has_initial, *, scale, l, impl, bv,
                 bvo, warps):
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
                   jax.ShapeDtypeStruct((hv, nc, l, dk), f32)],
        num_warps=warps[0], name="kda_wy",
    )(table, g, beta, k, v)
    enter, u, states = launch(
        functools.partial(_state_pass_kernel, bv=bv, **geo), impl=impl, grid=(dv // bv, hv, b),
        out_shape=[jax.ShapeDtypeStruct((nc, hv, dk, dv), dd),
                   jax.ShapeDtypeStruct(u.shape, u.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={6: 1, 7: 2}, num_warps=warps[1], name="kda_state_pass",
    )(table, tab.first, slot_ids, has_initial, cum, k, u, states, w)
    (o,) = launch(
        functools.partial(_chunk_out_kernel, bv=bvo, scale=scale, **geo), impl=impl,
        grid=(dv // bvo, hv, nc), out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
        num_warps=warps[2], name="kda_chunk_out",
    )(table, cum, q, k, enter, u)
    return o, states


def _diag_block(x, y, cum, *, strict):
    """M_ij = sum_c x_ic y_jc e^{G_ic - G_jc} for j < i (strict) or j <= i within one block;
    x, y, cum [SUB, dk] f32. Row j of y and G is picked by a masked sum (values cannot be
    sliced); the exponent is masked to -inf where j is not below i before exp."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    def body(j, m):
        y_j = jnp.sum(jnp.where(ri == j, y, 0.0), axis=0)  # [dk]
        g_j = jnp.sum(jnp.where(ri == j, cum, 0.0), axis=0)
        below = ri > j if strict else ri >= j  # [SUB, 1]
        e = jnp.exp(jnp.where(below, cum - g_j[None, :], -jnp.inf))
        col = jnp.sum(x * y_j[None, :] * e, axis=1)  # [SUB] over i
        return m + jnp.where(ci == j, col[:, None], 0.0)

    return jax.lax.fori_loop(0, SUB, body, jnp.zeros((SUB, SUB), jnp.float32))


def _cross_block(x_i, cum_i, y_j, cum_j, ref, dd):
    """M_ij = sum_c x_ic y_jc e^{G_ic - G_jc} for a block J before block I, through the
    cumulative decay `ref` [dk] of the row just before I: e^{G_i - R} e^{R - G_j}, both <= 1."""
    xd = (x_i * jnp.exp(cum_i - ref[None, :])).astype(dd)
    yd = (y_j * jnp.exp(ref[None, :] - cum_j)).astype(dd)
    return dot(xd, yd, trans_b=True)


def _wy_kernel(table_ref, g_ref, beta_ref, k_ref, v_ref, w_ref, u_ref, cum_ref, *, l, rep, b,
               dd):
    hd, c = pl.program_id(0), pl.program_id(1)
    f32, nb = jnp.float32, l // SUB

    @pl.when(table_ref[0, c] < b)  # real chunks only
    def _():
        win, _ = _window(table_ref, c, l)
        start, end = table_ref[1, c], table_ref[2, c]
        blocks, total = [], jnp.zeros((g_ref.shape[-1],), f32)
        for i in range(nb):
            w0 = win + i * SUB
            rows = w0 + jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
            ok = (rows >= start) & (rows < end)
            g = _masked(g_ref, w0, SUB, ok, hd, slice(None))  # [SUB, dk]
            ref = total  # G of the row before this block (0 before the window)
            cum = ref[None, :] + jnp.cumsum(g, axis=0)
            total = total + jnp.sum(g, axis=0)
            bt = _masked(beta_ref, w0, SUB, ok, hd)
            kk = _masked(k_ref, w0, SUB, ok, hd // rep, slice(None)).astype(f32)  # [SUB, dk]
            blocks.append((w0, ok, cum, bt, kk, ref))
            cum_ref[hd, c, pl.ds(i * SUB, SUB), :] = cum

        def a_block(i, j):  # A_IJ = beta_i k_i^T diag(e^{G_i - G_j}) k_j, j < i
            (_, _, cum_i, bt_i, k_i, ref), (_, _, cum_j, _, k_j, _) = blocks[i], blocks[j]
            if i == j:
                m = _diag_block(k_i, k_i, cum_i, strict=True)
            else:
                m = _cross_block(k_i, cum_i, k_j, cum_j, ref, dd)
            return bt_i[:, None] * m

        a = {(i, j): a_block(i, j) for i in range(nb) for j in range(i + 1)}
        t = {(i, i): _unit_lower_inverse(a[i, i], SUB) for i in range(nb)}
        for d in range(1, nb):  # block sub-diagonals, nearest first
            for i in range(d, nb):
                j = i - d
                acc = sum(dot(a[i, m], t[m, j]) for m in range(j, i))
                t[i, j] = -dot(t[i, i], acc)
        # beta e^G K: every exponent G <= 0 (it may underflow to 0, never overflow).
        xk = [(blk[4] * blk[3][:, None] * jnp.exp(blk[2])).astype(dd) for blk in blocks]
        for i in range(nb):
            w = sum(dot(t[i, j].astype(dd), xk[j]) for j in range(i + 1))
            w_ref[c, hd, pl.ds(i * SUB, SUB), :] = w.astype(w_ref.dtype)
        for i in range(nb):
            u = 0.0
            for j in range(i + 1):
                w0, ok, _, bt, _, _ = blocks[j]
                vv = _masked(v_ref, w0, SUB, ok, hd, slice(None)).astype(f32) * bt[:, None]
                u = u + dot(t[i, j].astype(dd), vv.astype(dd))
            u_ref[c, hd, pl.ds(i * SUB, SUB), :] = u.astype(u_ref.dtype)


def _chunk_out_kernel(table_ref, cum_ref, q_ref, k_ref, enter_ref, u_ref, o_ref, *, l, rep, b,
                      dd, bv, scale):
    vb, hd, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = table_ref[0, c]
    cols = pl.ds(vb * bv, bv)
    win, _ = _window(table_ref, c, l)
    start, end = table_ref[1, c], table_ref[2, c]
    f32, nb = jnp.float32, l // SUB

    def rows_of(i):
        w0 = win + i * SUB
        rows = w0 + jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
        return w0, (rows >= start) & (rows < end)

    @pl.when(seq == b)  # padding tail: o = 0
    def _():
        for i in range(nb):
            w0, ok = rows_of(i)
            plgpu.store(o_ref.at[pl.ds(w0, SUB), hd, cols], jnp.zeros((SUB, bv), o_ref.dtype),
                        mask=jnp.broadcast_to(ok[:, None], (SUB, bv)))

    @pl.when(seq < b)
    def _():
        blocks = []
        for i in range(nb):
            w0, ok = rows_of(i)
            kk = _masked(k_ref, w0, SUB, ok, hd // rep, slice(None)).astype(f32)
            blocks.append((w0, ok, cum_ref[hd, c, pl.ds(i * SUB, SUB), :], kk))
        for i in range(nb):
            w0, ok, cum_i, k_i = blocks[i]
            q_i = _masked(q_ref, w0, SUB, ok, hd // rep, slice(None)).astype(f32)
            o = dot((q_i * jnp.exp(cum_i)).astype(dd), enter_ref[c, hd, :, cols])
            for j in range(i + 1):
                _, _, cum_j, k_j = blocks[j]
                if i == j:
                    p = _diag_block(q_i, k_i, cum_i, strict=False)
                else:
                    ref = cum_ref[hd, c, i * SUB - 1, :]  # G of the row before block I
                    p = _cross_block(q_i, cum_i, k_j, cum_j, ref, dd)
                o = o + dot(p.astype(dd), u_ref[c, hd, pl.ds(j * SUB, SUB), cols])
            plgpu.store(o_ref.at[pl.ds(w0, SUB), hd, cols], (scale * o).astype(o_ref.dtype),
                        mask=jnp.broadcast_to(ok[:, None], (SUB, bv)))
