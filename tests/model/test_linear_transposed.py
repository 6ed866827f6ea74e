"""Linears held transposed ([out, in]) and the one-row reduction against float64 numpy.

The serving engine's fused model holds every plain Linear of its layers transposed
(hybrid_jax/fusion.py); a one-row product on a GPU is then a multiply and a sum that
XLA fuses into one reduction (`linear.REDUCTION_GEMV`). `REDUCTION_GEMV_ANY_BACKEND`
runs that form on the CPU here. The reference is numpy in float64 on the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.fusion import fuse_projections, linear_from
from hybrid_jax.layers import linear
from hybrid_jax.layers.linear import Linear
from hybrid_jax.model import CausalLM
from tests.model.test_fused_projections import CONFIGS
from tests.model.test_ragged_forward import Harness


@pytest.fixture
def reduction(monkeypatch):
    """The one-row reduction on the CPU; jit caches cleared around (the switch is read
    when a function traces)."""
    jax.clear_caches()
    monkeypatch.setattr(linear, "REDUCTION_GEMV_ANY_BACKEND", True)
    yield
    jax.clear_caches()


def _reference(x: np.ndarray, kernel_t: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(kernel_t, np.float64).T


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("use_reduction", [False, True])
def test_transposed_matmul_matches_float64(monkeypatch, dtype, tol, lead, use_reduction):
    jax.clear_caches()
    monkeypatch.setattr(linear, "REDUCTION_GEMV_ANY_BACKEND", use_reduction)
    rng = np.random.default_rng(len(lead) * 10 + lead[-1])
    kernel_t = jnp.asarray(rng.standard_normal((48, 160)), dtype)
    x = jnp.asarray(rng.standard_normal((*lead, 160)), dtype)
    with jax.default_matmul_precision("highest"):  # f32 dots on a GPU: not TF32
        got = jax.jit(lambda a, w: linear.matmul(a, w, transposed=True))(x, kernel_t)
    assert got.shape == (*lead, 48) and got.dtype == dtype
    want = _reference(np.asarray(x.astype(jnp.float32)).reshape(-1, 160),
                      np.asarray(kernel_t.astype(jnp.float32))).reshape(*lead, 48)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol * 10)
    jax.clear_caches()


def test_one_row_takes_the_reduction(reduction):
    """One row: a reduce in the HLO and no dot; two rows: a dot (the switch is static)."""
    w = jnp.ones((16, 32), jnp.bfloat16)
    for rows, dot in ((1, False), (2, True)):
        hlo = jax.jit(lambda a: linear.matmul(a, w, transposed=True)).lower(
            jnp.ones((rows, 32), jnp.bfloat16)).as_text()
        assert ("dot_general" in hlo) == dot and ("reduce" in hlo) != dot, hlo


def test_product_rows_is_a_slice_of_the_product():
    """`product_rows` (the prefill's out-projection per branch) in both layouts."""
    rng = np.random.default_rng(3)
    lin = Linear(40, 24, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kernel = np.asarray(lin.kernel[...])
    y = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    want = np.asarray(y, np.float64) @ kernel[8:24].astype(np.float64)
    np.testing.assert_allclose(lin.product_rows(y, 8), want, rtol=1e-5, atol=1e-5)
    lin.kernel = type(lin.kernel)(jnp.asarray(kernel.T))
    lin.transposed = True
    np.testing.assert_allclose(lin.product_rows(y, 8), want, rtol=1e-5, atol=1e-5)


# CI time: qkv_bias_muP's fused decode is covered by test_fused_projections' serving test.
@pytest.mark.parametrize("name", ["hybrid"])
def test_fused_decode_of_one_sequence_with_the_reduction(reduction, name):
    """A fused model decoding one sequence (one row: every layer Linear a reduction)
    gives the unfused model's logits."""
    model = CausalLM(CONFIGS[name], rngs=nnx.Rngs(0))
    fused = fuse_projections(model)
    prompt = np.random.default_rng(7).integers(0, 64, 12).tolist()
    got, want = Harness(fused, 1), Harness(model, 1)
    for part, decode in ((prompt[:11], False), (prompt[11:], True), (prompt[:1], True)):
        np.testing.assert_allclose(got.run({0: part}, decode=decode)[0],
                                   want.run({0: part}, decode=decode)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 4])
def test_partials_sum_to_the_product(parts):
    """`Linear.partials`: depth parts [S, b, o] f32 whose sum is x @ W (float64 numpy)."""
    rng = np.random.default_rng(parts)
    lin = linear_from(jnp.asarray(rng.normal(size=(24, 32)), jnp.float32), None)  # [out, in]
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    p = lin.partials(x, parts)
    assert p.shape == (parts, 5, 24) and p.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(lin.kernel[...], np.float64).T
    np.testing.assert_allclose(np.asarray(p, np.float64).sum(0), want, rtol=1e-5, atol=1e-5)
    k = 32 // parts
    x64, w64 = np.asarray(x, np.float64), np.asarray(lin.kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(p[1], np.float64), x64[:, k:2 * k] @ w64[:, k:2 * k].T,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        lin.partials(x, 3)


def test_split_k_parts_where_it_applies(monkeypatch):
    lin = linear_from(jnp.zeros((2048, 4096), jnp.bfloat16), None)
    monkeypatch.setattr(linear, "SPLIT_K_ANY_BACKEND", True)
    assert [lin.split_k_parts(r) for r in (1, 2, 64, 65)] == [1, 2, 2, 1]
    assert linear_from(jnp.zeros((4096, 2048), jnp.bfloat16), None).split_k_parts(8) == 1  # wide
    assert linear_from(jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros(8)).split_k_parts(8) == 1  # bias
    monkeypatch.setattr(linear, "SPLIT_K", False)
    assert lin.split_k_parts(8) == 1
