"""The gated delta rule's references against a float64 numpy loop, and step == ragged."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import gated_delta_ragged, gated_delta_step


def _numpy_rule(q, k, v, g, beta, s, scale):
    """float64 loop over tokens of one sequence, in the issue's [dv, dk] orientation."""
    hv, hk = v.shape[1], q.shape[1]
    rep = hv // hk
    s = s.transpose(0, 2, 1).astype(np.float64)  # [hv, dv, dk]
    out = np.zeros(v.shape, np.float64)
    for t in range(q.shape[0]):
        for h in range(hv):
            kk, qq = k[t, h // rep].astype(np.float64), q[t, h // rep].astype(np.float64)
            eye = np.eye(kk.shape[0])
            s[h] = np.exp(g[t, h]) * s[h] @ (eye - beta[t, h] * np.outer(kk, kk)) \
                + beta[t, h] * np.outer(v[t, h], kk)
            out[t, h] = scale * s[h] @ qq
    return out, s.transpose(0, 2, 1)


def _inputs(rng, t, hk=2, hv=4, dk=8, dv=16):
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (t, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
    return q, k, v, g, beta


def test_ragged_reference_matches_float64_loop_with_initial_states_and_padding():
    rng = np.random.default_rng(0)
    lens, t, scale = [5, 0, 3], 11, 0.35  # an empty sequence and 3 padding tokens
    q, k, v, g, beta = _inputs(rng, t)
    states = rng.standard_normal((4, 4, 8, 16)).astype(np.float32)
    slots, has_init = np.array([2, 0, 3]), np.array([True, False, False])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    o, new = gated_delta_ragged(*map(jnp.asarray, (q, k, v, g, beta, cu, states, slots, has_init)),
                                scale=scale)
    o, new = np.asarray(o), np.asarray(new)
    for i, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        s0 = states[slots[i]] if has_init[i] else np.zeros_like(states[0])
        want_o, want_s = _numpy_rule(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], s0, scale)
        np.testing.assert_allclose(o[a:e], want_o, rtol=1e-5, atol=1e-5)
        if e > a:
            np.testing.assert_allclose(new[slots[i]], want_s, rtol=1e-5, atol=1e-5)
    assert not o[cu[-1]:].any()
    np.testing.assert_array_equal(new[1], states[1])  # untouched slot


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_step_candidates_equal_token_by_token_decode(state_dtype):
    rng = np.random.default_rng(1)
    b, n = 3, 3
    q, k, v, g, beta = _inputs(rng, b * n)
    shape = lambda x: jnp.asarray(x.reshape(b, n, *x.shape[1:]))  # noqa: E731
    q, k, v, g, beta = map(shape, (q, k, v, g, beta))
    states = jnp.asarray(rng.standard_normal((5, 4, 8, 16)), state_dtype)
    slots = jnp.array([4, 1, 2])
    o_all, cand = gated_delta_step(q, k, v, g, beta, states, slots, scale=0.3, candidates=True)
    s = states
    for j in range(n):
        o, s = gated_delta_step(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1], g[:, j:j + 1],
                                beta[:, j:j + 1], s, slots, scale=0.3, candidates=False)
        np.testing.assert_array_equal(np.asarray(o[:, 0]), np.asarray(o_all[:, j]))
        np.testing.assert_array_equal(np.asarray(cand[j]), np.asarray(s[slots]))
