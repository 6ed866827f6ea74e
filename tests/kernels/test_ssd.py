"""Ragged SSD scan: kernel vs reference vs a float64 sequential loop.

Runs the Pallas pipeline in interpret mode on CPU (the interpreter fills kernel
outputs with NaN, so an unwritten row fails) and compiled on a GPU. State slots
that are untouched, or read with has_initial=False, hold NaN: a leak or a stray
write shows up. Chunked processing (each sequence split over two calls, the
state carried through its slot) must equal one call.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import make_ragged, poison_states, rel_err, split_batch, ssd_np

from pallas_kernels.ssd import ssd_ragged
from pallas_kernels.ssd_kernel import ssd_pallas

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
L = 16
# Max-normalised error allowed vs the float64 loop, by input dtype.
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 3e-2}
CASES = [  # (input dtype, state dtype, heads, groups, gated)
    (jnp.float32, jnp.float32, 4, 1, True),
    (jnp.float32, jnp.bfloat16, 4, 2, False),
    (jnp.bfloat16, jnp.float32, 4, 2, True),
]


def _inputs(rng, t, h, g, dtype, p=16, n=16):
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # dtype-exact
    return dict(
        x=cast(r(t, h, p)), dt=r(t, h) - 1.0, A=-np.exp(r(h)), B=cast(r(t, g, n)),
        C=cast(r(t, g, n)), D=r(h), dt_bias=r(h) * 0.5, z=cast(r(t, h, p)),
    )


def _run(inp, rg, states, impl, dtype, gated, dt_limit=(0.0, np.inf)):
    j = lambda k: jnp.asarray(inp[k], dtype if k in ("x", "B", "C", "z") else jnp.float32)
    y, st = ssd_ragged(
        j("x"), j("dt"), j("A"), j("B"), j("C"), j("D"), j("dt_bias"), jnp.asarray(rg.cu),
        jnp.asarray(states), jnp.asarray(rg.slots), jnp.asarray(rg.has_initial),
        z=j("z") if gated else None, dt_limit=dt_limit, chunk_size=L, impl=impl,
    )
    return np.asarray(y.astype(jnp.float32)), np.asarray(st.astype(jnp.float32))


def _check_states(got, want, rg, tol, name):
    live = rg.slots[: len(rg.slots) - 1]  # the last sequence is the empty dummy
    untouched = np.setdiff1d(np.arange(rg.num_slots), np.concatenate([live, [0]]))
    assert np.isnan(got[untouched]).all(), f"{name}: untouched slots were written"
    assert np.isfinite(got[live]).all(), f"{name}: non-finite final state"
    assert rel_err(got[live], want[live]) < tol, (name, rel_err(got[live], want[live]))


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("dtype,state_dtype,h,g,gated", CASES)
def test_ssd_matches_sequential_loop(impl, dtype, state_dtype, h, g, gated):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{state_dtype}{g}{impl}".encode()))
    rg = make_ragged(rng, [1, 37, L, 23, 5], pad_tail=6, num_slots=9)
    inp = _inputs(rng, rg.t, h, g, dtype)
    states = poison_states(rng, rg, (h, 16, 16), np.float32)
    states_q = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    want_y, want_s = ssd_np(**{k: inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")},
                            rg=rg, states=states_q, z=inp["z"] if gated else None)
    y, st = _run(inp, rg, jnp.asarray(states, state_dtype), impl, dtype, gated)
    assert np.isfinite(y).all(), "non-finite (unwritten?) output"
    assert (y[rg.cu[-1]:] == 0).all(), "padding tokens must get y = 0"
    assert rel_err(y, want_y) < TOL[dtype], rel_err(y, want_y)
    tol_s = TOL[dtype] if state_dtype == jnp.float32 else max(TOL[dtype], 1e-2)
    _check_states(st, want_s, rg, tol_s, impl)


@pytest.mark.parametrize("dtype,state_dtype,h,g,gated", CASES[:1] + CASES[2:])
def test_ssd_kernel_matches_reference(dtype, state_dtype, h, g, gated):
    rng = np.random.default_rng(7)
    rg = make_ragged(rng, [2 * L + 3, 1, 9], pad_tail=2, num_slots=6)
    inp = _inputs(rng, rg.t, h, g, dtype)
    states = jnp.asarray(poison_states(rng, rg, (h, 16, 16), np.float32), state_dtype)
    lim = (0.05, 2.0)  # a clamp that bites on both sides
    y_k, s_k = _run(inp, rg, states, KERNEL_IMPL, dtype, gated, lim)
    y_r, s_r = _run(inp, rg, states, "reference", dtype, gated, lim)
    assert rel_err(y_k, y_r) < TOL[dtype]
    live = rg.slots[:-1]
    assert rel_err(s_k[live], s_r[live]) < TOL[dtype]


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_ssd_split_over_two_calls_equals_one_call(impl):
    rng = np.random.default_rng(3)
    h, g, dtype = 4, 2, jnp.float32
    rg = make_ragged(rng, [40, 1, 19, 33], pad_tail=4, num_slots=7)
    inp = _inputs(rng, rg.t, h, g, dtype)
    states = poison_states(rng, rg, (h, 16, 16), np.float32)
    y_one, s_one = _run(inp, rg, states, impl, dtype, True)
    first, second, idx1, idx2 = split_batch(rng, rg)
    part = lambda idx, extra: {
        k: np.concatenate([v[idx], np.zeros((extra, *v.shape[1:]), v.dtype)])
        if v.shape[0] == rg.t else v for k, v in inp.items()
    }
    y1, s_mid = _run(part(idx1, 3), first, states, impl, dtype, True)
    y2, s_two = _run(part(idx2, 3), second, s_mid, impl, dtype, True)
    y_two = np.zeros_like(y_one)
    y_two[idx1], y_two[idx2] = y1[: len(idx1)], y2[: len(idx2)]
    assert rel_err(y_two, y_one) < 1e-5
    live = rg.slots[:-1]
    assert rel_err(s_two[live], s_one[live]) < 1e-5


def test_ssd_rejects_bad_chunk():
    z = jnp.zeros
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_ragged(z((8, 2, 16)), z((8, 2)), z(2), z((8, 1, 16)), z((8, 1, 16)), z(2), z(2),
                   jnp.array([0, 8], jnp.int32), z((2, 2, 16, 16)), jnp.array([1]),
                   jnp.array([True]), chunk_size=24, impl="reference")


@pytest.mark.parametrize("block_m,head_block", [(16, 1), (16, 4)])
def test_ssd_kernel_tilings_agree(block_m, head_block):
    """Several row blocks per chunk (steps 1 and 3) and other head blocks, chunk 32."""
    rng = np.random.default_rng(block_m + head_block)
    rg = make_ragged(rng, [70, 1, 33], pad_tail=3, num_slots=5)
    inp = _inputs(rng, rg.t, 4, 1, jnp.float32)
    states = jnp.asarray(poison_states(rng, rg, (4, 16, 16), np.float32))
    j = {k: jnp.asarray(v) for k, v in inp.items()}
    meta = (jnp.asarray(rg.cu), states, jnp.asarray(rg.slots), jnp.asarray(rg.has_initial))
    args = [j[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")] + list(meta)
    y_k, s_k = ssd_pallas(*args, z=j["z"], dt_limit=(0.0, np.inf), chunk_size=32,
                          impl=KERNEL_IMPL, block_m=block_m, head_block=head_block)
    y_r, s_r = ssd_ragged(*args, z=j["z"], chunk_size=32, impl="reference")
    live = rg.slots[:-1]
    assert rel_err(y_k, y_r) < 1e-5
    assert rel_err(np.asarray(s_k)[live], np.asarray(s_r)[live]) < 1e-5


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_inactive_sequences_are_skipped(impl):
    """`active` False: the sequence's slot is neither read nor written (a mixed step's
    decodes take the decode update instead); the others equal a run without `active`."""
    rng = np.random.default_rng(5)
    h, g, dtype = 4, 2, jnp.float32
    rg = make_ragged(rng, [1, 37, 1, 23, 5], pad_tail=6, num_slots=9)
    inp = _inputs(rng, rg.t, h, g, dtype)
    states = poison_states(rng, rg, (h, 16, 16), np.float32)
    states[rg.slots[[0, 2]]] = rng.standard_normal((2, h, 16, 16))  # skipped: any state
    y_all, s_all = _run(inp, rg, states, impl, dtype, True)
    active = np.array([False, True, False, True, True, True])[:len(rg.slots)]
    j = lambda k: jnp.asarray(inp[k], jnp.float32)
    y, st = ssd_ragged(
        j("x"), j("dt"), j("A"), j("B"), j("C"), j("D"), j("dt_bias"), jnp.asarray(rg.cu),
        jnp.asarray(states), jnp.asarray(rg.slots), jnp.asarray(rg.has_initial), z=j("z"),
        chunk_size=L, impl=impl, active=jnp.asarray(active))
    y, st = np.asarray(y), np.asarray(st)
    rows = np.concatenate([np.arange(rg.cu[i], rg.cu[i + 1]) for i in np.flatnonzero(active)])
    np.testing.assert_allclose(y[rows], y_all[rows], rtol=1e-5, atol=1e-5)
    live = rg.slots[:-1][active[:-1]]
    np.testing.assert_allclose(st[live], s_all[live], rtol=1e-5, atol=1e-5)
    skipped = rg.slots[[0, 2]]
    np.testing.assert_array_equal(st[skipped], states[skipped])  # not even rewritten
