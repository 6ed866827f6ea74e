"""Paged decode attention kernel: one query token per sequence, or n consecutive ones.

Grid (sequence, KV head, split). A program holds the G query heads of one GQA
group for each of the sequence's n query tokens (n = 1 for decode; n = k + 1 for
speculative verification: the tokens at positions len - n .. len - 1, each seeing
the keys up to itself), n x G rows padded with zero rows to a power of two of at
least 16 (the smallest Triton dot), and walks
the tiles of pages that intersect the window [len - w, len) only, so the cost
depends on min(context, window), never on the context. With `num_splits` > 1
each program takes a contiguous share of those tiles and the partial softmax
states are merged in XLA; that only pays when batch x KV heads is too small to
fill the GPU.

`decode_fused_pallas` is the one-query decode from a fused q/k/v projection row in one
launch: each program gathers its group's q heads and its KV head's k and v from the row,
applies RoPE, and attends the cached keys (positions < len - 1, as a query at len - 2
with a window one shorter) through the same tile loop; the last split adds the current
token from registers, and split 0 writes its k and v into their page slot, which no
program reads (no ordering between programs is needed).

`decode_fused_part` is that kernel as a `horizontal.Part`, which `parallel_decode` launches
beside the Mamba2 state update in one grid.

This module knows the page layout and the ring table, not the serving engine:
argument checking lives in `paged_attention.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.horizontal import Block, Part, launch_parts
from pallas_kernels.paged_tiles import (
    TileConfig,
    attend_one,
    attend_tiles,
    compute_dtype,
    finish,
    init_carry,
    tile_span,
)

MIN_ROWS = 16  # Triton dots need M >= 16
NUM_SMS = 132  # H100 SXM: the launch heuristics' idea of a full GPU
# Splits of the tile loop (few programs: small batches): at least 1 tile each, at most 32.
# In the engine's step on the H100 (native-1b-parallel, context 2012) at most 32 splits
# beat 4 / 16 (paged_decode 0.313 -> 0.280 ms per step at batch 1, 0.501 -> 0.457 ms at
# batch 8); since the splits are merged inside decode_glue.mixer_merge, 1 tile per split
# against 2: paged_decode 0.185 -> 0.143 ms per step at batch 1 (mixer_merge 0.061 ->
# 0.068 ms; compiled step 1.677 -> 1.646 ms), batch 8 unchanged (docs/history/benchmarks-2026.md, tenth pass).
MIN_TILES_PER_SPLIT = 1
MAX_SPLITS = 32


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _decode_kernel(lens_ref, pt_ref, q_ref, k_ref, v_ref, *out_refs, cfg: TileConfig, splits,
                   queries: int, group: int):
    b, s = pl.program_id(0), pl.program_id(2)
    length = lens_ref[b]
    q = q_ref[...]
    rows, e = q.shape
    if queries == 1:
        qpos = jnp.full((rows,), length - 1, jnp.int32)
    else:  # rows are token-major: row r is query token r // group (pad rows: the last)
        tok = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows,), 0) // group, queries - 1)
        qpos = length - queries + tok
    k_lo, k_hi, t_lo, t_hi, full_lo, full_hi = tile_span(length - queries, length - 1, cfg)
    t_hi = jnp.where(length > 0, t_hi, t_lo)  # padding rows visit no tile
    t0, t1 = split_range(t_lo, t_hi, s, splits)
    span = (k_lo, k_hi, full_lo, full_hi)
    carry = attend_tiles(q, qpos, k_ref, v_ref, pt_ref, b, span, (t0, t1), init_carry(rows, e), cfg)
    _store(carry, out_refs)


def split_range(t_lo, t_hi, s, splits: int):
    """Split s's contiguous share [t0, t1) of the tiles [t_lo, t_hi)."""
    per_split = (t_hi - t_lo + splits - 1) // splits
    t0 = jnp.minimum(t_lo + s * per_split, t_hi)
    return t0, jnp.minimum(t0 + per_split, t_hi)


def _store(carry, out_refs) -> None:
    """A program's result: normalised (one split) or its partial softmax state (o, m, l)."""
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        o_ref[...] = finish(carry).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = carry


def merge_splits(o, m, l):
    """Combine split partial states o [S,...,r,e], m/l [S,...,r] -> [..., r, e]."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None])
    l_all = jnp.sum(l * w, axis=0)
    o_all = jnp.sum(o * w[..., None], axis=0)
    return o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


def split_blocks(splits: int, b: int, nk: int, rows: int, e: int, dtype):
    """(out_shapes, blocks) of a decode launch on grid (b, nk, splits), as tuples: the
    normalised output [b, nk, rows, e] with one split, else each split's partial state o
    [S, b, nk, rows, e], m and l [S, b, nk, rows] in f32 (`merge_splits` combines them)."""
    if splits == 1:
        return ((jax.ShapeDtypeStruct((b, nk, rows, e), dtype),),
                (Block((None, None, rows, e), lambda i, j, x: (i, j, 0, 0)),))
    ml = jax.ShapeDtypeStruct((splits, b, nk, rows), jnp.float32)
    ml_block = Block((None, None, None, rows), lambda i, j, x: (x, i, j, 0))
    return ((jax.ShapeDtypeStruct((splits, b, nk, rows, e), jnp.float32), ml, ml),
            (Block((None, None, None, rows, e), lambda i, j, x: (x, i, j, 0, 0)), ml_block, ml_block))


def split_outputs(splits: int, b: int, nk: int, rows: int, e: int, dtype):
    """`split_blocks` as a `pallas_call` takes them: (out_shape, out_specs), a single
    array and spec with one split."""
    shapes, blocks = split_blocks(splits, b, nk, rows, e, dtype)
    specs = tuple(pl.BlockSpec(k.shape, k.index) for k in blocks)
    return (shapes, specs) if splits > 1 else (shapes[0], specs[0])


def query_rows(queries: int, group: int) -> int:
    """Rows of a program's query block: n x G padded to a power of two >= MIN_ROWS."""
    return max(MIN_ROWS, pl.next_power_of_2(queries * group))


@functools.partial(
    jax.jit, static_argnames=("cfg", "splits", "num_warps", "num_stages", "interpret", "queries")
)
def decode_pallas(
    q, k_pages, v_pages, lengths, page_table, *, cfg, splits, num_warps, num_stages, interpret,
    queries=1,
):
    """Kernel launch. q [b * n, h, e] (n = queries, sequence-major); pages [k, N, s, e];
    returns [b * n, h, e] in q.dtype."""
    nk, n_pages, s, e = k_pages.shape
    n = queries
    t, h, _ = q.shape
    b, g = t // n, h // nk
    rows = query_rows(n, g)
    qg = q.astype(compute_dtype(k_pages, q)).reshape(b, n, nk, g, e)
    qg = jnp.swapaxes(qg, 1, 2).reshape(b, nk, n * g, e)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - n * g), (0, 0)))
    pool_spec = pl.BlockSpec((None, n_pages, s, e), lambda i, j, x: (j, 0, 0, 0))
    out_shape, out_specs = split_outputs(splits, b, nk, rows, e, q.dtype)
    pt_flat = page_table.reshape(-1)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg, splits=splits, queries=n, group=g),
        grid=(b, nk, splits),
        in_specs=[
            _whole(lengths.shape),
            _whole(pt_flat.shape),
            pl.BlockSpec((None, None, rows, e), lambda i, j, x: (i, j, 0, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode",
    )(lengths, pt_flat, qg, k_pages, v_pages)
    if splits > 1:
        # Keep XLA from fusing the merge into a form that reorders the exp2s.
        out = merge_splits(*lax.optimization_barrier(out)).astype(q.dtype)
    out = out[:, :, :n * g].reshape(b, nk, n, g, e)
    return jnp.swapaxes(out, 1, 2).reshape(t, h, e)


def default_splits(batch: int, kv_heads: int, max_tiles: int, num_sms: int = NUM_SMS) -> int:
    """Split the tile loop only when b x k programs cannot fill the GPU twice."""
    programs = batch * kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def _roped(proj_ref, idx, idx_rot, sign, c, sn, multiplier):
    """Rotate-half RoPE of the flat projection gathered at idx (any shape, last axis the head
    dims), rounded as `apply_rope`: x * cos + (sign * x_rot) * sin in x's dtype (cos / sin
    1 / 0 on pass-through dims, which are then taken as they are)."""
    x, x_rot = proj_ref[idx], proj_ref[idx_rot]  # proj flattened row-major
    if multiplier is not None:
        x, x_rot = x * multiplier, x_rot * multiplier
    dt = x.dtype
    return x * c.astype(dt) + (sign * x_rot) * sn.astype(dt)


def _decode_fused_kernel(lens_ref, pt_ref, slot_ref, cos_ref, sin_ref, proj_ref, k_ref, v_ref,
                         *out_refs, cfg: TileConfig, splits: int, group: int, rows: int, width: int,
                         rope_dim: int, cols: tuple[int, int, int], key_multiplier: float, pids):
    """One program of `decode_fused_pallas`: pids (sequence b, KV head j, split s)."""
    b, j, s = pids
    *att_refs, kp_out, vp_out = out_refs
    _, page_size, e = k_ref.shape
    length = lens_ref[b]
    r, half = rope_dim, rope_dim // 2
    q_col, k_col, v_col = cols
    d = lax.broadcasted_iota(jnp.int32, (e,), 0)
    rot = jnp.where(d < half, d + half, jnp.where(d < r, d - half, d))
    sign = jnp.where(d < half, -1.0, 1.0).astype(proj_ref.dtype)
    cd = jnp.where(d < r, d, 0)
    c = jnp.where(d < r, cos_ref[b * r + cd], 1.0)
    sn = jnp.where(d < r, sin_ref[b * r + cd], 0.0)
    row0 = b * width
    # q: the group's heads as rows (padding rows repeat the last head; their outputs are
    # dropped), roped, in the pools' dtype.
    hh = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows,), 0), group - 1)
    qbase = row0 + q_col + (j * group + hh) * e
    q = _roped(proj_ref, qbase[:, None] + d[None, :], qbase[:, None] + rot[None, :],
               sign[None, :], c[None, :], sn[None, :], None).astype(k_ref.dtype)
    kbase = row0 + k_col + j * e
    mult = None if key_multiplier == 1.0 else key_multiplier
    k_cur = _roped(proj_ref, kbase + d, kbase + rot, sign, c, sn, mult).astype(k_ref.dtype)
    v_cur = proj_ref[row0 + v_col + j * e + d].astype(v_ref.dtype)

    # This token's k and v go to their page slot (split 0 writes). No program reads that
    # slot: the tiles below stop before it and the token is attended from registers.
    slot = slot_ref[b]

    @pl.when(s == 0)
    def _():
        kp_out[slot // page_size, slot % page_size, :] = k_cur
        vp_out[slot // page_size, slot % page_size, :] = v_cur

    # The cached keys: positions before this token, as a query at length - 2 with a window
    # one shorter sees them.
    prev = dataclasses.replace(cfg, window=None if cfg.window is None else cfg.window - 1)
    qpos = jnp.full((rows,), length - 2, jnp.int32)
    k_lo, k_hi, t_lo, t_hi, full_lo, full_hi = tile_span(length - 2, length - 2, prev)
    t_hi = jnp.where(length > 1, t_hi, t_lo)
    t0, t1 = split_range(t_lo, t_hi, s, splits)
    carry = attend_tiles(q, qpos, k_ref, v_ref, pt_ref, b, (k_lo, k_hi, full_lo, full_hi),
                         (t0, t1), init_carry(rows, e), prev)
    # This token, in the last split: one more key of the online softmax.
    carry = attend_one(q, k_cur, v_cur, (length > 0) & (s == splits - 1), carry, cfg)
    _store(carry, att_refs)


class FusedStatic(NamedTuple):
    """The static arguments of a fused decode launch (`decode_fused_part`)."""

    cfg: TileConfig
    splits: int
    heads: int
    cols: tuple[int, int, int]
    key_multiplier: float


def decode_fused_part(proj, cos, sin, k_pages, v_pages, slot_mapping, lengths, page_table, *,
                      cfg, splits, heads, cols, key_multiplier) -> Part:
    """The fused decode kernel as a `horizontal.Part` on grid (b, kv heads, splits). Its
    outputs: the attention (`split_blocks`), then k_pages and v_pages (aliased)."""
    nk, n_pages, s, e = k_pages.shape
    b, width = proj.shape
    g = heads // nk
    rows = query_rows(1, g)
    pool = Block((None, n_pages, s, e), lambda i, j, x: (j, 0, 0, 0))
    out_shape, att = split_blocks(splits, b, nk, rows, e, k_pages.dtype)
    pools = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
             jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    n_out = len(out_shape) + 2
    body = functools.partial(_decode_fused_kernel, cfg=cfg, splits=splits, group=g, rows=rows,
                             width=width, rope_dim=cos.shape[1], cols=cols,
                             key_multiplier=key_multiplier)
    operands = (lengths, page_table.reshape(-1), slot_mapping, cos.reshape(-1), sin.reshape(-1),
                proj.reshape(-1), k_pages, v_pages)
    return Part(body, (b, nk, splits), operands, (None,) * 6 + (pool, pool),
                (*out_shape, *pools), (*att, pool, pool), {6: n_out - 2, 7: n_out - 1})


def fused_outputs(out, heads: int, merge: bool):
    """A fused decode launch's outputs -> `decode_fused_pallas`'s return value."""
    *att, k_pages, v_pages = out
    if not merge:
        return tuple(att), k_pages, v_pages
    if len(att) > 1:
        o = merge_splits(*lax.optimization_barrier(tuple(att))).astype(k_pages.dtype)
    else:
        (o,) = att
    b, nk = o.shape[0], k_pages.shape[0]
    return o[:, :, :heads // nk].reshape(b, heads, -1), k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("cfg", "splits", "heads", "cols", "key_multiplier",
                                             "num_warps", "num_stages", "interpret", "merge"))
def decode_fused_pallas(proj, cos, sin, k_pages, v_pages, slot_mapping, lengths, page_table, *,
                        cfg, splits, heads, cols, key_multiplier, num_warps, num_stages, interpret,
                        merge=True):
    """A decode step's attention in one launch from the fused projection proj [b, W]: q's and
    k's RoPE, the token's K/V write and one-query paged attention (`paged_attention_decode_
    fused`). Returns (o [b, heads, e] in the pools' dtype, k_pages, v_pages), the pools
    updated in place (aliased). merge False: ((o,) [b, kv heads, rows, e] with one split, else
    (o, m, l), each split's partial state (`split_outputs`), k_pages, v_pages)."""
    part = decode_fused_part(proj, cos, sin, k_pages, v_pages, slot_mapping, lengths, page_table,
                             cfg=cfg, splits=splits, heads=heads, cols=cols,
                             key_multiplier=key_multiplier)
    out = launch_parts((part,), impl="interpret" if interpret else "pallas", num_warps=num_warps,
                       num_stages=num_stages, name="paged_decode_fused")
    return fused_outputs(out, heads, merge)
