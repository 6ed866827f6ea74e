"""The inner loop shared by the paged decode and prefill attention kernels.

A kernel program owns R query rows (GQA group heads x query tokens) of one
sequence and one KV head. This module walks that sequence's K/V in tiles of
`pages_per_tile` whole pages, gathered through the ring page table, and keeps
an online softmax (in base 2) over them. Only tiles that intersect the keys
some row may see are visited, and only edge tiles are masked: interior tiles
run without any mask arithmetic.

Within a visited tile, a page that lies wholly outside [k_lo, k_hi) is never
read: its index is redirected to the dummy page 0, whose contents are garbage
and are masked out (K through the logits, V by zeroing, because 0 * NaN is
NaN).

FP8 pages (float8_e4m3fn) are read as stored and widened to q's dtype in registers;
their scales never enter the loop (the callers fold them into q and the output).

This module knows nothing of how rows map to tokens: callers pass each row's
query position. It runs inside `pl.pallas_call` only (Triton or interpret).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
# Running max starts finite and masked logits are -inf: a row with no visible
# key in a tile then gets exp2(-inf - m) = 0, never exp2(-inf + inf) = NaN.
M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static parameters of the tile loop (hashable, part of the jit key)."""

    page_size: int
    pages_per_tile: int
    num_columns: int  # T, the ring width of the page table
    window: int | None
    softcap: float | None
    scale: float

    @property
    def tile_tokens(self) -> int:
        return self.page_size * self.pages_per_tile


def compute_dtype(k_pages, q) -> jnp.dtype:
    """The dtype the tile loop multiplies in: the pools' own, or q's for FP8 pools (read as
    e4m3, widened in registers)."""
    return q.dtype if k_pages.dtype == jnp.float8_e4m3fn else k_pages.dtype


def _precision(dtype) -> lax.Precision:
    # f32 operands would default to TF32 in Triton; ask for full precision.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, e] . b [n, e]^T -> [m, n] in f32."""
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=_precision(b.dtype), preferred_element_type=jnp.float32
    )


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, n] . b [n, e] -> [m, e] in f32."""
    dims = (((1,), (0,)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=_precision(b.dtype), preferred_element_type=jnp.float32
    )


def tile_pages(pt_ref, seq, tile, k_lo, k_hi, cfg: TileConfig) -> jax.Array:
    """Physical pages of one tile; pages wholly outside [k_lo, k_hi) -> page 0."""
    n = cfg.pages_per_tile
    logical = tile * n + lax.broadcasted_iota(jnp.int32, (n,), 0)
    cols = lax.rem(logical, cfg.num_columns)
    phys = pt_ref[seq * cfg.num_columns + cols]
    live = (logical >= k_lo // cfg.page_size) & (logical <= (k_hi - 1) // cfg.page_size)
    return jnp.where(live, phys, 0)


def _base2(s: jax.Array, cfg: TileConfig) -> jax.Array:
    """Raw dot products scaled (and soft-capped), in base-2 units."""
    s = s * cfg.scale
    if cfg.softcap is not None:
        s = jnp.tanh(s / cfg.softcap) * cfg.softcap
    return s * LOG2E


def _logits(q, k, cfg: TileConfig) -> jax.Array:
    """Scaled (and soft-capped) logits in base-2 units, f32 [r, n]."""
    return _base2(_dot_nt(q, k), cfg)


def visible(qpos, kpos, cfg: TileConfig) -> jax.Array:
    """[r, n] mask: query at qpos sees key at kpos iff qpos - w < kpos <= qpos."""
    ok = kpos[None, :] <= qpos[:, None]
    if cfg.window is not None:
        ok = ok & (kpos[None, :] > qpos[:, None] - cfg.window)
    return ok


def _make_step(q, qpos, k_ref, v_ref, pt_ref, seq, k_lo, k_hi, cfg: TileConfig, masked):
    """One tile of the online softmax; `masked` (static) adds edge masking."""
    kb = cfg.tile_tokens
    e = q.shape[-1]

    def step(tile, carry):
        o, m, l = carry
        pages = tile_pages(pt_ref, seq, tile, k_lo, k_hi, cfg)
        # FP8 pages (e4m3) are widened to q's dtype as they are read: the dots run in the
        # compute dtype, the per-head scales were folded into q and the output outside.
        k = k_ref[pages].reshape(kb, e).astype(q.dtype)
        v = v_ref[pages].reshape(kb, e).astype(q.dtype)
        s = _logits(q, k, cfg)
        if masked:
            kpos = tile * kb + lax.broadcasted_iota(jnp.int32, (kb,), 0)
            s = jnp.where(visible(qpos, kpos, cfg), s, -jnp.inf)
            in_span = (kpos >= k_lo) & (kpos < k_hi)
            v = jnp.where(in_span[:, None], v, jnp.zeros_like(v))
        return softmax_tile((o, m, l), s, v)

    return step


def softmax_tile(carry, s: jax.Array, v: jax.Array):
    """The online softmax over one more tile: base-2 logits s [r, kb] (masked ones -inf),
    values v [kb, ev]; p is rounded to v's dtype for the dot (f32 accumulation)."""
    o, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    o = o * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
    return o, m_new, l


def init_carry(rows: int, head_dim: int):
    """(o, m, l) for an empty softmax over `rows` rows."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def tile_span(pos_first, pos_last, cfg: TileConfig):
    """Key span and tile ranges for rows at positions [pos_first, pos_last].

    Returns (k_lo, k_hi, t_lo, t_hi, full_lo, full_hi): keys any row may see are
    [k_lo, k_hi); tiles [t_lo, t_hi) cover them; tiles [full_lo, full_hi) are
    visible to every row and need no mask. Empty spans give t_lo == t_hi.
    """
    kb = cfg.tile_tokens
    k_hi = pos_last + 1
    if cfg.window is None:
        k_lo = jnp.zeros_like(pos_first)
        all_lo = k_lo
    else:
        k_lo = jnp.maximum(pos_first - cfg.window + 1, 0)
        all_lo = jnp.maximum(pos_last - cfg.window + 1, 0)
    t_lo = k_lo // kb
    t_hi = jnp.maximum((k_hi + kb - 1) // kb, t_lo)
    full_lo = (all_lo + kb - 1) // kb
    full_hi = (pos_first + 1) // kb
    return k_lo, k_hi, t_lo, t_hi, full_lo, full_hi


def attend_tiles(q, qpos, k_ref, v_ref, pt_ref, seq, span, tiles, carry, cfg: TileConfig):
    """Online softmax of rows `q` over tiles [tiles[0], tiles[1]) of one sequence.

    q [r, e] (storage dtype); qpos int32 [r]; span = (k_lo, k_hi, full_lo, full_hi)
    from `tile_span`. Masked loops run over the edge tiles only.
    """
    k_lo, k_hi, full_lo, full_hi = span
    t0, t1 = tiles
    a = jnp.clip(full_lo, t0, t1)
    c = jnp.clip(full_hi, a, t1)
    args = (q, qpos, k_ref, v_ref, pt_ref, seq, k_lo, k_hi, cfg)
    carry = lax.fori_loop(t0, a, _make_step(*args, masked=True), carry)
    carry = lax.fori_loop(a, c, _make_step(*args, masked=False), carry)
    return lax.fori_loop(c, t1, _make_step(*args, masked=True), carry)


def attend_one(q, k, v, live, carry, cfg: TileConfig):
    """One more key of the online softmax, held in registers: k, v [e] (storage dtype),
    seen by every row of q [r, e] where `live` (a scalar). p is rounded to v's dtype as the
    tiles round it before their dot."""
    o, m, l = carry
    f32 = jnp.float32
    s = _base2(jnp.sum(q.astype(f32) * k.astype(f32)[None, :], axis=1), cfg)
    s = jnp.where(live, s, -jnp.inf)
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new)
    l = l * alpha + p
    o = o * alpha[:, None] + p.astype(v.dtype).astype(f32)[:, None] * v.astype(f32)[None, :]
    return o, m_new, l


def finish(carry) -> jax.Array:
    """Normalised f32 output; rows that saw no key give zeros."""
    o, _, l = carry
    return o / jnp.where(l == 0.0, 1.0, l)[:, None]
