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

from pallas_kernels.launch import launch
from pallas_kernels.paged_tiles import TileConfig, attend_tiles, finish, init_carry, tile_span

MIN_ROWS = 16  # Triton dots need M >= 16
NUM_SMS = 132  # H100 SXM: the launch heuristics' idea of a full GPU
# Splits of the tile loop (few programs: small batches): at least 2 tiles each, at most 32.
# In the engine's step on the H100 (native-1b-parallel, context 2012) this beat 4 / 16:
# paged_decode 0.313 -> 0.280 ms per step at batch 1, 0.501 -> 0.457 ms at batch 8.
MIN_TILES_PER_SPLIT = 2
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
    per_split = (t_hi - t_lo + splits - 1) // splits
    t0 = jnp.minimum(t_lo + s * per_split, t_hi)
    t1 = jnp.minimum(t0 + per_split, t_hi)
    span = (k_lo, k_hi, full_lo, full_hi)
    carry = attend_tiles(q, qpos, k_ref, v_ref, pt_ref, b, span, (t0, t1), init_carry(rows, e), cfg)
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = finish(carry).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = carry


def _merge_splits(o, m, l):
    """Combine split partial states o [S,...,r,e], m/l [S,...,r] -> [..., r, e]."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None])
    l_all = jnp.sum(l * w, axis=0)
    o_all = jnp.sum(o * w[..., None], axis=0)
    return o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


def split_outputs(splits: int, b: int, nk: int, rows: int, e: int, dtype):
    """(out_shape, out_specs) of a decode launch on grid (b, nk, splits): the normalised
    output [b, nk, rows, e] with one split, else each split's partial state o [S, b, nk,
    rows, e], m and l [S, b, nk, rows] in f32 (`_merge_splits` combines them)."""
    if splits == 1:
        return (jax.ShapeDtypeStruct((b, nk, rows, e), dtype),
                pl.BlockSpec((None, None, rows, e), lambda i, j, x: (i, j, 0, 0)))
    ml = jax.ShapeDtypeStruct((splits, b, nk, rows), jnp.float32)
    ml_spec = pl.BlockSpec((None, None, None, rows), lambda i, j, x: (x, i, j, 0))
    return ((jax.ShapeDtypeStruct((splits, b, nk, rows, e), jnp.float32), ml, ml),
            (pl.BlockSpec((None, None, None, rows, e), lambda i, j, x: (x, i, j, 0, 0)), ml_spec, ml_spec))


def query_rows(queries: int, group: int) -> int:
    """Rows of a program's query block: n x G padded to a power of two >= MIN_ROWS."""
    return max(MIN_ROWS, pl.next_power_of_2(queries * group))


@functools.partial(
    jax.jit, static_argnames=("cfg", "splits", "num_warps", "num_stages", "interpret", "queries",
                              "heads")
)
def decode_pallas(
    q, k_pages, v_pages, lengths, page_table, *, cfg, splits, num_warps, num_stages, interpret,
    queries=1, heads=None,
):
    """Kernel launch. q [b * n, h, e] (n = queries, sequence-major); pages [k, N, s, e];
    returns [b * n, h, e] in q.dtype. With `heads` = h, q is already the kernel's block
    layout [b, k, rows, e] in the pages' dtype (`rope_write_pallas` builds it; n = 1)."""
    nk, n_pages, s, e = k_pages.shape
    n = queries
    if heads is None:
        t, h, _ = q.shape
        b, g = t // n, h // nk
        rows = query_rows(n, g)
        qg = q.astype(k_pages.dtype).reshape(b, n, nk, g, e)
        qg = jnp.swapaxes(qg, 1, 2).reshape(b, nk, n * g, e)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - n * g), (0, 0)))
    else:
        assert n == 1, n
        qg, h, g = q, heads, heads // nk
        b, rows, t = q.shape[0], q.shape[2], q.shape[0]
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
        out = _merge_splits(*lax.optimization_barrier(out)).astype(q.dtype)
    out = out[:, :, :n * g].reshape(b, nk, n, g, e)
    return jnp.swapaxes(out, 1, 2).reshape(t, h, e)


def _rope_half(x_lo, x_hi, c_lo, c_hi, s_lo, s_hi):
    """Rotate-half RoPE of one head's rotary dims as `apply_rope` rounds it: products and
    sum in x's dtype, cos / sin (f32) cast to it first."""
    dt = x_lo.dtype
    c_lo, c_hi, s_lo, s_hi = (a.astype(dt) for a in (c_lo, c_hi, s_lo, s_hi))
    return x_lo * c_lo + (-x_hi) * s_lo, x_hi * c_hi + x_lo * s_hi


def _rope_write_kernel(slot_ref, cos_ref, sin_ref, proj_ref, kp_ref, vp_ref, q_out, kp_out, vp_out,
                       *, group, rows, head_dim, rope_dim, page_size, cols, key_multiplier):
    i, j = pl.program_id(0), pl.program_id(1)
    e, r, half = head_dim, rope_dim, rope_dim // 2
    q_col, k_col, v_col = cols
    cs = [ref[i, pl.ds(lo, half)] for ref in (cos_ref, sin_ref) for lo in (0, half)]

    def head(col, multiplier=None):
        """Roped pieces (offset, value) of the head at proj columns [col, col + e)."""
        x_lo, x_hi = proj_ref[i, pl.ds(col, half)], proj_ref[i, pl.ds(col + half, half)]
        rest = [(r, proj_ref[i, pl.ds(col + r, e - r)])] if e > r else []
        if multiplier is not None:
            x_lo, x_hi = x_lo * multiplier, x_hi * multiplier
            rest = [(o, x * multiplier) for o, x in rest]
        lo, hi = _rope_half(x_lo, x_hi, *cs)
        return [(0, lo), (half, hi), *rest]

    for hh in range(group):  # the group's query heads, then zero rows up to `rows`
        for off, x in head(q_col + (j * group + hh) * e):
            q_out[i, j, hh, pl.ds(off, x.shape[0])] = x.astype(q_out.dtype)
    for hh in range(group, rows):
        q_out[i, j, hh, pl.ds(0, e)] = jnp.zeros((e,), q_out.dtype)
    slot = slot_ref[i]
    page, pos = slot // page_size, slot % page_size
    multiplier = None if key_multiplier == 1.0 else key_multiplier
    for off, x in head(k_col + j * e, multiplier):
        kp_out[j, page, pos, pl.ds(off, x.shape[0])] = x.astype(kp_out.dtype)
    vp_out[j, page, pos, pl.ds(0, e)] = proj_ref[i, pl.ds(v_col + j * e, e)].astype(vp_out.dtype)


@functools.partial(jax.jit, static_argnames=("heads", "cols", "key_multiplier", "interpret"))
def rope_write_pallas(proj, cos, sin, k_pages, v_pages, slot_mapping, *, heads, cols,
                      key_multiplier, interpret):
    """One launch for what a decode step does before `decode_pallas`: RoPE of q and k
    read in place from the fused projection proj [b, W] (q, k, v heads at columns
    cols = (q, k, v) starting columns), k and v written into their page slots, and q laid
    out as the decode kernel's block [b, k, rows, e] (zero padding rows). cos, sin [b, r]
    f32 (`rope_cos_sin`). Returns (q block, k_pages, v_pages); the pools are updated in
    place (aliased)."""
    nk, _, s, e = k_pages.shape
    b, r = proj.shape[0], cos.shape[1]
    g = heads // nk
    rows = query_rows(1, g)
    kernel = functools.partial(
        _rope_write_kernel, group=g, rows=rows, head_dim=e, rope_dim=r, page_size=s, cols=cols,
        key_multiplier=key_multiplier)
    return launch(
        kernel, impl="interpret" if interpret else "pallas", grid=(b, nk),
        out_shape=[jax.ShapeDtypeStruct((b, nk, rows, e), k_pages.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        aliases={4: 1, 5: 2}, num_warps=1, name="rope_write_kv",
    )(slot_mapping, cos, sin, proj, k_pages, v_pages)


def default_splits(batch: int, kv_heads: int, max_tiles: int, num_sms: int = NUM_SMS) -> int:
    """Split the tile loop only when b x k programs cannot fill the GPU twice."""
    programs = batch * kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
