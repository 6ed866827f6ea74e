"""Paged decode attention over MLA's latent cache: one Pallas kernel (Triton) and its reference.

MLA (hybrid_jax/layers/mla.py) caches one latent row of L = r + dr values per token
(r = kv_lora_rank, dr = qk_rope_head_dim; 512 + 64 = 576 for Kimi Linear) in pages
[1, N, s, L]: one "KV head" shared by all h query heads. With queries absorbed into latent
space, q [h, L], a decode step is multi-query attention in latent space:

    logits_j = scale * q . row_j          (all L columns)
    o        = softmax(logits) . row[:, :r]  (the values: the same rows' first r columns)

Shapes: b sequences, n = `queries` query tokens per sequence (1 for decode; k + 1 for
speculative verification), h query heads, q [b * n, h, L] sequence-major, lengths int32 [b]
(tokens in cache including the current ones; query token i of sequence j sits at
lengths[j] - n + i and sees the keys up to itself), page_table int32 [b, T] a ring (logical
page i in column i % T). Returns o [b * n, h, r] in q's dtype; padding sequences
(lengths == 0) give zeros.

The kernel, on grid (sequence, row block, split): a program holds R query rows of one
sequence (its n x h (token, head) rows, token-major, padded with zero rows to a power of
two >= 16; R = all of them up to `MAX_ROWS`, so for Kimi Linear's 32 heads each latent row
is read ONCE per step for all heads) and walks tiles of whole pages from position 0 to the
sequence's length (never the whole ring as the reference does). L is not a power of two, so
each tile is loaded as two power-of-two column blocks, [kb, r] and [kb, dr]; the logits are
the sum of the two blocks' dot products, and the [kb, r] block already in registers is the
value tile (no second read). f32 accumulation, online softmax in base 2, masks on edge
tiles only (`paged_tiles`). With `splits` > 1 each program takes a contiguous share of the
tiles and the partial (o, m, l) are merged in XLA (`paged_decode.merge_splits`).

The reference (`mla_decode_reference`) is the paged attention reference with the pages
passed as both K and V (`paged_attention_decode(..., impl="reference")`), its first r
output columns: it shares no code with the kernel.

Kernel limits (`mla_decode_fits`; ValueError naming the field otherwise): r and dr powers
of two >= 16 (Triton dots need every dimension >= 16), page size a power of two in
[8, 64], pages bf16 / f16 / f32. FP8 pages are refused (the MLA cache is never FP8:
`kv_cache_dtype="fp8"` is refused for MLA models by the engine). No window, no soft-cap:
MLA has neither.

This module knows the page layout and the ring table, nothing of models or scheduling.
Checked in interpret mode on CPU and lowered to Triton IR there (tests/kernels/
test_mla_decode.py); not yet compiled or timed on a GPU (benchmarks/mla_decode.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import dot, impl_kwargs, is_pow2
from pallas_kernels.paged_attention import paged_attention_decode
from pallas_kernels.paged_decode import (
    MIN_ROWS,
    default_splits,
    merge_splits,
    split_outputs,
    split_range,
)
from pallas_kernels.paged_tiles import (
    LOG2E,
    TileConfig,
    finish,
    init_carry,
    softmax_tile,
    tile_pages,
    tile_span,
    visible,
)

# Rows per program: 32 holds Kimi Linear's 32 heads (TP = 1) in one program, its f32
# accumulator [32, 512] in registers over 8 warps. More rows (verification, or more heads)
# take more row blocks on the grid; each re-reads the latent (from L2, mostly).
MAX_ROWS = 32
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MLATuning:
    """A launch's tuning; 0 fields are chosen by `mla_tuning` from the shapes: ~32 KiB tiles
    (H100, 2026-12-06, Kimi Linear's 576-wide latent at 32k context: 32-token tiles took 155
    / 776 us at batch 1 / 16 against 249 / 1,294 us for 16-token ones;
    docs/bench/h100-2026-12-06/mla_sweep.txt), no cp.async stages (2 stages: 1.5-2.4x
    slower), splits only while b x row blocks cannot fill the GPU twice."""

    rows: int = 0  # query rows per program, a power of two >= 16
    tile_tokens: int = 0  # tokens per tile (whole pages), a power of two
    splits: int = 0
    num_warps: int = 0
    num_stages: int = 1


def _check_dims(rank: int, rope: int, page_size: int, dtype) -> str | None:
    """Why the kernel does not take these shapes, or None."""
    if not (is_pow2(rank) and rank >= 16):
        return f"kv_lora_rank {rank=} must be a power of two >= 16 for the MLA decode kernel"
    if not (is_pow2(rope) and rope >= 16):
        return (f"the key's rope columns {rope=} (latent width - rank) must be a power of two "
                ">= 16 for the MLA decode kernel")
    if not (is_pow2(page_size) and 8 <= page_size <= 64):
        return f"page size {page_size=} must be a power of two in [8, 64] for the MLA decode kernel"
    if jnp.dtype(dtype) not in DTYPES:
        return f"pages dtype {jnp.dtype(dtype)} must be one of bfloat16, float16, float32 (no FP8 for MLA)"
    return None


def mla_decode_fits(rank: int, pages) -> bool:
    """Whether the kernel takes latent pages [1, N, s, L] with the first `rank` columns the
    value (the engine runs the reference for shapes it does not take)."""
    return pages.ndim == 4 and _check_dims(rank, pages.shape[3] - rank, pages.shape[2],
                                           pages.dtype) is None


def mla_tuning(b: int, queries: int, heads: int, rank: int, pages, page_table,
               tuning: MLATuning | None = None) -> MLATuning:
    """The launch's tuning: `tuning`'s nonzero fields, the rest chosen from the shapes."""
    t = tuning or MLATuning()
    _, _, s, width = pages.shape
    rows = t.rows or min(MAX_ROWS, max(MIN_ROWS, pl.next_power_of_2(queries * heads)))
    # ~32 KiB of latent rows per tile (32 tokens of Kimi Linear's 576 bf16 values).
    fit = pl.next_power_of_2(max(1, 32768 // (width * pages.dtype.itemsize)))
    tile = t.tile_tokens or max(s, MIN_ROWS, min(64, fit))
    blocks = -(-queries * heads // rows)
    splits = t.splits or default_splits(b, blocks, -(-page_table.shape[1] * s // tile))
    # The f32 accumulator [rows, rank] takes rows x rank / (32 x warps) registers per thread:
    # 64 at Kimi Linear's 32 x 512 over 8 warps.
    warps = t.num_warps or (8 if rows * rank > 16 * 512 else 4)
    return MLATuning(rows, tile, splits, warps, t.num_stages)


def _check_tuning(t: MLATuning, page_size: int) -> None:
    if not (is_pow2(t.rows) and t.rows >= MIN_ROWS):
        raise ValueError(f"rows={t.rows} must be a power of two >= {MIN_ROWS}")
    if not (is_pow2(t.tile_tokens) and t.tile_tokens >= max(page_size, MIN_ROWS)):
        raise ValueError(f"tile_tokens={t.tile_tokens} must be a power of two >= the page size "
                         f"{page_size} and >= {MIN_ROWS}")
    if t.splits < 1 or t.num_warps < 1 or t.num_stages < 1:
        raise ValueError(f"splits, num_warps and num_stages must be >= 1, got {t}")


def _step(qc, qr, qpos, pages_ref, pt_ref, seq, k_lo, k_hi, cfg: TileConfig, masked: bool):
    """One tile of the online softmax (`masked`, static: an edge tile)."""
    kb, rank, rope = cfg.tile_tokens, qc.shape[1], qr.shape[1]

    def step(tile, carry):
        o, m, l = carry
        pages = tile_pages(pt_ref, seq, tile, k_lo, k_hi, cfg)
        # Two power-of-two column blocks of the same rows; the first is also the value.
        kc = pages_ref[pages, :, pl.ds(0, rank)].reshape(kb, rank)
        kr = pages_ref[pages, :, pl.ds(rank, rope)].reshape(kb, rope)
        s = (dot(qc, kc, trans_b=True) + dot(qr, kr, trans_b=True)) * (cfg.scale * LOG2E)
        if masked:
            kpos = tile * kb + lax.broadcasted_iota(jnp.int32, (kb,), 0)
            s = jnp.where(visible(qpos, kpos, cfg), s, -jnp.inf)
            # Unwritten slots and page 0 hold garbage (NaN in tests): 0 * NaN is NaN.
            in_span = (kpos >= k_lo) & (kpos < k_hi)
            kc = jnp.where(in_span[:, None], kc, jnp.zeros_like(kc))
        return softmax_tile((o, m, l), s, kc)

    return step


def _mla_kernel(lens_ref, pt_ref, qc_ref, qr_ref, pages_ref, *out_refs, cfg: TileConfig,
                splits: int, queries: int, heads: int):
    """One program: sequence b, row block j, split x."""
    b, j, x = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lens_ref[b]
    qc, qr = qc_ref[...], qr_ref[...]
    rows = qc.shape[0]
    if queries == 1:
        qpos = jnp.full((rows,), length - 1, jnp.int32)
    else:  # row j * rows + i is (token, head) = divmod(., heads); padding rows: the last token
        row = j * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
        qpos = length - queries + jnp.minimum(row // heads, queries - 1)
    k_lo, k_hi, t_lo, t_hi, full_lo, full_hi = tile_span(length - queries, length - 1, cfg)
    t_hi = jnp.where(length > 0, t_hi, t_lo)  # padding sequences visit no tile
    t0, t1 = split_range(t_lo, t_hi, x, splits)
    a = jnp.clip(full_lo, t0, t1)
    c = jnp.clip(full_hi, a, t1)
    args = (qc, qr, qpos, pages_ref, pt_ref, b, k_lo, k_hi, cfg)
    carry = init_carry(rows, qc.shape[1])
    carry = lax.fori_loop(t0, a, _step(*args, masked=True), carry)
    carry = lax.fori_loop(a, c, _step(*args, masked=False), carry)
    carry = lax.fori_loop(c, t1, _step(*args, masked=True), carry)
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = finish(carry).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = carry


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("rank", "scale", "queries", "tuning", "impl"))
def mla_decode_pallas(q, pages, lengths, page_table, *, rank: int, scale: float, queries: int,
                      tuning: MLATuning, impl: Impl):
    """Kernel launch (arguments checked by `mla_decode`). q [b * n, h, L]; pages [1, N, s, L]
    -> [b * n, h, rank] in q's dtype."""
    _, n_pages, s, width = pages.shape
    t, h, _ = q.shape
    n, rows = queries, tuning.rows
    b = t // n
    blocks = -(-n * h // rows)
    cfg = TileConfig(page_size=s, pages_per_tile=tuning.tile_tokens // s,
                     num_columns=page_table.shape[1], window=None, softcap=None, scale=scale)
    # [b, n * h] rows token-major, padded to whole row blocks.
    qg = q.astype(pages.dtype).reshape(b, n * h, width)
    qg = jnp.pad(qg, ((0, 0), (0, blocks * rows - n * h), (0, 0))).reshape(b, blocks, rows, width)
    qc, qr = qg[..., :rank], qg[..., rank:]
    q_spec = lambda e: pl.BlockSpec((None, None, rows, e), lambda i, j, x: (i, j, 0, 0))  # noqa: E731
    out_shape, out_specs = split_outputs(tuning.splits, b, blocks, rows, rank, q.dtype)
    pt_flat = page_table.reshape(-1)
    out = pl.pallas_call(
        functools.partial(_mla_kernel, cfg=cfg, splits=tuning.splits, queries=n, heads=h),
        grid=(b, blocks, tuning.splits),
        in_specs=[_whole(lengths.shape), _whole(pt_flat.shape), q_spec(rank), q_spec(width - rank),
                  pl.BlockSpec((None, n_pages, s, width), lambda i, j, x: (0, 0, 0, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        name="mla_decode",
        **impl_kwargs(impl, tuning.num_warps, tuning.num_stages),
    )(lengths, pt_flat, qc, qr, pages)
    if tuning.splits > 1:
        # Keep XLA from fusing the merge into a form that reorders the exp2s (paged_decode).
        out = merge_splits(*lax.optimization_barrier(out)).astype(q.dtype)
    return out.reshape(b, blocks * rows, rank)[:, :n * h].reshape(t, h, rank)


def mla_decode_reference(q, pages, lengths, page_table, *, rank: int, scale: float, queries: int = 1):
    """The paged attention reference over the latent rows as keys AND values, first `rank`
    output columns (same signature as `mla_decode` without impl and tuning)."""
    o = paged_attention_decode(q, pages, pages, lengths, page_table, scale=scale, queries=queries,
                               impl="reference")
    return o[..., :rank]


def mla_decode(
    q: jax.Array,
    pages: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    rank: int,
    scale: float,
    queries: int = 1,
    impl: Impl | None = None,
    tuning: MLATuning | None = None,
) -> jax.Array:
    """MLA decode over latent pages. q [b * n, h, L] (n = `queries`, sequence-major), pages
    [1, N, s, L] (values: the first `rank` columns), lengths int32 [b], page_table int32
    [b, T] -> o [b * n, h, rank] in q's dtype (module doc). `tuning` overrides the kernel's
    launch (benchmarks); the reference ignores it."""
    t, h, width = q.shape
    if queries < 1 or t % queries:
        raise ValueError(f"{queries=} must be >= 1 and divide the {t} query rows")
    b = t // queries
    if pages.ndim != 4 or pages.shape[0] != 1 or pages.shape[3] != width:
        raise ValueError(f"pages {pages.shape} must be [1, N, s, {width}] (one latent row of the "
                         "query's width per token)")
    if not 0 < rank < width:
        raise ValueError(f"{rank=} must be in (0, {width}) (the value columns of the latent row)")
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [{b}], got {lengths.dtype}{lengths.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [{b}, T], got {page_table.dtype}{page_table.shape}")
    if pages.dtype == jnp.float8_e4m3fn:
        raise ValueError("FP8 latent pages are not supported for MLA (kv_cache_dtype='fp8' is refused "
                         "for MLA models)")
    impl = resolve_impl(impl)
    if impl == "reference":
        return mla_decode_reference(q, pages, lengths, page_table, rank=rank, scale=scale,
                                    queries=queries)
    why = _check_dims(rank, width - rank, pages.shape[2], pages.dtype)
    if why is not None:
        raise ValueError(why)
    tuned = mla_tuning(b, queries, h, rank, pages, page_table, tuning)
    _check_tuning(tuned, pages.shape[2])
    return mla_decode_pallas(q, pages, lengths, page_table, rank=rank, scale=float(scale),
                             queries=queries, tuning=tuned, impl=impl)
