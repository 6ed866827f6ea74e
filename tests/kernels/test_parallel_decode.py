"""`attention_ssm_decode`: paged decode and the Mamba2 state update in one launch give what
the two kernels give launched apart (the same bodies: equal up to the last bit of a
rounding, as the compiler contracts the arithmetic of one body or two), and what the
float64 oracles give; one Triton call; pools and states updated in place.

Interpret mode on CPU, compiled on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import rel_err, softplus, ssm_step
from test_decode_fused import CASES, KERNEL_IMPL, TOL, _f64, _setup

import pallas_kernels.paged_attention as pa
from pallas_kernels.paged_attention import paged_attention_decode_fused
from pallas_kernels.parallel_decode import attention_ssm_decode
from pallas_kernels.ssm_decode import ssm_decode_packed

SSM_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _ssm_setup(b: int, state_dtype, seed: int = 0, h: int = 4, g: int = 2, p: int = 32, n: int = 16,
               stacked: bool = True):
    """ssm_decode_packed's keyword arguments (b rows, the last a padding row on slot 0) and
    the float64 loop's outputs. Untouched slots hold NaN."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s)  # noqa: E731
    num_slots = b + 3
    slots = rng.permutation(np.arange(1, num_slots))[:b].astype(np.int32)
    slots[-1] = 0
    states = np.full((num_slots, h, p, n), np.nan, np.float32)
    states[slots] = r(b, h, p, n)
    states = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    x, B, C = r(b, h, p), r(b, g, n), r(b, g, n)
    dt_col0 = 11
    zxbcdt = r(b, dt_col0 + h + 2).astype(np.float32)
    A_log, D, dt_bias = r(h), r(h), 0.5 * r(h)
    want_s = states.astype(np.float64).copy()
    want_y = []
    for i, s in enumerate(slots):
        dt = softplus(zxbcdt[i, dt_col0:dt_col0 + h].astype(np.float64) + dt_bias)
        want_y.append(ssm_step(want_s[s], x[i], dt, -np.exp(A_log), B[i], C[i], D))
    coeffs = [jnp.asarray(a, jnp.float32) for a in (A_log, D, dt_bias)]
    kw = dict(num_heads=h, head_dim=p, n_groups=g, dt_col0=dt_col0)
    if stacked:  # row 1 of stacks [3, h], as the fused model passes them
        coeffs = [jnp.stack([a + 5.0, a, a - 2.0]) for a in coeffs]
        kw["row"] = 1
    xbc = np.concatenate([x.reshape(b, -1), B.reshape(b, -1), C.reshape(b, -1)], 1)
    kw.update(xbc=jnp.asarray(xbc, jnp.float32), zxbcdt=jnp.asarray(zxbcdt),
              A_log=coeffs[0], D=coeffs[1], dt_bias=coeffs[2],
              states=jnp.asarray(states, state_dtype), slot_ids=jnp.asarray(slots))
    return kw, np.stack(want_y), want_s, slots


def _attention_kw(case):
    args, kw, want, slots = _setup(case)
    names = ("proj", "cos", "sin", "k_pages", "v_pages", "slot_mapping", "lengths", "page_table")
    return dict(zip(names, args, strict=True)) | kw, want, slots


@pytest.mark.parametrize("case,splits,state_dtype", [
    (CASES[0], 1, jnp.float32), (CASES[0], 3, jnp.bfloat16), (CASES[1], 2, jnp.float32),
    (CASES[2], 4, jnp.float32)], ids=["f32-1-split", "f32-3-splits-bf16-state", "bf16-2-splits",
                                       "partial-rotary-4-splits"])
def test_one_launch_equals_apart_and_oracles(monkeypatch, case, splits, state_dtype):
    monkeypatch.setattr(pa, "default_splits", lambda *_: splits)
    attention, want_o, kv_slots = _attention_kw(case)
    b = attention["proj"].shape[0]
    ssm, want_y, want_s, slots = _ssm_setup(b, state_dtype, seed=splits)
    (parts, k_out, v_out), (y, states) = attention_ssm_decode(
        attention | {"impl": KERNEL_IMPL}, ssm | {"impl": KERNEL_IMPL})
    apart_parts, k_apart, v_apart = paged_attention_decode_fused(**attention, merge=False, impl=KERNEL_IMPL)
    y_apart, s_apart = ssm_decode_packed(**ssm, impl=KERNEL_IMPL)
    assert (parts.m is None) == (splits == 1) and parts.group == apart_parts.group
    for got, apart in ((parts.o, apart_parts.o), (parts.m, apart_parts.m), (parts.l, apart_parts.l),
                       (k_out, k_apart), (v_out, v_apart), (y, y_apart), (states, s_apart)):
        if apart is None:
            assert got is None
            continue
        assert got.shape == apart.shape and got.dtype == apart.dtype
        ulp = 2e-6 if got.dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(_f64(got), _f64(apart), rtol=ulp, atol=ulp)
    # Against the oracles: the parts merged as mixer_merge merges them.
    from pallas_kernels.decode_glue import merge_parts_reference
    o = merge_parts_reference(parts)
    np.testing.assert_allclose(_f64(o), want_o, atol=TOL[case[0]][1], rtol=TOL[case[0]][1])
    st = np.asarray(states.astype(jnp.float32))
    assert rel_err(np.asarray(y)[:-1], want_y[:-1]) < SSM_TOL[state_dtype]
    assert rel_err(st[slots[:-1]], want_s[slots[:-1]]) < SSM_TOL[state_dtype]
    assert np.isnan(st[np.setdiff1d(np.arange(st.shape[0]), slots)]).all()


def test_reference_impl_runs_the_references():
    attention, want_o, _ = _attention_kw(CASES[0])
    ssm, want_y, _, _ = _ssm_setup(attention["proj"].shape[0], jnp.float32)
    ref = {"impl": "reference"}
    (parts, _, _), (y, _) = attention_ssm_decode(attention | ref, ssm | ref)
    ref_o, _, _ = paged_attention_decode_fused(**attention, impl="reference")
    np.testing.assert_array_equal(np.asarray(parts.o.reshape(ref_o.shape)), np.asarray(ref_o))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ssm_decode_packed(**ssm, impl="reference")[0]))


def test_refuses_mixed_impls():
    attention, _, _ = _attention_kw(CASES[0])
    ssm, _, _, _ = _ssm_setup(attention["proj"].shape[0], jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        attention_ssm_decode(attention | {"impl": "reference"}, ssm | {"impl": KERNEL_IMPL})


def assert_one_call_in_place(step, arrays):
    """step(*arrays, impl) -> the updated arrays: one Triton call where it lowers for a GPU,
    and, jitted with the arrays donated, each output in its input's buffer."""
    if KERNEL_IMPL == "interpret":  # the lowering for a GPU, checked from the CPU
        pytest.importorskip("jax._src.lib.triton")
        text = jax.jit(lambda *a: step(*a, "pallas")).trace(*arrays).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
    bufs = [jnp.array(a) for a in arrays]
    ptrs = [a.unsafe_buffer_pointer() for a in bufs]
    out = jax.jit(lambda *a: step(*a, KERNEL_IMPL), donate_argnums=tuple(range(len(bufs))))(*bufs)
    assert [a.unsafe_buffer_pointer() for a in out] == ptrs


def test_one_triton_call_and_updates_in_place():
    attention, _, _ = _attention_kw(CASES[0])
    ssm, _, _, _ = _ssm_setup(attention["proj"].shape[0], jnp.float32)

    def step(k_pages, v_pages, states, impl):
        (_, k, v), (_, s) = attention_ssm_decode(
            attention | {"k_pages": k_pages, "v_pages": v_pages, "impl": impl},
            ssm | {"states": states, "impl": impl})
        return k, v, s

    assert_one_call_in_place(step, (attention["k_pages"], attention["v_pages"], ssm["states"]))
