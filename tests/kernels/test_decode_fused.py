"""Fused decode attention (`paged_attention_decode_fused`): RoPE, K/V write and attention
from a fused q/k/v projection row, against a float64 numpy oracle, and the kernel
(interpret mode on CPU, compiled on a GPU) against the reference.

The pages hold every earlier token; each sequence's current position is NaN in its page
until the op writes it, so a missed or misplaced write shows in the output.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_oracle import build_cache, decode_np, round_to

from pallas_kernels.paged_attention import decode_fused_fits, paged_attention_decode_fused

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
TOL = {"f32": (1e-4, 1e-4), "bf16": (3e-2, 3e-2)}  # (kernel vs reference, reference vs oracle)

CASES = [
    # dtype, h, kv, e, rotary dims, s, window, key multiplier, lens (0: padding row)
    ("f32", 8, 2, 64, 64, 8, None, 1.0, [1, 0, 8, 9, 47, 70]),
    ("bf16", 16, 4, 128, 128, 16, 40, 1.0, [2, 40, 41, 130, 77]),
    ("f32", 4, 1, 128, 64, 16, 20, 1.0, [3, 16, 17, 95, 0]),  # partial rotary
    ("bf16", 8, 2, 64, 64, 8, 24, 0.5, [24, 25, 1, 60]),  # keys scaled before RoPE
    ("f32", 32, 1, 64, 32, 8, 9, 1.0, [9, 10, 31, 0]),  # 32 rows: no padding rows
]


def _rope_np(x, pos, r, theta):
    """float64 rotate-half RoPE of x [heads, e] at position pos over the first r dims."""
    inv = 1.0 / theta ** (np.arange(0, r, 2) / r)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[:, r // 2:r], x[:, :r // 2]], axis=1)
    return np.concatenate([x[:, :r] * np.cos(ang) + rot * np.sin(ang), x[:, r:]], axis=1)


def _setup(case):
    dname, h, nk, e, r, s, window, kmul, lens = case
    dtype = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    b, theta = len(lens), 10_000.0
    first = [0 if window is None else max(0, n - window) for n in lens]
    spans = [(n - 1) // s - lo // s + 1 for lo, n in zip(first, lens, strict=True) if n]
    cache = build_cache(rng, lens, first, kv_heads=nk, head_dim=e, page_size=s,
                        columns=max(spans) + 2, dtype=dtype)
    # The projection row: v, q, k at shuffled column offsets among unused columns.
    width = 3 + (h + 2 * nk) * e + 5
    proj = round_to(rng.standard_normal((b, width)), dtype)
    cols = (3 + nk * e, 3 + nk * e + h * e, 3)  # q, k, v
    pos = np.maximum(np.asarray(lens) - 1, 0)
    inv = 1.0 / theta ** (np.arange(0, r, 2, dtype=np.float32) / r)
    ang = pos[:, None].astype(np.float32) * inv
    ang = np.concatenate([ang, ang], axis=1)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    slots, want_q = [], np.zeros((b, h, e))
    k_pages, v_pages = cache.k_pages.copy(), cache.v_pages.copy()
    for i, n in enumerate(lens):
        row = proj[i]
        q = row[cols[0]:cols[0] + h * e].reshape(h, e)
        k = row[cols[1]:cols[1] + nk * e].reshape(nk, e) * kmul
        v = row[cols[2]:cols[2] + nk * e].reshape(nk, e)
        want_q[i] = _rope_np(q, n - 1, r, theta)
        if n == 0:
            slots.append(int(rng.integers(0, s)))  # padding rows write into dummy page 0
            continue
        phys = cache.page_table[i, (n - 1) // s % cache.page_table.shape[1]]
        slots.append(int(phys * s + (n - 1) % s))
        cache.k[i][n - 1], cache.v[i][n - 1] = _rope_np(k, n - 1, r, theta), v
        k_pages[:, phys, (n - 1) % s] = np.nan  # the op must write the current token
        v_pages[:, phys, (n - 1) % s] = np.nan
    want = decode_np(want_q, cache, lens, window=window, softcap=None, scale=e**-0.5)
    args = (jnp.asarray(proj, dtype), jnp.asarray(cos), jnp.asarray(sin),
            jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    kw = dict(heads=h, cols=cols, key_multiplier=kmul, window=window)
    return args, kw, want, np.asarray(slots)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_fused_decode_matches_oracle_and_reference(case):
    args, kw, want, slots = _setup(case)
    tol_kernel, tol_ref = TOL[case[0]]
    o_ref, k_ref, v_ref = paged_attention_decode_fused(*args, **kw, impl="reference")
    o, k_out, v_out = paged_attention_decode_fused(*args, **kw, impl=KERNEL_IMPL)
    assert o.shape == want.shape and o.dtype == o_ref.dtype == args[0].dtype
    assert np.isfinite(_f64(o)).all(), "non-finite output: a K/V slot was not written"
    np.testing.assert_allclose(_f64(o_ref), want, atol=tol_ref, rtol=tol_ref)
    np.testing.assert_allclose(_f64(o), _f64(o_ref), atol=tol_kernel, rtol=tol_kernel)
    # The pools: the kernel's written slots equal the reference's, all else untouched.
    nk, n_pages, s, e = args[3].shape
    for before, ref, got in ((args[3], k_ref, k_out), (args[4], v_ref, v_out)):
        before, ref, got = (_f64(a).reshape(nk, n_pages * s, e) for a in (before, ref, got))
        keep = np.setdiff1d(np.arange(n_pages * s), slots)
        np.testing.assert_array_equal(got[:, keep], before[:, keep])
        real = slots[np.asarray(args[6]) > 0]
        np.testing.assert_allclose(got[:, real], ref[:, real], atol=tol_kernel, rtol=tol_kernel)


def test_fused_decode_donated_pools_update_in_place():
    args, kw, _, _ = _setup(CASES[0])
    args = (*args[:3], jnp.array(args[3]), jnp.array(args[4]), *args[5:])
    ptrs = (args[3].unsafe_buffer_pointer(), args[4].unsafe_buffer_pointer())
    step = jax.jit(lambda *a: paged_attention_decode_fused(*a, **kw, impl=KERNEL_IMPL),
                   donate_argnums=(3, 4))
    _, k_out, v_out = step(*args)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


def test_fits_and_refusals():
    pages = jnp.zeros((2, 4, 16, 128), jnp.bfloat16)
    assert decode_fused_fits(128, 128, pages) and decode_fused_fits(128, 64, pages)
    assert not decode_fused_fits(128, 96, pages)  # 48-wide halves: not a power of 2
    assert not decode_fused_fits(64, 64, pages)  # pages wider than the head
    args, kw, _, _ = _setup(CASES[0])
    with pytest.raises(ValueError, match="cols"):
        paged_attention_decode_fused(*args, **{**kw, "cols": (0, 0, 10**6)}, impl="reference")
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_attention_decode_fused(*args[:5], args[5][:-1], *args[6:], **kw, impl="reference")


@pytest.mark.parametrize("splits", [1, 3])
def test_fused_decode_any_split_count(monkeypatch, splits):
    """The kernel's split paths: one program per sequence and KV head, and three splits
    of the tile loop (the current token attended by the last)."""
    import pallas_kernels.paged_attention as pa
    monkeypatch.setattr(pa, "default_splits", lambda *_: splits)
    for case in (CASES[1], CASES[3]):
        args, kw, want, _ = _setup(case)
        o, _, _ = paged_attention_decode_fused(*args, **kw, impl=KERNEL_IMPL)
        np.testing.assert_allclose(_f64(o), want, atol=TOL[case[0]][1], rtol=TOL[case[0]][1])
