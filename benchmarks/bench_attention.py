"""Benchmark the paged attention kernels on a GPU (bf16) against their targets.

    PYTHONPATH=. python benchmarks/bench_attention.py [--suite decode prefill write ceil verify]
        [--quick] [--out results.json]

Prints one table (time, achieved TB/s or TFLOP/s, % of the ceilings) with the
Pallas kernel variants, the pure-XLA reference, JAX's own Pallas paged decode
(no window) and cuDNN prefill on contiguous K/V. Bytes are the in-window K/V
bytes each decode must read; FLOPs are the unmasked causal/window work. Never
meaningful on CPU. Knows nothing of the engine.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from attention_inputs import decode_inputs, prefill_inputs, time_fn

from pallas_kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)
from pallas_kernels.paged_decode import decode_pallas
from pallas_kernels.paged_prefill import prefill_pallas
from pallas_kernels.paged_tiles import TileConfig

COPY_TBPS, MATMUL_TFLOPS = 2.95, 800.0  # ceilings quoted by the issue
ROWS: list[dict] = []
# The shapes; --smoke shrinks them and runs interpret mode (CPU check of this script).
SHAPES = dict(batches=(64, 256), context=32768, window=4096, flat=(8192, 131072),
              global_ctx=4096, prefill=(4, 4096), write_tokens=64)
SMOKE = dict(batches=(2,), context=512, window=256, flat=(384,), global_ctx=256,
             prefill=(2, 128), write_tokens=4)
INTERPRET = False


def report(name, seconds, *, nbytes=None, flops=None, note=""):
    row = {"name": name, "us": seconds * 1e6, "note": note}
    if nbytes:
        row["TB/s"] = nbytes / seconds / 1e12
        row["%copy"] = 100 * row["TB/s"] / COPY_TBPS
    if flops:
        row["TFLOP/s"] = flops / seconds / 1e12
        row["%mma"] = 100 * row["TFLOP/s"] / MATMUL_TFLOPS
    ROWS.append(row)
    print(_fmt(row), flush=True)


def _fmt(r):
    rate = (f"{r['TB/s']:6.2f} TB/s {r['%copy']:5.1f}%" if "TB/s" in r
            else f"{r['TFLOP/s']:6.1f} TF/s {r['%mma']:5.1f}%" if "TFLOP/s" in r else " " * 20)
    return f"{r['name']:<52} {r['us']:10.1f} us  {rate}  {r['note']}"


def _cfg(k_pages, table, window, tile_tokens):
    s, e = k_pages.shape[2], k_pages.shape[3]
    return TileConfig(s, tile_tokens // s, table.shape[1], window, None, e**-0.5)


def decode_variant(args, window, *, tile, warps, stages, splits):
    cfg = _cfg(args[1], args[4], window, tile)
    return jax.jit(functools.partial(decode_pallas, cfg=cfg, splits=splits, num_warps=warps,
                                     num_stages=stages, interpret=INTERPRET))


def bench_decode(rng, sh, variants, quick):
    w, ctx = sh["window"], sh["context"]
    for batch in sh["batches"]:
        args = decode_inputs(rng, batch=batch, context=ctx, window=w)
        nbytes = 2 * 2 * batch * 8 * w * 128
        ref = jax.jit(functools.partial(paged_attention_decode, window=w, impl="reference"))
        want = ref(*args).astype(jnp.float32)
        for v in variants:
            fn = decode_variant(args, w, **v)
            err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
            report(f"decode B={batch} ctx={ctx} w={w} {_vname(v)}", time_fn(fn, *args),
                   nbytes=nbytes, note=f"max|err| {err:.1e}")
        report(f"decode B={batch} ctx={ctx} w={w} XLA reference", time_fn(ref, *args),
               nbytes=nbytes)
        del args, want
    best = variants[0]
    b = sh["batches"][0]
    for c in (() if quick else sh["flat"]):
        args = decode_inputs(rng, batch=b, context=c, window=w)
        report(f"decode B={b} ctx={c} w={w} {_vname(best)}",
               time_fn(decode_variant(args, w, **best), *args), nbytes=2 * 2 * b * 8 * w * 128)
    bench_decode_global(rng, b, sh["global_ctx"])


def bench_decode_global(rng, b, ctx):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged

    args = decode_inputs(rng, batch=b, context=ctx, window=None)
    nbytes = 2 * 2 * b * 8 * ctx * 128
    impl = "interpret" if INTERPRET else "pallas"
    ours = jax.jit(functools.partial(paged_attention_decode, window=None, impl=impl))
    # JAX's op does not scale the logits: hand it q * e**-0.5.
    theirs = jax.jit(lambda q, k, v, lens, table: jax_paged(
        q * q.shape[-1] ** -0.5, k, v, table, lens, k_splits=min(16, table.shape[1]), interpret=INTERPRET))
    err = float(jnp.max(jnp.abs(ours(*args).astype(jnp.float32)
                                - theirs(*args).astype(jnp.float32))))
    name = f"decode B={b} ctx={ctx} global"
    report(f"{name}, ours (default tuning)", time_fn(ours, *args), nbytes=nbytes,
           note=f"max|ours-jax| {err:.1e}")
    report(f"{name}, jax.experimental paged_attention", time_fn(theirs, *args), nbytes=nbytes)
    ref = jax.jit(functools.partial(paged_attention_decode, window=None, impl="reference"))
    report(f"{name}, XLA reference", time_fn(ref, *args), nbytes=nbytes)


def _vname(v):
    return " ".join(f"{k}={x}" for k, x in v.items())


def prefill_flops(seqs, n, w, heads=32, e=128):
    keys = sum(min(p + 1, w) for p in range(n))
    return 4 * seqs * heads * e * keys


def bench_prefill(rng, sh, variants):
    w, (seqs, n) = sh["window"], sh["prefill"]
    args = prefill_inputs(rng, seqs=seqs, new_tokens=n, context=n, window=w)
    flops = prefill_flops(seqs, n, w)
    ref = jax.jit(functools.partial(paged_attention_prefill, window=w, impl="reference"))
    want = ref(*args).astype(jnp.float32)
    name = f"prefill {seqs}x{n} w={w}"
    for v in variants:
        cfg = _cfg(args[1], args[5], w, v["tile"])
        fn = jax.jit(functools.partial(prefill_pallas, cfg=cfg, block_q=v["block_q"],
                                       num_warps=v["warps"], num_stages=v["stages"],
                                       interpret=INTERPRET))
        try:
            err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
        except jax.errors.JaxRuntimeError as exc:  # e.g. shared memory: report, go on
            print(f"{name} {_vname(v)} FAILED: {str(exc)[:120]}", flush=True)
            continue
        report(f"{name} {_vname(v)}", time_fn(fn, *args), flops=flops, note=f"max|err| {err:.1e}")
    report(f"{name} XLA reference", time_fn(ref, *args), flops=flops)
    if not INTERPRET:
        bench_cudnn(rng, name, seqs, n, w, flops)


def bench_cudnn(rng, name, seqs, n, w, flops):
    key = jax.random.key(int(rng.integers(2**31)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (seqs, n, 32, 128), jnp.bfloat16)
    k = jax.random.normal(kk, (seqs, n, 8, 128), jnp.bfloat16)
    v = jax.random.normal(kv, (seqs, n, 8, 128), jnp.bfloat16)
    fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   local_window_size=(w - 1, 0), implementation="cudnn"))
    report(f"{name} cuDNN, contiguous K/V (not paged)", time_fn(fn, q, k, v), flops=flops)


VERIFY_SHAPES = [  # (name, heads, kv heads, head dim, window, dtype): the engine's models
    ("default model", 4, 2, 64, 128, jnp.float32),
    ("default model", 4, 2, 64, 128, jnp.bfloat16),
    ("native-1b", 16, 4, 128, 2048, jnp.bfloat16),
]


def bench_verify(rng, sh):
    """Speculative verification (q = 5 tokens per sequence) and short mixed chunks: the
    prefill kernel against the decode kernel's multi-query form, at context 600 and 2000."""
    smoke = INTERPRET
    for name, h, nk, e, w, dtype in VERIFY_SHAPES[:1] if smoke else VERIFY_SHAPES:
        for b in (2,) if smoke else (1, 8, 64):
            for ctx in (40,) if smoke else (600,):
                for q in (5,):
                    args = prefill_inputs(rng, seqs=b, new_tokens=q, context=ctx, window=w, heads=h,
                                          kv_heads=nk, head_dim=e, dtype=dtype)
                    qx, kp, vp, cu, lens, table = args
                    pre = jax.jit(functools.partial(paged_attention_prefill, window=w,
                                                    impl="interpret" if smoke else "pallas"))
                    dec = jax.jit(functools.partial(paged_attention_decode, window=w, queries=q,
                                                    impl="interpret" if smoke else "pallas"))
                    want = pre(*args).astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(dec(qx, kp, vp, lens, table).astype(jnp.float32) - want)))
                    tag = f"verify {name} {jnp.dtype(dtype).name} b={b} q={q} ctx={ctx}"
                    nbytes = 2 * b * min(ctx, w + q) * nk * e * jnp.dtype(dtype).itemsize
                    report(f"{tag} prefill kernel", time_fn(pre, *args), nbytes=nbytes)
                    report(f"{tag} multi-query decode", time_fn(dec, qx, kp, vp, lens, table),
                           nbytes=nbytes, note=f"max|diff| {err:.1e}")


def bench_write(rng, sh):
    args = decode_inputs(rng, batch=sh["batches"][0], context=sh["context"], window=sh["window"])
    k_pages, v_pages = args[1], args[2]
    t = sh["write_tokens"]
    slots = jnp.asarray(rng.choice(k_pages.shape[1] * 16, t, replace=False), jnp.int32)
    new = jax.random.normal(jax.random.key(3), (t, 8, 128), jnp.bfloat16)
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    pool_bytes = 2 * k_pages.size * k_pages.dtype.itemsize
    state = {"kv": (k_pages, v_pages)}
    del args, k_pages, v_pages

    def run():
        state["kv"] = step(*state["kv"], new, new, slots)
        return state["kv"]

    report(f"write_kv {t} tokens, donated pools of {pool_bytes / 2**30:.2f} GiB", time_fn(run),
           note=f"copying the pools would take ~{pool_bytes * 2 / COPY_TBPS / 1e6:.0f} us")


def bench_ceilings(sh):
    n = 2**29 if sh is SHAPES else 2**20
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    report(f"ceiling: device copy {x.nbytes / 2**20:.0f} MiB (read + write)", time_fn(copy, x),
           nbytes=2 * x.nbytes)
    m = 8192 if sh is SHAPES else 256
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    report(f"ceiling: bf16 matmul {m}^3", time_fn(mm, a, a), flops=2 * m**3)


# First entry = the default tuning in paged_attention.py; the rest are the runners-up
# and the first-round defaults, kept for comparison (full sweep: docs/history/benchmarks-2026.md).
DECODE_VARIANTS = [
    dict(tile=64, warps=4, stages=1, splits=1),
    dict(tile=64, warps=2, stages=1, splits=1),
    dict(tile=128, warps=4, stages=1, splits=1),
    dict(tile=128, warps=4, stages=2, splits=1),
    dict(tile=64, warps=4, stages=1, splits=2),
]
PREFILL_VARIANTS = [
    dict(block_q=32, tile=128, warps=8, stages=3),
    dict(block_q=32, tile=128, warps=8, stages=2),
    dict(block_q=32, tile=128, warps=8, stages=1),
    dict(block_q=32, tile=64, warps=8, stages=2),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", nargs="+", default=["ceil", "decode", "prefill", "write"])
    p.add_argument("--quick", action="store_true", help="first variant only, fewer shapes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    global INTERPRET
    INTERPRET = a.smoke
    sh = SMOKE if a.smoke else SHAPES
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rng = np.random.default_rng(0)
    n = 1 if a.quick else None
    dec, pre = DECODE_VARIANTS, PREFILL_VARIANTS
    suites = {
        "ceil": lambda: bench_ceilings(sh),
        "decode": lambda: bench_decode(rng, sh, dec[:n], a.quick),
        "prefill": lambda: bench_prefill(rng, sh, pre[:n]),
        "write": lambda: bench_write(rng, sh),
        "verify": lambda: bench_verify(rng, sh),
    }
    for name in a.suite:
        suites[name]()
    print("\n".join(["", "summary:"] + [_fmt(r) for r in ROWS]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
