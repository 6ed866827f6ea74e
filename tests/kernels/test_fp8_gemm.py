"""The block-scaled FP8 GEMM (pallas_kernels/fp8_gemm.py): activation quantization per
token and 128-wide group, the reference against float64 numpy summing block products
with their scales, the wrapper's padding and layout (its kernel replaced on CPU by a
float64-checked stand-in with the kernel's operands), `fp8_matmul`'s routing, and the
Mosaic GPU kernel itself on a Hopper GPU (jax 0.10.2's interpret mode lacks wgmma on
transposed operands, as for stream_gemm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.layers import fp8 as fp8_layer
from hybrid_jax.layers.fp8 import quantize
from pallas_kernels import fp8_gemm
from pallas_kernels.fp8_gemm import BLOCK, Fp8GemmConfig, check, fits, fp8_block_matmul, quantize_rows

HOPPER = jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def _operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, :BLOCK] *= 30.0  # groups of very different magnitude: per-group scales matter
    w = rng.standard_normal((n, k)).astype(np.float32) * k ** -0.5
    wq, ws = quantize(w, BLOCK)
    return jnp.asarray(x, jnp.bfloat16), wq, ws


def _blockwise64(xq, xs, wq, ws):
    """float64: sum over 128-deep blocks of xs * ws * (xq_b @ wq_b.T), the format's definition."""
    xq = np.asarray(xq.astype(jnp.float32), np.float64)
    wq = np.asarray(wq.astype(jnp.float32), np.float64)
    xs, ws = np.asarray(xs, np.float64), np.asarray(ws, np.float64)
    m, k = xq.shape
    n = wq.shape[0]
    y = np.zeros((m, n))
    for b in range(k // BLOCK):
        kk = slice(b * BLOCK, (b + 1) * BLOCK)
        wsb = np.repeat(ws[:, b], BLOCK)[:n]
        y += (xq[:, kk] @ wq[:, kk].T) * xs[:, b:b + 1] * wsb[None, :]
    return y


def test_quantize_rows_scales_each_group_to_e4m3s_range():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 384)) * [[1.0], [1e-3], [1e3], [0.0], [7.0]],
                    jnp.float32)
    xq, xs = quantize_rows(x)
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (5, 3)
    qf = np.asarray(xq.astype(jnp.float32))
    amax = np.abs(qf.reshape(5, 3, BLOCK)).max(-1)
    np.testing.assert_array_equal(amax[[0, 1, 2, 4]], 448.0)  # each group's largest value is e4m3's max
    np.testing.assert_array_equal(np.asarray(xs)[3], 1.0)  # an all-zero group keeps scale 1
    back = qf.reshape(5, 3, BLOCK) * np.asarray(xs)[..., None]
    xf = np.asarray(x).reshape(5, 3, BLOCK)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values of each group
    big = np.abs(xf) > np.abs(xf).max(-1, keepdims=True) / 64
    assert np.all(np.abs(back - xf)[big] <= np.abs(xf)[big] * 2 ** -4 + 1e-30)


@pytest.mark.parametrize("m,k,n", [(8, 256, 128), (130, 384, 200), (64, 512, 384)])
def test_reference_is_the_blockwise_definition(m, k, n):
    x, wq, ws = _operands(m, k, n, seed=m + n)
    xq, xs = quantize_rows(x)
    got = np.asarray(fp8_gemm.reference(xq, xs, wq, ws, jnp.float32), np.float64)
    want = _blockwise64(xq, xs, wq, ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and against the unquantized activations (the dequantize path's operands): FP8 activations
    # cost a few percent at most
    wf = np.asarray(fp8_layer.dequantize(wq, ws, BLOCK, jnp.float32), np.float64)
    exact = np.asarray(x.astype(jnp.float32), np.float64) @ wf.T
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()


def _stand_in(xq, xs_t, wq, ws, tn, stages, out_dtype):
    """The kernel's contract with its operands, checked: rows padded to 128, x's scales
    transposed [k/128, m], f32 weight scales; computes the definition in float64 and
    returns whole tiles of columns, as the kernel does (zeros past n)."""
    m, k = xq.shape
    n = wq.shape[0]
    assert m % fp8_gemm.ROWS == 0 and xs_t.shape == (k // BLOCK, m) and ws.dtype == jnp.float32
    check(m, k, n, Fp8GemmConfig(tn=tn, stages=stages))
    y = _blockwise64(xq, np.asarray(xs_t).T, wq, ws)
    return jnp.asarray(np.pad(y, ((0, 0), (0, -(-n // tn) * tn - n))), out_dtype)


@pytest.mark.parametrize("m,n,tn", [(1, 256, 256), (200, 384, 256), (256, 512, 256), (129, 128, 128),
                                    (130, 200, 256)])  # n ends inside a block: tn 128, columns cut
def test_wrapper_pads_and_lays_out_operands(monkeypatch, m, n, tn):
    monkeypatch.setattr(fp8_gemm, "_kernel", _stand_in)
    x, wq, ws = _operands(m, 512, n, seed=n)
    got = fp8_block_matmul(x, wq, ws, cfg=Fp8GemmConfig(tn=tn, stages=3), out_dtype=jnp.float32)
    want = fp8_block_matmul(x, wq, ws, out_dtype=jnp.float32, impl="reference")
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))


def test_fits_and_check_name_what_does_not_fit():
    assert fits(4096, 2048, 11264, 128) and fits(4096, 2048, 4384, 128)  # n may end inside a block
    assert not fits(4096, 2000, 2048, 128) and not fits(4096, 2048, 2048, 64)
    assert fp8_gemm.tile_for(384, Fp8GemmConfig(tn=256)).tn == 128
    assert fp8_gemm.tile_for(4384, Fp8GemmConfig(tn=256)).tn == 128
    with pytest.raises(ValueError, match="rows"):
        check(100, 512, 256, Fp8GemmConfig())
    with pytest.raises(ValueError, match="tn=256"):
        check(128, 512, 384, Fp8GemmConfig(tn=256))
    with pytest.raises(ValueError, match="shared memory"):
        check(128, 512, 256, Fp8GemmConfig(tn=256, stages=8))


def test_fp8_matmul_routes_prefill_rows_to_the_gemm(monkeypatch):
    """With the switch on a Hopper GPU, more than 64 rows of an [o, i] kernel take the
    block-scaled GEMM (its kernel stood in for here), and the result is its product; 64
    rows and fewer do not."""
    calls = []

    def spy(*a):
        calls.append(a[0].shape)
        return _stand_in(*a)

    monkeypatch.setattr(fp8_gemm, "_kernel", spy)
    monkeypatch.setattr(fp8_layer, "FP8_GEMM", True)
    monkeypatch.setattr(fp8_layer, "_hopper", lambda: True)
    x, wq, ws = _operands(96, 256, 256, seed=3)
    got = fp8_layer.fp8_matmul(x.reshape(2, 48, 256), wq, ws, block=BLOCK, dtype=jnp.float32,
                               transposed=True, impl="pallas")
    assert calls == [(128, 256)] and got.shape == (2, 48, 256)
    want = fp8_block_matmul(x, wq, ws, out_dtype=jnp.float32, impl="reference")
    np.testing.assert_allclose(np.asarray(got).reshape(96, 256), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))
    monkeypatch.setattr(fp8_layer, "FP8_GEMM", False)
    monkeypatch.setattr(fp8_layer, "FP8_GEMV", False)
    fp8_layer.fp8_matmul(x, wq, ws, block=BLOCK, dtype=jnp.float32, transposed=True, impl="pallas")
    assert len(calls) == 1  # switch off: the dequantize path


@pytest.mark.skipif(not HOPPER, reason="Mosaic GPU wgmma kernels run on Hopper GPUs")
@pytest.mark.parametrize("m,k,n,cfg", [
    (128, 512, 256, Fp8GemmConfig(tn=256, stages=3)),
    (256, 1024, 512, Fp8GemmConfig()),  # the default launch
    (200, 1024, 384, Fp8GemmConfig(tn=256, stages=3)),  # rows padded, tn cut to 128
    (512, 256, 512, Fp8GemmConfig(tn=128, stages=4)),  # fewer blocks than stages
    (256, 2048, 1024, Fp8GemmConfig(tn=256, stages=3)),
    (128, 512, 200, Fp8GemmConfig(tn=256, stages=3)),  # n ends inside a block: zeros read past it
])
def test_kernel_matches_reference_on_hopper(m, k, n, cfg):
    x, wq, ws = _operands(m, k, n, seed=k)
    got = np.asarray(fp8_block_matmul(x, wq, ws, cfg=cfg, out_dtype=jnp.float32), np.float64)
    xq, xs = quantize_rows(x)
    want = _blockwise64(xq, xs, wq, ws)
    # Hopper's e4m3 wgmma accumulates a 128-deep block with fewer mantissa bits than f32
    # (DeepSeek-V3's report: about 14), hence the block-wise promotion; on the H100 the
    # kernel's error was 3e-4 of max |y| at most (2026-12-06).
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
