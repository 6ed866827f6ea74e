"""Mamba2 decode update: kernel vs reference vs a float64 loop, in place per slot.

Interpret mode on CPU, compiled on GPU. Untouched slots hold NaN and must stay
NaN; the decode step must also equal the ragged SSD scan on one-token sequences.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import rel_err, silu, softplus, ssm_step

from pallas_kernels.ssd import ssd_ragged
from pallas_kernels.ssm_decode import ssm_decode, ssm_decode_packed

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _case(seed, b, h, g, p, n, num_slots):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[:b].astype(np.int32)
    slots[-1] = 0  # a padded row on the dummy slot
    states = np.full((num_slots, h, p, n), np.nan, np.float32)
    states[slots] = r(b, h, p, n)
    args = dict(x=r(b, h, p), dt=r(b, h) - 1.0, A=-np.exp(r(h)), B=r(b, g, n), C=r(b, g, n),
                D=r(h), dt_bias=r(h) * 0.5)
    return args, states, slots, r(b, h, p)


def _oracle(args, states, slots, z):
    states = states.astype(np.float64).copy()
    ys = []
    for i, s in enumerate(slots):
        a = {k: np.asarray(v, np.float64) for k, v in args.items()}
        dt = softplus(a["dt"][i] + a["dt_bias"])
        y = ssm_step(states[s], a["x"][i], dt, a["A"], a["B"][i], a["C"][i], a["D"])
        ys.append(y * silu(np.asarray(z[i], np.float64)) if z is not None else y)
    return np.stack(ys), states


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g,gated", [(1, True), (2, False)])
def test_decode_matches_loop(impl, state_dtype, g, gated):
    args, states, slots, z = _case(zlib.crc32(f"{impl}{state_dtype}{g}".encode()), 5, 4, g,
                                   32, 16, 8)
    states_q = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    want_y, want_s = _oracle(args, states_q, slots, z if gated else None)
    y, st = ssm_decode(**{k: jnp.asarray(v) for k, v in args.items()},
                       states=jnp.asarray(states, state_dtype), slot_ids=jnp.asarray(slots),
                       z=jnp.asarray(z) if gated else None, impl=impl)
    y, st = np.asarray(y), np.asarray(st.astype(jnp.float32))
    assert np.isfinite(y).all()
    live = slots[:-1]
    untouched = np.setdiff1d(np.arange(8), slots)
    assert np.isnan(st[untouched]).all(), "untouched slots were written"
    tol = TOL[state_dtype]
    assert rel_err(y[:-1], want_y[:-1]) < tol, rel_err(y[:-1], want_y[:-1])
    assert rel_err(st[live], want_s[live]) < tol


def test_decode_equals_one_token_ssd():
    args, states, slots, z = _case(11, 4, 4, 2, 16, 16, 6)
    j = {k: jnp.asarray(v) for k, v in args.items()}
    y_d, s_d = ssm_decode(**j, states=jnp.asarray(states), slot_ids=jnp.asarray(slots),
                          z=jnp.asarray(z), impl=KERNEL_IMPL)
    y_s, s_s = ssd_ragged(**j, cu_seqlens=jnp.arange(5, dtype=jnp.int32),
                          states=jnp.asarray(states), slot_ids=jnp.asarray(slots),
                          has_initial=jnp.ones(4, bool), z=jnp.asarray(z), chunk_size=16,
                          impl=KERNEL_IMPL)
    live = slots[:-1]
    assert rel_err(y_d[:-1], y_s[:-1]) < 1e-5
    assert rel_err(np.asarray(s_d)[live], np.asarray(s_s)[live]) < 1e-5


def test_decode_rejects_bad_state():
    args, states, slots, _ = _case(0, 2, 4, 1, 16, 16, 4)
    with pytest.raises(ValueError, match="states"):
        ssm_decode(**{k: jnp.asarray(v) for k, v in args.items()},
                   states=jnp.asarray(states[:, :, :8]), slot_ids=jnp.asarray(slots))


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("state_dtype,g,dt_limit,stacked", [
    (jnp.float32, 1, (0.0, float("inf")), False), (jnp.bfloat16, 2, (0.05, 2.0), False),
    (jnp.float32, 2, (0.05, 2.0), True)])
def test_packed_decode_matches_loop(impl, state_dtype, g, dt_limit, stacked):
    """`ssm_decode_packed` reads x/B/C from one xBC row and the raw dt from columns of a
    wider in_proj row, takes A_log, and gives the float64 loop's outputs. `stacked`: A_log,
    D and dt_bias are row 2 of stacks [3, h] (`row=2`; the other rows junk)."""
    b, h, p, n, num_slots = 5, 4, 32, 16, 8
    args, states, slots, _ = _case(zlib.crc32(f"packed{impl}{g}".encode()), b, h, g, p, n, num_slots)
    rng = np.random.default_rng(3)
    xbc = np.concatenate([args["x"].reshape(b, -1), args["B"].reshape(b, -1), args["C"].reshape(b, -1)], 1)
    dt_col0 = 40
    zxbcdt = rng.standard_normal((b, dt_col0 + h + 3)).astype(np.float32)
    zxbcdt[:, dt_col0:dt_col0 + h] = args["dt"]
    A_log = np.log(-args["A"])
    states_q = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    want_y, want_s = _oracle(args, states_q, slots, None)
    if dt_limit != (0.0, float("inf")):  # the oracle's dt, clamped
        want_y, want_s = _oracle_clamped(args, states_q, slots, dt_limit)
    coeffs = [jnp.asarray(a, jnp.float32) for a in (A_log, args["D"], args["dt_bias"])]
    kw = {}
    if stacked:
        coeffs = [jnp.stack([a + 7.0, a - 3.0, a]) for a in coeffs]
        kw = dict(row=2)
    y, st = ssm_decode_packed(jnp.asarray(xbc), jnp.asarray(zxbcdt), *coeffs,
                              jnp.asarray(states, state_dtype), jnp.asarray(slots), num_heads=h,
                              head_dim=p, n_groups=g, dt_col0=dt_col0, dt_limit=dt_limit, impl=impl,
                              **kw)
    y, st = np.asarray(y), np.asarray(st.astype(jnp.float32))
    live = slots[:-1]
    assert rel_err(y[:-1], want_y[:-1]) < TOL[state_dtype]
    assert rel_err(st[live], want_s[live]) < TOL[state_dtype]
    assert np.isnan(st[np.setdiff1d(np.arange(num_slots), slots)]).all()


def _oracle_clamped(args, states, slots, dt_limit):
    states = states.astype(np.float64).copy()
    ys = []
    for i, s in enumerate(slots):
        a = {k: np.asarray(v, np.float64) for k, v in args.items()}
        dt = np.clip(softplus(a["dt"][i] + a["dt_bias"]), *dt_limit)
        ys.append(ssm_step(states[s], a["x"][i], dt, a["A"], a["B"][i], a["C"][i], a["D"]))
    return np.stack(ys), states


def test_packed_decode_lowers_to_triton():
    pytest.importorskip("jax._src.lib.triton")
    b, h, p, n = 4, 4, 32, 16
    args = (jnp.zeros((b, h * p + 2 * n), jnp.bfloat16), jnp.zeros((b, 64), jnp.bfloat16),
            jnp.zeros((h,)), jnp.zeros((h,)), jnp.zeros((h,)), jnp.zeros((6, h, p, n)),
            jnp.zeros((b,), jnp.int32))
    f = jax.jit(lambda *a: ssm_decode_packed(*a, num_heads=h, head_dim=p, n_groups=1, dt_col0=60,
                                             impl="pallas"))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_packed_decode_rejects_bad_shapes():
    z = lambda *s: jnp.zeros(s)  # noqa: E731
    args = dict(num_heads=4, head_dim=32, n_groups=1, impl=KERNEL_IMPL)
    slots = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="states.shape"):
        ssm_decode_packed(z(2, 4 * 32 + 2 * 16), z(2, 70), z(4), z(4), z(4), z(3, 4, 32, 8), slots,
                          dt_col0=60, **args)
    with pytest.raises(ValueError, match="zxbcdt"):
        ssm_decode_packed(z(2, 4 * 32 + 2 * 16), z(2, 70), z(4), z(4), z(4), z(3, 4, 32, 16), slots,
                          dt_col0=68, **args)
    with pytest.raises(ValueError, match="xbc.shape"):
        ssm_decode_packed(z(2, 4 * 32 + 2 * 16 + 1), z(2, 70), z(4), z(4), z(4), z(3, 4, 32, 16), slots,
                          dt_col0=60, **args)
    with pytest.raises(ValueError, match="row"):  # stacks of 2 rows: row 2 is outside
        ssm_decode_packed(z(2, 4 * 32 + 2 * 16), z(2, 70), z(2, 4), z(2, 4), z(2, 4), z(3, 4, 32, 16),
                          slots, dt_col0=60, row=2, **args)


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_negative_slot_skips_the_row(impl):
    args, states, slots, _ = _case(23, 5, 4, 2, 32, 16, 8)
    j = {k: jnp.asarray(v) for k, v in args.items()}
    y_all, s_all = ssm_decode(**j, states=jnp.asarray(states), slot_ids=jnp.asarray(slots), impl=impl)
    skip = slots.copy()
    skip[1] = -1
    y, st = ssm_decode(**j, states=jnp.asarray(states), slot_ids=jnp.asarray(skip), impl=impl)
    y, st, y_all, s_all = map(np.asarray, (y, st, y_all, s_all))
    keep = [0, 2, 3]
    np.testing.assert_array_equal(y[keep], y_all[keep])
    np.testing.assert_array_equal(st[slots[keep]], s_all[slots[keep]])
    np.testing.assert_array_equal(st[slots[1]], states[slots[1]])  # read and written by no one
