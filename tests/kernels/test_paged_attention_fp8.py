"""Paged attention over FP8 (e4m3) pages with per-KV-head scales: kernels (interpret mode on
CPU, compiled on a GPU) and references against a float64 oracle of the dequantized K/V,
and write_kv's quantization against numpy.

The oracle sees contiguous K/V equal to the e4m3 page values times their head's scale
(paged_oracle builds the pages; NaN poison marks what must not be read: e4m3fn has NaN).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paged_oracle import build_cache, decode_np, prefill_np, round_to

from pallas_kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_fused,
    paged_attention_prefill,
    write_kv,
)

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
E4M3 = ml_dtypes.float8_e4m3fn
# q in bf16: the kernels fold k_scale into q (one bf16 rounding) and v_scale into the
# bf16 output; the references round the dequantized K/V to bf16.
TOL = 3e-2


def _fp8_cache(case, lens, first, cols):
    """(cache with e4m3 pages, k_scale, v_scale, cache of the real K/V for the oracle)."""
    h, nk, e, s = case[:4]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    cache = build_cache(rng, lens, first, kv_heads=nk, head_dim=e, page_size=s, columns=cols, dtype=E4M3)
    k_scale = np.asarray([0.02, 3.0, 0.5, 1.0][:nk], np.float32)  # different per head
    v_scale = np.asarray([4.0, 0.01, 1.0, 0.25][:nk], np.float32)
    real = dataclasses.replace(cache, k=[k * k_scale[None, :, None] for k in cache.k],
                               v=[v * v_scale[None, :, None] for v in cache.v])
    return rng, cache, jnp.asarray(k_scale), jnp.asarray(v_scale), real


def _pools(cache):
    return jnp.asarray(cache.k_pages, jnp.float8_e4m3fn), jnp.asarray(cache.v_pages, jnp.float8_e4m3fn)


def _close(name, got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite output"
    scale = np.abs(want).max()
    np.testing.assert_allclose(got / scale, want / scale, atol=TOL, err_msg=name)


# h, kv, e, s, window, softcap, lens
DECODE = (4, 2, 64, 8, 20, None, [2, 21, 0, 30])


@pytest.mark.parametrize("queries", [1, 3])
def test_decode_fp8_pages(queries):
    """One query per sequence, and three (verification), against the oracle of the real K/V."""
    h, nk, e, s, window, softcap, lens = DECODE
    old = [max(0, n - queries) for n in lens]
    first = [0 if window is None else max(0, o - window + 1) for o in old]
    cols = max((n - 1) // s - lo // s + 1 for lo, n in zip(first, lens, strict=True) if n) + 1
    rng, cache, ks, vs, real = _fp8_cache((*DECODE[:4], queries), lens, first, cols)
    b = len(lens)
    q = round_to(rng.standard_normal((b * queries, h, e)), ml_dtypes.bfloat16)
    if queries == 1:
        want = decode_np(q, real, lens, window=window, softcap=softcap, scale=e**-0.5)
        rows = np.arange(b)
    else:
        n_new = [queries if x else 0 for x in lens]
        cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        rows = np.concatenate([np.arange(i * queries, i * queries + k) for i, k in enumerate(n_new)])
        want = np.zeros_like(q)
        want[rows] = prefill_np(q[rows], real, cu, lens, window=window, softcap=softcap,
                                scale=e**-0.5)[:len(rows)]
    args = (jnp.asarray(q, jnp.bfloat16), *_pools(cache), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    kw = dict(window=window, softcap=softcap, queries=queries, k_scale=ks, v_scale=vs)
    ref = paged_attention_decode(*args, **kw, impl="reference")
    out = paged_attention_decode(*args, **kw, impl=KERNEL_IMPL)
    _close("reference vs oracle", np.asarray(jnp.asarray(ref, jnp.float32))[rows], want[rows])
    _close("kernel vs oracle", np.asarray(jnp.asarray(out, jnp.float32))[rows], want[rows])


def test_prefill_fp8_pages():
    h, nk, e, s, window, softcap = 8, 2, 64, 8, 12, 4.0
    n_new, n_old, pad = [10, 1], [14, 0], 3
    lens = [a + b for a, b in zip(n_new, n_old, strict=True)]
    first = [max(0, o - window + 1) for o in n_old]
    cols = max((n - 1) // s - lo // s + 1 for lo, n in zip(first, lens, strict=True)) + 1
    rng, cache, ks, vs, real = _fp8_cache((h, nk, e, s, "prefill"), lens, first, cols)
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    q = round_to(rng.standard_normal((int(cu[-1]) + pad, h, e)), ml_dtypes.bfloat16)
    want = prefill_np(q, real, cu, lens, window=window, softcap=softcap, scale=e**-0.5)
    args = (jnp.asarray(q, jnp.bfloat16), *_pools(cache), jnp.asarray(cu), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    kw = dict(window=window, softcap=softcap, k_scale=ks, v_scale=vs)
    for impl in ("reference", KERNEL_IMPL):
        _close(f"{impl} vs oracle", paged_attention_prefill(*args, **kw, impl=impl), want)


def test_write_kv_quantizes_per_head_and_refuses_mismatched_scales():
    rng = np.random.default_rng(3)
    nk, n_pages, s, e, t = 2, 5, 8, 64, 6
    pages = jnp.zeros((nk, n_pages, s, e), jnp.float8_e4m3fn)
    k_new = jnp.asarray(rng.standard_normal((t, nk, e)) * 50, jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((t, nk, e)), jnp.bfloat16)
    ks, vs = jnp.asarray([0.05, 2.0], jnp.float32), jnp.asarray([1.0, 0.5], jnp.float32)
    slots = jnp.asarray(rng.choice(np.arange(s, n_pages * s), size=t, replace=False), jnp.int32)
    k_out, v_out = write_kv(pages, pages, k_new, v_new, slots, k_scale=ks, v_scale=vs)
    for new, sc, out in ((k_new, ks, k_out), (v_new, vs, v_out)):
        x = np.asarray(new, np.float32) / np.asarray(sc)[None, :, None]
        want = np.clip(x, -448, 448).astype(E4M3)  # values past 448 clip, never NaN
        got = np.asarray(out).reshape(nk, n_pages * s, e)[:, np.asarray(slots)].transpose(1, 0, 2)
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert np.abs(np.asarray(k_out, np.float32)).max() == 448.0  # head 0 clipped
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        write_kv(pages, pages, k_new, v_new, slots)
    with pytest.raises(ValueError, match="one per KV head"):
        write_kv(pages, pages, k_new, v_new, slots, k_scale=ks[:1], v_scale=vs[:1])
    bf16 = pages.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention_decode(jnp.ones((1, 2, e), jnp.bfloat16), bf16, bf16, jnp.ones(1, jnp.int32),
                               jnp.ones((1, 1), jnp.int32), k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="FP8 pages are not taken by the fused decode"):
        paged_attention_decode_fused(jnp.ones((1, 4 * e), jnp.bfloat16), jnp.ones((1, e)), jnp.ones((1, e)),
                                     pages, pages, jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32),
                                     jnp.ones((1, 1), jnp.int32), heads=2, cols=(0, 2 * e, 3 * e))
