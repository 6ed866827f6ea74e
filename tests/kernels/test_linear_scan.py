"""Diagonal linear recurrence (RG-LRU scan): kernel vs reference vs a float64 loop.

Interpret mode on CPU, compiled on GPU. Decays include exact zeros (RG-LRU's
reset); lengths cross the kernel's 16-token tiles; three channel blocks;
untouched slots and slots read with has_initial=False hold NaN.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import make_ragged, rel_err, scan_np, split_batch

from pallas_kernels.linear_scan import linear_scan_decode, linear_scan_ragged

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
C = 384  # three blocks of 128


def _data(rng, t, dtype):
    a = rng.uniform(0.5, 1.0, (t, C)).astype(np.float32)
    a[rng.random((t, C)) < 0.05] = 0.0
    b = rng.standard_normal((t, C)).astype(np.float32)
    q = lambda v: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
    return q(a), q(b)


def _states(rng, rg):
    states = np.full((rg.num_slots, C), np.nan, np.float32)
    for s, h in zip(rg.slots, rg.has_initial, strict=True):
        if h:
            states[s] = rng.standard_normal(C)
    return states


def _run(a, b, rg, states, impl, dtype=jnp.float32):
    h, st = linear_scan_ragged(jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(rg.cu),
                               jnp.asarray(states), jnp.asarray(rg.slots),
                               jnp.asarray(rg.has_initial), impl=impl)
    return np.asarray(h.astype(jnp.float32)), np.asarray(st)


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scan_matches_loop(impl, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{impl}{dtype}".encode()))
    rg = make_ragged(rng, [1, 17, 40, 16, 3], pad_tail=5, num_slots=9)
    a, b = _data(rng, rg.t, dtype)
    states = _states(rng, rg)
    want_h, want_s = scan_np(a, b, rg, states)
    h, st = _run(a, b, rg, states, impl, dtype)
    assert np.isfinite(h).all() and (h[rg.cu[-1]:] == 0).all()
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16 output rounding
    assert rel_err(h, want_h) < tol, rel_err(h, want_h)
    live = rg.slots[:-1]
    assert np.isnan(st[np.setdiff1d(np.arange(rg.num_slots), rg.slots)]).all()
    assert rel_err(st[live], want_s[live]) < 1e-5


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_scan_split_equals_one_call(impl):
    rng = np.random.default_rng(9)
    rg = make_ragged(rng, [33, 1, 20], pad_tail=3, num_slots=5)
    a, b = _data(rng, rg.t, jnp.float32)
    states = _states(rng, rg)
    h_one, s_one = _run(a, b, rg, states, impl)
    first, second, idx1, idx2 = split_batch(rng, rg)
    pad = lambda v, idx: np.concatenate([v[idx], np.zeros((3, C), np.float32)])
    h1, s_mid = _run(pad(a, idx1), pad(b, idx1), first, states, impl)
    h2, s_two = _run(pad(a, idx2), pad(b, idx2), second, s_mid, impl)
    h_two = np.zeros_like(h_one)
    h_two[idx1], h_two[idx2] = h1[: len(idx1)], h2[: len(idx2)]
    assert rel_err(h_two, h_one) < 1e-6
    live = rg.slots[:-1]
    assert rel_err(s_two[live], s_one[live]) < 1e-6


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_scan_decode(impl):
    rng = np.random.default_rng(zlib.crc32(impl.encode()))
    slots = np.array([3, 1, 0], np.int32)
    states = np.full((5, C), np.nan, np.float32)
    states[slots] = rng.standard_normal((3, C))
    a, b = _data(rng, 3, jnp.float32)
    h, st = linear_scan_decode(jnp.asarray(a), jnp.asarray(b), jnp.asarray(states),
                               jnp.asarray(slots), impl=impl)
    want = a * states[slots] + b
    assert rel_err(np.asarray(h)[:2], want[:2]) < 1e-6
    assert rel_err(np.asarray(st)[slots[:2]], want[:2]) < 1e-6
    assert np.isnan(np.asarray(st)[[2, 4]]).all()


def test_scan_rejects_bf16_state():
    with pytest.raises(ValueError, match="states"):
        linear_scan_decode(jnp.zeros((2, C)), jnp.zeros((2, C)), jnp.zeros((3, C), jnp.bfloat16),
                           jnp.array([1, 2]))
