"""Skinny GEMM (x [m, k] @ w [k, n], m <= 256): kernel and reference vs a float64 product.

Interpret mode on CPU, compiled on GPU. Row counts that are and are not powers of 2
(masked rows), n that the column block does and does not divide (masked columns),
split_k 1 and > 1, bf16 and f32 weights, x in another dtype than w. Also the argument
errors, the launch heuristic on every native-1b projection, the backward pass, and
that the kernel lowers to one Triton call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny_gemm
from pallas_kernels.skinny_gemm import skinny_config, skinny_matmul, skinny_matmul_reference

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
BF16, F32 = jnp.bfloat16, jnp.float32
TOL = {BF16: 1e-2, F32: 1e-5}  # relative Frobenius error; bf16: y is rounded to bf16
# native-1b-parallel's projections, (k, n): q/o_proj/out_proj, k/v, in_proj, gate/up, down.
NATIVE_1B = ((2048, 2048), (2048, 512), (2048, 4384), (2048, 5632), (5632, 2048))


def _case(seed, m, k, n, w_dtype, x_dtype=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype or w_dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / math.sqrt(k), w_dtype)
    return x, w


def _oracle(x, w):
    """Float64 product of x rounded to w's dtype and w (the contract's rounding of x)."""
    xw = np.asarray(x.astype(w.dtype).astype(F32), np.float64)
    return xw @ np.asarray(w.astype(F32), np.float64)


def _rel(a, b):
    a = np.asarray(jnp.asarray(a).astype(F32), np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _config(block_n, block_k, split_k, num_warps=4, num_stages=2):
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages)


# (m, k, n, w dtype, x dtype): masked rows (m < 16 or not a power of 2), masked columns.
CASES = [(1, 64, 48, BF16, BF16), (8, 128, 256, F32, F32), (13, 256, 96, BF16, F32),
         (64, 128, 80, F32, BF16)]


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("m,k,n,dtype,x_dtype", CASES)
def test_matches_float64(impl, m, k, n, dtype, x_dtype):
    """The heuristic's config; x is cast to the weights' dtype, y comes out in it."""
    x, w = _case(m * 1000 + n, m, k, n, dtype, x_dtype)
    y = skinny_matmul(x, w, impl=impl)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, _oracle(x, w)) < TOL[dtype], _rel(y, _oracle(x, w))


@pytest.mark.parametrize("m,dtype,config", [
    (8, BF16, _config(16, 16, 1)),  # many column blocks, many chunks per program
    (13, F32, _config(32, 32, 2)),  # split K, masked rows, masked last column block
    (1, BF16, _config(64, 16, 8)),  # split K down to one chunk per program
    (64, F32, _config(32, 64, 2)),  # no masks at all
])
def test_configs_match_float64(m, dtype, config):
    k, n = 128, 96
    x, w = _case(m + config["block_n"], m, k, n, dtype)
    y = skinny_matmul(x, w, impl=KERNEL_IMPL, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, _oracle(x, w)) < TOL[dtype], _rel(y, _oracle(x, w))


def test_gradients_are_the_reference_gradients():
    x, w = _case(5, 13, 64, 48, F32)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    with jax.default_matmul_precision("float32"):  # the reference's dots: not TF32 on GPUs
        got = jax.grad(loss(lambda a, b: skinny_matmul(a, b, impl=KERNEL_IMPL)), (0, 1))(x, w)
        want = jax.grad(loss(skinny_matmul_reference), (0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments():
    x, w = _case(0, 8, 64, 32, BF16)
    with pytest.raises(ValueError, match="m=257"):
        skinny_matmul(jnp.zeros((257, 64), BF16), w, impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="m=0"):
        skinny_matmul(jnp.zeros((0, 64), BF16), w, impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="k=40"):
        skinny_matmul(x[:, :40], w[:40], impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="x "):
        skinny_matmul(x[:, :32], w, impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="w "):
        skinny_matmul(x, w.astype(jnp.float16), impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="x "):
        skinny_matmul(x.astype(jnp.int32), w, impl=KERNEL_IMPL)
    for bad, match in ((_config(48, 16, 1), "powers of 2"), (_config(16, 8, 1), "powers of 2"),
                       (_config(16, 128, 1), "divide"), (_config(16, 16, 3), "divide"),
                       (_config(16, 16, 1, num_warps=3), "num_warps"),
                       ({"block_n": 16}, "config keys")):
        with pytest.raises(ValueError, match=match):
            skinny_matmul(x, w, impl=KERNEL_IMPL, config=bad)


@pytest.mark.parametrize("m", [1, 8, 13, 16, 32, 64, 100, 128, 256])
def test_heuristic_configs_are_valid_on_native_1b(m):
    """Every native-1b projection gets a launchable config, a grid of a sensible size,
    and tiles whose pipelined buffers fit the H100's 228 KB of shared memory."""
    for k, n in NATIVE_1B:
        c = skinny_config(m, k, n)
        skinny_gemm._check_config(c, k)
        programs = math.ceil(n / c["block_n"]) * c["split_k"]
        assert 8 <= programs <= skinny_gemm.TARGET_PROGRAMS + c["split_k"] * 64, (m, k, n, c)
        per_program = k // c["split_k"] * c["block_n"] * 2
        assert per_program >= 8 << 10, (m, k, n, c)
        rows = skinny_gemm.row_block(m)
        smem = c["num_stages"] * (rows + c["block_n"]) * c["block_k"] * 2
        assert smem <= 228 << 10, (m, k, n, c)


def test_heuristic_small_shapes_and_overrides(monkeypatch):
    c = skinny_config(3, 48, 20)  # tiles clipped to k and n
    assert c["block_k"] == 16 and c["block_n"] == 32
    skinny_gemm._check_config(c, 48)
    monkeypatch.setitem(skinny_gemm.SKINNY_OVERRIDES, (16, 2048, 512), {"split_k": 4})
    assert skinny_config(9, 2048, 512)["split_k"] == 4  # rows 9 -> row block 16
    assert skinny_config(17, 2048, 512)["split_k"] == 16  # row block 32: the heuristic's
    with pytest.raises(ValueError, match="m=300"):
        skinny_config(300, 2048, 512)


def test_kernel_lowers_to_triton():
    """The kernel body uses only ops the Pallas Triton lowering has (checked on CPU by
    lowering for CUDA; PTX compilation itself needs the GPU): masked and unmasked rows
    and columns, split_k 1 and > 1, bf16 and f32 weights."""
    pytest.importorskip("jax._src.lib.triton")
    for m, k, n, dtype, config in ((8, 2048, 4384, BF16, None), (13, 128, 96, F32, None),
                                   (256, 5632, 2048, BF16, None),
                                   (64, 256, 256, BF16, _config(128, 64, 1))):
        x = jax.ShapeDtypeStruct((m, k), BF16)
        w = jax.ShapeDtypeStruct((k, n), dtype)
        f = jax.jit(lambda a, b, c=config: skinny_matmul(a, b, impl="pallas", config=c))
        text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1, (m, k, n)
