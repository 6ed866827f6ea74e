"""Causal depthwise conv1d (ragged prefill and decode) vs reference vs a float64 loop.

Interpret mode on CPU, compiled on GPU. Sequences shorter than k-1 (the new
state then keeps older inputs from the slot), empty dummy sequences, NaN in
untouched slots and in slots read with has_initial=False, several channel
blocks, and a split over two calls equal to one call.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import conv_np, make_ragged, poison_states, rel_err, split_batch

from pallas_kernels.conv1d import conv1d_decode, conv1d_ragged

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
K, C = 4, 48  # 48 channels: three blocks of 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _run(x, w, bias, rg, states, impl, act):
    return conv1d_ragged(jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias),
                         jnp.asarray(rg.cu), jnp.asarray(states), jnp.asarray(rg.slots),
                         jnp.asarray(rg.has_initial), activation=act, impl=impl)


def _data(rng, t, dtype):
    x = np.asarray(jnp.asarray(rng.standard_normal((t, C)), dtype))
    return x, rng.standard_normal((C, K)).astype(np.float32), rng.standard_normal(C).astype(
        np.float32
    )


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("dtype,act,with_bias", [(jnp.float32, "silu", True),
                                                  (jnp.bfloat16, None, False)])
def test_conv_ragged_matches_loop(impl, dtype, act, with_bias):
    rng = np.random.default_rng(zlib.crc32(f"{impl}{dtype}".encode()))
    rg = make_ragged(rng, [1, 70, 2, 5, 3], pad_tail=5, num_slots=9)
    x, w, bias = _data(rng, rg.t, dtype)
    bias = bias if with_bias else None
    states = poison_states(rng, rg, (K - 1, C), np.float32)
    want_y, want_s = conv_np(np.asarray(x, np.float32), w, bias, rg, states, act)
    y, st = _run(x, w, bias, rg, states, impl, act)
    y, st = np.asarray(y.astype(jnp.float32)), np.asarray(st)
    assert np.isfinite(y).all() and (y[rg.cu[-1]:] == 0).all()
    assert rel_err(y, want_y) < TOL[dtype], rel_err(y, want_y)
    live = rg.slots[:-1]
    untouched = np.setdiff1d(np.arange(rg.num_slots), rg.slots)
    assert np.isnan(st[untouched]).all()
    assert rel_err(st[live], want_s[live]) < TOL[dtype]


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_conv_split_equals_one_call(impl):
    rng = np.random.default_rng(5)
    rg = make_ragged(rng, [9, 2, 30, 1], pad_tail=2, num_slots=6)
    x, w, bias = _data(rng, rg.t, jnp.float32)
    states = poison_states(rng, rg, (K - 1, C), np.float32)
    y_one, s_one = _run(x, w, bias, rg, states, impl, "silu")
    first, second, idx1, idx2 = split_batch(rng, rg)
    pad = lambda idx: np.concatenate([x[idx], np.zeros((3, C), x.dtype)])
    y1, s_mid = _run(pad(idx1), w, bias, first, states, impl, "silu")
    y2, s_two = _run(pad(idx2), w, bias, second, s_mid, impl, "silu")
    y_two = np.zeros_like(np.asarray(y_one))
    y_two[idx1], y_two[idx2] = np.asarray(y1)[: len(idx1)], np.asarray(y2)[: len(idx2)]
    assert rel_err(y_two, y_one) < 1e-6
    live = rg.slots[:-1]
    assert rel_err(np.asarray(s_two)[live], np.asarray(s_one)[live]) < 1e-6


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_conv_decode_matches_loop(impl, state_dtype):
    rng = np.random.default_rng(zlib.crc32(f"{impl}{state_dtype}".encode()))
    b, num_slots = 4, 7
    slots = rng.permutation(np.arange(1, num_slots))[:b].astype(np.int32)
    slots[-1] = 0
    states = np.full((num_slots, K - 1, C), np.nan, np.float32)
    states[slots] = rng.standard_normal((b, K - 1, C))
    states = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    x, w, bias = _data(rng, b, jnp.float32)
    y, st = conv1d_decode(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias),
                          jnp.asarray(states, state_dtype), jnp.asarray(slots),
                          activation="silu", impl=impl)
    window = np.concatenate([states[slots], x[:, None]], 1).astype(np.float64)  # [b, k, c]
    v = (window * w.T[None]).sum(1) + bias
    want_y = v / (1 + np.exp(-v))
    st = np.asarray(st.astype(jnp.float32))
    assert rel_err(np.asarray(y)[:-1], want_y[:-1]) < 1e-5
    rolled = np.asarray(jnp.asarray(window[:-1, 1:], state_dtype).astype(jnp.float32))
    assert np.array_equal(st[slots[:-1]], rolled)
    assert np.isnan(st[np.setdiff1d(np.arange(num_slots), slots)]).all()


def test_conv_rejects_bad_activation():
    with pytest.raises(ValueError, match="activation"):
        conv1d_decode(jnp.zeros((2, C)), jnp.zeros((C, K)), None, jnp.zeros((3, K - 1, C)),
                      jnp.array([1, 2]), activation="gelu")


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("with_bias,stacked", [(True, False), (False, False), (True, True),
                                               (False, True)])
def test_conv_decode_reads_columns_of_a_wider_input(impl, with_bias, stacked):
    """`col0`: the channels are columns [col0, col0 + C) of a wider x (the Mamba2 in_proj
    output, read in place), with bf16 weights and bias as stored: same as the slice.
    `row`: the weight and bias are row 1 of stacks [3, C, K] / [3, C] (other rows junk)."""
    rng = np.random.default_rng(11 + with_bias)
    b, num_slots, col0 = 3, 5, 32
    slots = np.array([2, 4, 0], np.int32)
    states = rng.standard_normal((num_slots, K - 1, C)).astype(np.float32)
    wide = rng.standard_normal((b, col0 + C + 24)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((C, K)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(C), jnp.bfloat16) if with_bias else None
    kw = {}
    ws, bs = w, bias
    if stacked:
        junk = lambda a: jnp.asarray(rng.standard_normal(a.shape) * 100, a.dtype)  # noqa: E731
        ws = jnp.stack([junk(w), w, junk(w)])
        bs = None if bias is None else jnp.stack([junk(bias), bias, junk(bias)])
        kw = dict(row=1)
    y, st = conv1d_decode(jnp.asarray(wide), ws, bs, jnp.asarray(states), jnp.asarray(slots),
                          activation="silu", impl=impl, col0=col0, **kw)
    x = wide[:, col0:col0 + C]
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    bf = np.asarray(bias.astype(jnp.float32), np.float64) if with_bias else 0.0
    window = np.concatenate([states[slots], x[:, None]], 1).astype(np.float64)
    v = (window * wf.T[None]).sum(1) + bf
    assert rel_err(np.asarray(y)[:-1], (v / (1 + np.exp(-v)))[:-1]) < 1e-5
    assert np.array_equal(np.asarray(st)[slots[:-1]], window[:-1, 1:].astype(np.float32))
    with pytest.raises(ValueError, match="col0"):
        conv1d_decode(jnp.asarray(wide), ws, bs, jnp.asarray(states), jnp.asarray(slots),
                      activation="silu", impl=impl, col0=col0 + 25, **kw)
    if stacked:
        with pytest.raises(ValueError, match="row"):
            conv1d_decode(jnp.asarray(wide), ws, bs, jnp.asarray(states), jnp.asarray(slots),
                          activation="silu", impl=impl, col0=col0, row=3)
    with pytest.raises(ValueError, match="weight.shape"):  # wider x without col0: a mismatch
        conv1d_decode(jnp.asarray(wide), w, bias, jnp.asarray(states), jnp.asarray(slots),
                      activation="silu", impl=impl)


def test_conv_decode_lowers_to_triton():
    """The decode kernel (strided bf16 weight loads, column offset) lowers for Triton
    (checked on CPU by lowering for CUDA)."""
    pytest.importorskip("jax._src.lib.triton")
    args = (jnp.zeros((4, 2 * C), jnp.bfloat16), jnp.zeros((C, K), jnp.bfloat16),
            jnp.zeros((C,), jnp.bfloat16), jnp.zeros((5, K - 1, C), jnp.bfloat16),
            jnp.zeros((4,), jnp.int32))
    f = jax.jit(lambda *a: conv1d_decode(*a, activation="silu", impl="pallas", col0=C))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
