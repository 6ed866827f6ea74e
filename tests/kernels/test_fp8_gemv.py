"""FP8 decode GEMV (pallas_kernels/fp8_gemv.py) against the dequantize path and a float64
numpy product of the dequantized weight: both layouts, 1 / 5 / 64 rows, one split and
several (f32 partial sums), interpret mode on CPU, compiled on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.layers.fp8 import quantize
from pallas_kernels.fp8_gemv import fits, fp8_gemv, fp8_reference

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_gemv_matches_the_dequantize_path(transposed):
    rng = np.random.default_rng(int(transposed))
    k, n = 384, 224  # n: an edge block of 96 columns (32-column tiles)
    w = rng.standard_normal((k, n)).astype(np.float32) * np.repeat(rng.uniform(0.01, 10, (3, 1)), 128, 0)
    held = w.T if transposed else w
    kernel, scale = quantize(held, 128)
    full = np.kron(np.asarray(scale, np.float64), np.ones((128, 128)))[:held.shape[0], :held.shape[1]]
    deq = np.asarray(kernel, np.float64) * full
    deq = deq.T if transposed else deq
    for m, splits in ((1, 1), (5, 3), (64, 2)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ deq
        got = fp8_gemv(jnp.asarray(x), kernel, scale, transposed=transposed, splits=splits,
                       interpret=INTERPRET)
        ref = fp8_reference(jnp.asarray(x), kernel, scale, transposed=transposed, out_dtype=jnp.float32)
        tol = 1e-5 * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(ref), want, atol=tol, err_msg="reference")
        np.testing.assert_allclose(np.asarray(got), want, atol=tol, err_msg=f"kernel m={m} splits={splits}")
    assert fits(64, 384, 224, 128) and not fits(65, 384, 256, 128) and not fits(1, 300, 256, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_gemv(jnp.ones((1, 300)), jnp.zeros((300, 256), jnp.float8_e4m3fn), jnp.ones((3, 2)),
                 transposed=False)


def test_fp8_matmul_takes_the_kernel_by_row_count():
    """Linear's FP8 product: the kernel (interpret) for few rows equals the dequantize path
    (impl reference); leading dims are flattened and restored."""
    from hybrid_jax.layers.fp8 import fp8_matmul

    rng = np.random.default_rng(7)
    kernel, scale = quantize(rng.standard_normal((256, 128)).astype(np.float32), 128)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    kw = dict(block=128, dtype=jnp.float32, transposed=False)
    got = fp8_matmul(x, kernel, scale, **kw, impl="interpret")
    want = fp8_matmul(x, kernel, scale, **kw, impl="reference")
    assert got.shape == (2, 3, 128)
    for rows, taken in ((6, True), (65, False)):  # the kernel for few rows only
        jaxpr = str(jax.make_jaxpr(lambda a: fp8_matmul(a, kernel, scale, **kw, impl="interpret"))(
            jnp.zeros((rows, 256))))
        assert ("fp8_gemv" in jaxpr) == taken
        # past 64 rows the dequantized kernel is written apart (no fusion into the GEMM)
        assert ("optimization_barrier" in jaxpr) == (not taken)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fp8_stream_against_float64():
    """The Mosaic GPU FP8 stream kernel's reference (the dequantize path) against float64 on
    any backend, its refusals, and, on a Hopper GPU, the kernel itself (1 / 5 / 64 rows,
    one split and several, n not a multiple of the tile)."""
    from pallas_kernels.fp8_stream import Fp8StreamConfig, fp8_stream_matmul
    from pallas_kernels.fp8_stream import fits as stream_fits

    rng = np.random.default_rng(3)
    n, k = 200, 512  # n: the last tile runs past W's rows (TMA reads zeros there)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.repeat(rng.uniform(0.01, 10, (1, 4)), 128, 1)
    kernel, scale = quantize(w, 128)
    deq = np.asarray(kernel, np.float64) * np.kron(np.asarray(scale, np.float64), np.ones((128, 128)))[:n, :k]
    hopper = getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")
    for m, cfg in ((1, Fp8StreamConfig()), (5, Fp8StreamConfig(tn=64, splits=4)), (64, Fp8StreamConfig())):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ deq.T
        tol = 1e-2 * np.abs(want).max()  # the weight rounded to bf16 after scaling
        for impl in ("reference", "pallas") if hopper else ("reference",):
            got = fp8_stream_matmul(x, kernel, scale, cfg=cfg, out_dtype=jnp.float32, impl=impl)
            np.testing.assert_allclose(np.asarray(got), want, atol=tol, err_msg=f"{impl} m={m} {cfg}")
    assert stream_fits(64, 512, 200, 128) and not stream_fits(65, 512, 200, 128)
    assert not stream_fits(1, 300, 200, 128) and not stream_fits(1, 512, 200, 64)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_stream_matmul(jnp.ones((1, 512), jnp.bfloat16), kernel, scale[:, :2])


def test_fp8_row_reduce_against_float64(monkeypatch):
    """The one-row FP8 product as XLA reductions (hybrid_jax.layers.fp8.row_reduce), both
    forms, against float64: whole 128-blocks, and k with an edge block (one reduction);
    `fp8_matmul` takes it for one row of an [out, in] kernel where one-row products are
    reductions (a GPU; forced here), and not for two rows or the [in, out] layout."""
    from hybrid_jax.layers import fp8, linear
    from hybrid_jax.layers.fp8 import fp8_matmul, row_reduce

    rng = np.random.default_rng(11)
    for n, k in ((200, 512), (130, 300)):
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 10, (n, 1))
        kernel, scale = quantize(w, 128)
        deq = np.asarray(kernel, np.float64) * np.kron(np.asarray(scale, np.float64),
                                                       np.ones((128, 128)))[:n, :k]
        x = rng.standard_normal(k).astype(np.float32)
        want = deq @ x.astype(np.float64)
        for two in (True, False):
            got = np.asarray(row_reduce(jnp.asarray(x), kernel, scale, 128, two_stage=two))
            assert got.shape == (n,) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), err_msg=f"{n}x{k} {two}")
        # with the compute dtype: the scaled weight rounded to it first, as the dequantize path
        rounded = np.asarray(jnp.asarray(deq, jnp.float32).astype(jnp.bfloat16), np.float64)
        got = np.asarray(row_reduce(jnp.asarray(x), kernel, scale, 128, dtype=jnp.bfloat16))
        np.testing.assert_allclose(got, rounded @ x.astype(np.float64), atol=1e-5 * np.abs(want).max())
        assert np.abs(got - want).max() > 1e-4 * np.abs(want).max()  # the rounding is there
    monkeypatch.setattr(linear, "reduction_gemv", lambda: True)
    monkeypatch.setattr(fp8, "FP8_REDUCE", True)
    kw = dict(block=128, dtype=jnp.float32)
    for shape, transposed, taken in (((1, 1, 300), True, True), ((2, 300), True, False),
                                     ((1, 300), False, False)):
        held = kernel if transposed else kernel.T
        sc = scale if transposed else scale.T
        xs = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        jaxpr = str(jax.make_jaxpr(functools.partial(fp8_matmul, kernel=held, scale=sc, **kw,
                                                     transposed=transposed, impl="interpret"))(xs))
        assert ("dot_general" not in jaxpr) == taken, (shape, transposed)
        got = fp8_matmul(xs, held, sc, **kw, transposed=transposed, impl="interpret")
        ref = fp8_matmul(xs, held, sc, **kw, transposed=transposed, impl="reference")
        assert got.shape == (*shape[:-1], 130)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
