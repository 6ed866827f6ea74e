"""`add_rms_norm` and `mixer_merge` (pallas_kernels/decode_glue.py): the kernels (interpret
mode on CPU, compiled on a GPU) against float64 numpy written here, and against the ops
they replace: paged decode's split merge (`paged_attention_decode_fused` with merge on) and
the model's norm modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.layers.norms import GatedRMSNorm, RMSNorm
from pallas_kernels.decode_glue import DecodeParts, add_rms_norm, mixer_merge

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _rms64(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("b", [1, 3])
def test_add_rms_norm_matches_float64(dtype, offset, b):
    rng = np.random.default_rng(b + 10 * offset)
    d, layers, row = 256, 3, 2
    h = jnp.asarray(rng.normal(size=(b, d)), dtype)
    delta = jnp.asarray(rng.normal(size=(b, d)) * 3, dtype)
    w = jnp.asarray(rng.normal(size=(layers, d)), dtype)
    h_new, normed = add_rms_norm(h, delta, w, eps=1e-5, offset=offset, row=row, impl=KERNEL_IMPL)
    assert h_new.dtype == normed.dtype == dtype and h_new.shape == normed.shape == (b, d)
    s = _np(h) + _np(delta)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_np(h_new), s, rtol=tol, atol=tol)
    scale = 1.0 + _np(w[row]) if offset else _np(w[row])
    np.testing.assert_allclose(_np(normed), scale * _rms64(_np(h_new), 1e-5), rtol=3 * tol, atol=3 * tol)


@pytest.mark.parametrize("parts", [2, 3])
def test_add_rms_norm_sums_parts_in_f32(parts):
    """delta given as parts [S, b, d] f32 (a split-depth product): their f32 sum, rounded
    to h's dtype once, is added."""
    rng = np.random.default_rng(parts)
    b, d = 3, 128
    h = jnp.asarray(rng.normal(size=(b, d)), jnp.bfloat16)
    delta = jnp.asarray(rng.normal(size=(parts, b, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d,)), jnp.bfloat16)
    h_new, normed = add_rms_norm(h, delta, w, eps=1e-5, impl=KERNEL_IMPL)
    total = jnp.asarray(_np(delta).sum(0), jnp.bfloat16)  # one rounding of the f64 sum
    np.testing.assert_allclose(_np(h_new), _np(h + total), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(_np(normed), _np(w) * _rms64(_np(h_new), 1e-5), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_equals_the_model_modules(offset):
    """Bit for bit in f32 against h + delta and RMSNorm (one weight, no stack)."""
    rng = np.random.default_rng(7)
    d = 128
    norm = RMSNorm(d, eps=1e-6, offset=offset, dtype=jnp.float32)
    norm.weight[...] = jnp.asarray(rng.normal(size=d), jnp.float32)
    h = jnp.asarray(rng.normal(size=(4, d)), jnp.float32)
    delta = jnp.asarray(rng.normal(size=(4, d)), jnp.float32)
    h_new, normed = add_rms_norm(h, delta, norm.weight[...], eps=1e-6, offset=offset, impl=KERNEL_IMPL)
    np.testing.assert_array_equal(np.asarray(h_new), np.asarray(h + delta))
    np.testing.assert_allclose(np.asarray(normed), np.asarray(norm(h + delta)), rtol=2e-6, atol=2e-6)


def test_add_rms_norm_refuses_bad_shapes():
    h = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match=r"\[S, b, d\]"):
        add_rms_norm(h, jnp.zeros((2, 4)), jnp.ones(8), eps=1e-5, impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="row"):
        add_rms_norm(h, h, jnp.ones((2, 8)), eps=1e-5, row=2, impl=KERNEL_IMPL)


def _parts(rng, splits, b, nk, rows, g, e, dtype):
    """Split partial states as paged decode writes them (m in log2 units, l > 0 or an empty
    split with m = -inf, l = 0), and the float64 merge of the first g rows."""
    o = rng.normal(size=(splits, b, nk, rows, e))
    m = rng.normal(size=(splits, b, nk, rows)) * 4
    l = rng.uniform(0.5, 3.0, size=(splits, b, nk, rows))
    if splits > 1:
        m[-1, 0], l[-1, 0], o[-1, 0] = -np.inf, 0.0, 0.0  # an empty last split (short context)
    w = np.exp2(m - m.max(axis=0))
    merged = (o * w[..., None]).sum(0) / (l * w).sum(0)[..., None]
    parts = DecodeParts(jnp.asarray(o, jnp.float32), jnp.asarray(m, jnp.float32),
                        jnp.asarray(l, jnp.float32), g, dtype)
    return parts, merged[:, :, :g].reshape(b, nk * g, e)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("n_groups,norm_before_gate", [(1, False), (2, False), (2, True)])
def test_mixer_merge_matches_float64(splits, n_groups, norm_before_gate):
    rng = np.random.default_rng(splits * 10 + n_groups)
    b, nk, rows, g, e, h, p = 3, 2, 16, 4, 32, 4, 16
    d, z_col, width = h * p, 40, 40 + h * p + 9
    dtype = jnp.float32
    if splits == 1:  # one split: the launch's output is already merged, in the pools' dtype
        o = rng.normal(size=(b, nk, rows, e))
        parts, attn = DecodeParts(jnp.asarray(o, dtype), None, None, g, dtype), o[:, :, :g].reshape(b, -1, e)
    else:
        parts, attn = _parts(rng, splits, b, nk, rows, g, e, dtype)
    y = jnp.asarray(rng.normal(size=(b, h, p)), dtype)
    proj = jnp.asarray(rng.normal(size=(b, width)), dtype)
    w = jnp.asarray(rng.normal(size=(2, d)), dtype)
    out = mixer_merge(parts, y, proj, w, z_col=z_col, n_groups=n_groups, eps=1e-5,
                      norm_before_gate=norm_before_gate, row=1, impl=KERNEL_IMPL)
    assert out.shape == (b, nk * g * e + d) and out.dtype == dtype
    np.testing.assert_allclose(_np(out[:, :nk * g * e]), attn.reshape(b, -1), rtol=1e-5, atol=1e-5)
    z = _np(proj)[:, z_col:z_col + d]
    gate = z / (1 + np.exp(-z))
    yy = _np(y).reshape(b, d) * (1.0 if norm_before_gate else gate)
    normed = _rms64(yy.reshape(b, n_groups, -1), 1e-5).reshape(b, d) * _np(w[1])
    if norm_before_gate:
        normed = normed * gate
    np.testing.assert_allclose(_np(out[:, nk * g * e:]), normed, rtol=1e-5, atol=1e-5)


def test_mixer_merge_three_heads_per_kv_head():
    """3 query heads per KV head (one program per head: any count)."""
    rng = np.random.default_rng(11)
    b, nk, rows, g, e, h, p = 2, 2, 16, 3, 32, 2, 16
    parts, attn = _parts(rng, 2, b, nk, rows, g, e, jnp.float32)
    y = jnp.asarray(rng.normal(size=(b, h, p)), jnp.float32)
    proj = jnp.asarray(rng.normal(size=(b, h * p)), jnp.float32)
    out = mixer_merge(parts, y, proj, jnp.ones(h * p), z_col=0, n_groups=1, eps=1e-5, impl=KERNEL_IMPL)
    np.testing.assert_allclose(_np(out[:, :nk * g * e]), attn.reshape(b, -1), rtol=1e-5, atol=1e-5)


def test_mixer_merge_bf16_rounds_the_attention_to_the_pools_dtype():
    """The merged heads are rounded to the pools' dtype, then to proj's (the unfused path's
    casts); the gated norm to proj's dtype. bf16 against float64 within bf16 rounding."""
    rng = np.random.default_rng(3)
    b, nk, rows, g, e, h, p = 2, 2, 16, 2, 64, 2, 64
    parts, attn = _parts(rng, 3, b, nk, rows, g, e, jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(b, h, p)), jnp.bfloat16)
    proj = jnp.asarray(rng.normal(size=(b, h * p)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(h * p,)), jnp.bfloat16)
    out = mixer_merge(parts, y, proj, w, z_col=0, n_groups=1, eps=1e-5, impl=KERNEL_IMPL)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(_np(out[:, :nk * g * e]), attn.reshape(b, -1), rtol=1e-2, atol=1e-2)
    ref = GatedRMSNorm(h * p, n_groups=1, eps=1e-5, norm_before_gate=False, dtype=jnp.bfloat16)
    ref.weight[...] = w
    expect = ref(y.reshape(b, -1), proj).astype(jnp.bfloat16)
    np.testing.assert_allclose(_np(out[:, nk * g * e:]), _np(expect), rtol=1e-2, atol=1e-2)


def test_mixer_merge_refuses_bad_shapes():
    parts = DecodeParts(jnp.zeros((1, 2, 16, 8)), None, None, 4, jnp.float32)
    y, proj = jnp.zeros((1, 2, 4)), jnp.zeros((1, 12))
    with pytest.raises(ValueError, match="z_col"):
        mixer_merge(parts, y, proj, jnp.ones(8), z_col=8, n_groups=1, eps=1e-5, impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="row"):
        mixer_merge(parts, y, proj, jnp.ones((2, 8)), z_col=0, n_groups=1, eps=1e-5, row=3,
                    impl=KERNEL_IMPL)
    for bad_y in (jnp.zeros((2, 2, 4)), jnp.zeros((1, 8))):
        with pytest.raises(ValueError, match=r"\[1, h, p\]"):
            mixer_merge(parts, bad_y, proj, jnp.ones(8), z_col=0, n_groups=1, eps=1e-5,
                        impl=KERNEL_IMPL)
