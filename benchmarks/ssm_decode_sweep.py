"""Sweep launch variants of the Mamba2 decode kernel (pallas_kernels/ssm_decode.py).

For each variant: a fresh random check against the XLA reference (slot 0 poisoned
with NaN and never touched; every live slot's state must change to the reference's),
then the median per-call time of chained, donated calls on the issue's shape
(B 256, h 80, p 64, n 128, bf16 x/B/C, f32 or bf16 state; 674 MB of f32 state, far
above the 50 MB L2). The same timing as benchmarks/bench_ssm.py. Baselines are timed
first and last to show the run's spread. Prints a table last.

    PYTHONPATH=. python benchmarks/ssm_decode_sweep.py [--only NAME ...] [--reps 30]
    PYTHONPATH=. python benchmarks/ssm_decode_sweep.py --smoke   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ssm_common import effective_dt

# The module, not the op of the same name that the package exports.
ssm_decode = importlib.import_module("pallas_kernels.ssm_decode")

F32, BF16 = jnp.float32, jnp.bfloat16

# name -> (state dtype, kwargs of ssm_decode._decode_pallas)
V = {}
for _bp, _w in ((16, 1), (32, 2), (64, 4)):
    V[f"f32 shp bp{_bp} w{_w}"] = ("float32", dict(block_p=_bp, num_warps=_w))
for _bp, _w in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8)):
    V[f"f32 phs bp{_bp} w{_w}"] = ("float32", dict(block_p=_bp, num_warps=_w, order="phs"))
for _bp, _w in ((16, 1), (32, 2)):
    for _ord in ("shp", "phs"):
        V[f"f32 {_ord} bp{_bp} w{_w} evict1st"] = (
            "float32", dict(block_p=_bp, num_warps=_w, order=_ord, evict="evict_first"))
for _hb, _bp, _w in ((2, 16, 2), (2, 32, 4), (4, 16, 4)):
    V[f"f32 phs hb{_hb} bp{_bp} w{_w}"] = (
        "float32", dict(block_p=_bp, num_warps=_w, order="phs", heads=_hb))
for _bp, _lp, _w, _st in ((16, 4, 1, 1), (16, 4, 1, 2), (16, 4, 1, 3), (32, 2, 2, 2)):
    V[f"f32 phs bp{_bp}x{_lp} w{_w} st{_st}"] = (
        "float32", dict(block_p=_bp, num_warps=_w, order="phs", loops=_lp, num_stages=_st))
for _bp, _w in ((32, 4), (64, 8)):
    V[f"f32 phs bp{_bp} w{_w} evict1st"] = (
        "float32", dict(block_p=_bp, num_warps=_w, order="phs", evict="evict_first"))
V["f32 shp bp16 w1 (again)"] = V["f32 shp bp16 w1"]
V["bf16 shp bp16 w4"] = ("bfloat16", dict(block_p=16, num_warps=4))
for _bp, _w in ((16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8)):
    V[f"bf16 phs bp{_bp} w{_w}"] = ("bfloat16", dict(block_p=_bp, num_warps=_w, order="phs"))
V["bf16 phs bp32 w4 evict1st"] = ("bfloat16", dict(block_p=32, num_warps=4, order="phs",
                                                   evict="evict_first"))
V["bf16 phs bp64 w8 evict1st"] = ("bfloat16", dict(block_p=64, num_warps=8, order="phs",
                                                   evict="evict_first"))
V["bf16 phs hb2 bp32 w4"] = ("bfloat16", dict(block_p=32, num_warps=4, order="phs", heads=2))
V["bf16 shp bp16 w4 (again)"] = V["bf16 shp bp16 w4"]

SHAPE = dict(b=256, h=80, p=64, n=128, g=1)
SMOKE = dict(b=4, h=4, p=64, n=16, g=1)


def timeit(fn, state, args, reps, inner):
    """Per-call seconds of chained `y, state = fn(state, args)`: (median, min, max); state."""
    for _ in range(3):
        out, state = fn(state, args)
    jax.block_until_ready((out, state))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out, state = fn(state, args)
        jax.block_until_ready((out, state))
        times.append((time.perf_counter() - t0) / inner)
    return (statistics.median(times), min(times), max(times)), state


def inputs(key, sdt, s):
    b, h, p, n, g = s["b"], s["h"], s["p"], s["n"], s["g"]
    ks = jax.random.split(key, 9)
    r = lambda k, shape, dt=F32, sc=1.0, sh=0.0: (jax.random.normal(k, shape, F32) * sc
                                                  + sh).astype(dt)
    a = dict(x=r(ks[0], (b, h, p), BF16), dt=r(ks[1], (b, h), F32, 0.5, -2.0),
             A=-jnp.exp(r(ks[2], (h,))), B=r(ks[3], (b, g, n), BF16),
             C=r(ks[4], (b, g, n), BF16), D=r(ks[5], (h,)), dt_bias=r(ks[6], (h,), F32, 0.5))
    slots = jnp.asarray(np.random.default_rng(int(ks[7][0]) % 2**31).permutation(
        np.arange(1, b + 1)), jnp.int32)
    states = r(ks[8], (b + 1, h, p, n), F32).astype(sdt).at[0].set(jnp.nan)  # slot 0: poison
    return a, slots, states


def make_fn(kw, impl):
    def fn(st, a):
        dte = effective_dt(a["dt"], a["dt_bias"], (0.0, float("inf")))
        return ssm_decode._decode_pallas(a["x"], dte, a["A"], a["B"], a["C"], a["D"], st,
                                         a["slots"], None, impl=impl, **kw)
    return jax.jit(fn, donate_argnums=0)


REF = jax.jit(lambda st, a: ssm_decode.ssm_decode_reference(
    a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], st, a["slots"]))


def check(fn, sdt, seed, s):
    a, slots, states = inputs(jax.random.PRNGKey(seed), sdt, s)
    a["slots"] = slots
    want_y, want_s = REF(states, a)
    y, st = fn(jnp.array(states, copy=True), a)
    y, st = np.asarray(y, np.float32), np.asarray(st.astype(F32))
    want_y, want_s = np.asarray(want_y, np.float32), np.asarray(want_s.astype(F32))
    old = np.asarray(states[1:].astype(F32))
    live = st[1:]
    err = lambda u, v: float(np.linalg.norm(u - v) / np.linalg.norm(v))
    # Every live state must be rewritten; a bf16 state under a decay of ~1 may round
    # back to its old value, so the changed fraction is only a coarse check there.
    changed = (live != old).mean()
    ok = (np.isfinite(y).all() and np.isfinite(live).all() and np.isnan(st[0]).all()
          and changed > (0.99 if sdt == F32 else 0.5))
    return ok, err(y, want_y), err(live, want_s[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shape, interpret mode (CPU)")
    args = ap.parse_args()
    s, impl = (SMOKE, "interpret") if args.smoke else (SHAPE, "pallas")
    if args.smoke:
        args.reps, args.inner = 1, 1
    names = args.only or list(V)
    dev = jax.devices()[0].device_kind
    # Ceilings: a large XLA copy, and XLA's in-place scale of the f32 state buffer itself.
    big = jax.random.normal(jax.random.PRNGKey(0), (2**28 if not args.smoke else 2**12,), F32)
    cp = jax.jit(lambda v, _: (v[0], v * 1.0001), donate_argnums=0)
    (tc, _, _), big = timeit(cp, big, None, 10, 10)
    copy_tbps = 2 * big.nbytes / tc / 1e12
    del big
    _, _, st32 = inputs(jax.random.PRNGKey(1), F32, s)
    st32 = st32.at[0].set(0.0)
    (ts, _, _), st32 = timeit(cp, st32, None, 10, 10)
    state_tbps = 2 * st32.nbytes / ts / 1e12
    print(f"{dev}: XLA copy {copy_tbps:.3f} TB/s; in-place scale of f32 state "
          f"{ts * 1e6:.1f} us = {state_tbps:.3f} TB/s", flush=True)
    del st32
    rows, timed = [], {}
    for i, name in enumerate(names):
        sdt, kw = V[name]
        sdt = jnp.dtype(sdt)
        b, h, p, n = s["b"], s["h"], s["p"], s["n"]
        nbytes = 2 * b * h * p * n * sdt.itemsize + 2 * b * h * p * 2
        row = dict(name=name, kw=kw)
        try:
            fn = make_fn(kw, impl)
            ok, ey, es = check(fn, sdt, 1000 + i, s)
            # y is bf16 (x's dtype): summation order flips its last bit now and then.
            tol = 1e-5 if sdt == F32 else 1e-2
            row.update(ok=bool(ok and ey < 1e-3 and es < tol), err_y=ey, err_s=es)
            a, slots, states = inputs(jax.random.PRNGKey(7), sdt, s)
            a["slots"] = slots
            (med, lo, hi), _ = timeit(fn, states, a, args.reps, args.inner)
            del states
            row.update(us=med * 1e6, lo=lo * 1e6, hi=hi * 1e6, tbps=nbytes / med / 1e12)
            row["pct_copy"] = 100 * row["tbps"] / copy_tbps
        except Exception as e:  # a variant that fails to lower is reported, not fatal
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        timed[name] = row
        print(json.dumps(row), flush=True)
    print(f"\n{dev}; XLA copy {copy_tbps:.3f} TB/s, f32-state in-place scale "
          f"{ts * 1e6:.1f} us ({state_tbps:.3f} TB/s); median of {args.reps} x {args.inner}")
    print(f"{'variant':<32} {'ok':>3} {'err_s':>8} {'us':>8} {'min':>7} {'max':>7} "
          f"{'TB/s':>6} {'%copy':>6}")
    for r in rows:
        if "us" in r:
            print(f"{r['name']:<32} {'y' if r['ok'] else 'N':>3} {r['err_s']:8.1e} "
                  f"{r['us']:8.1f} {r['lo']:7.1f} {r['hi']:7.1f} {r['tbps']:6.3f} "
                  f"{r['pct_copy']:6.1f}")
        else:
            print(f"{r['name']:<32} ERR {r.get('error', '')[:120]}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "ssm_decode_sweep.json"), "w") as f:
            json.dump(dict(device=dev, copy_tbps=copy_tbps, state_scale_us=ts * 1e6,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
