"""The conv folded into the Mamba2 state update (`ssm_decode_packed(conv_states=...)`),
apart and beside paged decode in one launch (`attention_ssm_decode`), with
`mixer_merge(conv_states=...)` rolling B's and C's conv states after it: together they
give what `conv1d_decode` then the unfolded update give (the same arithmetic: equal up to
the last bit of a rounding) and what a float64 loop gives; slots not in the batch keep
their states; the conv states are updated in place.

Interpret mode on CPU, compiled on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import rel_err, silu, softplus, ssm_step
from test_decode_fused import CASES, KERNEL_IMPL, _f64, _setup
from test_parallel_decode import assert_one_call_in_place

import pallas_kernels.paged_attention as pa
from pallas_kernels.conv1d import conv1d_decode
from pallas_kernels.decode_glue import DecodeParts, mixer_merge
from pallas_kernels.parallel_decode import attention_ssm_decode
from pallas_kernels.ssm_decode import ssm_decode_packed

H, G, P, N, K = 4, 2, 32, 16, 4
D_IN = H * P
C = D_IN + 2 * G * N  # conv channels: x, B, C


def _case(b: int, dtype, bias: bool = True, seed: int = 0):
    """The folded call's keyword arguments (b rows, the last a padding row on slot 0, the
    in_proj row laid out z | xBC | dt after 5 leading columns) and the float64 loop's
    y, SSM states and conv states. Slots outside the batch hold NaN."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s)  # noqa: E731
    num_slots = b + 3
    slots = rng.permutation(np.arange(1, num_slots))[:b].astype(np.int32)
    slots[-1] = 0
    rnd = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    states = np.full((num_slots, H, P, N), np.nan, np.float32)
    states[slots] = r(b, H, P, N)
    conv = np.full((num_slots, K - 1, C), np.nan, np.float32)
    conv[slots] = rnd(r(b, K - 1, C))
    col0 = 5
    zxbcdt = rnd(r(b, col0 + D_IN + C + H))
    xbc_col0, dt_col0 = col0 + D_IN, col0 + D_IN + C
    # Stacks [3, ...] read at row 1, as the fused model passes them.
    w = rnd(0.5 * r(3, C, K))
    cb = rnd(0.2 * r(3, C)) if bias else None
    A_log, D, dt_bias = r(3, H), r(3, H), 0.5 * r(3, H)
    # float64 loop: conv (silu, rounded to the row's dtype as the conv's output), then the SSM.
    want_s, want_c = states.astype(np.float64), conv.astype(np.float64)
    want_y = []
    for i, s in enumerate(slots):
        window = np.concatenate([want_c[s], zxbcdt[i, None, xbc_col0:xbc_col0 + C]], 0)  # [K, C]
        u = rnd(silu((window * w[1].T).sum(0) + (cb[1] if bias else 0.0)))
        want_c[s] = window[1:]
        dt = softplus(zxbcdt[i, dt_col0:dt_col0 + H] + dt_bias[1])
        x, B, Cm = u[:D_IN].reshape(H, P), u[D_IN:D_IN + G * N].reshape(G, N), u[D_IN + G * N:].reshape(G, N)
        want_y.append(ssm_step(want_s[s], x, dt, -np.exp(A_log[1]), B, Cm, D[1]))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    kw = dict(xbc=None, zxbcdt=jnp.asarray(zxbcdt, dtype), A_log=f32(A_log), D=f32(D), dt_bias=f32(dt_bias),
              states=f32(states), slot_ids=jnp.asarray(slots), num_heads=H, head_dim=P, n_groups=G,
              dt_col0=dt_col0, row=1, conv_weight=jnp.asarray(w, dtype),
              conv_bias=None if cb is None else jnp.asarray(cb, dtype),
              conv_states=jnp.asarray(conv, dtype), xbc_col0=xbc_col0)
    return kw, np.stack(want_y), want_s, want_c, slots


def _unfolded(kw, impl):
    """conv1d_decode, then the update reading its output: the path the fold replaces."""
    xbc, conv = conv1d_decode(kw["zxbcdt"], kw["conv_weight"], kw["conv_bias"], kw["conv_states"],
                              kw["slot_ids"], activation="silu", impl=impl, col0=kw["xbc_col0"],
                              row=kw["row"])
    rest = {k: v for k, v in kw.items() if k not in ("conv_weight", "conv_bias", "conv_states", "xbc_col0")}
    y, states = ssm_decode_packed(**rest | {"xbc": xbc}, impl=impl)
    return y, states, conv


def _roll(kw, conv, impl):
    """mixer_merge rolling B's and C's conv states (its merge output checked unchanged)."""
    b = kw["zxbcdt"].shape[0]
    rng = np.random.default_rng(7)
    parts = DecodeParts(jnp.asarray(rng.standard_normal((b, 1, 2, 16)), jnp.float32), None, None, 2,
                        jnp.float32)
    y = jnp.asarray(rng.standard_normal((b, H, P)), jnp.float32)
    common = dict(z_col=0, n_groups=G, eps=1e-5, row=None, impl=impl)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(D_IN), jnp.float32)
    out, rolled = mixer_merge(parts, y, kw["zxbcdt"], weight, **common, conv_states=conv,
                              slot_ids=kw["slot_ids"], xbc_col=kw["xbc_col0"])
    plain = mixer_merge(parts, y, kw["zxbcdt"], weight, **common)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    return rolled


def _check(y, states, conv, want_y, want_s, want_c, slots, tol):
    real = slots[:-1]
    assert rel_err(np.asarray(y, np.float64)[:-1], want_y[:-1]) < tol
    st = np.asarray(states)
    assert rel_err(st[real], want_s[real]) < tol
    np.testing.assert_allclose(_f64(conv)[real], want_c[real], rtol=1e-6, atol=0)  # copies of inputs
    others = np.setdiff1d(np.arange(st.shape[0]), slots)
    assert np.isnan(st[others]).all() and np.isnan(_f64(conv)[others]).all()


@pytest.mark.parametrize("dtype,bias", [(jnp.float32, True), (jnp.bfloat16, True), (jnp.float32, False)],
                         ids=["f32", "bf16", "f32-no-bias"])
@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_folded_equals_conv_then_update_and_oracle(dtype, bias, impl):
    kw, want_y, want_s, want_c, slots = _case(6, dtype, bias)
    y, states, conv = ssm_decode_packed(**kw, impl=impl)
    # Before mixer_merge: the x channels rolled, B's and C's as they were.
    before = np.asarray(kw["conv_states"], np.float32)
    np.testing.assert_array_equal(_f64(conv)[slots, :, D_IN:], before[slots, :, D_IN:])
    np.testing.assert_allclose(_f64(conv)[slots[:-1], :, :D_IN], want_c[slots[:-1], :, :D_IN], rtol=1e-6)
    conv = _roll(kw, conv, impl)
    y_ref, s_ref, c_ref = _unfolded(kw, impl)
    ulp = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_f64(y), _f64(y_ref), rtol=ulp, atol=ulp)
    np.testing.assert_allclose(np.asarray(states), np.asarray(s_ref), rtol=2e-6, atol=2e-6)
    real = slots[:-1]
    np.testing.assert_array_equal(np.asarray(conv)[real], np.asarray(c_ref)[real])
    _check(y, states, conv, want_y, want_s, want_c, slots, 2e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_folded_in_one_launch(monkeypatch, splits):
    monkeypatch.setattr(pa, "default_splits", lambda *_: splits)
    args, akw, _, _ = _setup(CASES[0])
    names = ("proj", "cos", "sin", "k_pages", "v_pages", "slot_mapping", "lengths", "page_table")
    attention = dict(zip(names, args, strict=True)) | akw
    b = attention["proj"].shape[0]
    kw, want_y, want_s, want_c, slots = _case(b, jnp.float32, seed=splits)
    _, (y, states, conv) = attention_ssm_decode(
        attention | {"impl": KERNEL_IMPL}, kw | {"impl": KERNEL_IMPL})
    y_apart, s_apart, c_apart = ssm_decode_packed(**kw, impl=KERNEL_IMPL)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_apart), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(states), np.asarray(s_apart), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(conv), np.asarray(c_apart))
    _check(y, states, _roll(kw, conv, KERNEL_IMPL), want_y, want_s, want_c, slots, 2e-5)

    def step(k_pages, states, conv, impl):
        (_, k, _), (_, s, c) = attention_ssm_decode(
            attention | {"k_pages": k_pages, "impl": impl},
            kw | {"states": states, "conv_states": conv, "impl": impl})
        return k, s, c

    assert_one_call_in_place(step, (attention["k_pages"], kw["states"], kw["conv_states"]))


def test_refuses_bad_conv_arguments():
    kw, *_ = _case(3, jnp.float32)
    with pytest.raises(ValueError, match="xbc=None"):
        ssm_decode_packed(**kw | {"xbc": kw["zxbcdt"]})
    with pytest.raises(ValueError, match="xbc_col0"):
        ssm_decode_packed(**kw | {"xbc_col0": kw["zxbcdt"].shape[1] - C + 1})
    with pytest.raises(ValueError, match="conv_states"):
        ssm_decode_packed(**kw | {"conv_states": kw["conv_states"][:, :1]})
    with pytest.raises(ValueError, match="conv_states"):
        _roll(kw | {"xbc_col0": None}, kw["conv_states"], KERNEL_IMPL)
