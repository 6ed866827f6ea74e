"""Ragged (chunked) prefill attention kernel over paged K/V.

The packed query axis is cut into work items: blocks of up to `block_q`
consecutive query tokens of ONE sequence (a block never straddles sequences).
A program owns one item and one KV head; its rows are block_q tokens x G
group heads (token-major), so every K/V tile it loads serves the whole GQA
group. It visits only the key tiles inside the union of its rows' windows and
masks only the edge tiles (see `paged_tiles`).

The item table is built in XLA from `cu_q_lens`. Tokens past cu_q_lens[-1]
(bucket padding) form one extra pseudo-sequence whose items visit no key and
write zeros, so every output row is written by exactly one program. Within a
sequence the latest (heaviest) blocks come first, which shortens the tail.

This module knows the page layout and the ring table, not the serving engine:
argument checking lives in `paged_attention.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_tiles import attend_tiles, compute_dtype, finish, init_carry, tile_span


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def work_items(cu_q_lens: jax.Array, lengths: jax.Array, t: int, block_q: int):
    """Item table (seq, q0, nq, pos0), each int32 [m], m = cdiv(t, block_q) + b + 1.

    seq is -1 for the padding tail (zero-fill items) and for unused items
    (nq == 0). Item rows are packed tokens [q0, q0 + nq), at positions pos0 + j.
    """
    b = lengths.shape[0]
    m = pl.cdiv(t, block_q) + b + 1
    n = cu_q_lens[1:] - cu_q_lens[:-1]
    seg_start = jnp.append(cu_q_lens[:-1], cu_q_lens[b])
    seg_n = jnp.append(n, t - cu_q_lens[b])
    seg_pos0 = jnp.append(lengths - n, 0)
    seg_seq = jnp.append(jnp.arange(b, dtype=jnp.int32), -1)
    blocks = (seg_n + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    j = jnp.arange(m, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(ends, j, side="right"), b).astype(jnp.int32)
    used = j < ends[b]
    blk = ends[seg] - 1 - j  # counts down: the sequence's last block first
    q0 = seg_start[seg] + blk * block_q
    nq = jnp.where(used, jnp.clip(seg_n[seg] - blk * block_q, 0, block_q), 0)
    seq = jnp.where(used, seg_seq[seg], -1)
    pos0 = seg_pos0[seg] + blk * block_q
    as_i32 = lambda x: x.astype(jnp.int32)
    return as_i32(seq), as_i32(jnp.where(used, q0, 0)), as_i32(nq), as_i32(pos0)


def _prefill_kernel(
    seq_ref, q0_ref, nq_ref, pos0_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, *, cfg, block_q
):
    item = pl.program_id(0)
    seq, q0, nq, pos0 = seq_ref[item], q0_ref[item], nq_ref[item], pos0_ref[item]
    _, group, e = q_ref.shape
    rows = block_q * group
    tok_ok = lax.broadcasted_iota(jnp.int32, (block_q, group, e), 0) < nq
    q_blk = q_ref.at[pl.ds(q0, block_q)]
    q = plgpu.load(q_blk, mask=tok_ok, other=0).reshape(rows, e)
    pos_last = pos0 + jnp.maximum(nq, 1) - 1
    qpos = jnp.minimum(pos0 + lax.broadcasted_iota(jnp.int32, (rows,), 0) // group, pos_last)
    k_lo, k_hi, t_lo, t_hi, full_lo, full_hi = tile_span(pos0, pos_last, cfg)
    t_hi = jnp.where(seq >= 0, t_hi, t_lo)  # padding tail: no key, zeros out
    span = (k_lo, k_hi, full_lo, full_hi)
    carry = init_carry(rows, e)
    carry = attend_tiles(q, qpos, k_ref, v_ref, pt_ref, jnp.maximum(seq, 0), span, (t_lo, t_hi),
                         carry, cfg)
    out = finish(carry).reshape(block_q, group, e).astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(q0, block_q)], out, mask=tok_ok)


@functools.partial(
    jax.jit, static_argnames=("cfg", "block_q", "num_warps", "num_stages", "interpret")
)
def prefill_pallas(
    q, k_pages, v_pages, cu_q_lens, lengths, page_table, *,
    cfg, block_q, num_warps, num_stages, interpret,
):
    """Kernel launch. q [t, h, e]; pages [k, N, s, e]; returns [t, h, e] in q.dtype."""
    t, h, e = q.shape
    nk, n_pages, s, _ = k_pages.shape
    g = h // nk
    group = pl.next_power_of_2(g)  # tiles must have power-of-2 sizes
    qg = q.astype(compute_dtype(k_pages, q)).reshape(t, nk, g, e)
    if group != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group - g), (0, 0)))
    items = work_items(cu_q_lens, lengths, t, block_q)
    pt_flat = page_table.reshape(-1)
    rows_spec = pl.BlockSpec((t, None, group, e), lambda i, j: (0, j, 0, 0))
    pool_spec = pl.BlockSpec((None, n_pages, s, e), lambda i, j: (j, 0, 0, 0))
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, cfg=cfg, block_q=block_q),
        grid=(items[0].shape[0], nk),
        in_specs=[*(_whole(x.shape) for x in items), _whole(pt_flat.shape),
                  rows_spec, pool_spec, pool_spec],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct((t, nk, group, e), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill",
    )(*items, pt_flat, qg, k_pages, v_pages)
    return out[:, :, :g].reshape(t, h, e)
