"""Time the SSM kernels (SSD prefill, Mamba2 decode, conv1d, linear scan) on a GPU.

Each row: warm-up, then `--reps` batches of `--inner` back-to-back calls (states
donated and chained, one sync per batch); the median per-call time is reported
with the achieved TB/s (minimum bytes: each input read once, each output written
once) or TFLOP/s and the percentage of the ceilings measured at start (device
copy, bf16 matmul). Every kernel is compared with its pure-XLA reference. Inputs
are random; working sets exceed the 50 MB L2.

    PYTHONPATH=. python benchmarks/bench_ssm.py [--quick] [--variants] [--out r.json]

Knows nothing of models: shapes are the issue's targets (Mamba2-2.7B-like heads).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import conv1d, linear_scan, ssd_kernel
from pallas_kernels.ssd import ssd_ragged_reference
from serving.entrypoints.bench.probe import time_chained

# The module, not the op of the same name that the package exports.
ssm_decode = importlib.import_module("pallas_kernels.ssm_decode")

F32, BF16 = jnp.float32, jnp.bfloat16


def timeit(fn, state, args, reps, inner):
    """(median seconds per chained call, last state): `time_chained` without its output."""
    sec, _, state = time_chained(fn, state, args, reps, inner)
    return sec, state


def ceilings():
    """Measured device copy TB/s (read + write) and bf16 matmul TFLOP/s."""
    x = jax.random.normal(jax.random.PRNGKey(0), (SIZE["copy"],), F32)
    copy = jax.jit(lambda v: v * 1.0001)
    t, _ = timeit(lambda s: (lambda r: (r, r))(copy(s)), x, (), 5, 10)
    m = SIZE["mm"]
    a = jax.random.normal(jax.random.PRNGKey(0), (m, m), BF16)
    mm = jax.jit(lambda v: v @ v)
    tm, _ = timeit(lambda s, v: (mm(v), s), a, (a,), 5, 10)
    return 2 * x.nbytes / t / 1e12, 2 * m**3 / tm / 1e12


class Table:
    def __init__(self, copy_tbps, mm_tflops):
        self.rows, self.copy, self.mm = [], copy_tbps, mm_tflops

    def add(self, name, shape, impl, sec, nbytes=None, flops=None, target_us=None):
        row = dict(kernel=name, shape=shape, impl=impl, us=sec * 1e6, target_us=target_us)
        if nbytes:
            row["TB/s"] = nbytes / sec / 1e12
            row["%copy"] = 100 * row["TB/s"] / self.copy
        if flops:
            row["TFLOP/s"] = flops / sec / 1e12
            row["%mm"] = 100 * row["TFLOP/s"] / self.mm
        self.rows.append(row)
        print(self.fmt(row), flush=True)

    @staticmethod
    def fmt(r):
        f = lambda k, spec: format(r[k], spec) if r.get(k) is not None else "-"
        return (f"{r['kernel']:<12} {r['shape']:<28} {r['impl']:<30} {r['us']:>9.1f} "
                f"{f('target_us', '>7.0f'):>7} {f('TB/s', '6.2f'):>6} {f('%copy', '5.0f'):>5} "
                f"{f('TFLOP/s', '7.1f'):>7} {f('%mm', '5.0f'):>5}")

    def print(self):
        print(f"\n{'kernel':<12} {'shape':<28} {'impl':<30} {'us':>9} {'target':>7} "
              f"{'TB/s':>6} {'%copy':>5} {'TFLOP/s':>7} {'%mm':>5}")
        for r in self.rows:
            print(self.fmt(r))


FULL = dict(copy=256 * 2**20, mm=8192, t=16384, h=80, b=256, conv_c=5376, lru=2560, l=256)
SMOKE = dict(copy=2**20, mm=256, t=512, h=4, b=8, conv_c=64, lru=256, l=64)
SIZE, IMPL = dict(FULL), "pallas"  # --smoke: tiny shapes in interpret mode (CPU check)


def _rand(key, shape, dtype=F32, scale=1.0, shift=0.0):
    return (jax.random.normal(key, shape, F32) * scale + shift).astype(dtype)


def _ragged(lens, seed=0):
    """cu_seqlens, permuted slots 1..b (0 is the dummy), has_initial all True."""
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    slots = np.random.default_rng(seed).permutation(np.arange(1, len(lens) + 1))
    return cu, jnp.asarray(slots, jnp.int32), jnp.ones((len(lens),), bool)


def _ssd_call(states, common, slots, init, *, stages, **tuning):
    out = ssd_kernel.ssd_pallas(*common, states, slots, init, z=None, dt_limit=(0.0, np.inf),
                                chunk_size=SIZE["l"], impl=IMPL, stages=stages, **tuning)
    return (out[0], out[1]) if stages != 1 else (out[1], states)


def bench_ssd(tab, args):
    t, h, p, n, g, l = SIZE["t"], SIZE["h"], 64, 128, 1, SIZE["l"]
    ks = jax.random.split(jax.random.PRNGKey(1), 8)
    x = _rand(ks[0], (t, h, p), BF16)
    dt = _rand(ks[1], (t, h), F32, 0.5, -2.0)
    A = -jnp.exp(_rand(ks[2], (h,), F32, 0.5))
    B, C = _rand(ks[3], (t, g, n), BF16), _rand(ks[4], (t, g, n), BF16)
    D, bias = _rand(ks[5], (h,)), _rand(ks[6], (h,), F32, 0.1)
    # states/outputs of each chunk: 4pn per token-head; causal C B^T and its product with x.
    flops = t * h * (4 * p * n + l * p) + t * g * l * n
    nbytes = 2 * x.nbytes + B.nbytes + C.nbytes + dt.nbytes
    variants = [dict(block_m=ssd_kernel.BLOCK_M, head_block=ssd_kernel.HEAD_BLOCK,
                     pass_block_p=ssd_kernel.PASS_BLOCK_P, warps=ssd_kernel.WARPS)]
    if args.variants:
        variants += [dict(variants[0], **kw) for kw in (
            dict(head_block=1), dict(head_block=4), dict(warps=(8, 4, 4)),
            dict(warps=(4, 4, 8)), dict(head_block=4, warps=(4, 4, 8)),
            dict(pass_block_p=64), dict(pass_block_p=16), dict(block_m=128, warps=(4, 4, 8)),
        )]
    for lens in ([t], [t // 4] * 4):
        cu, slots, init = _ragged(lens)
        states = _rand(ks[7], (len(lens) + 1, h, p, n), F32)
        shape = f"{len(lens)}x{lens[0]} h{h} p{p} n{n} l{l}"
        common = (x, dt, A, B, C, D, bias, cu)
        for i, v in enumerate(variants if len(lens) == 4 else variants[:1]):
            label = (f"pallas bm{v['block_m']} hb{v['head_block']} bp{v['pass_block_p']} "
                     f"w{''.join(map(str, v['warps']))}")
            for stages in (1, 2, 3) if i == 0 else (3,):
                fn = jax.jit(functools.partial(_ssd_call, stages=stages, **v), donate_argnums=0)
                sec, states = timeit(fn, states, (common, slots, init), args.reps, args.inner)
                if stages < 3:
                    tab.add("ssd.steps", shape, f"{label} steps<={stages}", sec)
                else:
                    tab.add("ssd", shape, label, sec, nbytes, flops, 800.0)
        ref = jax.jit(lambda st, c, s, i: ssd_ragged_reference(*c, st, s, i, chunk_size=l),
                      donate_argnums=0)
        sec, _ = timeit(ref, states, (common, slots, init), max(2, args.reps // 4), 2)
        tab.add("ssd", shape, "xla reference (f32 HIGHEST)", sec, nbytes, flops)


def bench_decode(tab, args):
    bsz, h, p, n, g = SIZE["b"], SIZE["h"], 64, 128, 1
    ks = jax.random.split(jax.random.PRNGKey(2), 8)
    x = _rand(ks[0], (bsz, h, p), BF16)
    dt = _rand(ks[1], (bsz, h), F32, 0.5, -2.0)
    A = -jnp.exp(_rand(ks[2], (h,)))
    B, C = _rand(ks[3], (bsz, g, n), BF16), _rand(ks[4], (bsz, g, n), BF16)
    D, bias = _rand(ks[5], (h,)), _rand(ks[6], (h,))
    _, slots, _ = _ragged([1] * bsz, seed=1)
    dte = jax.nn.softplus(dt + bias)
    for sdt, target in ((F32, 520.0), (BF16, 300.0)):
        default = ssm_decode.DECODE_TUNING[jnp.dtype(sdt).name]
        tuning = [default]
        if args.variants:  # the wider launch sweep: docs/history/benchmarks-2026.md
            tuning += [dict(default, block_p=bp, num_warps=w)
                       for bp, w in ((16, 1), (16, 2), (32, 2), (64, 4), (64, 8))]
        states = _rand(ks[7], (bsz + 1, h, p, n), sdt)
        shape = f"B{bsz} h{h} p{p} n{n} {jnp.dtype(sdt).name}"
        nbytes = 2 * bsz * h * p * n * jnp.dtype(sdt).itemsize + 2 * x.nbytes
        for kw in tuning:
            fn = jax.jit(lambda st, a, kw=kw: ssm_decode._decode_pallas(
                a[0], a[1], A, a[2], a[3], D, st, slots, None, impl=IMPL, **kw),
                donate_argnums=0)
            sec, states = timeit(fn, states, ((x, dte, B, C),), args.reps, args.inner)
            label = (f"pallas bp{kw['block_p']} w{kw['num_warps']} {kw.get('order', 'shp')}"
                     + (f" {kw['evict']}" if kw.get("evict") else ""))
            tab.add("ssm_decode", shape, label, sec, nbytes, None, target)
        ref = jax.jit(lambda st, a: ssm_decode.ssm_decode_reference(
            a[0], a[1], A, a[2], a[3], D, bias, st, slots), donate_argnums=0)
        sec, _ = timeit(ref, states, ((x, dt, B, C),), args.reps, args.inner)
        tab.add("ssm_decode", shape, "xla reference", sec, nbytes)


def bench_conv(tab, args):
    t, c, k, bsz = SIZE["t"], SIZE["conv_c"], 4, SIZE["b"]
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    x = _rand(ks[0], (t, c), BF16)
    w, bias = _rand(ks[1], (c, k)), _rand(ks[2], (c,))
    cu, slots, init = _ragged([t // 4] * 4)
    states = _rand(ks[3], (bsz + 1, k - 1, c), BF16)
    shape = f"4x{t // 4} c{c} k{k} bf16"
    for rb in (conv1d.ROW_BLOCK,) + ((16, 64) if args.variants else ()):
        fn = jax.jit(lambda st, xx, rb=rb: conv1d._ragged_pallas(
            xx, w, bias, cu, st, slots, init.astype(jnp.int32), activation="silu",
            impl=IMPL, row_block=rb), donate_argnums=0)
        sec, states = timeit(fn, states, (x,), args.reps, args.inner)
        tab.add("conv1d", shape, f"pallas rows{rb}", sec, 2 * x.nbytes)
    ref = jax.jit(lambda st, xx: conv1d.conv1d_ragged_reference(xx, w, bias, cu, st, slots, init),
                  donate_argnums=0)
    sec, states = timeit(ref, states, (x,), args.reps, args.inner)
    tab.add("conv1d", shape, "xla reference", sec, 2 * x.nbytes)
    xd = _rand(ks[4], (bsz, c), BF16)
    _, dslots, _ = _ragged([1] * bsz, seed=2)
    nbytes = 2 * bsz * (k - 1) * c * 2 + 2 * xd.nbytes
    for impl in (IMPL, "reference"):
        fn = jax.jit(lambda st, xx, impl=impl: conv1d.conv1d_decode(
            xx, w, bias, st, dslots, activation="silu", impl=impl), donate_argnums=0)
        sec, states = timeit(fn, states, (xd,), args.reps, args.inner)
        tab.add("conv1d_dec", f"B{bsz} c{c} k{k} bf16", impl, sec, nbytes)


def bench_scan(tab, args):
    c, bsz, t = SIZE["lru"], SIZE["b"], SIZE["t"]
    ks = jax.random.split(jax.random.PRNGKey(4), 6)
    a = jax.random.uniform(ks[0], (t, c), F32, 0.8, 1.0)
    b = _rand(ks[1], (t, c))
    for lens in ([t // 4] * 4, [t], [128] * (t // 128)):
        cu, slots, init = _ragged(lens)
        states = _rand(ks[2], (len(lens) + 1, c))
        shape = f"{len(lens)}x{lens[0]} c{c} f32"
        tuning = [(linear_scan.TILE, linear_scan.CHANNEL_BLOCK, 4)]
        if args.variants and len(lens) <= 4:
            tuning += [(16, 128, 4), (32, 64, 2), (32, 32, 1), (64, 128, 4)]
        for tile, bc, wp in tuning:
            fn = jax.jit(
                lambda st, aa, bb, tile=tile, bc=bc, wp=wp, cu=cu, sl=slots, ini=init:
                linear_scan._ragged_pallas(aa, bb, cu, st, sl, ini.astype(jnp.int32), impl=IMPL,
                                           tile=tile, block_c=bc, warps=wp),
                donate_argnums=0)
            sec, states = timeit(fn, states, (a, b), args.reps, args.inner)
            tab.add("lin_scan", shape, f"pallas tile{tile} c{bc} w{wp}", sec, 3 * a.nbytes)
        ref = jax.jit(lambda st, aa, bb, cu=cu, sl=slots, ini=init:
                      linear_scan.linear_scan_ragged_reference(aa, bb, cu, st, sl, ini),
                      donate_argnums=0)
        sec, _ = timeit(ref, states, (a, b), args.reps, args.inner)
        tab.add("lin_scan", shape, "xla reference", sec, 3 * a.nbytes)
    ad, bd = jax.random.uniform(ks[3], (bsz, c)), _rand(ks[4], (bsz, c))
    states = _rand(ks[5], (bsz + 1, c))
    _, dslots, _ = _ragged([1] * bsz, seed=3)
    for impl in (IMPL, "reference"):
        fn = jax.jit(lambda st, aa, bb, impl=impl: linear_scan.linear_scan_decode(
            aa, bb, st, dslots, impl=impl), donate_argnums=0)
        sec, states = timeit(fn, states, (ad, bd), args.reps, args.inner)
        tab.add("lin_scan_dec", f"B{bsz} c{c} f32", impl, sec, 5 * ad.nbytes)


BENCHES = dict(ssd=bench_ssd, decode=bench_decode, conv=bench_conv, scan=bench_scan)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=sorted(BENCHES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--variants", action="store_true", help="also sweep tuning variants")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    args = ap.parse_args()
    global IMPL
    if args.smoke:
        SIZE.update(SMOKE)
        IMPL = "interpret"
        args.reps, args.inner = 1, 1
    elif jax.default_backend() != "gpu":
        raise SystemExit("bench_ssm times compiled kernels: run it on a GPU (or --smoke)")
    copy_tbps, mm_tflops = ceilings()
    print(f"{jax.devices()[0].device_kind}: copy {copy_tbps:.2f} TB/s, "
          f"bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    tab = Table(copy_tbps, mm_tflops)
    for name in args.only:
        BENCHES[name](tab, args)  # no try/except: a kernel that fails to lower is a bug
    tab.print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, copy_tbps=copy_tbps,
                           mm_tflops=mm_tflops, rows=tab.rows), f, indent=1)


if __name__ == "__main__":
    main()
