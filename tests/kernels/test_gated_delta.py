"""The gated delta rule: references against a float64 numpy loop, the chunked form and the
Pallas kernels (interpret mode on CPU, compiled on a GPU) against the sequential references.

Kernel tests poison untouched slots and slots read with has_initial=False with NaN, so a
stray read or write shows up (the interpreter also fills unwritten outputs with NaN).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import (
    gated_delta_ragged,
    gated_delta_ragged_reference,
    gated_delta_step,
    gated_delta_step_reference,
)

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


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
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, cu, states, slots, has_init)))
    chunked = functools.partial(gated_delta_ragged, impl="reference")
    for fn in (gated_delta_ragged_reference, chunked):
        _check_against_loop(*fn(*args, scale=scale), q, k, v, g, beta, cu, states, slots,
                            has_init, scale)


def _check_against_loop(o, new, q, k, v, g, beta, cu, states, slots, has_init, scale):
    o, new = np.asarray(o), np.asarray(new)
    for i, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        s0 = states[slots[i]] if has_init[i] else np.zeros_like(states[0])
        want_o, want_s = _numpy_rule(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], s0, scale)
        np.testing.assert_allclose(o[a:e], want_o, rtol=1e-5, atol=1e-5)
        if e > a:
            np.testing.assert_allclose(new[slots[i]], want_s, rtol=1e-5, atol=1e-5)
    assert not o[cu[-1]:].any()
    np.testing.assert_array_equal(new[1], states[1])  # untouched slot


@pytest.mark.parametrize("state_dtype,impl", [
    ("float32", "reference"), ("bfloat16", "reference"), ("bfloat16", KERNEL_IMPL)])
def test_step_candidates_equal_token_by_token_decode(state_dtype, impl):
    # Exact equality: speculative decoding keeps a candidate in place of a plain decode.
    rng = np.random.default_rng(1)
    b, n, dk = 3, 3, 16
    q, k, v, g, beta = _inputs(rng, b * n, dk=dk)
    shape = lambda x: jnp.asarray(x.reshape(b, n, *x.shape[1:]))  # noqa: E731
    q, k, v, g, beta = map(shape, (q, k, v, g, beta))
    states = jnp.asarray(rng.standard_normal((5, 4, dk, 16)), state_dtype)
    slots = jnp.array([4, 1, 2])
    step = functools.partial(gated_delta_step, scale=0.3, impl=impl)
    o_all, cand = step(q, k, v, g, beta, states, slots, candidates=True)
    s = states
    for j in range(n):
        o, s = step(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1], g[:, j:j + 1],
                    beta[:, j:j + 1], s, slots, candidates=False)
        np.testing.assert_array_equal(np.asarray(o[:, 0]), np.asarray(o_all[:, j]))
        np.testing.assert_array_equal(np.asarray(cand[j]), np.asarray(s[slots]))


def _ragged_case(rng, lens, pad, dtype, state_dtype, hk=2, hv=4, d=16, num_slots=7):
    """Sequences of `lens` on shuffled slots (has_initial mixed), then an empty one on the
    dummy slot 0, then `pad` padding tokens; untouched and unread slots hold NaN."""
    b = len(lens) + 1
    t = sum(lens) + pad
    q, k, v, g, beta = _inputs(rng, t, hk, hv, d, d)
    slots = np.concatenate([rng.permutation(np.arange(1, num_slots))[:b - 1], [0]])
    has_init = np.array([i % 2 == 0 for i in range(b - 1)] + [False])
    states = np.full((num_slots, hv, d, d), np.nan, np.float32)
    states[slots[has_init]] = rng.standard_normal((int(has_init.sum()), hv, d, d))
    cu = np.concatenate([[0], np.cumsum(list(lens) + [0])]).astype(np.int32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return ((cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(cu),
             jnp.asarray(states, state_dtype), jnp.asarray(slots), jnp.asarray(has_init)),
            slots[:-1])


def _max_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


@pytest.mark.parametrize("dtype,state_dtype,tol,lens,chunk", [
    # chunks of 64 (four 16-row blocks in the kernel's triangular inverse): a sequence of
    # two chunks, one shorter than a chunk, an empty one; a padding tail
    (jnp.float32, jnp.float32, 2e-5, [70, 5], 64),
    # chunks of 16: sequences of 1, 2 and 3 chunks and one exactly a chunk long
    (jnp.bfloat16, jnp.bfloat16, 3e-2, [37, 16, 5, 40], 16),
])
def test_chunked_reference_and_prefill_kernel_match_the_sequential_scan(dtype, state_dtype, tol,
                                                                        lens, chunk):
    args, live = _ragged_case(np.random.default_rng(2), lens, 19, dtype, state_dtype)
    want_o, want_s = gated_delta_ragged_reference(*args, scale=0.25)
    untouched = np.setdiff1d(np.arange(args[6].shape[0]), np.concatenate([live, [0]]))
    runs = {impl: functools.partial(gated_delta_ragged, impl=impl)
            for impl in ("reference", KERNEL_IMPL)}
    for impl, run in runs.items():
        o, s = run(*args, scale=0.25, chunk_size=chunk)
        assert _max_err(o, want_o) < tol, (impl, _max_err(o, want_o))
        assert _max_err(s[live], want_s[live]) < tol, (impl, _max_err(s[live], want_s[live]))
        assert not np.asarray(o[int(args[5][-1]):], np.float32).any(), impl  # padding: 0
        assert np.isnan(np.asarray(s[untouched], np.float32)).all(), impl


@pytest.mark.parametrize("n,state_dtype,per_channel", [(1, jnp.float32, False), (3, jnp.bfloat16, False),
                                                      (3, jnp.float32, True)])
def test_step_kernel_matches_the_reference(n, state_dtype, per_channel):
    """per_channel: KDA's decay, one per key channel (g [b, n, hv, dk])."""
    rng = np.random.default_rng(3)
    b, num_slots, d = 3, 6, 16
    q, k, v, g, beta = _inputs(rng, b * n, 2, 4, d, 2 * d)
    if per_channel:
        g = -rng.uniform(0.01, 3.0, (b * n, 4, d)).astype(np.float32)
    shape = lambda x: jnp.asarray(x.reshape(b, n, *x.shape[1:]))  # noqa: E731
    q, k, v, g, beta = map(shape, (q, k, v, g, beta))
    states = np.full((num_slots, 4, d, 2 * d), np.nan, np.float32)
    slots = np.array([4, 1, 2])
    states[slots] = rng.standard_normal((b, 4, d, 2 * d))
    states = jnp.asarray(states, state_dtype)
    tol = 1e-5 if state_dtype == jnp.float32 else 1e-2  # a bf16 rounding may flip
    for candidates in (False, True):
        args = (q, k, v, g, beta, states, jnp.asarray(slots))
        want = gated_delta_step_reference(*args, scale=0.3, candidates=candidates)
        got = gated_delta_step(*args, scale=0.3, candidates=candidates, impl=KERNEL_IMPL)
        assert _max_err(got[0], want[0]) < tol, candidates
        if candidates:
            assert got[1].shape == (n, b, 4, d, 2 * d) and got[1].dtype == state_dtype
            assert _max_err(got[1], want[1]) < tol
        else:
            assert _max_err(got[1][slots], want[1][slots]) < tol
            untouched = np.setdiff1d(np.arange(num_slots), slots)
            assert np.isnan(np.asarray(got[1][untouched], np.float32)).all()


def test_bad_arguments_are_refused_by_name():
    rng = np.random.default_rng(4)
    args, _ = _ragged_case(rng, [5], 0, jnp.float32, jnp.float32, d=8)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_ragged(*args, scale=1.0, chunk_size=48)
    with pytest.raises(ValueError, match="powers of 2 >= 16"):
        gated_delta_ragged(*args, scale=1.0, impl="interpret")
    with pytest.raises(ValueError, match="states"):
        gated_delta_ragged(*args[:6], args[6].astype(jnp.float16), *args[7:], scale=1.0)
    q, k, v, g, beta = (x[:, None] for x in args[:5])
    with pytest.raises(ValueError, match="slot_ids"):
        gated_delta_step(q, k, v, g, beta, args[6], args[7][:1], scale=1.0, candidates=False)


def test_kernels_lower_to_triton():
    """The kernel bodies use only ops the Pallas Triton lowering has (checked on CPU by
    lowering for CUDA; PTX compilation itself needs the GPU)."""
    pytest.importorskip("jax._src.lib.triton")
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    f32 = jnp.float32
    t, b, d = 64, 3, 16
    ragged = (spec(t, 2, d), spec(t, 2, d), spec(t, 4, d), spec(t, 4, dt=f32), spec(t, 4, dt=f32),
              spec(b + 1, dt=jnp.int32), spec(5, 4, d, d, dt=f32), spec(b, dt=jnp.int32),
              spec(b, dt=jnp.bool_))
    f = jax.jit(lambda *a: gated_delta_ragged(*a, scale=0.1, impl="pallas"))
    assert f.trace(*ragged).lower(lowering_platforms=("cuda",)).as_text().count(
        "__gpu$xla.gpu.triton") == 3
    for n, candidates, state_dtype, g_shape in ((1, False, f32, (4,)), (3, True, jnp.bfloat16, (4,)),
                                                (1, False, f32, (4, d))):  # the last: KDA's g
        step = (spec(b, n, 2, d), spec(b, n, 2, d), spec(b, n, 4, d), spec(b, n, *g_shape, dt=f32),
                spec(b, n, 4, dt=f32), spec(5, 4, d, d, dt=state_dtype), spec(b, dt=jnp.int32))
        f = jax.jit(lambda *a, c=candidates: gated_delta_step(*a, scale=0.1, candidates=c,
                                                              impl="pallas"))
        assert f.trace(*step).lower(lowering_platforms=("cuda",)).as_text().count(
            "__gpu$xla.gpu.triton") == 1


def test_unit_lower_solve_matches_a_float64_solve():
    """The UT transform's forward substitution (not lax's triangular_solve: see its doc)."""
    from pallas_kernels.gated_delta_chunked import unit_lower_solve

    rng = np.random.default_rng(3)
    a = rng.normal(size=(3, 2, 16, 16)).astype(np.float32) * 0.3
    rhs = rng.normal(size=(3, 2, 16, 5)).astype(np.float32)
    ref = np.linalg.solve(np.eye(16) + np.tril(a.astype(np.float64), -1), rhs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(unit_lower_solve(jnp.asarray(a), jnp.asarray(rhs))), ref,
                               rtol=1e-4, atol=1e-4)
