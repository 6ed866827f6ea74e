"""grouped_matmul (pallas_kernels/grouped_gemm.py) against a float64 numpy loop over the
sorted rows: empty groups, groups of several row tiles, a last tile past the end, rows
gathered by `src` and stored at `dst`, the gated (silu) and plain (relu2) epilogues, and the MoE routed sum
through the kernel against the dense reference. Interpret mode on CPU; compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.layers.mlp import ACTIVATIONS
from hybrid_jax.layers.moe import routed_experts, routed_reference
from pallas_kernels.grouped_gemm import GroupedConfig, grouped_matmul, work_table

IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
# Compiled on a GPU the Triton lowering's f32 dots run in TF32 (errors up to ~5e-3 of the
# largest output seen on an H100, 2026-12-06), where interpret mode (CPU) is exact f32.
GPU_F32_TOL = 3e-2


def _numpy(x, w, sizes, src, glu, act):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    rows = x64 if src is None else x64[np.asarray(src)]
    y = np.einsum("mk,mkn->mn", rows, w64[group])
    if glu:
        g, u = np.split(y, 2, axis=-1)
        return act(g) * u
    return act(y)


def _silu(v):
    return v / (1 + np.exp(-v))


def _relu2(v):
    return np.square(np.maximum(v, 0))


CASES = [  # t, k, n_w, sizes, gathered, glu, dtype, config
    (12, 32, 64, [5, 0, 21, 3, 0, 7], True, True, jnp.float32, GroupedConfig(bm=16, bn=16, bk=16)),
    (36, 48, 32, [0, 17, 0, 19], False, False, jnp.float32,
     GroupedConfig(bm=16, bn=32, bk=32, cols_major=True)),
    (8, 64, 96, [1, 2, 0, 9, 4], True, True, jnp.bfloat16, GroupedConfig(bm=32, bn=16, bk=64)),
    # split-K: partials added and the epilogue applied after the kernel (gated and plain)
    (12, 64, 64, [5, 0, 21, 3, 0, 7], True, True, jnp.float32, GroupedConfig(bm=16, bn=16, bk=16, splits=4)),
    (36, 96, 32, [0, 17, 0, 19], False, False, jnp.float32,
     GroupedConfig(bm=16, bn=32, bk=16, cols_major=True, splits=3)),
]


@pytest.mark.parametrize("t,k,nw,sizes,gathered,glu,dtype,cfg", CASES)
def test_matches_float64(t, k, nw, sizes, gathered, glu, dtype, cfg):
    rng = np.random.default_rng(t + k + nw)
    m, e = sum(sizes), len(sizes)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, k, nw)) * k**-0.5, dtype)
    src = jnp.asarray(rng.integers(0, t, m), jnp.int32) if gathered else None
    if not gathered:
        assert t == m
    act, np_act = (ACTIVATIONS["silu"], _silu) if glu else (ACTIVATIONS["relu2"], _relu2)
    perm = rng.permutation(m)
    dst = None if gathered else jnp.asarray(perm, jnp.int32)  # sorted row r -> output row perm[r]
    got = grouped_matmul(x, w, jnp.asarray(sizes), src=src, dst=dst, glu=glu, act=act,
                         out_dtype=jnp.float32, cfg=cfg, impl=IMPL)
    want = _numpy(x, w, sizes, src, glu, np_act)
    if dst is not None:
        want[perm] = want.copy()
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    # Compiled on a GPU the Triton lowering's f32 dots are TF32 (~5e-3 relative seen on the
    # H100), like XLA's default f32 matmuls there; interpret mode (CPU) is exact f32.
    ktol = GPU_F32_TOL if IMPL == "pallas" and dtype == jnp.float32 else tol
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=ktol * np.abs(want).max(), rtol=ktol)
    ref = grouped_matmul(x, w, jnp.asarray(sizes), src=src, dst=dst, glu=glu, act=act,
                         out_dtype=jnp.float32, impl="reference")
    # XLA's f32 ragged_dot on a GPU runs in TF32 by default as well.
    rtol = GPU_F32_TOL if jax.default_backend() == "gpu" and dtype == jnp.float32 else tol
    np.testing.assert_allclose(np.asarray(ref), want, atol=rtol * np.abs(want).max(), rtol=rtol)


def test_work_table_covers_each_row_once():
    sizes = np.array([5, 0, 21, 3, 0, 7])
    group, row0, count = (np.asarray(a) for a in work_table(jnp.asarray(sizes), sizes.sum(), 8))
    owner = np.full(sizes.sum(), -1)
    for g, r, c in zip(group, row0, count, strict=True):
        assert c <= 8 and (owner[r:r + c] == -1).all()
        owner[r:r + c] = g
    np.testing.assert_array_equal(owner, np.repeat(np.arange(6), sizes))
    assert len(group) == -(-sizes.sum() // 8) + 6  # the static bound


def test_routed_sum_through_the_kernel_matches_the_dense_reference():
    rng = np.random.default_rng(0)
    t, d, e, f, k = 9, 32, 6, 16, 2
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * d**-0.5, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, f, d)) * f**-0.5, jnp.float32)
    got = routed_experts(x, weights, experts, gate_up, down, activation="silu", gated=True, impl=IMPL)
    want = routed_reference(x, weights, experts, gate_up, down, activation="silu", gated=True)
    tol = GPU_F32_TOL if IMPL == "pallas" else 1e-4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * np.abs(want).max(), rtol=tol)


def test_bad_shapes_are_refused_by_name():
    x, w = jnp.zeros((4, 32)), jnp.zeros((2, 16, 32))
    with pytest.raises(ValueError, match="depth"):
        grouped_matmul(x, w, jnp.array([2, 2]), impl=IMPL)
    with pytest.raises(ValueError, match="sizes"):
        grouped_matmul(jnp.zeros((4, 16)), w, jnp.array([4]), impl=IMPL)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 8, 32)), jnp.array([2, 2]), impl=IMPL)


def _dequant_np(q, scale, block, glu):
    """float64 numpy: each expert's e4m3 weights times its block scales (gated: the gate and
    up halves on their own block grids), edge blocks cut to the weight's extent."""
    q64, s64 = np.asarray(q.astype(jnp.float32), np.float64), np.asarray(scale.astype(jnp.float32),
                                                                         np.float64)
    e, k, nw = q64.shape
    halves = np.split(np.arange(nw), 2) if glu else [np.arange(nw)]
    s_halves = np.split(s64, 2, axis=2) if glu else [s64]
    out = np.empty_like(q64)
    for cols, s in zip(halves, s_halves, strict=True):
        full = np.stack([np.kron(s[j], np.ones((block, block)))[:k, :len(cols)] for j in range(e)])
        out[:, :, cols] = q64[:, :, cols] * full
    return out


FP8_CASES = [  # t, k, n_w, sizes, glu, dtype, scale dtype, block, config
    # edge blocks: k = 48 and each 48-wide half of gate/up end in a 16-wide block of 32
    (12, 48, 96, [5, 0, 21, 3, 0, 7], True, jnp.float32, jnp.float32, 32,
     GroupedConfig(bm=16, bn=128, bk=128)),
    (36, 64, 80, [0, 17, 0, 19], False, jnp.bfloat16, jnp.bfloat16, 32,
     GroupedConfig(bm=16, bn=32, bk=32, cols_major=True)),
    # decode-like: 128 x 128 blocks, most experts untouched
    (3, 256, 256, [0, 0, 2, 0, 1, 0, 0, 0], True, jnp.bfloat16, jnp.float32, 128,
     GroupedConfig(bm=16, bn=128, bk=128)),
    # the scale applied to the weight tile instead of the partial product (fp8_scale)
    (12, 48, 96, [5, 0, 21, 3, 0, 7], True, jnp.float32, jnp.float32, 32,
     GroupedConfig(bm=16, bn=128, bk=128, fp8_scale="weights")),
    (36, 64, 80, [0, 17, 0, 19], False, jnp.bfloat16, jnp.bfloat16, 32,
     GroupedConfig(bm=16, bn=32, bk=32, cols_major=True, fp8_scale="weights")),
    # split-K over 32-deep tiles, each split's first tile's scales its own (k = 96: 3 blocks)
    (12, 96, 96, [5, 0, 21, 3, 0, 7], True, jnp.float32, jnp.float32, 32,
     GroupedConfig(bm=16, bn=16, bk=32, splits=3)),
    (3, 256, 256, [0, 0, 2, 0, 1, 0, 0, 0], False, jnp.bfloat16, jnp.float32, 128,
     GroupedConfig(bm=16, bn=64, bk=64, splits=2)),
]


@pytest.mark.parametrize("t,k,nw,sizes,glu,dtype,sdtype,block,cfg", FP8_CASES)
def test_fp8_weights_match_float64_of_the_dequantized(t, k, nw, sizes, glu, dtype, sdtype, block, cfg):
    """FP8 experts with block scales read in place: the kernel and the reference against
    float64 numpy of the dequantized weights."""
    from pallas_kernels.grouped_gemm import scale_blocks

    rng = np.random.default_rng(t + k + nw)
    m, e = sum(sizes), len(sizes)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    q = jnp.asarray(rng.uniform(-448, 448, (e, k, nw)), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2, (e, *scale_blocks(k, nw, block, glu))) / 448 * k**-0.5, sdtype)
    src = jnp.asarray(rng.integers(0, t, m), jnp.int32)
    act, np_act = (ACTIVATIONS["silu"], _silu) if glu else (ACTIVATIONS["relu2"], _relu2)
    want = _numpy(x, _dequant_np(q, scale, block, glu), sizes, src, glu, np_act)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    for impl in (IMPL, "reference"):
        got = grouped_matmul(x, q, jnp.asarray(sizes), src=src, glu=glu, act=act, out_dtype=jnp.float32,
                             cfg=cfg, impl=impl, scale=scale, block=block)
        # On a GPU f32 dots are TF32 by default, the kernel's and XLA's alike (see above).
        ktol = 1e-2 if jax.default_backend() == "gpu" and dtype == jnp.float32 else tol
        np.testing.assert_allclose(np.asarray(got), want, atol=ktol * np.abs(want).max(), rtol=ktol,
                                   err_msg=impl)
    with pytest.raises(ValueError, match="scale"):
        grouped_matmul(x, q, jnp.asarray(sizes), src=src, glu=glu, impl=IMPL, scale=scale[:, :1],
                       block=block)


@pytest.mark.parametrize("fp8", [False, True])
def test_few_assignments_skip_the_sort_and_match_the_dense_reference(fp8):
    """Batch 1 and 2 at decode (t * k <= 16): each assignment is its own item of the grouped
    GEMM (assignment_table), with no argsort or work table; one expert chosen by both tokens
    is streamed twice. Same sums as the dense reference, FP8 stacks too; at 18 assignments
    the sorted path runs (its sort is in the graph)."""
    from hybrid_jax.layers.fp8 import quantize_experts

    rng = np.random.default_rng(5)
    d, e, f = 256, 8, 128
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * d**-0.5, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, f, d)) * f**-0.5, jnp.float32)
    kw = dict(activation="silu", gated=True)
    if fp8:
        (gq, gs), (dq, ds) = quantize_experts(gate_up, 128, True), quantize_experts(down, 128, False)
        stacks, kw = (gq, dq), dict(kw, fp8=(gs, ds, 128))
    else:
        stacks = (gate_up, down)
    for experts, sorted_path in (([[5, 1, 2, 7, 0, 3]], False), ([[4, 2, 6], [2, 6, 1]], False),
                                 ([[0, 1, 2, 3, 4, 5, 6, 7, 0]] * 2, True)):
        experts = jnp.asarray(experts, jnp.int32)
        t, k = experts.shape
        x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
        weights = jnp.asarray(rng.random((t, k)), jnp.float32)
        fn = lambda x, w, ex: routed_experts(x, w, ex, *stacks, impl=IMPL, **kw)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(fn)(x, weights, experts))
        assert ("sort" in jaxpr) == sorted_path, experts
        want = routed_reference(x, weights, experts, *stacks, **kw)
        for cfg in (None, GroupedConfig(bm=16, bn=64, bk=64, splits=2)):  # the engine's, split-K
            got = routed_experts(x, weights, experts, *stacks, impl=IMPL, cfg=cfg, **kw)
            tol = GPU_F32_TOL if IMPL == "pallas" else 1e-4
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * np.abs(want).max(),
                                       rtol=tol, err_msg=f"{experts} {cfg}")


def test_ring_stages_capped_to_shared_memory(monkeypatch):
    """f32 operands at the few-row tiles (6 stages of 72 KB) would ask for more shared
    memory than an H100 has (a compile error there): the ring is cut to what fits, the
    bf16 and FP8 defaults keep theirs."""
    from pallas_kernels import grouped_gemm as gg

    seen = []
    monkeypatch.setattr(gg, "_launch", lambda *a, cfg, **kw: seen.append(cfg.num_stages))
    for dtype, want in ((jnp.float32, 3), (jnp.bfloat16, gg.DECODE_FEW.num_stages)):
        x, w = jnp.zeros((2, 256), dtype), jnp.zeros((4, 256, 256), dtype)
        gg.grouped_matmul(x, w, jnp.asarray([2, 0, 0, 0]), glu=True, cfg=gg.DECODE_FEW, impl="interpret")
        assert seen[-1] == want, (dtype, seen)
