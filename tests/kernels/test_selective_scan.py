"""Mamba1 selective scan: kernels (interpret mode on CPU, compiled on GPU) vs references vs a
float64 loop.

Ragged prefill: lengths cross the kernel's token tiles; two channel blocks; a gate and
no gate; untouched slots and slots read with has_initial=False hold NaN; cutting every
sequence in two calls (chunked prefill) equals one call. The q-token step: q = 1 writes
the slots, q = 3 returns the state after each position and leaves the slots alone, and
equals the ragged scan over the same tokens; bf16 states are rounded between positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import make_ragged, poison_states, rel_err, selective_scan_np, split_batch

from pallas_kernels.selective_scan import selective_scan_ragged, selective_scan_step

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
C, N = 256, 8  # two channel blocks of the prefill (128), four of the step (64)


def _params(rng):
    A = -np.exp(rng.uniform(-1.0, 1.5, (C, N))).astype(np.float32)
    D = rng.standard_normal(C).astype(np.float32)
    dt_bias = rng.normal(-1.0, 0.5, C).astype(np.float32)
    return A, D, dt_bias


def _tokens(rng, shape):
    x, dt, z = (rng.standard_normal((*shape, C)).astype(np.float32) for _ in range(3))
    B, Cm = (rng.standard_normal((*shape, N)).astype(np.float32) for _ in range(2))
    return x, dt, B, Cm, z


def _ragged(args, rg, states, impl, gated=True):
    x, dt, B, Cm, z, A, D, dt_bias = args
    y, st = selective_scan_ragged(*map(jnp.asarray, (x, dt, A, B, Cm, D, dt_bias, rg.cu, states,
                                                     rg.slots, rg.has_initial)),
                                  z=jnp.asarray(z) if gated else None, impl=impl)
    return np.asarray(y), np.asarray(st.astype(jnp.float32))


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_ragged_scan_matches_loop_and_splits(impl):
    rng = np.random.default_rng(5)
    rg = make_ragged(rng, [1, 9, 13, 4], pad_tail=3, num_slots=7)
    toks = _tokens(rng, (rg.t,))
    args = (*toks, *_params(rng))
    states = poison_states(rng, rg, (C, N), np.float32)
    for gated in (True, False):
        want_y, want_s = selective_scan_np(toks[0], toks[1], args[5], toks[2], toks[3], args[6], args[7], rg,
                                           states, z=toks[4] if gated else None)
        y, st = _ragged(args, rg, states, impl, gated)
        assert np.isfinite(y).all() and (y[rg.cu[-1]:] == 0).all()
        assert rel_err(y, want_y) < 1e-5, rel_err(y, want_y)
        live = rg.slots[:-1]
        assert rel_err(st[live], want_s[live]) < 1e-5
        assert np.isnan(st[np.setdiff1d(np.arange(rg.num_slots), rg.slots)]).all()
    # Chunked prefill: each sequence cut in two calls, the second starting from the slot.
    first, second, idx1, idx2 = split_batch(rng, rg)
    pad = lambda v, idx: np.concatenate([v[idx], np.zeros((3, *v.shape[1:]), np.float32)])
    part = lambda idx: tuple(pad(v, idx) for v in toks) + args[5:]
    y1, s_mid = _ragged(part(idx1), first, states, impl)
    y2, s_two = _ragged(part(idx2), second, s_mid, impl)
    y_one, s_one = _ragged(args, rg, states, impl)
    y_two = np.zeros_like(y_one)
    y_two[idx1], y_two[idx2] = y1[:len(idx1)], y2[:len(idx2)]
    assert rel_err(y_two, y_one) < 1e-5
    assert rel_err(s_two[rg.slots[:-1]], s_one[rg.slots[:-1]]) < 1e-5


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_step_candidates_and_decode(impl, state_dtype):
    rng = np.random.default_rng(11)
    A, D, dt_bias = _params(rng)
    slots = np.array([3, 1, 0], np.int32)  # the last row: padding on the dummy slot
    states = np.full((5, C, N), np.nan, np.float32)
    states[slots] = rng.standard_normal((3, C, N))
    states = jnp.asarray(states, state_dtype)
    q = 3
    x, dt, B, Cm, z = _tokens(rng, (3, q))
    common = dict(z=jnp.asarray(z), impl=impl)
    y, cands = selective_scan_step(*map(jnp.asarray, (x, dt, A, B, Cm, D, dt_bias)), states,
                                   jnp.asarray(slots), candidates=True, **common)
    assert cands.shape == (q, 3, C, N) and cands.dtype == state_dtype
    # q one-token steps give the same outputs, and after step j the state is candidate j.
    st = states
    for j in range(q):
        yj, st = selective_scan_step(*(jnp.asarray(v[:, j:j + 1]) for v in (x, dt)), jnp.asarray(A),
                                     *(jnp.asarray(v[:, j:j + 1]) for v in (B, Cm)), jnp.asarray(D),
                                     jnp.asarray(dt_bias), st, jnp.asarray(slots),
                                     z=jnp.asarray(z[:, j:j + 1]), impl=impl)
        np.testing.assert_allclose(np.asarray(yj)[:2, 0], np.asarray(y)[:2, j], rtol=1e-5, atol=1e-5)
        got = np.asarray(st.astype(jnp.float32))[slots[:2]]
        np.testing.assert_allclose(got, np.asarray(cands[j, :2].astype(jnp.float32)), rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(st.astype(jnp.float32))[[2, 4]]).all()
    if state_dtype == jnp.float32:  # against the float64 loop over the same q tokens
        rg = make_ragged(rng, [q, q], pad_tail=0, num_slots=5, pad_seqs=0)
        rg.slots, rg.has_initial = slots[:2], np.array([True, True])
        flat = lambda v: v[:2].reshape(2 * q, -1)
        want_y, want_s = selective_scan_np(flat(x), flat(dt), A, flat(B), flat(Cm), D, dt_bias, rg,
                                           np.asarray(states), z=flat(z))
        assert rel_err(np.asarray(y)[:2].reshape(2 * q, C), want_y) < 1e-5
        assert rel_err(np.asarray(cands[-1, :2]), want_s[slots[:2]]) < 1e-5


def test_rejects_bad_shapes():
    z = jnp.zeros
    with pytest.raises(ValueError, match="A.shape"):
        selective_scan_step(z((1, 1, C)), z((1, 1, C)), z((C,)), z((1, 1, N)), z((1, 1, N)), z((C,)),
                            z((C,)), z((2, C, N)), jnp.array([1]))
    with pytest.raises(ValueError, match="states"):
        selective_scan_step(z((1, 1, C)), z((1, 1, C)), z((C, N)), z((1, 1, N)), z((1, 1, N)), z((C,)),
                            z((C,)), z((2, C, N), jnp.float16), jnp.array([1]))
