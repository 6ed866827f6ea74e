"""Paged decode attention: alternative kernel DESIGNS against the engine's kernel (GPU, bf16).

`paged_decode_sweep.py` sweeps the launch knobs of today's kernel; this script tries other
designs of the program, each a self-contained Pallas (Triton backend) kernel defined here:

  grp    today's grid (sequence, KV head, split): the G query heads of one GQA group padded
         to 16 rows; optionally (`pf`) the next tile's K/V is loaded into registers before
         the current tile is computed (software prefetch, carried through the loop).
  seq    one program per (sequence, split) for ALL KV heads: rows = the sequence's H query
         heads (16 real rows at 4 KV heads x 4), each KV head's K/V tile loaded separately;
         q.k for head j is a 16-row dot whose rows of other heads are discarded, p.v uses p
         with the other heads' rows zeroed. 4x the bytes in flight per program, 4x fewer
         programs. Optionally `pf` as above.
  bcast  today's grid, but the G real rows only and no MMA: q.k and p.v as broadcast
         multiply-and-sum per row (per-row online softmax).
  mgpu   Mosaic GPU (GPU only, jax 0.11): grid (sequence, KV head), one TMA copy per 4 KiB
         page into a 2-3 deep shared-memory ring, wgmma on 64 padded rows; no splits.

Each variant is checked against the pure-JAX reference on a batch of mixed lengths (0,
1, lengths off the tile grid, beyond the window), and against the engine's kernel on
every timed shape. Times rotate over enough input sets that the K/V read is not an L2
hit (the engine's layers evict each other), and are printed as microseconds and % of
the measured copy bandwidth (in-window K/V bytes / time).

    PYTHONPATH=. python benchmarks/paged_decode_variants.py [--out variants.json]
    PYTHONPATH=. python benchmarks/paged_decode_variants.py --smoke   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

sys.path.insert(0, os.path.dirname(__file__))
from attention_inputs import paged_pool, ring_columns  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_decode  # noqa: E402
from pallas_kernels.paged_attention_ref import paged_attention_decode_reference  # noqa: E402
from pallas_kernels.paged_decode import (  # noqa: E402
    MIN_TILES_PER_SPLIT,
    NUM_SMS,
    _merge_splits,
    split_outputs,
)
from pallas_kernels.paged_tiles import finish  # noqa: E402
from serving.entrypoints.bench.floor import copy_bandwidth  # noqa: E402

# native-1b-parallel's attention: 16 query heads, 4 KV heads of 128, window 2048.
HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 128, 16
WINDOW = 2048
SHAPES = ((256, 312), (128, 1112), (64, 612), (8, 2012), (1, 2012))
SMOKE_SHAPES = ((2, 40),)
LOG2E = math.log2(math.e)
M_INIT = -1e30
TOL = 2e-2


# ----------------------------------------------------------------------------- kernels


def _tile_pages(pt_ref, seq, tile, k_lo, k_hi, *, ppt, page, cols):
    """Physical pages of one tile; pages wholly outside [k_lo, k_hi) -> dummy page 0."""
    logical = tile * ppt + lax.broadcasted_iota(jnp.int32, (ppt,), 0)
    phys = pt_ref[seq * cols + lax.rem(logical, cols)]
    live = (logical >= k_lo // page) & (logical <= (k_hi - 1) // page)
    return jnp.where(live, phys, 0)


def _dot_nt(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _variant_kernel(lens_ref, pt_ref, q_ref, k_ref, v_ref, *out_refs, design, hp, group, ppt,
                    page, cols, window, scale, splits, prefetch):
    b, s_id = pl.program_id(0), pl.program_id(2)
    kb = ppt * page
    length = lens_ref[b]
    rows, e = q_ref.shape
    # Decode: one query at length - 1 sees keys [k_lo, k_hi).
    k_hi = length
    k_lo = jnp.maximum(length - window, 0)
    t_lo = k_lo // kb
    t_hi = jnp.where(length > 0, jnp.maximum((k_hi + kb - 1) // kb, t_lo), t_lo)
    full_lo = (k_lo + kb - 1) // kb
    full_hi = length // kb
    per = (t_hi - t_lo + splits - 1) // splits
    t0 = jnp.minimum(t_lo + s_id * per, t_hi)
    t1 = jnp.minimum(t0 + per, t_hi)
    a = jnp.clip(full_lo, t0, t1)
    c = jnp.clip(full_hi, a, t1)
    c2 = scale * LOG2E

    def load(tile, limit=None):
        pages = _tile_pages(pt_ref, b, tile, k_lo, k_hi, ppt=ppt, page=page, cols=cols)
        if limit is not None:  # prefetch past the program's last tile: the (cached) dummy page
            pages = jnp.where(tile < limit, pages, 0)
        ks = tuple(k_ref[j, pages].reshape(kb, e) for j in range(hp))
        vs = tuple(v_ref[j, pages].reshape(kb, e) for j in range(hp))
        return ks, vs

    def span_mask(tile):
        kpos = tile * kb + lax.broadcasted_iota(jnp.int32, (kb,), 0)
        return (kpos >= k_lo) & (kpos < k_hi)

    if design == "bcast":
        qs = tuple(q_ref[r, :].astype(jnp.float32) * c2 for r in range(rows))

        def compute(tile, state, kv, masked):
            (ks, vs) = kv
            k = ks[0].astype(jnp.float32)
            v = vs[0]
            if masked:
                ok = span_mask(tile)
                v = jnp.where(ok[:, None], v, jnp.zeros_like(v))
            v = v.astype(jnp.float32)
            new = []
            for r in range(rows):
                o, m, l = state[r]
                s = jnp.sum(qs[r][None, :] * k, axis=1)
                if masked:
                    s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - m_new)
                l = l * alpha + jnp.sum(p)
                o = o * alpha + jnp.sum(p[:, None] * v, axis=0)
                new.append((o, m_new, l))
            return tuple(new)

        state0 = tuple((jnp.zeros((e,), jnp.float32), jnp.float32(M_INIT), jnp.float32(0.0))
                       for _ in range(rows))
    else:
        q = q_ref[...]
        rowhead = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group

        def compute(tile, state, kv, masked):
            ks, vs = kv
            o, m, l = state
            s = _dot_nt(q, ks[0])
            for j in range(1, hp):
                s = jnp.where(rowhead == j, _dot_nt(q, ks[j]), s)
            s = s * c2
            if masked:
                ok = span_mask(tile)
                s = jnp.where(ok[None, :], s, -jnp.inf)
                vs = tuple(jnp.where(ok[:, None], v, jnp.zeros_like(v)) for v in vs)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            o = o * alpha[:, None]
            if hp == 1:
                o = o + _dot_nn(p.astype(vs[0].dtype), vs[0])
            else:
                for j in range(hp):
                    pj = jnp.where(rowhead == j, p, 0.0).astype(vs[j].dtype)
                    o = o + _dot_nn(pj, vs[j])
            return o, m_new, l

        state0 = (jnp.zeros((rows, e), jnp.float32), jnp.full((rows,), M_INIT, jnp.float32),
                  jnp.zeros((rows,), jnp.float32))

    if prefetch:
        def body(masked):
            def step(tile, carry):
                state, kv = carry
                nxt = load(tile + 1, t1)
                return compute(tile, state, kv, masked), nxt
            return step

        carry = (state0, load(t0, t1))
        carry = lax.fori_loop(t0, a, body(True), carry)
        carry = lax.fori_loop(a, c, body(False), carry)
        state, _ = lax.fori_loop(c, t1, body(True), carry)
    else:
        def body(masked):
            return lambda tile, st: compute(tile, st, load(tile), masked)

        state = lax.fori_loop(t0, a, body(True), state0)
        state = lax.fori_loop(a, c, body(False), state)
        state = lax.fori_loop(c, t1, body(True), state)

    if design == "bcast":  # per-row states -> [rows, e], [rows]
        ri = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        o = jnp.zeros((rows, e), jnp.float32)
        m = jnp.zeros((rows,), jnp.float32)
        l = jnp.zeros((rows,), jnp.float32)
        for r, (o_r, m_r, l_r) in enumerate(state):
            o = jnp.where(ri[:, None] == r, o_r[None, :], o)
            m = jnp.where(ri == r, m_r, m)
            l = jnp.where(ri == r, l_r, l)
        state = (o, m, l)
    o, m, l = state
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = finish(state).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = o, m, l


def auto_splits(programs, max_tiles, max_splits):
    """`paged_decode.default_splits` with a settable cap (the variants try up to 64)."""
    if programs >= 2 * NUM_SMS:
        return 1
    return max(1, min(-(-2 * NUM_SMS // programs), max_tiles // MIN_TILES_PER_SPLIT, max_splits))


@functools.partial(jax.jit, static_argnames=(
    "design", "tile", "warps", "stages", "prefetch", "splits", "max_splits", "window",
    "interpret"))
def variant_decode(q, k_pages, v_pages, lengths, page_table, *, design, tile, warps, stages,
                   prefetch=False, splits=None, max_splits=32, window=WINDOW, interpret=False):
    """q [b, h, e]; pools [k, N, s, e]; returns [b, h, e] in q.dtype."""
    b, h, e = q.shape
    nk, n_pages, page, _ = k_pages.shape
    g = h // nk
    hp = nk if design == "seq" else 1
    ng = nk // hp
    real = hp * g
    rows = real if design == "bcast" else max(16, pl.next_power_of_2(real))
    ppt = max(1, tile // page)
    kb = ppt * page
    max_tiles = -(-(window + kb - 1) // kb)
    if splits is None:
        splits = auto_splits(b * ng, max_tiles, max_splits)
    qg = q.astype(k_pages.dtype).reshape(b, ng, real, e)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - real), (0, 0)))
    pool_spec = pl.BlockSpec((hp, n_pages, page, e), lambda i, j, x: (j, 0, 0, 0))
    out_shape, out_specs = split_outputs(splits, b, ng, rows, e, q.dtype)
    pt_flat = page_table.reshape(-1)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(
        _variant_kernel, design=design, hp=hp, group=g, ppt=ppt, page=page,
        cols=page_table.shape[1], window=window, scale=e**-0.5, splits=splits, prefetch=prefetch)
    out = pl.pallas_call(
        kernel,
        grid=(b, ng, splits),
        in_specs=[whole(lengths.shape), whole(pt_flat.shape),
                  pl.BlockSpec((None, None, rows, e), lambda i, j, x: (i, j, 0, 0)),
                  pool_spec, pool_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"paged_decode_{design}",
    )(lengths, pt_flat, qg, k_pages, v_pages)
    if splits > 1:
        out = _merge_splits(*lax.optimization_barrier(out)).astype(q.dtype)
    return out[:, :, :real].reshape(b, h, e)


# ----------------------------------------------------------------------------- Mosaic GPU


@functools.partial(jax.jit, static_argnames=("tile", "stages", "window"))
def mosaic_decode(q, k_pages, v_pages, lengths, page_table, *, tile=64, stages=3, window=WINDOW):
    """Mosaic GPU (jax >= 0.11 on Hopper): grid (sequence, KV head), one warpgroup.

    Each tile's pages are fetched by one TMA copy per page (16 x 128 bf16 = 4 KiB, K and
    V) into a `stages`-deep ring of swizzled shared-memory buffers that complete on one
    barrier per slot; q.k and p.v are wgmma with the G query rows padded to 64. Pages
    before/after the span are clamped to the first/last live page (masked by position),
    so the dummy page is never read. No splits (large batches only).
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, h, e = q.shape
    nk, _, page, _ = k_pages.shape
    g = h // nk
    rows = 64
    ppt = tile // page
    cols = page_table.shape[1]
    c2 = e**-0.5 * LOG2E
    dt = k_pages.dtype
    qg = q.astype(dt).reshape(b, nk, g, e)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    pt_flat = page_table.reshape(-1)

    def body(lens_gmem, pt_gmem, q_gmem, k_gmem, v_gmem, o_gmem):
        bi = lax.axis_index("b")
        hi = lax.axis_index("h")

        def scoped(q_smem, k_smem, v_smem, q_bar, kv_bar):
            length = lens_gmem[bi]
            k_hi = length
            k_lo = jnp.maximum(length - window, 0)
            t_lo = lax.div(k_lo, jnp.int32(tile))
            n_t = jnp.maximum(lax.div(k_hi + (tile - 1), jnp.int32(tile)) - t_lo, 0)
            lo_pg = lax.div(k_lo, jnp.int32(page))
            hi_pg = jnp.maximum(lax.div(k_hi - 1, jnp.int32(page)), lo_pg)
            plgpu.copy_gmem_to_smem(q_gmem.at[bi, hi], q_smem, q_bar.at[0])

            def issue(i):
                slot = lax.rem(i, jnp.int32(stages))
                for p in range(ppt):
                    logical = jnp.minimum(jnp.maximum((t_lo + i) * ppt + p, lo_pg), hi_pg)
                    phys = pt_gmem[bi * cols + lax.rem(logical, jnp.int32(cols))]
                    dst = pl.ds(p * page, page)
                    plgpu.copy_gmem_to_smem(k_gmem.at[hi, phys], k_smem.at[slot, dst], kv_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_gmem.at[hi, phys], v_smem.at[slot, dst], kv_bar.at[slot])

            for i in range(stages):
                pl.when(i < n_t)(functools.partial(issue, jnp.int32(i)))
            plgpu.barrier_wait(q_bar.at[0])

            def step(i, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(kv_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((rows, tile), jnp.float32)) * c2
                kpos = (t_lo + i) * tile + plgpu.broadcasted_iota(
                    jnp.int32, (rows, tile), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where((kpos >= k_lo) & (kpos < k_hi), s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dt)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                pl.when(i + stages < n_t)(functools.partial(issue, i + stages))
                return acc, m_new, l_i

            m0 = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32),
                                   plgpu.Layout.WGMMA.reduce(1))
            l0 = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32),
                                   plgpu.Layout.WGMMA.reduce(1))
            a0 = plgpu.layout_cast(jnp.full((rows, e), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            acc, _, l_i = lax.fori_loop(0, n_t, step, (a0, m0, l0))
            l_i = jnp.maximum(l_i, 1e-30)
            acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            q_smem[...] = acc.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[bi, hi])
            plgpu.wait_smem_to_gmem(0)

        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        pl.run_scoped(
            scoped,
            plgpu.SMEM((rows, e), dt, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, tile, e), dt, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, tile, e), dt, transforms=(tiling, swizzle)),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=2 * ppt, num_barriers=stages),
        )

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, nk, rows, e), q.dtype),
        grid=(b, nk),
        grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(lengths, pt_flat, qg, k_pages, v_pages)
    return out[:, :, :g].reshape(b, h, e)


# (name, kwargs) of the variants timed on the GPU; kwargs with "mosaic" go to mosaic_decode.
# H100, 2026-11-24: no variant beat the engine's kernel by more than the run-to-run spread
# at batch >= 8 (see the report in the session notes). Dropped after the first runs: bcast
# (all slower), seq without prefetch, seq with 2-3 stages (T128 s3 exceeds shared memory),
# grp T128, grp T32 w1 pf, grp T64 w2 pf, mgpu T64 s3.
VARIANTS = [
    ("grp  T64 w2", dict(design="grp", tile=64, warps=2, stages=1)),
    ("grp  T32 w2", dict(design="grp", tile=32, warps=2, stages=1)),
    ("grp  T32 w4", dict(design="grp", tile=32, warps=4, stages=1)),
    ("grp  T16 w2 x64", dict(design="grp", tile=16, warps=2, stages=1, max_splits=64)),
    ("grp  T32 w2 pf", dict(design="grp", tile=32, warps=2, stages=1, prefetch=True)),
    ("grp  T64 w4 pf", dict(design="grp", tile=64, warps=4, stages=1, prefetch=True)),
    ("grp  T64 w8 pf", dict(design="grp", tile=64, warps=8, stages=1, prefetch=True)),
    ("seq  T16 w4 pf", dict(design="seq", tile=16, warps=4, stages=1, prefetch=True, max_splits=64)),
    ("mgpu T64 s2", dict(mosaic=True, tile=64, stages=2)),
    ("mgpu T128 s2", dict(mosaic=True, tile=128, stages=2)),
]
COMPACT_TOO = ("grp  T64 w2", "mgpu T64 s2")
SMOKE_VARIANTS = [
    ("grp  T32 w2", dict(design="grp", tile=32, warps=2, stages=1)),
    ("grp  T32 w4 pf", dict(design="grp", tile=32, warps=4, stages=1, prefetch=True)),
    ("seq  T16 w4", dict(design="seq", tile=16, warps=4, stages=1, max_splits=64)),
    ("seq  T32 w8 pf", dict(design="seq", tile=32, warps=8, stages=1, prefetch=True)),
    ("bcast T32 w4 pf", dict(design="bcast", tile=32, warps=4, stages=1, prefetch=True)),
    ("bcast T16 w4", dict(design="bcast", tile=16, warps=4, stages=1)),
]


def make_fn(kw, interpret):
    kw = dict(kw)
    if kw.pop("mosaic", False):
        return functools.partial(mosaic_decode, **kw)
    return functools.partial(variant_decode, interpret=interpret, **kw)


# ----------------------------------------------------------------------------- harness


def make_inputs(rng, lengths, layout="random"):
    """Decode inputs. layout "random": live pages at random slots of a pool sized to the ring
    (the benchmarks' usual layout); "compact": each sequence's live pages consecutive and the
    sequences back to back in a pool of exactly the live pages (a locality best case)."""
    lengths = np.asarray(lengths, np.int32)
    first = np.maximum(lengths - WINDOW, 0)
    cols = ring_columns(WINDOW, int(lengths.max()), PAGE)
    if layout == "random":
        k, v, table = paged_pool(rng, len(lengths), lengths, first, kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, page_size=PAGE, columns=cols)
    else:
        table = np.zeros((len(lengths), cols), np.int32)
        nxt = 1
        for i, (lo, n) in enumerate(zip(first, lengths, strict=True)):
            pages = np.arange(lo // PAGE, (n - 1) // PAGE + 1)
            table[i, pages % cols] = nxt + np.arange(len(pages))
            nxt += len(pages)
        shape = (KV_HEADS, nxt, PAGE, HEAD_DIM)
        kk, kv = jax.random.split(jax.random.key(int(rng.integers(2**31))))
        k = jax.random.normal(kk, shape, jnp.bfloat16)
        v = jax.random.normal(kv, shape, jnp.bfloat16)
        table = jnp.asarray(table)
    q = jax.random.normal(jax.random.key(int(rng.integers(2**31))),
                          (len(lengths), HEADS, HEAD_DIM), jnp.bfloat16)
    return q, k, v, jnp.asarray(lengths), table


def time_rot(fn, sets, *, rounds=5, target_s=0.03):
    """Median seconds per call, calls rotating over the input sets (async within a round)."""
    for args in sets:
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*sets[0]))
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(len(sets), min(3000, int(target_s / once)))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for i in range(reps):
            out = fn(*sets[i % len(sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def time_chain(fn, big, batch, nsets, calls):
    """Device seconds per call: `calls` calls (rotating over the nsets slices of `big`,
    which share one page pool) inside one jit, so host dispatch is amortised."""
    def chain(qa, k, v, la, ta):
        outs = []
        for i in range(calls):
            sl = slice((i % nsets) * batch, (i % nsets + 1) * batch)
            outs.append(fn(qa[sl], k, v, la[sl], ta[sl]))
        return outs
    return time_rot(jax.jit(chain), [big]) / calls


def max_err(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shape, interpret mode (CPU check)")
    p.add_argument("--only", default=None, help="comma-separated substrings of variant names")
    p.add_argument("--shapes", default=None, help="e.g. 256x312,8x2012")
    p.add_argument("--budget", type=float, default=480.0, help="seconds; later timings skipped")
    a = p.parse_args()
    t_start = time.perf_counter()
    interp = a.smoke
    variants = SMOKE_VARIANTS if a.smoke else VARIANTS
    if a.only:
        keys = a.only.split(",")
        variants = [v for v in variants if any(k in v[0] for k in keys)]
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    if a.shapes:
        shapes = tuple(tuple(int(x) for x in s.split("x")) for s in a.shapes.split(","))
    dev = str(jax.devices()[0])
    print(f"device {dev}, jax {jax.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
          flush=True)
    bw = 1e12 if a.smoke else copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    impl = "interpret" if interp else "pallas"
    engine = jax.jit(lambda *x: paged_attention_decode(*x, window=WINDOW, impl=impl))
    result = {"device": dev, "jax": jax.__version__, "copy_Bps": bw, "check": {}, "rows": []}

    def dump():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    # 1. Correctness on mixed lengths (0, 1, off the tile grid, past the window) vs the reference.
    rng = np.random.default_rng(0)
    mixed = [0, 1, 15, 16, 17, 33, 100, 40, 313] if a.smoke else \
        [0, 1, 15, 16, 17, 33, 100, 312, 1111, 2047, 2048, 2049, 2100, 2600, 4097, 63]
    args = make_inputs(rng, mixed)
    ref = jax.jit(lambda *x: paged_attention_decode_reference(*x, window=WINDOW))(*args)
    e = max_err(engine(*args), ref)
    result["check"]["engine default"] = e
    print(f"mixed-length check: engine default max|err| {e:.2e}", flush=True)
    if a.smoke:  # Mosaic GPU cannot run here: check that it traces and lowers for CUDA
        try:
            jax.jit(mosaic_decode).trace(*args).lower(lowering_platforms=("cuda",))
            print("  mgpu: lowers for CUDA (not run on CPU)", flush=True)
        except Exception as err:
            print(f"  mgpu: does not lower here: {type(err).__name__}: {str(err)[:300]}", flush=True)
    ok_names = []
    for name, kw in variants:
        try:
            fn = make_fn(kw, interp)
            out = fn(*args)
            e = max_err(out, ref)
            nan = bool(jnp.any(jnp.isnan(out.astype(jnp.float32))))
            good = e < TOL and not nan
            e2 = None
            if "mosaic" not in kw:  # 3 splits forced: exercises the merge at any batch
                e2 = max_err(fn(*args, splits=3), ref)
                good = good and e2 < TOL
        except Exception as err:  # a design the compiler refuses: report and go on
            print(f"  {name}: FAILED {type(err).__name__}: {str(err)[:600]}", flush=True)
            result["check"][name] = f"failed: {type(err).__name__}: {str(err)[:2000]}"
            continue
        result["check"][name] = {"max_err": e, "max_err_split3": e2, "nan": nan, "ok": good}
        print(f"  {name}: max|err| {e:.2e} (3 splits {e2 if e2 is None else f'{e2:.2e}'}) "
              f"{'ok' if good else 'WRONG'}", flush=True)
        if good:
            ok_names.append(name)
    dump()

    # 2. Timing at the engine's shapes, each beside the engine default: `calls` calls in one
    # jit, rotating over nsets slices of one pool so that K/V are not L2 hits.
    table = {}
    for batch, context in shapes:
        seen = min(context, WINDOW)
        nbytes = 2 * batch * seen * KV_HEADS * HEAD_DIM * 2
        # Every call of a chain reads its own slice: identical calls would be merged by XLA.
        nsets = 1 if a.smoke else max(4, min(16, -(-256_000_000 // nbytes)))
        calls = nsets
        big = make_inputs(rng, [context] * (batch * nsets))
        compact = make_inputs(rng, [context] * (batch * nsets), layout="compact")
        set0 = (big[0][:batch], big[1], big[2], big[3][:batch], big[4][:batch])
        base = engine(*set0)

        def timed(fn, pool=big, set0=set0, batch=batch, nsets=nsets, calls=calls):
            if a.smoke:
                return time_rot(fn, [set0], rounds=1, target_s=0.0)
            return time_chain(fn, pool, batch, nsets, calls)

        t = timed(engine)
        row = dict(batch=batch, context=context, variant="engine default", us=t * 1e6,
                   pct_copy=100 * nbytes / t / bw)
        result["rows"].append(row)
        table[(batch, context, "engine default")] = row
        print(f"B={batch} ctx={context} ({nsets} sets, {calls} calls/jit, {nbytes / 1e6:.1f} MB): "
              f"engine default {t * 1e6:7.1f} us {100 * nbytes / t / bw:5.1f}%", flush=True)
        for name, kw in variants:
            if name not in ok_names:
                continue
            if time.perf_counter() - t_start > a.budget:
                print(f"  {name}: skipped (budget)", flush=True)
                continue
            try:
                fn = make_fn(kw, interp)
                e = max_err(fn(*set0), base)
                t = timed(fn)
            except Exception as err:
                print(f"  {name}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            row = dict(batch=batch, context=context, variant=name, us=t * 1e6,
                       pct_copy=100 * nbytes / t / bw, err_vs_engine=e)
            result["rows"].append(row)
            table[(batch, context, name)] = row
            print(f"  {name:18s} {t * 1e6:7.1f} us {100 * nbytes / t / bw:5.1f}%  "
                  f"err vs engine {e:.1e}", flush=True)
        extra = [("engine default again", engine, big)]
        if not a.smoke:  # locality diagnostic: the same kernels on the compact layout
            extra += [("engine [compact]", engine, compact)]
            extra += [(f"{n} [compact]", make_fn(kw, interp), compact)
                      for n, kw in variants if n in COMPACT_TOO and n in ok_names]
        for name, fn, pool in extra:
            if time.perf_counter() - t_start > a.budget:
                continue
            t = timed(fn, pool)
            row = dict(batch=batch, context=context, variant=name, us=t * 1e6,
                       pct_copy=100 * nbytes / t / bw)
            result["rows"].append(row)
            table[(batch, context, name)] = row
            print(f"  {name:18s} {t * 1e6:7.1f} us {100 * nbytes / t / bw:5.1f}%", flush=True)
        dump()

    # 3. Summary table: us (% of copy) per variant x shape.
    names = ["engine default"] + ok_names + ["engine default again", "engine [compact]"] + [
        f"{n} [compact]" for n in COMPACT_TOO]
    head = "variant".ljust(18) + "".join(f"{f'{b}x{c}':>16s}" for b, c in shapes)
    print("\n" + head)
    for n in names:
        cells = []
        for b, c in shapes:
            r = table.get((b, c, n))
            cells.append(f"{r['us']:7.1f} ({r['pct_copy']:4.1f}%)" if r else " " * 16)
        print(n.ljust(18) + "".join(f"{x:>16s}" for x in cells))
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    dump()


if __name__ == "__main__":
    main()
