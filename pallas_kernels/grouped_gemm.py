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
- Split-K (`GroupedConfig.splits` > 1): a third grid axis; program (.., .., s) walks the
  s-th of `splits` equal ranges of the depth and stores its raw f32 partial product (gate
  and up columns both) at [dst row, s, column]; XLA adds the partials and applies the
  epilogue. It multiplies the programs of a few-row call (batch 1 at top-8: 8 items times
  n / bn column blocks), whose weight streaming otherwise runs on a fraction of the SMs.
- FP8 weights (the Hub's fine-grained format, stacked): w in float8_e4m3fn with one scale
  per B x B block of each expert, `scale` [e, ceil(k/B), nb] (f32 or bf16), read in place.
  nb = ceil(n_w/B) plain; gated, the gate and up halves each have their own block grid
  (nb = 2 ceil(n/B): gate's block columns, then up's), so an expert width n that is not a
  multiple of B keeps whole blocks per half, as per-expert checkpoints store them. Tiles
  are capped at the largest power of 2 dividing B, so a [bk, bn] weight tile lies inside
  one block: the kernel widens the e4m3 tile to x's dtype in registers (exact), multiplies
  (f32 accumulation) and scales the partial product by its block's scale (exact in real
  arithmetic: the scale factors out of the block's sum). Decode moves one byte per weight.
  A tile's scales are loaded one tile ahead (the loop carries them), so the dependent
  global load does not stall every step.

`grouped_reference` is the same contract in XLA (`jax.lax.ragged_dot`; FP8 weights
dequantized first by `dequantize_stack`). This module knows nothing of routing or models:
hybrid_jax/layers/moe.py sorts the assignments and combines.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from configs import switches
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
    # FP8 weights: where a block's scale is applied. "output": each k step's partial product
    # [bm, bn] is scaled, then added (the accumulator cannot ride in the MMA). "weights": the
    # widened weight tile [bk, bn] is scaled in f32 and rounded to x's dtype (the reference's
    # dequantized weights, bit for bit), then the MMA accumulates in place. Which is faster
    # is the GPU's to say (benchmarks/moe_fp8.py times both).
    fp8_scale: str = "output"
    # Split-K: each program walks 1/splits of the depth and stores its f32 partial product;
    # XLA adds the partials and applies the epilogue (one small fusion). More programs for
    # few rows (decode at batch 1 has m * n / bn programs, under one per SM at some shapes).
    splits: int = 1

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if not is_pow2(v) or v < 16:
                raise ValueError(f"{name}={v} must be a power of 2 >= 16")
        if self.splits < 1:
            raise ValueError(f"splits={self.splits} must be >= 1")
        if self.fp8_scale not in ("output", "weights"):
            raise ValueError(f"fp8_scale={self.fp8_scale!r} must be 'output' or 'weights'")


# Measured on an H100 at Granite-4.0-H-Small's expert shapes (docs/benchmarks.md, MoE).
DECODE = GroupedConfig(bm=16, bn=128, bk=128, num_warps=4, num_stages=3)
# FP8 stacks (H100, 2026-12-06, qwen3.5-35b-a3b's expert shapes, benchmarks/moe_fp8.py): at
# 4096 tokens scaling the weight tile beats scaling each partial product (1183 vs 1558 us),
# at decode sizes it loses (87 vs 78 us at 1 token, 367 vs 344 us at 64): prefill tiles scale
# the weights, decode tiles the output.
PREFILL = GroupedConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, cols_major=True,
                        fp8_scale="weights")
# Sorted rows up to which decode tiles win (moe_config). H100, Granite-4.0-H-Small shapes:
# 1280 rows 0.52 vs 0.55 ms (decode tiles better), 2560 rows 0.61 vs 0.56 ms (prefill's).
DECODE_ROWS = 2048


# At most 16 sorted rows (batch 1, and 2 at top-8 or less: each row its own item, moe.py):
# narrower column blocks and a deeper ring give few experts more programs and more bytes in
# flight. H100, granite-4.0-h-tiny's experts (d 1536, width 512), one token: 19.1 vs 22.4 us
# the routed sum (benchmarks/moe.py --shape granite-tiny).
DECODE_FEW = GroupedConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=6)
# FP8 stacks at few rows: the same tiles with the depth split in 4. H100, 2026-12-06,
# qwen3.5-35b-a3b's experts, one token (8 rows): 26.1 vs 45.0 us the routed sum
# (benchmarks/moe_fp8.py --tokens 1 --tries ...). bf16 stacks keep one split: granite-4.0-h-
# tiny's step at batch 1 was the same with 4 (2.676 vs 2.674 ms; the isolated sum 16.3 vs 19.5 us).
DECODE_FEW_FP8 = GroupedConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=6, splits=4)
FEW_ROWS = 16
SMEM_BUDGET = 220 * 1024  # bytes of the stages' ring (an H100 has 227 KB a block)


def moe_config(m: int, fp8: bool = False) -> GroupedConfig:
    """Tiles by row count (and FP8 stacks at few rows): small batches stream each touched
    expert's weights once (bm 16); large ones tile each group as a GEMM.
    HYBRID_JAX_MOE_FEW_CONFIG overrides the few-row tiles (read when a step is traced)."""
    if m <= FEW_ROWS:
        override = switches.moe_few_config()
        if override is None:
            return DECODE_FEW_FP8 if fp8 else DECODE_FEW
        bn, bk, warps, stages, splits = override
        return GroupedConfig(bm=16, bn=bn, bk=bk, num_warps=warps, num_stages=stages, splits=splits)
    return DECODE if m <= DECODE_ROWS else PREFILL


def assignment_table(groups: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """groups [m] -> (group, row0, count), each [m]: every row an item of its own (row i of
    groups[i]), so the rows need not be sorted by group: no sort, group sizes or
    `work_table` (decode at batch 1, where those are most of a layer's small kernels). A
    group chosen by several rows is streamed once per row, so it pays off for a few rows."""
    m = groups.shape[0]
    # numpy constants: literals of the executable, not iota kernels run on every step
    return (groups.astype(jnp.int32), jnp.asarray(np.arange(m, dtype=np.int32)),
            jnp.asarray(np.ones(m, np.int32)))


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


FP8 = jnp.dtype(jnp.float8_e4m3fn)


def scale_blocks(k: int, nw: int, block: int, glu: bool) -> tuple[int, int]:
    """The block grid of one expert's scales: (ceil(k/B), nb) (module doc: gated halves
    each have their own block columns)."""
    kb = -(-k // block)
    return (kb, 2 * -(-(nw // 2) // block)) if glu else (kb, -(-nw // block))


def dequantize_stack(w: jax.Array, scale: jax.Array, block: int, glu: bool, dtype) -> jax.Array:
    """The reference: FP8 experts w [e, k, n_w] times their block scales (module doc) in
    f32, then `dtype`."""
    def expand(s, cols):  # [e, kb, cb] -> [e, k, cols]
        s = jnp.repeat(jnp.repeat(s.astype(F32), block, axis=1), block, axis=2)
        return s[:, :w.shape[1], :cols]

    if glu:
        n = w.shape[2] // 2
        half = scale.shape[2] // 2
        s = jnp.concatenate([expand(scale[..., :half], n), expand(scale[..., half:], n)], axis=2)
    else:
        s = expand(scale, w.shape[2])
    return (w.astype(F32) * s).astype(dtype)


def _check_fp8(w, scale, block, glu: bool):
    if (scale is None) != (w.dtype != FP8) or (scale is not None and not block):
        raise ValueError(f"w {w.dtype} needs `scale` and `block` exactly when it is float8_e4m3fn")
    if scale is not None:
        e, k, nw = w.shape
        want = (e, *scale_blocks(k, nw, block, glu))
        if tuple(scale.shape) != want:
            raise ValueError(f"scale {scale.shape} must be {want} for FP8 w {w.shape} in {block} x "
                             f"{block} blocks{' (gate and up halves apart)' if glu else ''}")


def _check(x, w, sizes, src, dst, glu: bool):
    e, k, nw = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} differ in depth")
    if sizes is not None and sizes.shape != (e,):
        raise ValueError(f"sizes {sizes.shape} must be [{e}] (one per group of w)")
    if src is not None and src.ndim != 1:
        raise ValueError(f"src {src.shape} must be 1-D (a row of x per sorted row)")
    if dst is not None and dst.shape != (x.shape[0] if src is None else src.shape[0],):
        raise ValueError(f"dst {dst.shape} must hold one output row per sorted row")
    if glu and nw % 2:
        raise ValueError(f"gated: w's {nw} columns must be gate then up (even)")



def grouped_reference(x: jax.Array, w: jax.Array, sizes: jax.Array, *, src: jax.Array | None = None,
                      dst: jax.Array | None = None, glu: bool = False, act: Callable | None = None,
                      out_dtype=None, table=None, scale: jax.Array | None = None,
                      block: int | None = None) -> jax.Array:
    """XLA: the module's contract by `jax.lax.ragged_dot` (f32 accumulation, the epilogue in
    f32, one rounding to `out_dtype`, default x's; FP8 w dequantized to x's dtype first).
    `table` is ignored (kernel only)."""
    del table
    _check(x, w, sizes, src, dst, glu)
    _check_fp8(w, scale, block, glu)
    if scale is not None:
        w = dequantize_stack(w, scale, block, glu, x.dtype)
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
                   impl: Impl | None = None, scale: jax.Array | None = None,
                   block: int | None = None) -> jax.Array:
    """x [t, k] (rows gathered by src [m]; x itself when src is None), w [e, k, n_w],
    sizes [e] (sum == m) -> [m, n] with n = n_w / 2 gated, else n_w (module doc); sorted
    row r is stored at output row dst[r] (a permutation of [0, m); r when None). `table`:
    `work_table(sizes, m, cfg.bm)` when the caller shares one between calls, or
    `assignment_table(groups)` (rows in any order, one item each; sizes may then be None:
    the kernel only). FP8 w
    (float8_e4m3fn) comes with its block scales `scale` and `block` (module doc); the
    products then run in x's dtype."""
    impl = resolve_impl(impl)
    if sizes is None and (table is None or impl == "reference"):
        raise ValueError("sizes may be None only with a table (assignment_table) and the kernel")
    if impl == "reference":
        return grouped_reference(x, w, sizes, src=src, dst=dst, glu=glu, act=act, out_dtype=out_dtype,
                                 scale=scale, block=block)
    _check(x, w, sizes, src, dst, glu)
    _check_fp8(w, scale, block, glu)
    e, k, nw = w.shape
    n = nw // 2 if glu else nw
    m = x.shape[0] if src is None else src.shape[0]
    if max(x.shape[0] * k, (m + 1) * n) >= 2**31:
        raise ValueError(f"x {x.shape} or the output [{m}, {n}] is too large for the kernel's "
                         "int32 flat offsets")
    cfg = cfg or moe_config(m, fp8=scale is not None)
    # FP8: tiles inside one scale block (the largest power of 2 dividing B caps them).
    cap = channel_block(block, 1 << 30) if scale is not None else 1 << 30
    bn, bk = channel_block(n, min(cfg.bn, cap)), channel_block(k, min(cfg.bk, cap))
    if bn < 16 or bk < 16:
        raise ValueError(f"n={n} and k={k} must be multiples of 16 (tiles of >= 16 for the dot)"
                         + (f", and the FP8 block {block} too" if scale is not None else ""))
    # Split-K only where the depth's tiles divide evenly (else one program walks it all).
    splits = cfg.splits if (k // bk) % cfg.splits == 0 else 1
    # The ring's stages capped to what fits in shared memory (f32 operands of the few-row
    # tiles asked for 368 KB of an H100's 227 KB).
    x_bytes = (x.dtype if scale is not None else w.dtype).itemsize  # x as the kernel takes it
    stage_bytes = cfg.bm * bk * x_bytes + (2 if glu else 1) * bk * bn * w.dtype.itemsize
    stages = max(2, min(cfg.num_stages, SMEM_BUDGET // stage_bytes))
    if stages != cfg.num_stages:
        cfg = dataclasses.replace(cfg, num_stages=stages)
    # Padded by a tile so that the last tile's index loads stay in bounds; its masked rows read
    # row 0 and point past the output (m), where no store lands (the interpreter drops it).
    # The identity (src / dst None) as numpy constants: literals, not kernels on every step.
    rows = np.arange(m, dtype=np.int32)
    src = (jnp.asarray(np.pad(rows, (0, cfg.bm))) if src is None
           else jnp.pad(src.astype(jnp.int32), (0, cfg.bm)))
    dst = (jnp.asarray(np.pad(rows, (0, cfg.bm), constant_values=m)) if dst is None
           else jnp.pad(dst.astype(jnp.int32), (0, cfg.bm), constant_values=m))
    table = work_table(sizes, m, cfg.bm) if table is None else table
    x = x if scale is not None else x.astype(w.dtype)
    # Scales flat in f32: the kernel loads one scalar per (k tile, column tile).
    flat = None if scale is None else scale.astype(F32).reshape(-1)
    return _launch(*table, src, dst, x.reshape(-1), w, flat, m=m, n=n, bn=bn, bk=bk, glu=glu, act=act,
                   out_dtype=jnp.dtype(out_dtype or x.dtype), cfg=cfg, impl=impl, block=block,
                   splits=splits)


@functools.partial(jax.jit, static_argnames=("m", "n", "bn", "bk", "glu", "act", "out_dtype",
                                             "cfg", "impl", "block", "splits"))
def _launch(group, row0, count, src, dst, x_flat, w, scale, *, m, n, bn, bk, glu, act, out_dtype, cfg,
            impl, block, splits):
    items = group.shape[0]
    e, k, nw = w.shape
    fp8 = None if scale is None else (block, *scale_blocks(k, nw, block, glu))
    kernel = functools.partial(_kernel, bm=cfg.bm, bn=bn, bk=bk, n=n, k=k, glu=glu, act=act,
                               cols_major=cfg.cols_major, fp8=fp8, scale_weights=cfg.fp8_scale == "weights",
                               splits=splits)
    grid = (n // bn, items) if cfg.cols_major else (items, n // bn)
    operands = (group, row0, count, src, dst, x_flat, w) + (() if scale is None else (scale,))
    # Split-K stores raw f32 partials, row-major [m, splits, n_w] (a masked row's `dst` = m
    # still points past the output), summed and finished below.
    cols = 2 * n if glu else n
    out = pl.pallas_call(
        kernel,
        grid=grid + ((splits,) if splits > 1 else ()),
        out_shape=jax.ShapeDtypeStruct((m * n,), out_dtype) if splits == 1 else
        jax.ShapeDtypeStruct((m * splits * cols,), F32),
        name=("grouped_glu" if glu else "grouped_gemm") + ("_fp8" if fp8 else "")
        + ("_splitk" if splits > 1 else ""),
        **impl_kwargs(impl, cfg.num_warps, cfg.num_stages),
    )(*operands)
    if splits == 1:
        return out.reshape(m, n)
    y = jnp.sum(out.reshape(m, splits, cols), axis=1)
    return _epilogue(y, glu, act).astype(out_dtype)


def _kernel(group_ref, row0_ref, count_ref, src_ref, dst_ref, x_ref, w_ref, *refs, bm, bn, bk,
            n, k, glu, act, cols_major, fp8, scale_weights, splits):
    s_ref, o_ref = refs if fp8 else (None, refs[0])
    item, j = pl.program_id(int(cols_major)), pl.program_id(1 - int(cols_major))
    g, r0, count = group_ref[item], row0_ref[item], count_ref[item]
    steps = k // bk // splits  # this program's k tiles (split-K: the split's share)
    split = pl.program_id(2) if splits > 1 else 0  # read here: the interpreter wants it at the top
    kstart = split * (steps * bk)

    @pl.when(count > 0)
    def _():
        # Flat offsets of this tile's source rows in x (x passed flat: a gather of rows).
        base = src_ref[pl.ds(r0, bm)] * k
        cols = jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
        c0 = j * bn

        def scales(k0):  # FP8: the scales of the weight tiles at depth k0 (gate's, up's)
            block, kb, nb = fp8
            # The tile's block: row k0 // B of expert g, column (c0 // B) of its half.
            at = (g * kb + k0 // block) * nb + c0 // block
            return (s_ref[at],) + ((s_ref[at + nb // 2],) if glu else ())

        def product(xt, k0, col, scale):  # x tile times a weight tile (FP8: widened, then scaled)
            wt = w_ref[g, pl.ds(k0, bk), pl.ds(col, bn)]
            if not fp8:
                return dot(xt, wt)
            # e4m3 -> bf16 is exact and lowers everywhere (Triton converts e4m3 to 16-bit
            # types), then to x's dtype (exact again for f32).
            wide = wt.astype(jnp.bfloat16)
            if scale_weights:  # dequantized as the reference does: f32 product, one rounding
                return dot(xt, (wide.astype(F32) * scale).astype(xt.dtype))
            return dot(xt, wide.astype(xt.dtype)) * scale

        def step(i, carry):  # launch.dot: bf16 on the tensor cores, f32 at full precision
            accs, cur = carry
            k0 = pl.multiple_of(kstart + i * bk, bk)
            # FP8: the next tile's scales loaded now, so their latency (a dependent global
            # load) hides behind this tile's product instead of stalling each step.
            nxt = scales(kstart + jnp.minimum(i + 1, steps - 1) * bk) if fp8 else cur
            xt = x_ref[base[:, None] + k0 + cols]
            acc_g = accs[0] + product(xt, k0, c0, cur[0] if fp8 else None)
            if not glu:
                return (acc_g,), nxt
            return (acc_g, accs[1] + product(xt, k0, n + c0, cur[1] if fp8 else None)), nxt

        zero = jnp.zeros((bm, bn), F32)
        first = scales(kstart) if fp8 else ()
        accs, _ = jax.lax.fori_loop(0, steps, step, ((zero, zero) if glu else (zero,), first))
        keep = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < count
        rows = dst_ref[pl.ds(r0, bm)][:, None]
        lane = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
        if splits > 1:  # raw partials at [dst, split, column] of the f32 [m, splits, n_w] output
            at = (rows * splits + split) * (2 * n if glu else n) + c0 + lane
            for half, acc in enumerate(accs):
                plgpu.store(o_ref.at[at + half * n], acc, mask=keep)
            return
        if glu:
            h = (act(accs[0]) if act else accs[0]) * accs[1]
        else:
            h = act(accs[0]) if act else accs[0]
        # Scattered to the output rows dst (flat, as x is gathered).
        plgpu.store(o_ref.at[rows * n + c0 + lane], h.astype(o_ref.dtype), mask=keep)
