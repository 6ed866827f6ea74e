"""Fused Mamba2 step (conv + split + SSM, q tokens): kernel vs reference vs a float64 loop.

Interpret mode on CPU, compiled on GPU. Decode (q = 1, slots advanced in place) and
verification (q candidates, slots untouched); f32 and bf16 states; one and two groups;
conv bias or none. Untouched slots hold NaN and must stay NaN; the last row is padding
on dummy slot 0. The q candidates equal q decode steps (speculative decoding relies on it).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ssm_oracle import rel_err, silu, softplus, ssm_step

from pallas_kernels.mamba_step import mamba2_step

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
H, P, N, K, SLOTS, B = 4, 32, 16, 4, 8, 4


def _case(seed, q, g, with_bias, state_dtype, model_dtype=jnp.float32):
    """Random inputs; slots of the b rows (the last one padding on slot 0) hold random
    states, every other slot NaN."""
    rng = np.random.default_rng(seed)
    c = H * P + 2 * g * N
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    md = lambda a: jnp.asarray(a, model_dtype)
    slots = rng.permutation(np.arange(1, SLOTS))[:B].astype(np.int32)
    slots[-1] = 0
    conv = np.full((SLOTS, K - 1, c), np.nan, np.float32)
    conv[slots] = r(B, K - 1, c)
    ssm = np.full((SLOTS, H, P, N), np.nan, np.float32)
    ssm[slots] = r(B, H, P, N)
    args = dict(xbc=md(r(B, q, c)), dt=md(r(B, q, H) - 1.0), conv_w=md(0.5 * r(c, K)),
                conv_b=md(r(c)) if with_bias else None, A=jnp.asarray(-np.exp(r(H))),
                D=jnp.asarray(r(H)), dt_bias=jnp.asarray(0.5 * r(H)),
                conv_states=md(conv), ssm_states=jnp.asarray(ssm, state_dtype),
                slot_ids=jnp.asarray(slots))
    return args, slots


def _oracle(args, g, dt_limit):
    """Float64 loop from the math: per sequence, per token, conv window -> silu -> split
    -> SSM step. Returns (y [b, q, h, p], conv and ssm states after each token [q, b, ...])."""
    f = lambda v: None if v is None else np.asarray(jnp.asarray(v, jnp.float32), np.float64)
    xbc, dt, w, bias = f(args["xbc"]), f(args["dt"]), f(args["conv_w"]), f(args["conv_b"])
    A, D, dt_bias = f(args["A"]), f(args["D"]), f(args["dt_bias"])
    b, q, _ = xbc.shape
    hp, gn = H * P, g * N
    ys, convs, ssms = np.zeros((b, q, H, P)), [], []
    conv = f(args["conv_states"])[args["slot_ids"]]
    ssm = f(args["ssm_states"])[args["slot_ids"]]
    for j in range(q):
        for i in range(b):
            window = np.concatenate([conv[i], xbc[i, j][None]])  # [k, c], oldest first
            u = silu((window * w.T).sum(0) + (0.0 if bias is None else bias))
            conv[i] = window[1:]
            x, Bg, Cg = u[:hp].reshape(H, P), u[hp:hp + gn].reshape(g, N), u[hp + gn:].reshape(g, N)
            d = np.clip(softplus(dt[i, j] + dt_bias), *dt_limit)
            ys[i, j] = ssm_step(ssm[i], x, d, A, Bg, Cg, D)
        convs.append(conv.copy())
        ssms.append(ssm.copy())
    return ys, np.stack(convs), np.stack(ssms)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g,with_bias", [(1, False), (2, True)])
@pytest.mark.parametrize("q,candidates", [(1, False), (3, True), (5, True)])
def test_step_matches_loop(impl, state_dtype, g, with_bias, q, candidates):
    _check_against_loop(impl, state_dtype, g, with_bias, q, candidates)


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_one_candidate_matches_loop(impl):
    _check_against_loop(impl, jnp.bfloat16, 2, True, 1, True)


def _check_against_loop(impl, state_dtype, g, with_bias, q, candidates):
    seed = zlib.crc32(f"{impl}{state_dtype}{g}{q}{candidates}".encode())
    args, slots = _case(seed, q, g, with_bias, state_dtype)
    dt_limit = (0.0, 2.0) if g == 2 else (0.0, float("inf"))
    want_y, want_conv, want_ssm = _oracle(args, g, dt_limit)
    y, conv, ssm = mamba2_step(**args, n_groups=g, head_dim=P, dt_limit=dt_limit,
                               candidates=candidates, impl=impl)
    y, conv, ssm = _f32(y), _f32(conv), _f32(ssm)
    tol = TOL[state_dtype]
    assert y.shape == (B, q, H, P) and y.dtype == np.float32
    assert rel_err(y, want_y) < tol, rel_err(y, want_y)
    if candidates:
        assert conv.shape == (q, B, K - 1, conv.shape[-1]) and ssm.shape == (q, B, H, P, N)
        assert np.isfinite(conv).all() and np.isfinite(ssm).all()
        assert rel_err(conv, want_conv) < 1e-6
        assert rel_err(ssm, want_ssm) < tol, rel_err(ssm, want_ssm)
        return
    live = slots[:-1]
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    assert np.isnan(conv[untouched]).all() and np.isnan(ssm[untouched]).all(), "untouched slots written"
    assert rel_err(conv[live], want_conv[-1, :-1]) < 1e-6
    assert rel_err(ssm[live], want_ssm[-1, :-1]) < tol, rel_err(ssm[live], want_ssm[-1, :-1])


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_candidates_equal_decode_steps(state_dtype):
    """q verification candidates == q one-token decode calls, in bf16 model dtype (every
    rounding the decode path does between tokens is done between positions too). Not
    bitwise: the two are different compiled programs (on CPU, XLA vectorizes the sum over
    n differently; one bf16 ulp in y was seen), so within a few f32 ulps of the state."""
    q, g = 3, 2
    args, slots = _case(7, q, g, True, state_dtype, model_dtype=jnp.bfloat16)
    kw = dict(n_groups=g, head_dim=P, impl=KERNEL_IMPL)
    y, conv_c, ssm_c = mamba2_step(**args, candidates=True, **kw)
    st = dict(conv_states=args["conv_states"], ssm_states=args["ssm_states"])
    live = slots[:-1]
    for j in range(q):
        one = args | st | dict(xbc=args["xbc"][:, j:j + 1], dt=args["dt"][:, j:j + 1])
        y_j, *new = mamba2_step(**one, candidates=False, **kw)
        st = dict(conv_states=new[0], ssm_states=new[1])
        assert rel_err(_f32(y[:, j, :-1]), _f32(y_j[:, 0, :-1])) < 1e-4
        np.testing.assert_array_equal(_f32(conv_c[j, :-1]), _f32(new[0][live]))
        assert rel_err(_f32(ssm_c[j, :-1]), _f32(new[1][live])) < 1e-5


def test_kernel_matches_reference_bf16_model():
    """bf16 inputs (u rounded to bf16 between conv and SSM, as the unfused path stores it)."""
    args, _ = _case(3, 3, 1, True, jnp.float32, model_dtype=jnp.bfloat16)
    kw = dict(n_groups=1, head_dim=P, candidates=True)
    got = mamba2_step(**args, **kw, impl=KERNEL_IMPL)
    want = mamba2_step(**args, **kw, impl="reference")
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(_f32(a), _f32(b)) < 1e-2, rel_err(_f32(a), _f32(b))


def test_step_rejects_bad_arguments():
    args, _ = _case(0, 3, 1, False, jnp.float32)
    with pytest.raises(ValueError, match="candidates"):
        mamba2_step(**args, n_groups=1, head_dim=P, candidates=False)
    with pytest.raises(ValueError, match="conv_dim"):
        mamba2_step(**args, n_groups=2, head_dim=P, candidates=True)
    bad = args | dict(ssm_states=args["ssm_states"][:, :, :24], xbc=args["xbc"][..., 32:],
                      conv_w=args["conv_w"][32:], conv_states=args["conv_states"][..., 32:])
    with pytest.raises(ValueError, match="powers of 2"):
        mamba2_step(**bad, n_groups=1, head_dim=24, candidates=True, impl=KERNEL_IMPL)


def test_kernel_lowers_to_triton():
    """The kernel body uses only ops the Pallas Triton lowering has (checked on CPU by
    lowering for CUDA; PTX compilation itself needs the GPU)."""
    pytest.importorskip("jax._src.lib.triton")
    for state_dtype, q, candidates in ((jnp.float32, 5, True), (jnp.bfloat16, 1, False)):
        args, _ = _case(1, q, 2, True, state_dtype, model_dtype=jnp.bfloat16)
        f = jax.jit(lambda a, c=candidates: mamba2_step(**a, n_groups=2, head_dim=P,
                                                         candidates=c, impl="pallas"))
        text = f.trace(args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
