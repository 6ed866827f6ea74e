"""Pallas pipeline for the ragged SSD scan (contract: `ssd.ssd_ragged`).

Three launches over a chunk table built in XLA (chunks never straddle sequences):

1. chunk state, grid (h, c), bm rows per loop step: cum = cumsum(dt A) over the
   chunk (stored for steps 2 and 3) and the chunk's state from zero,
   S_c = x^T (exp(cum_last - cum) dt B)   [p, n].
2. state passing, grid (h, p blocks, b): a sequential loop over the chunks of
   one sequence, S <- exp(cum_last) S + S_c, starting from the slot (or zero);
   stores the state entering each chunk (in the dot dtype) and writes the final
   one to the slot (the state buffer is aliased in place).
3. chunk output, grid (h / hb, l / bm, c): for bm rows and hb heads of one group,
   y = exp(cum) C S_enter^T + sum_{k <= m} (C B_k^T * exp(cum_m - cum_k) dt_k) x_k
   + D x, gated; C B_k^T is computed once for the hb heads; padding rows get 0.

Chunks are read through l-token windows clamped inside [0, t) (rows outside
the chunk are masked to dt = 0, x = 0), so no load ever leaves a buffer. Dots
take the input dtype (bf16 on tensor cores; f32 at HIGHEST); the weighted
C B^T and S_enter are cast to the input dtype like the published Triton kernels.

This module knows nothing of argument checking (`ssd.py` does it) or models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.launch import dot, launch
from pallas_kernels.ragged import chunk_table, pad_tokens
from pallas_kernels.ssm_common import effective_dt, silu

# Tuned on H100 (docs/history/benchmarks-2026.md).
BLOCK_M = 64  # rows of a chunk per program in step 3 (and per loop step in step 1)
HEAD_BLOCK = 2  # heads per program in step 3, sharing one C B^T per block
PASS_BLOCK_P = 16  # state rows per program in step 2
WARPS = (4, 4, 4)  # num_warps of steps 1, 2, 3


def ssd_pallas(
    x, dt, A, B, C, D, dt_bias, cu_seqlens, states, slot_ids, has_initial, *,
    z, dt_limit, chunk_size, impl, block_m=BLOCK_M, head_block=HEAD_BLOCK,
    pass_block_p=PASS_BLOCK_P, warps=WARPS, stages=3, active=None,
):
    """Checked arguments in; (y, states) out. Pads to >= chunk_size tokens.

    Benchmarks time a prefix of the pipeline with `stages` < 3 (outputs of that step).
    """
    t, h, g = x.shape[0], x.shape[1], B.shape[1]
    hb = max(v for v in (1, 2, 4, 8) if v <= head_block and (h // g) % v == 0)
    lo, hi = dt_limit
    run = _ssd_jit(
        x, dt, A, B, C, D, dt_bias, cu_seqlens.astype(jnp.int32), states,
        slot_ids.astype(jnp.int32), has_initial.astype(jnp.int32), z,
        None if active is None else active.astype(jnp.int32),
        dt_limit=(float(lo), float(hi)), l=chunk_size, impl=impl,
        bm=min(block_m, chunk_size), hb=hb, bp=min(pass_block_p, x.shape[2]),
        warps=tuple(warps), stages=stages,
    )
    if stages < 3:
        return run
    y, states = run
    return y[:t], states


@functools.partial(
    jax.jit, static_argnames=("dt_limit", "l", "impl", "bm", "hb", "bp", "warps", "stages")
)
def _ssd_jit(x, dt, A, B, C, D, dt_bias, cu, states, slot_ids, has_initial, z, active, *,
             dt_limit, l, impl, bm, hb, bp, warps, stages):
    x, dt, B, C, z = pad_tokens(l, x, dt, B, C, z)
    t, h, p = x.shape
    g, n = B.shape[1:]
    b = cu.shape[0] - 1
    f32 = jnp.float32
    tab = chunk_table(cu, t, l)
    nc = tab.seq.shape[0]
    # Sequences with no chunk to run: padding rows (no tokens) and skipped ones (`active`).
    # Their chunks become unused rows (steps 1 and 3 skip them), the state pass leaves
    # their slots alone.
    runs = tab.first[1:b + 1] > tab.first[:b]
    seq = tab.seq
    if active is not None:
        runs = runs & (active != 0)
        seq = jnp.where((seq < b) & (active[jnp.minimum(seq, b - 1)] == 0), b + 1, seq)
    table = jnp.stack([seq, tab.start, tab.end, tab.window])  # [4, c] int32
    # [t, h] as the projection has it: a transposed copy here let XLA lay the whole
    # in_proj output out column-major, and every other consumer then transposed it.
    dte = effective_dt(dt, dt_bias, dt_limit)
    a32, d32 = A.astype(f32), D.astype(f32)
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    geo = dict(l=l, bm=bm, hpg=h // g, b=b, dot_dtype=dot_dtype)

    s_chunk, cum = launch(
        functools.partial(_chunk_state_kernel, **geo), impl=impl, grid=(h, nc),
        out_shape=[jax.ShapeDtypeStruct((nc, h, p, n), f32), jax.ShapeDtypeStruct((h, nc, l), f32)],
        num_warps=warps[0], name="ssd_chunk_state",
    )(table, dte, a32, x, B)
    if stages == 1:
        return s_chunk, cum

    # The entering states only feed step 3's dot: store them in its operand dtype.
    enter, states = launch(
        functools.partial(_state_pass_kernel, l=l, bp=bp), impl=impl, grid=(h, p // bp, b),
        out_shape=[jax.ShapeDtypeStruct((nc, h, p, n), dot_dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        aliases={5: 1}, num_warps=warps[1], name="ssd_state_pass",
    )(tab.first, slot_ids, has_initial.astype(jnp.int32) + 2 * runs.astype(jnp.int32), cum, s_chunk,
      states)
    if stages == 2:
        return enter, states

    args = [table, dte, cum, d32, x, B, C, enter] + ([] if z is None else [z])
    (y,) = launch(
        functools.partial(_chunk_out_kernel, hb=hb, gated=z is not None, **geo), impl=impl,
        grid=(h // hb, l // bm, nc), out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
        num_warps=warps[2], name="ssd_chunk_out",
    )(*args)
    return y, states


def _rows(table_ref, c, size: int, offset):
    """Global rows [window + offset, + size) of chunk c and which are in the chunk."""
    start, end, win = table_ref[1, c], table_ref[2, c], table_ref[3, c]
    rows = win + offset + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    return rows, (rows >= start) & (rows < end)


def _first_block(table_ref, c, bm):
    """The first bm-row block of chunk c's window that holds a row of the chunk."""
    return jnp.maximum(table_ref[1, c] - table_ref[3, c], 0) // bm


def _chunk_state_kernel(table_ref, dt_ref, a_ref, x_ref, b_ref, sc_ref, cum_ref, *,
                        l, bm, hpg, b, dot_dtype):
    hh, c = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32

    @pl.when(table_ref[0, c] < b)  # real chunks only; padding and unused rows skip
    def _():
        win, a = table_ref[3, c], a_ref[hh]
        _, valid = _rows(table_ref, c, l, 0)
        total = jnp.sum(jnp.where(valid, dt_ref[pl.ds(win, l), hh], 0.0) * a)

        def body(kb, carry):  # bm rows at a time, so loads pipeline with the dots
            acc, run = carry
            _, vk = _rows(table_ref, c, bm, kb * bm)
            rows = pl.ds(win + kb * bm, bm)
            dt = jnp.where(vk, dt_ref[rows, hh], 0.0)
            cum = run + jnp.cumsum(dt * a)
            cum_ref[hh, c, pl.ds(kb * bm, bm)] = cum
            x = jnp.where(vk[:, None], x_ref[rows, hh, :], 0).astype(dot_dtype)
            bw = b_ref[rows, hh // hpg, :].astype(f32) * (dt * jnp.exp(total - cum))[:, None]
            return acc + dot(x, bw.astype(dot_dtype), trans_a=True), run + jnp.sum(dt * a)

        zero = jnp.zeros(sc_ref.shape[2:], f32)
        acc, _ = jax.lax.fori_loop(_first_block(table_ref, c, bm), l // bm, body,
                                   (zero, jnp.float32(0.0)))
        sc_ref[c, hh, :, :] = acc  # [p, n]


def _state_pass_kernel(first_ref, slot_ref, init_ref, cum_ref, sc_ref, st_ref, enter_ref,
                       st_out, *, l, bp):
    """init_ref[s]: bit 0 has_initial, bit 1 the sequence runs (has chunks, is active);
    a sequence that does not run leaves its slot untouched (padding rows share slot 0)."""
    hh, pb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pb * bp, bp)
    slot = slot_ref[s]
    flags = init_ref[s]

    @pl.when(flags >= 2)
    def _():
        start = jnp.where(flags % 2 != 0, st_ref[slot, hh, rows, :].astype(jnp.float32), 0.0)

        def body(c, state):
            chunk = sc_ref[c, hh, rows, :]
            enter_ref[c, hh, rows, :] = state.astype(enter_ref.dtype)
            return jnp.exp(cum_ref[hh, c, l - 1]) * state + chunk

        final = jax.lax.fori_loop(first_ref[s], first_ref[s + 1], body, start)
        st_out[slot, hh, rows, :] = final.astype(st_out.dtype)


def _chunk_out_kernel(*refs, l, bm, hb, hpg, b, dot_dtype, gated):
    table_ref, dt_ref, cum_ref, d_ref, x_ref, b_ref, c_ref, enter_ref = refs[:8]
    z_ref = refs[8] if gated else None
    y_ref = refs[-1]
    hblk, mb, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = [hblk * hb + i for i in range(hb)]
    seq, start, end, win = table_ref[0, c], table_ref[1, c], table_ref[2, c], table_ref[3, c]
    m0 = win + mb * bm
    rows_m, valid_m = _rows(table_ref, c, bm, mb * bm)
    live = (m0 < end) & (m0 + bm > start)
    p = y_ref.shape[2]
    mask = jnp.broadcast_to(valid_m[:, None], (bm, p))
    out = lambda hh: y_ref.at[pl.ds(m0, bm), hh, :]

    @pl.when(live & (seq == b))  # padding tail: y = 0
    def _():
        for hh in heads:
            plgpu.store(out(hh), jnp.zeros((bm, p), y_ref.dtype), mask=mask)

    @pl.when(live & (seq < b))
    def _():
        ys = _chunk_rows(table_ref, dt_ref, cum_ref, x_ref, b_ref, c_ref, enter_ref, heads, mb,
                         c, rows_m, l=l, bm=bm, hpg=hpg, dot_dtype=dot_dtype)
        for hh, y in zip(heads, ys, strict=True):
            y = y + d_ref[hh] * x_ref[pl.ds(m0, bm), hh, :].astype(jnp.float32)
            if gated:
                y = y * silu(z_ref[pl.ds(m0, bm), hh, :].astype(jnp.float32))
            plgpu.store(out(hh), y.astype(y_ref.dtype), mask=mask)


def _chunk_rows(table_ref, dt_ref, cum_ref, x_ref, b_ref, c_ref, enter_ref, heads, mb, c,
                rows_m, *, l, bm, hpg, dot_dtype):
    """C . S for rows m of chunk c and each head (one group): the inter-chunk part plus
    the causal intra-chunk sum, with C B^T computed once for all the heads."""
    g = heads[0] // hpg
    win = table_ref[3, c]
    cm = c_ref[pl.ds(win + mb * bm, bm), g, :].astype(dot_dtype)  # [bm, n]
    cum_m = [cum_ref[hh, c, pl.ds(mb * bm, bm)] for hh in heads]
    ys = tuple(
        dot(cm, enter_ref[c, hh, :, :].astype(dot_dtype), trans_b=True) * jnp.exp(cm_)[:, None]
        for hh, cm_ in zip(heads, cum_m, strict=True)
    )  # [bm, p] each

    def body(kb, accs):
        rows_k, valid_k = _rows(table_ref, c, bm, kb * bm)
        rows = pl.ds(win + kb * bm, bm)
        cb = dot(cm, b_ref[rows, g, :].astype(dot_dtype), trans_b=True)  # [bm, bm]
        causal = rows_m[:, None] >= rows_k[None, :]
        new = []
        for hh, cum_mh, acc in zip(heads, cum_m, accs, strict=True):
            dt_k = jnp.where(valid_k, dt_ref[rows, hh], 0.0)
            cum_k = cum_ref[hh, c, pl.ds(kb * bm, bm)]
            x_k = jnp.where(valid_k[:, None], x_ref[rows, hh, :], 0).astype(dot_dtype)
            decay = jnp.exp(jnp.where(causal, cum_mh[:, None] - cum_k[None, :], -jnp.inf))
            new.append(acc + dot((cb * decay * dt_k[None, :]).astype(dot_dtype), x_k))
        return tuple(new)

    return jax.lax.fori_loop(_first_block(table_ref, c, bm), mb + 1, body, ys)
