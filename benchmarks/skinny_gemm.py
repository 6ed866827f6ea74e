"""Time the skinny GEMM (pallas_kernels/skinny_gemm.py) against XLA's dot on a GPU.

Shapes: native-1b-parallel's nine projections per layer (five distinct (k, n), bf16
weights [k, n]) at m rows. Each timing is a jit of a chain of calls on distinct weight
matrices (>= 24, and >= 200 MB of weights in all, so they stream from HBM rather than
the 50 MB L2, as in a decode step), x shared; median over `--reps` runs, divided by the
chain's length. Both sides compile with the step executables' XLA options
(serving/step_fns.compile_options: Triton GEMM fusions off, so XLA's dot is cuBLAS).
The skinny side includes XLA's sum over K-splits (in a model it may fuse into the
consumer). GB/s counts weight bytes only; %copy compares them with a device copy
(serving/entrypoints/bench/floor.copy_bandwidth, read + write bytes). The step column estimates one
decode step's 216 projections (24 layers) from the per-call times.

    PYTHONPATH=. python benchmarks/skinny_gemm.py [--rows 1 8 ...] [--shapes q down] [--out r.json]
    PYTHONPATH=. python benchmarks/skinny_gemm.py --sweep [--rows 8 64] [--out sweep.json]
    PYTHONPATH=. python benchmarks/skinny_gemm.py --smoke [--sweep]   # CPU, interpret mode

--sweep times a small grid of launch configs per (shape, m) (~15 tiles x K-splits with
the heuristic's warps and stages, then warps x stages around the best: ~20 compiles per
(shape, m), ~600 for all) and prints the best ones as SKINNY_OVERRIDES entries. The JSON
is rewritten after every (shape, m), so a run cut short keeps what it measured;
--budget-s stops starting new ones (then the tables are printed). Split a full sweep by
--shapes to stay within a time limit. This script knows nothing of the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import skinny_gemm
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.runner.step_fns import compile_options

BF16, F32 = jnp.bfloat16, jnp.float32
LAYERS = 24
# Distinct (k, n) of native-1b-parallel -> the projections of a layer with that shape.
SHAPES = {
    "q": ((2048, 2048), ("q_proj", "o_proj", "mamba out_proj")),
    "kv": ((2048, 512), ("k_proj", "v_proj")),
    "in_proj": ((2048, 4384), ("mamba in_proj",)),
    "gate_up": ((2048, 5632), ("mlp gate", "mlp up")),
    "down": ((5632, 2048), ("mlp down",)),
}
SMOKE_SHAPES = {"a": ((64, 48), ("a",)), "b": ((128, 256), ("b", "b2"))}
ROWS = (1, 8, 16, 64, 128, 256)
CHAIN_BYTES = 200 << 20


def chain_length(k: int, n: int, smoke: bool) -> int:
    return 2 if smoke else max(LAYERS, math.ceil(CHAIN_BYTES / (2 * k * n)))


def compiled_chain(fn, x, ws):
    """One executable running fn(x, w) for every w, compiled with the step's XLA options."""
    chain = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    return chain.lower(x, ws).compile(compile_options())


def time_per_call(exe, x, ws, reps: int) -> float:
    """Median seconds per matmul of the chain executable."""
    jax.block_until_ready(exe(x, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(x, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(ws)


def inputs(m: int, k: int, n: int, length: int):
    key = jax.random.PRNGKey(m * 7919 + k + n)
    kx, *kw = jax.random.split(key, length + 1)
    x = jax.random.normal(kx, (m, k), F32).astype(BF16)
    ws = [(jax.random.normal(kk, (k, n), F32) / math.sqrt(k)).astype(BF16) for kk in kw]
    return x, ws


def xla_dot(x, w):
    return jnp.dot(x.astype(w.dtype), w)  # Linear's plain path


def measure(m, k, n, x, ws, impl, config, reps):
    """(seconds per call, relative error vs XLA) of one launch config; config None: XLA."""
    if config is None:
        exe = compiled_chain(xla_dot, x, ws)
    else:
        exe = compiled_chain(lambda a, b: skinny_gemm.skinny_matmul(a, b, impl=impl, config=config),
                             x, ws)
    y = np.asarray(exe(x, ws)[0].astype(F32), np.float64)
    want = np.asarray(xla_dot(x, ws[0]).astype(F32), np.float64)
    err = float(np.linalg.norm(y - want) / max(np.linalg.norm(want), 1e-30))
    return time_per_call(exe, x, ws, reps), err


def row(name, m, k, n, seconds, err, config, bandwidth):
    gbps = 2 * k * n / seconds / 1e9
    return dict(shape=name, m=m, k=k, n=n, us=seconds * 1e6, gbps=gbps,
                pct_copy=100 * gbps * 1e9 / bandwidth, err=err, config=config)


def compare(shapes, rows, impl, reps, bandwidth, smoke):
    """Skinny (heuristic config) vs XLA for every shape and m."""
    results = []
    for name, ((k, n), _) in shapes.items():
        length = chain_length(k, n, smoke)
        for m in rows:
            x, ws = inputs(m, k, n, length)
            config = skinny_gemm.skinny_config(m, k, n)
            sk = row(name, m, k, n, *measure(m, k, n, x, ws, impl, config, reps), config, bandwidth)
            xl = row(name, m, k, n, *measure(m, k, n, x, ws, impl, None, reps), None, bandwidth)
            results.append(dict(skinny=sk, xla=xl, speedup=xl["us"] / sk["us"]))
            print(json.dumps(results[-1]), flush=True)
            del x, ws
    return results


def print_compare(results, shapes, rows):
    print(f"\n{'shape':<8} {'k':>5} {'n':>5} {'m':>4} {'skinny us':>9} {'GB/s':>6} {'%copy':>6} "
          f"{'xla us':>8} {'GB/s':>6} {'%copy':>6} {'x':>5}  config (block_n, block_k, split_k, "
          "warps, stages)")
    for r in results:
        s, x = r["skinny"], r["xla"]
        c = s["config"]
        flag = "" if s["err"] < 1e-2 else f"  ERR {s['err']:.1e}"
        print(f"{s['shape']:<8} {s['k']:>5} {s['n']:>5} {s['m']:>4} {s['us']:9.2f} {s['gbps']:6.0f} "
              f"{s['pct_copy']:6.1f} {x['us']:8.2f} {x['gbps']:6.0f} {x['pct_copy']:6.1f} "
              f"{r['speedup']:5.2f}  {tuple(c[kn] for kn in skinny_gemm.KNOBS)}{flag}")
    print(f"\nper decode step ({LAYERS} layers x {sum(len(p) for _, p in shapes.values())} projections):")
    for m in rows:
        per = [r for r in results if r["skinny"]["m"] == m]
        tot = {side: LAYERS * sum(len(shapes[r[side]["shape"]][1]) * r[side]["us"] for r in per)
               for side in ("skinny", "xla")}
        print(f"  m={m:<4} skinny {tot['skinny'] / 1e3:7.3f} ms   xla {tot['xla'] / 1e3:7.3f} ms")


def divisors(v: int) -> list[int]:
    return [d for d in range(1, v + 1) if v % d == 0]


def sweep_configs(m: int, k: int, n: int, smoke: bool) -> list[dict[str, int]]:
    """Stage 1: tiles x K-splits (programs nearest 1 and 2 waves; split 1), the
    heuristic's warps and stages; shared memory kept under 200 KB."""
    base = skinny_gemm.skinny_config(m, k, n)
    bm = skinny_gemm.row_block(m)
    tiles = ((16, 16), (32, 16)) if smoke else ((64, 128), (128, 64), (128, 128), (256, 64))
    configs = [base]
    waves = (1,) if smoke else (1, 2)
    for bn, bk in tiles:
        if k % bk or base["num_stages"] * (bm + bn) * bk * 2 > 200 << 10:
            continue
        splits = divisors(k // bk)
        nb = math.ceil(n / bn)
        picks = {1} | {min(splits, key=lambda s: abs(nb * s - w * skinny_gemm.NUM_SMS))
                       for w in waves}
        for s in sorted(picks):
            c = dict(base, block_n=bn, block_k=bk, split_k=s)
            if c not in configs:
                configs.append(c)
    return configs


def sweep_one(name, m, k, n, impl, reps, bandwidth, smoke):
    """All variants for one (shape, m), best first; stage 2 varies warps and stages of the best."""
    x, ws = inputs(m, k, n, chain_length(k, n, smoke))
    measured = []

    def run(c):
        try:
            measured.append(row(name, m, k, n, *measure(m, k, n, x, ws, impl, c, reps), c, bandwidth))
        except Exception as e:  # a variant that fails to compile is reported, not fatal
            print(f"  {c}: {type(e).__name__}: {str(e)[:200]}", flush=True)

    for c in sweep_configs(m, k, n, smoke):
        run(c)
    ok = [r for r in measured if r["err"] < 1e-2]
    if ok:
        best = min(ok, key=lambda r: r["us"])["config"]
        bm = skinny_gemm.row_block(m)
        for warps in (4, 8):
            for stages in (2, 3, 4):
                c = dict(best, num_warps=warps, num_stages=stages)
                if c not in [r["config"] for r in measured] and \
                        stages * (bm + c["block_n"]) * c["block_k"] * 2 <= 200 << 10:
                    run(c)
    xla = row(name, m, k, n, *measure(m, k, n, x, ws, impl, None, reps), None, bandwidth)
    return sorted(measured, key=lambda r: (r["err"] >= 1e-2, r["us"])), xla


def sweep(shapes, rows, impl, reps, bandwidth, smoke, out, budget_s):
    summary = []
    deadline = time.perf_counter() + (budget_s or math.inf)
    for name, m in ((name, m) for name in shapes for m in rows):
        (k, n), _ = shapes[name]
        if time.perf_counter() > deadline:
            print(f"--budget-s spent: {name} m={m} and later not swept", flush=True)
            break
        ranked, xla = sweep_one(name, m, k, n, impl, reps, bandwidth, smoke)
        if not ranked:
            continue
        base = skinny_gemm.skinny_config(m, k, n)
        heur = next((r for r in ranked if r["config"] == base), None)
        summary.append(dict(shape=name, m=m, k=k, n=n, best=ranked[0], heuristic=heur, xla=xla,
                            variants=ranked))
        b = ranked[0]
        print(f"{name} m={m}: best {b['us']:.2f} us ({b['pct_copy']:.0f}% copy) {b['config']}; "
              f"heuristic {_us(heur)}; xla {xla['us']:.2f} us", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(dict(device=jax.devices()[0].device_kind, copy_bandwidth=bandwidth,
                               sweep=summary), f, indent=1)
    print(f"\n{'shape':<8} {'m':>4} {'best us':>8} {'%copy':>6} {'heur us':>8} {'xla us':>8}  best config")
    for s in summary:
        b = s["best"]
        print(f"{s['shape']:<8} {s['m']:>4} {b['us']:8.2f} {b['pct_copy']:6.1f} "
              f"{_us(s['heuristic']):>8} {s['xla']['us']:8.2f}  {b['config']}")
    print_overrides(summary)


def _us(r) -> str:
    return "failed" if r is None else f"{r['us']:.2f}"


def print_overrides(summary):
    """SKINNY_OVERRIDES is keyed by row block: per (row block, k, n), the config with the
    least total time over the swept m of that block (among configs measured at all of
    them), where it beats the heuristic's total by > 3%."""
    buckets: dict[tuple[int, int, int], list[dict]] = {}
    for s in summary:
        buckets.setdefault((skinny_gemm.row_block(s["m"]), s["k"], s["n"]), []).append(s)
    print("\nSKINNY_OVERRIDES entries (best total over the swept m of each row block, "
          "where > 3% better than the heuristic):")
    for key, sums in buckets.items():
        totals: dict[str, list[float]] = {}
        for s in sums:
            for r in s["variants"]:
                if r["err"] < 1e-2:
                    totals.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r["us"])
        full = {c: sum(t) for c, t in totals.items() if len(t) == len(sums)}
        if not full or any(s["heuristic"] is None for s in sums):
            continue
        best = min(full, key=full.get)
        heur = sum(s["heuristic"]["us"] for s in sums)
        if full[best] < 0.97 * heur:
            ms = ", ".join(str(s["m"]) for s in sums)
            print(f"    {key}: {json.loads(best)},  # m {ms}: {heur:.1f} -> {full[best]:.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", help=f"m values (default {ROWS})")
    ap.add_argument("--shapes", nargs="*", help=f"of {list(SHAPES)} (default: all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="try a grid of launch configs per shape")
    ap.add_argument("--budget-s", type=float, help="sweep: start no new (shape, m) after this long")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    table = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = {s: table[s] for s in (args.shapes or table)}
    rows = args.rows or ((1, 13) if args.smoke else ROWS)
    impl = "interpret" if args.smoke else "pallas"
    reps = 2 if args.smoke else args.reps
    bandwidth = copy_bandwidth(1 << 20, reps=2) if args.smoke else copy_bandwidth()
    dev = jax.devices()[0].device_kind
    print(f"{dev}: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    if args.sweep:
        sweep(shapes, rows, impl, reps, bandwidth, args.smoke, args.out, args.budget_s)
        return
    results = compare(shapes, rows, impl, reps, bandwidth, args.smoke)
    print_compare(results, shapes, rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, copy_bandwidth=bandwidth, results=results), f, indent=1)


if __name__ == "__main__":
    main()
