"""stream_matmul: x @ w[row0:row0 + n].T (or its split partial sums) against float64 numpy,
for row counts 8-64, layer offsets into a stacked weight, tiles that do not divide n (the
last tile reads the next layer's rows or past the array's end), both operand orders and
split depth. The Mosaic GPU kernel runs on a Hopper GPU only (jax 0.10.2's interpret mode
lacks wgmma on transposed operands); elsewhere the XLA reference is checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.stream_gemm import StreamConfig, check, stream_glu, stream_matmul

HOPPER = jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
IMPLS = ["reference"] + (["pallas"] if HOPPER else [])

CASES = [  # m, k, n, layers, row, config
    (64, 512, 384, 3, 1, StreamConfig()),
    (8, 512, 384, 3, 2, StreamConfig(tn=64, tk=128, stages=3)),
    (16, 1024, 200, 4, 3, StreamConfig(tn=128, tk=64, stages=4)),  # last tile past the array's end
    (32, 512, 200, 4, 1, StreamConfig()),  # last tile reads the next layer's rows
    (64, 1024, 256, 2, 1, StreamConfig(swap=False, tn=64)),
    (64, 1024, 256, 2, 0, StreamConfig(swap=False, splits=4, tk=128, stages=2)),
    (64, 2048, 384, 2, 1, StreamConfig(splits=2, swap=False, tn=128, stages=3)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,layers,row,cfg", CASES)
def test_matches_float64(impl, m, k, n, layers, row, cfg):
    rng = np.random.default_rng(m + k + n + row)
    w = rng.standard_normal((layers * n, k)).astype(np.float32) * k ** -0.5
    x = rng.standard_normal((m, k)).astype(np.float32)
    wb, xb = jnp.asarray(w, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(stream_matmul(xb, wb, row0=row * n, n=n, cfg=cfg, impl=impl), np.float64)
    w64 = np.asarray(wb, np.float64)[row * n:(row + 1) * n]
    x64 = np.asarray(xb, np.float64)
    if cfg.splits > 1:
        assert got.shape == (cfg.splits, m, n)
        d = k // cfg.splits
        want = np.stack([x64[:, s * d:(s + 1) * d] @ w64[:, s * d:(s + 1) * d].T for s in range(cfg.splits)])
        tol = 1e-4  # f32 partials
    else:
        assert got.shape == (m, n)
        want = x64 @ w64.T
        tol = 1e-2 * np.abs(want).max()  # rounded to bf16
    np.testing.assert_allclose(got, want, atol=tol, rtol=1e-2)


GLU_CASES = [  # m, k, n (per half), layers, row, gate multiplier, config
    (64, 512, 192, 3, 1, 1.0, StreamConfig(swap=False, tn=64, tk=128, stages=3)),
    (8, 1024, 256, 2, 1, 1.0, StreamConfig(tn=64, tk=128, stages=4)),
    (16, 512, 200, 3, 2, 0.5, StreamConfig(tn=64, tk=64, stages=4)),  # last tile past the array's end
    (32, 1024, 104, 3, 0, 1.0, StreamConfig(tn=64, tk=128, stages=4)),  # up's last tile reads the next layer
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,layers,row,mult,cfg", GLU_CASES)
def test_glu_matches_float64(impl, m, k, n, layers, row, mult, cfg):
    rng = np.random.default_rng(m + k + n + row + 7)
    w = rng.standard_normal((layers * 2 * n, k)).astype(np.float32) * k ** -0.5
    x = rng.standard_normal((m, k)).astype(np.float32) * 2
    wb, xb = jnp.asarray(w, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(stream_glu(xb, wb, row0=row * 2 * n, n=n, gate_multiplier=mult, cfg=cfg, impl=impl),
                     np.float64)
    w64 = np.asarray(wb, np.float64)[row * 2 * n:(row + 1) * 2 * n]
    gu = np.asarray(xb, np.float64) @ w64.T
    gate, up = gu[:, :n] * mult, gu[:, n:]
    want = gate / (1 + np.exp(-gate)) * up
    assert got.shape == (m, n)
    # bf16 roundings of gate, up, the activation and the product: a few parts in 256
    np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=3e-2)
    assert np.abs(got - want).mean() < 4e-3 * np.abs(want).mean() + 1e-6


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        check(12, 512, 256, 256, 0, StreamConfig(), 2)
    with pytest.raises(ValueError, match="multiple of 64"):
        check(8, 512, 256, 256, 0, StreamConfig(swap=False), 2)
    with pytest.raises(ValueError, match="tk \\* splits"):
        check(8, 320, 256, 256, 0, StreamConfig(), 2)
    with pytest.raises(ValueError, match="outside"):
        check(8, 512, 256, 300, 96, StreamConfig(), 2)
    with pytest.raises(ValueError, match="shared memory"):
        check(256, 512, 256, 256, 0, StreamConfig(tn=256, stages=8), 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        check(8, 512, 256, 512, 4, StreamConfig(), 2)
    with pytest.raises(ValueError, match="multiples of 8"):  # the up half's first row
        check(8, 512, 100, 512, 0, StreamConfig(), 2, weights=2)
    with pytest.raises(ValueError, match="outside"):  # the up half past the weight's rows
        check(8, 512, 256, 384, 0, StreamConfig(), 2, weights=2)
    with pytest.raises(ValueError, match="splits"):
        check(64, 512, 256, 512, 0, StreamConfig(splits=2, swap=False), 2, weights=2)
    with pytest.raises(ValueError, match="swap=False"):
        check(8, 512, 256, 256, 0, StreamConfig(splits=2), 4)
    with pytest.raises(ValueError, match="depth"):
        stream_matmul(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((64, 512), jnp.bfloat16))
