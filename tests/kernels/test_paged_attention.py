"""Paged attention: kernel vs reference vs a float64 numpy oracle, and write_kv.

Runs the Pallas kernels in interpret mode on CPU (the interpreter fills kernel
outputs with NaN, so an unwritten element fails) and compiled on a GPU. The
oracle sees contiguous K/V only; pages are built through a random permutation
and ring tables whose spare columns point at NaN pages (see paged_oracle).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_oracle import build_cache, decode_np, prefill_np, round_to

from pallas_kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)
from pallas_kernels.paged_decode import decode_pallas
from pallas_kernels.paged_prefill import work_items
from pallas_kernels.paged_tiles import TileConfig, tile_span

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# (kernel vs reference, reference vs float64 oracle), as atol = rtol.
TOL = {"f32": (1e-4, 1e-4), "bf16": (3e-2, 2e-2)}


def _ring_columns(lens, first_visible, s, extra):
    spans = [(n - 1) // s - lo // s + 1 for lo, n in zip(first_visible, lens, strict=True) if n]
    return max(spans) + extra


def _check(name, got, want, tol):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite output"
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=name)


def _pools(cache, dtype):
    return jnp.asarray(cache.k_pages, dtype), jnp.asarray(cache.v_pages, dtype)


DECODE_CASES = [
    # dtype, h, kv, e, s, window, softcap, lens
    ("f32", 8, 2, 64, 8, None, None, [1, 0, 8, 9, 47, 70]),
    ("f32", 4, 1, 64, 16, 20, 2.0, [1, 16, 17, 33, 95, 0]),
    ("bf16", 8, 2, 128, 16, 40, None, [2, 40, 41, 130, 1, 77]),
    ("f32", 6, 2, 64, 8, 1000, None, [3, 64, 65, 1, 0, 100]),
    ("f32", 2, 2, 256, 8, 24, 5.0, [24, 25, 1, 60]),
    ("bf16", 32, 1, 64, 8, 9, 3.0, [9, 10, 1, 31, 0]),
]


def _decode_setup(case):
    """(args, kw, oracle output) for one DECODE_CASES entry."""
    dname, h, nk, e, s, window, softcap, lens = case
    dtype = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    first = [0 if window is None else max(0, n - window) for n in lens]
    cols = _ring_columns(lens, first, s, extra=2)
    cache = build_cache(rng, lens, first, kv_heads=nk, head_dim=e, page_size=s,
                        columns=cols, dtype=dtype)
    q = round_to(rng.standard_normal((len(lens), h, e)), dtype)
    want = decode_np(q, cache, lens, window=window, softcap=softcap, scale=e**-0.5)
    args = (jnp.asarray(q, dtype), *_pools(cache, dtype), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    return args, dict(window=window, softcap=softcap), want


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_decode(case):
    args, kw, want = _decode_setup(case)
    ref = paged_attention_decode(*args, **kw, impl="reference")
    out = paged_attention_decode(*args, **kw, impl=KERNEL_IMPL)
    tol_kernel, tol_ref = TOL[case[0]]
    _check("reference vs oracle", ref, want, tol_ref)
    _check("kernel vs reference", out, np.asarray(jnp.asarray(ref, jnp.float32)), tol_kernel)


@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2]], ids=["mqa-w20", "gqa-w40"])
def test_decode_split_tiles(case):
    """Split-K path (small batches): 16-token tiles shared out over 3 splits."""
    args, kw, want = _decode_setup(case)
    e = args[0].shape[-1]
    cfg = TileConfig(page_size=args[1].shape[2], pages_per_tile=max(1, 16 // args[1].shape[2]),
                     num_columns=args[4].shape[1], window=kw["window"], softcap=kw["softcap"],
                     scale=e**-0.5)
    out = decode_pallas(*args, cfg=cfg, splits=3, num_warps=4, num_stages=1,
                        interpret=KERNEL_IMPL == "interpret")
    _check("split kernel vs oracle", out, want, TOL[case[0]][1])


MULTI_QUERY_CASES = [
    # dtype, h, kv, e, s, window, softcap, queries per sequence, lens (0: padding row), splits
    ("f32", 8, 2, 64, 8, None, None, 5, [5, 0, 9, 47, 70], 1),
    ("f32", 4, 1, 64, 16, 20, 2.0, 3, [3, 16, 17, 33, 95, 0], 1),
    ("bf16", 8, 2, 128, 16, 40, None, 5, [6, 40, 41, 130, 77], 1),
    ("f32", 2, 2, 64, 8, 7, None, 4, [4, 9, 30], 3),
    ("f32", 16, 2, 64, 8, 12, None, 2, [2, 13, 50], 2),  # 2 x 8 heads: 16 rows, no padding
]


@pytest.mark.parametrize("case", MULTI_QUERY_CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_decode_multi_query(case):
    """n queries per sequence (speculative verification) through the decode kernel, against
    the float64 oracle of the same queries as a ragged prefill (each token sees keys up to
    itself, inside its own window); the reference is the prefill reference."""
    dname, h, nk, e, s, window, softcap, n, lens, splits = case
    dtype = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    old = [max(0, x - n) for x in lens]
    first = [0 if window is None else max(0, o - window + 1) for o in old]
    cols = _ring_columns(lens, first, s, extra=1)
    cache = build_cache(rng, lens, first, kv_heads=nk, head_dim=e, page_size=s,
                        columns=cols, dtype=dtype)
    b = len(lens)
    q = round_to(rng.standard_normal((b * n, h, e)), dtype)
    n_new = [n if x else 0 for x in lens]  # a padding row has no query token that counts
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    rows = np.concatenate([np.arange(i * n, i * n + k) for i, k in enumerate(n_new)]).astype(int)
    want_real = prefill_np(q[rows], cache, cu, lens, window=window, softcap=softcap, scale=e**-0.5)
    want = np.zeros((b * n, h, e))
    want[rows] = want_real[:len(rows)]
    args = (jnp.asarray(q, dtype), *_pools(cache, dtype), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    kw = dict(window=window, softcap=softcap)
    ref = paged_attention_decode(*args, **kw, impl="reference", queries=n)
    tol_kernel, tol_ref = TOL[dname]
    _check("reference vs oracle", np.asarray(jnp.asarray(ref, jnp.float32))[rows], want[rows], tol_ref)
    cfg = TileConfig(page_size=s, pages_per_tile=max(1, 16 // s), num_columns=cols, window=window,
                     softcap=softcap, scale=e**-0.5)
    for out in (paged_attention_decode(*args, **kw, impl=KERNEL_IMPL, queries=n),
                decode_pallas(*args, cfg=cfg, splits=splits, num_warps=4, num_stages=1,
                              interpret=KERNEL_IMPL == "interpret", queries=n)):
        _check("kernel vs oracle", out, want, tol_ref)
    with pytest.raises(ValueError, match="queries"):
        paged_attention_decode(args[0][:-1], *args[1:], **kw, impl="reference", queries=n)


PREFILL_CASES = [
    # dtype, h, kv, e, s, window, softcap, new tokens n_i, earlier context, padding
    ("f32", 8, 2, 64, 8, None, None, [5, 1, 0, 70], [0, 9, 3, 90], 3),
    ("bf16", 8, 2, 128, 16, 12, 4.0, [40, 1, 17], [30, 0, 5], 0),
    ("f32", 4, 1, 64, 16, 40, None, [3, 24, 50], [50, 0, 7], 5),
    ("f32", 6, 2, 64, 8, 7, None, [33, 2, 9], [0, 11, 60], 2),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_prefill(case):
    dname, h, nk, e, s, window, softcap, n_new, n_old, pad = case
    dtype = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    lens = [a + b for a, b in zip(n_new, n_old, strict=True)]
    first = [0 if window is None else max(0, old - window + 1) for old in n_old]
    cols = _ring_columns(lens, first, s, extra=1)
    cache = build_cache(rng, lens, first, kv_heads=nk, head_dim=e, page_size=s,
                        columns=cols, dtype=dtype)
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    t = int(cu[-1]) + pad
    q = round_to(rng.standard_normal((t, h, e)), dtype)
    want = prefill_np(q, cache, cu, lens, window=window, softcap=softcap, scale=e**-0.5)
    args = (jnp.asarray(q, dtype), *_pools(cache, dtype), jnp.asarray(cu),
            jnp.asarray(lens, jnp.int32), jnp.asarray(cache.page_table))
    kw = dict(window=window, softcap=softcap)
    ref = paged_attention_prefill(*args, **kw, impl="reference")
    out = paged_attention_prefill(*args, **kw, impl=KERNEL_IMPL)
    tol_kernel, tol_ref = TOL[dname]
    _check("reference vs oracle", ref, want, tol_ref)
    _check("kernel vs reference", out, np.asarray(jnp.asarray(ref, jnp.float32)), tol_kernel)


def test_work_items_cover_each_token_once():
    rng = np.random.default_rng(7)
    n_new = rng.integers(0, 40, size=6)
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    lens = (n_new + rng.integers(0, 50, size=6)).astype(np.int32)
    t, block_q = int(cu[-1]) + 13, 8
    seq, q0, nq, pos0 = map(np.asarray, work_items(jnp.asarray(cu), jnp.asarray(lens), t, block_q))
    owner = np.full(t, -2)
    pos = np.full(t, -1)
    for sq, a, n, p in zip(seq, q0, nq, pos0, strict=True):
        assert 0 <= n <= block_q
        assert (owner[a:a + n] == -2).all(), "token covered twice"
        owner[a:a + n] = sq
        pos[a:a + n] = p + np.arange(n)
    for i in range(6):
        assert (owner[cu[i]:cu[i + 1]] == i).all()
        assert (pos[cu[i]:cu[i + 1]] == lens[i] - n_new[i] + np.arange(n_new[i])).all()
    assert (owner[cu[-1]:] == -1).all(), "padding tail must be zero-filled"


def _write_inputs(rng, dtype=jnp.float32):
    nk, n_pages, s, e, t = 2, 9, 8, 64, 12
    k_pages = jnp.asarray(rng.standard_normal((nk, n_pages, s, e)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((nk, n_pages, s, e)), dtype)
    slots = rng.choice(np.arange(s, n_pages * s), size=t, replace=False)
    slots[-2:] = [1, 3]  # padding rows write into dummy page 0
    k_new = jnp.asarray(rng.standard_normal((t, nk, e)), dtype)
    v_new = jnp.asarray(rng.standard_normal((t, nk, e)), dtype)
    return k_pages, v_pages, k_new, v_new, jnp.asarray(slots, jnp.int32)


def test_write_kv_matches_numpy():
    k_pages, v_pages, k_new, v_new, slots = _write_inputs(np.random.default_rng(1))
    nk, n_pages, s, e = k_pages.shape
    k_out, v_out = write_kv(k_pages, v_pages, k_new, v_new, slots)
    for pages, new, out in ((k_pages, k_new, k_out), (v_pages, v_new, v_out)):
        want = np.array(pages).reshape(nk, n_pages * s, e)
        want[:, np.asarray(slots)] = np.asarray(new).transpose(1, 0, 2)
        np.testing.assert_array_equal(np.asarray(out), want.reshape(pages.shape))


def test_write_kv_donated_updates_in_place():
    k_pages, v_pages, k_new, v_new, slots = _write_inputs(np.random.default_rng(2))
    ptrs = (k_pages.unsafe_buffer_pointer(), v_pages.unsafe_buffer_pointer())
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    k_out, v_out = step(k_pages, v_pages, k_new, v_new, slots)
    assert k_pages.is_deleted() and v_pages.is_deleted(), "pools were not donated"
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


@pytest.mark.parametrize(
    "bad",
    [
        dict(lengths=np.ones(2, np.float32)),
        dict(page_size=12),
        dict(window=0),
        dict(heads=3),
    ],
    ids=["lengths-dtype", "page-size", "window", "heads"],
)
def test_decode_rejects_bad_arguments(bad):
    """Page-size limits are the kernels' (the references take any); the rest are for all."""
    s = bad.get("page_size", 8)
    h = bad.get("heads", 4)
    pages = jnp.zeros((2, 4, s, 64), jnp.float32)
    lengths = jnp.asarray(bad.get("lengths", np.ones(2, np.int32)))
    with pytest.raises(ValueError):
        paged_attention_decode(jnp.ones((2, h, 64)), pages, pages, lengths,
                               jnp.zeros((2, 3), jnp.int32), window=bad.get("window"),
                               impl="interpret")


def test_references_take_head_dims_and_pages_the_kernels_do_not():
    pages = jnp.ones((1, 3, 4, 24), jnp.float32)
    out = paged_attention_decode(jnp.ones((2, 2, 24)), pages, pages, jnp.asarray([3, 0], jnp.int32),
                                 jnp.asarray([[1, 2], [0, 0]], jnp.int32), impl="reference")
    np.testing.assert_allclose(np.asarray(out[0]), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    with pytest.raises(ValueError, match="for the Pallas kernels"):
        paged_attention_decode(jnp.ones((2, 2, 24)), pages, pages, jnp.asarray([3, 0], jnp.int32),
                               jnp.asarray([[1, 2], [0, 0]], jnp.int32), impl="interpret")


@pytest.mark.parametrize("window", [None, 1, 37, 128, 300])
def test_tile_span_visits_only_tiles_inside_the_window(window):
    """Skipping, not masking: the tiles a decode row visits depend on min(len, w) only."""
    cfg = TileConfig(page_size=8, pages_per_tile=4, num_columns=64, window=window,
                     softcap=None, scale=1.0)
    kb = cfg.tile_tokens
    lens = jnp.arange(1, 3000, 7, dtype=jnp.int32)
    k_lo, k_hi, t_lo, t_hi, full_lo, full_hi = map(np.asarray, tile_span(lens - 1, lens - 1, cfg))
    lens = np.asarray(lens)
    lo = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0)
    np.testing.assert_array_equal(k_lo, lo)
    np.testing.assert_array_equal(k_hi, lens)
    assert (t_lo * kb <= lo).all() and ((t_lo + 1) * kb > lo).all(), "first tile must hold lo"
    assert (t_hi * kb >= lens).all() and ((t_hi - 1) * kb < lens).all(), "last tile must hold len-1"
    if window is not None:
        assert (t_hi - t_lo <= -(-(window - 1) // kb) + 1).all()
    full = (full_lo * kb >= lo) & (full_hi * kb <= lens)
    assert full[full_hi > full_lo].all(), "unmasked tiles must lie inside [lo, len)"
