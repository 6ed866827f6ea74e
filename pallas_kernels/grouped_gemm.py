"""Grouped GEMM over ragged expert groups (mixture of experts), Pallas through Triton.

Shapes: t source rows, m sorted rows (assignments), k depth, e groups (experts), n output
columns (2n weight columns in the gated form).

    y[r, c] = sum_k x[src_r, k] w[g(r), k, c]        g(r): the group that row r falls in
    gated:  h[r, c] = act(y[r, c]) * y[r, n + c]     (w holds the gate columns, then the up)
    plain:  h[r, c] = act(y[r, c])                   (act = identity when None)

Rows are sorted by group: group g owns rows [off_g, off_g + sizes_g), off = the exclusive
cumulative sum of `sizes`, sum(sizes) == m. The weights are the stacked expert tensors
w [e, k, n_w], read in place: a program reads only its own group's weight columns, so a
group with no rows costs nothing (decode at small batch reads only the touched experts).

- The work table (built in XLA from `sizes`, static shapes): item i -> (group, first row,
  row count) for every tile of `bm` rows that lies inside one group. A group of s rows
  has ceil(s / bm) tiles, so at most ceil(m / bm) + e items; the rest have count 0 and
  exit at once. The grid is (items, n / bn), or (n / bn, items) with `cols_major`.
- A program streams its group's [k, bn] weight block (two blocks, gate and up, in the
  gated form) in tiles of bk, multiplying a [bm, bk] tile of its rows (bf16 in, f32
  accumulation), applies the epilogue and stores the rows it owns (masked). Tiles never
  straddle groups, so programs never write the same row.
- `src` gathers the rows straight from x (the tokens; `src_r` = the token of assignment r),
  so the [m, k] sorted copy of x is never built; without `src` x is already sorted. `dst`
  scatters the output rows the same way (the MoE down pass stores each row back at its
  assignment, so no unsorting pass follows). Masked rows of a tile never store (their
  `dst` points past the output, where the interpreter drops the store too). x and the
  output are indexed flat in int32: t * k and m * n must stay below 2**31.
- One kernel serves prefill (bm 128: a tiled GEMM per group) and decode (bm 16: each
  touched expert's weights streamed once, its few rows riding along); `moe_config` picks
  the tiles by row count. H100 figures at Granite-4.0-H-Small shapes: docs/benchmarks.md.

`grouped_reference` is the same contract in XLA (`jax.lax.ragged_dot`). This module knows
nothing of routing or models: hybrid_jax/layers/moe.py sorts the assignments and combines.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import channel_block, dot, impl_kwargs, is_pow2

F32 = jnp.float32


@dataclass(frozen=True)
class GroupedConfig:
    bm: int = 64  # rows per tile (power of 2, >= 16)
    bn: int = 128  # output columns per program: the largest power of 2 <= bn dividing n
    bk: int = 64  # depth per step: the largest power of 2 <= bk dividing k
    num_warps: int = 4
    num_stages: int = 3
    # Grid (column blocks, items) instead of (items, column blocks): the order programs are
    # launched in. Measured, not modelled: prefill on an H100, 1.67 vs 2.07 ms of GEMMs.
    cols_major: bool = False

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if not is_pow2(v) or v < 16:
                raise ValueError(f"{name}={v} must be a power of 2 >= 16")


# Measured on an H100 at Granite-4.0-H-Small's expert shapes (docs/benchmarks.md, MoE).
DECODE = GroupedConfig(bm=16, bn=128, bk=128, num_warps=4, num_stages=3)
PREFILL = GroupedConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, cols_major=True)
# Sorted rows up to which decode tiles win (moe_config). H100, Granite-4.0-H-Small shapes:
# 1280 rows 0.52 vs 0.55 ms (decode tiles better), 2560 rows 0.61 vs 0.56 ms (prefill's).
DECODE_ROWS = 2048


def moe_config(m: int) -> GroupedConfig:
    """Tiles by row count: small batches stream each touched expert's weights once (bm 16);
    large ones tile each group as a GEMM."""
    return DECODE if m <= DECODE_ROWS else PREFILL


def work_table(sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """sizes [e] -> (group, row0, count), each [ceil(m / bm) + e] int32: item i is the tile of
    rows [row0, row0 + count) of `group` (count <= bm); unused items have count 0."""
    e = sizes.shape[0]
    items = pl.cdiv(m, bm) + e
    sizes = sizes.astype(jnp.int32)
    tiles = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(tiles)  # inclusive
    row_off = jnp.cumsum(sizes) - sizes
    i = jnp.arange(items, dtype=jnp.int32)
    # The group of item i: how many groups end at or before it (one fusion; a scan-based
    # searchsorted is a loop of small kernels, which decode pays for).
    group = jnp.minimum(jnp.sum(tile_end[None, :] <= i[:, None], axis=1), e - 1).astype(jnp.int32)
    local = i - (tile_end[group] - tiles[group])  # tile index within its group
    row0 = row_off[group] + local * bm
    count = jnp.clip(sizes[group] - local * bm, 0, bm)
    used = i < tile_end[-1]
    return group, jnp.where(used, row0, 0), jnp.where(used, count, 0).astype(jnp.int32)


def _check(x, w, sizes, src, dst, glu: bool):
    e, k, nw = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} differ in depth")
    if sizes.shape != (e,):
        raise ValueError(f"sizes {sizes.shape} must be [{e}] (one per group of w)")
    if src is not None and src.ndim != 1:
        raise ValueError(f"src {src.shape} must be 1-D (a row of x per sorted row)")
    if dst is not None and dst.shape != (x.shape[0] if src is None else src.shape[0],):
        raise ValueError(f"dst {dst.shape} must hold one output row per sorted row")
    if glu and nw % 2:
        raise ValueError(f"gated: w's {nw} columns must be gate then up (even)")



def grouped_reference(x: jax.Array, w: jax.Array, sizes: jax.Array, *, src: jax.Array | None = None,
                      dst: jax.Array | None = None, glu: bool = False, act: Callable | None = None,
                      out_dtype=None, table=None) -> jax.Array:
    """XLA: the module's contract by `jax.lax.ragged_dot` (f32 accumulation, the epilogue in
    f32, one rounding to `out_dtype`, default x's). `table` is ignored (kernel only)."""
    del table
    _check(x, w, sizes, src, dst, glu)
    rows = x if src is None else jnp.take(x, src, axis=0)
    y = jax.lax.ragged_dot(rows.astype(w.dtype), w, sizes.astype(jnp.int32),
                           preferred_element_type=F32)
    y = _epilogue(y, glu, act).astype(out_dtype or x.dtype)
    return y if dst is None else jnp.zeros_like(y).at[dst].set(y)


def _epilogue(y: jax.Array, glu: bool, act: Callable | None) -> jax.Array:
    if glu:
        gate, up = jnp.split(y, 2, axis=-1)
        return (act(gate) if act else gate) * up
    return act(y) if act else y


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, *, src: jax.Array | None = None,
                   dst: jax.Array | None = None, glu: bool = False, act: Callable | None = None,
                   out_dtype=None, cfg: GroupedConfig | None = None, table=None,
                   impl: Impl | None = None) -> jax.Array:
    """x [t, k] (rows gathered by src [m]; x itself when src is None), w [e, k, n_w],
    sizes [e] (sum == m) -> [m, n] with n = n_w / 2 gated, else n_w (module doc); sorted
    row r is stored at output row dst[r] (a permutation of [0, m); r when None). `table`:
    `work_table(sizes, m, cfg.bm)` when the caller shares one between calls."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return grouped_reference(x, w, sizes, src=src, dst=dst, glu=glu, act=act, out_dtype=out_dtype)
    _check(x, w, sizes, src, dst, glu)
    e, k, nw = w.shape
    n = nw // 2 if glu else nw
    m = x.shape[0] if src is None else src.shape[0]
    if max(x.shape[0] * k, (m + 1) * n) >= 2**31:
        raise ValueError(f"x {x.shape} or the output [{m}, {n}] is too large for the kernel's "
                         "int32 flat offsets")
    cfg = cfg or moe_config(m)
    bn, bk = channel_block(n, cfg.bn), channel_block(k, cfg.bk)
    if bn < 16 or bk < 16:
        raise ValueError(f"n={n} and k={k} must be multiples of 16 (tiles of >= 16 for the dot)")
    rows = jnp.arange(m, dtype=jnp.int32)
    # Padded by a tile so that the last tile's index loads stay in bounds; its masked rows read
    # row 0 and point past the output (m), where no store lands (the interpreter drops it).
    src = jnp.pad(rows if src is None else src.astype(jnp.int32), (0, cfg.bm))
    dst = jnp.pad(rows if dst is None else dst.astype(jnp.int32), (0, cfg.bm), constant_values=m)
    table = work_table(sizes, m, cfg.bm) if table is None else table
    return _launch(*table, src, dst, x.astype(w.dtype).reshape(-1), w, m=m, n=n, bn=bn, bk=bk,
                   glu=glu, act=act, out_dtype=jnp.dtype(out_dtype or x.dtype), cfg=cfg, impl=impl)


@functools.partial(jax.jit, static_argnames=("m", "n", "bn", "bk", "glu", "act", "out_dtype",
                                             "cfg", "impl"))
def _launch(group, row0, count, src, dst, x_flat, w, *, m, n, bn, bk, glu, act, out_dtype, cfg, impl):
    items = group.shape[0]
    kernel = functools.partial(_kernel, bm=cfg.bm, bn=bn, bk=bk, n=n, k=w.shape[1], glu=glu, act=act,
                               cols_major=cfg.cols_major)
    grid = (n // bn, items) if cfg.cols_major else (items, n // bn)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((m * n,), out_dtype),
        name="grouped_glu" if glu else "grouped_gemm",
        **impl_kwargs(impl, cfg.num_warps, cfg.num_stages),
    )(group, row0, count, src, dst, x_flat, w)
    return out.reshape(m, n)


def _kernel(group_ref, row0_ref, count_ref, src_ref, dst_ref, x_ref, w_ref, o_ref, *, bm, bn, bk,
            n, k, glu, act, cols_major):
    item, j = pl.program_id(int(cols_major)), pl.program_id(1 - int(cols_major))
    g, r0, count = group_ref[item], row0_ref[item], count_ref[item]

    @pl.when(count > 0)
    def _():
        # Flat offsets of this tile's source rows in x (x passed flat: a gather of rows).
        base = src_ref[pl.ds(r0, bm)] * k
        cols = jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
        c0 = j * bn

        def step(i, accs):  # launch.dot: bf16 on the tensor cores, f32 at full precision
            k0 = pl.multiple_of(i * bk, bk)
            xt = x_ref[base[:, None] + k0 + cols]
            acc_g = accs[0] + dot(xt, w_ref[g, pl.ds(k0, bk), pl.ds(c0, bn)])
            if not glu:
                return (acc_g,)
            return acc_g, accs[1] + dot(xt, w_ref[g, pl.ds(k0, bk), pl.ds(n + c0, bn)])

        zero = jnp.zeros((bm, bn), F32)
        accs = jax.lax.fori_loop(0, k // bk, step, (zero, zero) if glu else (zero,))
        if glu:
            h = (act(accs[0]) if act else accs[0]) * accs[1]
        else:
            h = act(accs[0]) if act else accs[0]
        keep = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < count
        # Scattered to the output rows dst (flat, as x is gathered).
        out = dst_ref[pl.ds(r0, bm)][:, None] * n + c0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
        plgpu.store(o_ref.at[out], h.astype(o_ref.dtype), mask=keep)
