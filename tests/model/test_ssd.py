"""The chunked SSD and the associative-scan recurrences against float64 numpy sequential loops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.recurrence import causal_conv1d, linear_recurrence
from hybrid_jax.ssd import ssd_chunked


def ssd_sequential_f64(x, dt, A, B, C, D, h0):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T; y_t = S_t C_t + D x_t (float64 numpy)."""
    b, t, h, p = x.shape
    g = B.shape[2]
    rep = h // g
    S = h0.astype(np.float64).copy()
    y = np.zeros((b, t, h, p))
    for i in range(t):
        for head in range(h):
            grp = head // rep
            decay = np.exp(dt[:, i, head] * A[head])[:, None, None]
            S[:, head] = decay * S[:, head] + dt[:, i, head, None, None] * \
                x[:, i, head, :, None] * B[:, i, grp, None, :]
            y[:, i, head] = np.einsum("bpn,bn->bp", S[:, head], C[:, i, grp]) + D[head] * x[:, i, head]
    return y, S


@pytest.mark.parametrize("t,chunk", [(1, 4), (7, 4), (16, 8), (37, 8), (64, 16)])
@pytest.mark.parametrize("g", [1, 2])
def test_ssd_chunked_matches_sequential(t, chunk, g):
    rng = np.random.default_rng(t * 10 + g)
    b, h, p, n = 2, 4, 8, 6
    x = rng.normal(size=(b, t, h, p))
    dt = rng.uniform(0.05, 1.0, size=(b, t, h))
    A = -rng.uniform(0.5, 4.0, size=h)
    B = rng.normal(size=(b, t, g, n))
    C = rng.normal(size=(b, t, g, n))
    D = rng.normal(size=h)
    h0 = rng.normal(size=(b, h, p, n))
    want_y, want_s = ssd_sequential_f64(x, dt, A, B, C, D, h0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    y, s = ssd_chunked(f32(x), f32(dt), f32(A), f32(B), f32(C), f32(D), chunk_size=chunk,
                       initial_state=f32(h0))
    scale = np.abs(want_y).max()
    np.testing.assert_allclose(np.asarray(y), want_y, atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(s), want_s, atol=2e-5 * np.abs(want_s).max(), rtol=0)


def test_ssd_zero_initial_state_is_default():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 10, 2, 4)), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.1, 0.5, size=(1, 10, 2)), jnp.float32)
    A, D = -jnp.ones(2), jnp.zeros(2)
    B = jnp.asarray(rng.normal(size=(1, 10, 1, 3)), jnp.float32)
    y0, _ = ssd_chunked(x, dt, A, B, B, D, chunk_size=4)
    y1, _ = ssd_chunked(x, dt, A, B, B, D, chunk_size=4, initial_state=jnp.zeros((1, 2, 4, 3)))
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))


@pytest.mark.parametrize("t", [1, 5, 33])
def test_linear_recurrence_matches_loop(t):
    rng = np.random.default_rng(t)
    a = rng.uniform(0.0, 1.0, size=(3, t, 5))
    b = rng.normal(size=(3, t, 5))
    h0 = rng.normal(size=(3, 5))
    h, last = linear_recurrence(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                jnp.asarray(h0, jnp.float32))
    state = h0.copy()
    want = np.zeros_like(b)
    for i in range(t):
        state = a[:, i] * state + b[:, i]
        want[:, i] = state
    np.testing.assert_allclose(np.asarray(h), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), want[:, -1], rtol=1e-5, atol=1e-5)


def test_causal_conv1d_matches_loop_with_initial_state():
    rng = np.random.default_rng(1)
    b, t, c, k = 2, 9, 5, 4
    x, w, bias = rng.normal(size=(b, t, c)), rng.normal(size=(c, k)), rng.normal(size=c)
    init = rng.normal(size=(b, k - 1, c))
    full = np.concatenate([init, x], axis=1)
    want = np.stack([(full[:, i:i + k] * w.T).sum(1) + bias for i in range(t)], axis=1)
    got = causal_conv1d(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                        jnp.asarray(bias, jnp.float32), jnp.asarray(init, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
