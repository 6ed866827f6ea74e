"""Kimi Delta Attention (the gated delta rule with a per-channel decay) against float64 numpy.

The oracle is a token-sequential float64 numpy scan written here from the rule, not from
the module. Checked: the chunked prefill (`kda_chunked.py` through `gated_delta_ragged`,
impl="reference"; the Pallas pipeline is tests/kernels/test_kda_prefill.py)
over a ragged batch with initial states, empty and one-token sequences, chunk-straddling
lengths and strong decays (per-token log decays down to -30 on some channels, so
e^{G} of a 64-token chunk is far below f32's range while the pairwise decays stay
representable); the sequential reference scan; the q-token step (plain and candidates),
and that a scalar per-head decay broadcast over dk is the per-head rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import (
    gated_delta_ragged,
    gated_delta_ragged_reference,
    gated_delta_step,
)

HK, HV, DK, DV = 2, 4, 8, 16
SCALE = DK ** -0.5


def numpy_rule(q, k, v, g, beta, s0):
    """float64 scan for one sequence: q, k [t, hk, dk]; v [t, hv, dv]; g [t, hv, dk]."""
    r = v.shape[1] // q.shape[1]
    s = s0.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for i in range(v.shape[0]):
        for h in range(v.shape[1]):
            kk, qq = k[i, h // r].astype(np.float64), q[i, h // r].astype(np.float64)
            s[h] = np.exp(g[i, h].astype(np.float64))[:, None] * s[h]
            delta = beta[i, h] * (v[i, h] - s[h].T @ kk)
            s[h] = s[h] + np.outer(kk, delta)
            out[i, h] = SCALE * s[h].T @ qq
    return out, s


def inputs(rng, t, strong=True):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((t, HK, DK))).astype(np.float32)
    k = unit(rng.standard_normal((t, HK, DK))).astype(np.float32)
    v = rng.standard_normal((t, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (t, HV, DK))
    if strong:  # some channels forget almost everything at every token
        g[:, :, :2] = -rng.uniform(10.0, 30.0, (t, HV, 2))
    beta = rng.uniform(0.1, 1.0, (t, HV)).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    lens = [70, 0, 1, 33, 129]
    t = sum(lens) + 5  # + padding tokens
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = inputs(rng, t)
    states = rng.standard_normal((7, HV, DK, DV)).astype(np.float32)
    slots = np.array([3, 1, 6, 2, 5], np.int32)
    has = np.array([True, True, False, True, False])
    want_o = np.zeros((t, HV, DV))
    want_s = states.astype(np.float64).copy()
    for i in range(len(lens)):
        a, e = cu[i], cu[i + 1]
        s0 = states[slots[i]] if has[i] else np.zeros((HV, DK, DV))
        o, s = numpy_rule(*(y[a:e] for y in x), s0)
        want_o[a:e], want_s[slots[i]] = o, s
    return x, cu, states, slots, has, want_o, want_s


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_matches_float64(batch, chunk):
    x, cu, states, slots, has, want_o, want_s = batch
    args = [jnp.asarray(a) for a in (*x, cu, states, slots, has)]
    o, s = gated_delta_ragged(*args, scale=SCALE, chunk_size=chunk, impl="reference")
    np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s), want_s, atol=2e-4, rtol=1e-4)
    assert np.isfinite(np.asarray(o)).all()
    o, s = gated_delta_ragged_reference(*args, scale=SCALE)
    np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s), want_s, atol=2e-4, rtol=1e-4)


def test_step_and_candidates_match_float64(batch):
    rng = np.random.default_rng(1)
    _, _, states, _, _, _, _ = batch
    b, n = 3, 3
    q, k, v, g, beta = (y.reshape(b, n, *y.shape[1:]) for y in inputs(rng, b * n))
    slots = np.array([4, 0, 2], np.int32)
    args = [jnp.asarray(a) for a in (q, k, v, g, beta, states, slots)]
    o, s = gated_delta_step(*args, scale=SCALE, candidates=False)
    _, cands = gated_delta_step(*args, scale=SCALE, candidates=True)
    for i in range(b):
        want_o, want_s = numpy_rule(q[i], k[i], v[i], g[i], beta[i], states[slots[i]])
        np.testing.assert_allclose(np.asarray(o[i]), want_o, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(s[slots[i]]), want_s, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(cands[-1, i]), want_s, atol=2e-4, rtol=1e-4)
        _, first = numpy_rule(q[i, :1], k[i, :1], v[i, :1], g[i, :1], beta[i, :1], states[slots[i]])
        np.testing.assert_allclose(np.asarray(cands[0, i]), first, atol=2e-4, rtol=1e-4)


def test_per_head_decay_is_the_broadcast_case(batch):
    """A per-channel decay equal on every channel gives the per-head rule's result."""
    x, cu, states, slots, has, _, _ = batch
    q, k, v, g, beta = x
    g_head = g[..., 3]  # the weak channels' values
    common = [jnp.asarray(a) for a in (cu, states, slots, has)]
    per_head = gated_delta_ragged(*map(jnp.asarray, (q, k, v, g_head, beta)), *common,
                                  scale=SCALE, impl="reference")
    per_chan = gated_delta_ragged(*map(jnp.asarray, (q, k, v, np.repeat(g_head[..., None], DK, -1),
                                                     beta)), *common, scale=SCALE, impl="reference")
    for a, b in zip(per_head, per_chan, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
