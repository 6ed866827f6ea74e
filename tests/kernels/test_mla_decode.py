"""MLA latent decode: the Pallas kernel (interpret mode on CPU, compiled on a GPU) against the
paged reference and both against a float64 numpy oracle over contiguous latent rows.

Pages are built by paged_oracle (a random physical permutation, ring columns holding no
live page, page 0 and unwritten slots NaN), with one "KV head" of width L = r + dr. The
oracle attends each query over its sequence's rows with keys the whole rows and values
their first r columns. Cases cover ragged lengths (0, 1, page and tile boundaries), h not
a multiple of the 16-row tile, several row blocks (verification with 2 queries), forced
splits whose boundaries fall inside a sequence, and Kimi Linear's r = 512, dr = 64.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_oracle import build_cache, round_to

from pallas_kernels.mla_decode import MLATuning, mla_decode, mla_decode_fits, mla_tuning

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
TOL = {"f32": (1e-4, 1e-4), "bf16": (3e-2, 2e-2)}  # (kernel vs reference, reference vs oracle)


def oracle(q, rows, lens, rank, scale, queries):
    """q [b * n, h, L] float64; rows[i] [len_i, L] -> [b * n, h, rank]; token t of sequence i
    at position lens[i] - n + t sees rows 0..itself; padding sequences give zeros."""
    out = np.zeros(q.shape[:2] + (rank,))
    for i, n in enumerate(lens):
        for t in range(queries if n else 0):
            k = rows[i][:n - queries + t + 1]
            logits = q[i * queries + t] @ k.T * scale  # [h, keys]
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[i * queries + t] = p @ k[:, :rank] / p.sum(-1, keepdims=True)
    return out


CASES = [
    # dtype, h, r, dr, page size, queries, lens, tuning (None: the defaults)
    ("f32", 5, 32, 16, 8, 1, [1, 0, 8, 9, 47, 70], None),
    ("f32", 5, 32, 16, 8, 1, [1, 0, 8, 9, 47, 70], MLATuning(tile_tokens=16, splits=3)),
    ("bf16", 20, 16, 16, 16, 2, [2, 17, 33, 0, 50], MLATuning(tile_tokens=32, splits=2)),
    ("bf16", 3, 512, 64, 16, 1, [1, 20, 33], None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_mla_decode(case):
    dname, h, r, dr, s, n, lens, tuning = case
    dtype, (tol_kernel, tol_ref) = DTYPES[dname], TOL[dname]
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    cols = max(-(-x // s) for x in lens) + 2
    cache = build_cache(rng, lens, [0] * len(lens), kv_heads=1, head_dim=r + dr, page_size=s,
                        columns=cols, dtype=dtype)
    q = round_to(rng.standard_normal((len(lens) * n, h, r + dr)), dtype)
    scale = (r + dr) ** -0.5 * 0.7
    want = oracle(q, [k[:, 0] for k in cache.k], lens, r, scale, n)
    args = (jnp.asarray(q, dtype), jnp.asarray(cache.k_pages, dtype), jnp.asarray(lens, jnp.int32),
            jnp.asarray(cache.page_table))
    kw = dict(rank=r, scale=scale, queries=n)
    ref = np.asarray(mla_decode(*args, **kw, impl="reference").astype(jnp.float32), np.float64)
    out = np.asarray(mla_decode(*args, **kw, impl=KERNEL_IMPL, tuning=tuning).astype(jnp.float32),
                     np.float64)
    assert out.shape == (len(lens) * n, h, r) and np.isfinite(out).all()
    np.testing.assert_allclose(ref, want, atol=tol_ref, rtol=tol_ref)
    np.testing.assert_allclose(out, ref, atol=tol_kernel, rtol=tol_kernel)
    tuned = mla_tuning(len(lens), n, h, r, args[1], args[3], tuning)
    if tuning is not None:  # the forced launch is the one that ran
        assert (tuned.splits, tuned.tile_tokens) == (tuning.splits, tuning.tile_tokens)
    if h * n > 32:  # several row blocks of one sequence
        assert -(-h * n // tuned.rows) > 1


def test_refusals():
    q = jnp.zeros((2, 4, 48), jnp.float32)
    pages = jnp.zeros((1, 5, 8, 48), jnp.float32)
    lens, table = jnp.ones((2,), jnp.int32), jnp.ones((2, 3), jnp.int32)
    call = lambda *a, **kw: mla_decode(*a, **({"rank": 32, "scale": 1.0, "impl": "interpret"} | kw))  # noqa: E731
    for kw, match in [({"rank": 24}, "kv_lora_rank"), ({"queries": 3}, "queries")]:
        with pytest.raises(ValueError, match=match):
            call(q, pages, lens, table, **kw)
    with pytest.raises(ValueError, match="rope columns"):  # 32 + 8
        call(q[..., :40], pages[..., :40], lens, table)
    with pytest.raises(ValueError, match="page size"):
        call(q, jnp.zeros((1, 5, 12, 48)), lens, table)
    with pytest.raises(ValueError, match="FP8"):
        call(q, pages.astype(jnp.float8_e4m3fn), lens, table)
    with pytest.raises(ValueError, match=r"\[1, N, s, 48\]"):
        call(q, jnp.zeros((2, 5, 8, 48)), lens, table)
    with pytest.raises(ValueError, match="tile_tokens"):
        call(q, pages, lens, table, tuning=MLATuning(tile_tokens=24))
    # The reference takes any split of the row (the engine's fallback for such shapes).
    assert call(q, pages, lens, table, rank=24, impl="reference").shape == (2, 4, 24)
    assert mla_decode_fits(512, jnp.zeros((1, 2, 16, 576), jnp.bfloat16))
    assert not mla_decode_fits(16, jnp.zeros((1, 2, 16, 24), jnp.bfloat16))  # dr = 8


def test_lowers_to_triton():
    """Kimi Linear's shapes (32 heads, 512 + 64, bf16; one and three queries) lower for
    Triton (checked on CPU by lowering for CUDA)."""
    pytest.importorskip("jax._src.lib.triton")
    for n in (1, 3):
        args = (jnp.zeros((2 * n, 32, 576), jnp.bfloat16), jnp.zeros((1, 9, 16, 576), jnp.bfloat16),
                jnp.ones((2,), jnp.int32), jnp.ones((2, 4), jnp.int32))
        f = jax.jit(lambda *a, n=n: mla_decode(*a, rank=512, scale=0.1, queries=n, impl="pallas"))
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
