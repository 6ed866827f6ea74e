"""FP8 products on the GPU: the decode kernels' launch sweep and their check, and the
prefill anchors, in one process (one lease).

Decode (`--rows`, default 1 64): per weight shape [N, K] (held as the engine's fused
copy), each product is a jit of a chain of distinct weights (> 4x the L2 together),
dispatched back to back without a sync (so host dispatch overlaps the device), time per
product = wall / (reps x chain):
  bf16        XLA's dot, bf16 weight (the engine's bf16 path)
  fp8_deq     dequantize then the bf16 product (hybrid_jax.layers.fp8 reference path)
  bf16_reduce the engine's bf16 one-row product (XLA row reduction; 1 row only)
  reduce:2 / reduce:1  hybrid_jax.layers.fp8.row_reduce, two-stage / one reduction over k;
              reduce:bf16 the one reduction with the weight rounded to bf16 (the engine's
              one-row FP8 product since HYBRID_JAX_FP8_REDUCE; 1 row only)
  reduce_rows (2-8 rows) one reduction with the rows innermost: a candidate, not the engine's
  gemv:...    pallas_kernels/fp8_gemv.py (Triton lowering), launch variants
  stream:...  pallas_kernels/fp8_stream.py (Mosaic GPU, TMA ring + wgmma), launch variants
Shapes in `--sweep-shapes` try every launch
variant, the others the defaults. Each kernel variant is first checked against the
dequantize path on one weight (max |error| over max |y|, printed).
`%copy` is (e4m3 weight + f32 scale bytes) / time over the measured copy bandwidth
(an f32 read+write pass over 1 GiB).

Prefill (`--prefill-rows`, default 2048 8192): bf16 XLA dot, fp8_deq, torch bf16 matmul,
torch._scaled_mm e4m3 (per-tensor, rowwise, and 1x128 / 128x128 block scales where this
torch takes them: the anchor), and pallas_kernels/fp8_gemm.py's block-scaled FP8 GEMM
(`gemm:tn<T>s<S>`; activations quantized in the timed call, as
the engine runs it; first checked against its float64-exact XLA reference: `gemm:...:err`,
max |error| over max |y|), TFLOP/s against the bf16 rate.

    PYTHONPATH=. python benchmarks/fp8_decode.py --out r.jsonl          # everything (~2 min)
    PYTHONPATH=. python benchmarks/fp8_decode.py --quick                # default launches only
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

from benchmarks.fp8 import torch_operands

SHAPES = {  # name: (N, K), the weight held [N, K]
    "in": (4384, 2048), "gate_up": (11264, 2048), "out": (2048, 4096), "down": (2048, 5632),
    "35b_qkv": (9216, 2048), "large": (8192, 8192),
}
BLOCK = 128
L2_BYTES = 50 << 20



def log(out, rec):
    print(json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def timed(fn, args, reps):
    import jax

    jax.block_until_ready(fn(*args))
    best = None
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            y = fn(*args)
        jax.block_until_ready(y)
        s = (time.perf_counter() - t) / reps
        best = s if best is None else min(best, s)
    return best


def weights(n, k, chain):
    import jax
    import jax.numpy as jnp

    from hybrid_jax.layers.fp8 import quantize

    key = jax.random.key(n * 7 + k)
    out = []
    for i in range(chain):
        w = jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * k**-0.5
        out.append((w.astype(jnp.bfloat16), *quantize(w, BLOCK)))
    return out


def fp8_rows_reduce(x, q, s):
    """A few rows x [m, k] times the FP8 W [n, k] transposed as one XLA reduction with the
    rows innermost ([n, m, k] -> [n, m]), so consecutive reductions share a weight row (read
    from cache after the first): a candidate for 2-8 rows, timed beside the kernels."""
    import jax.numpy as jnp

    from hybrid_jax.layers.fp8 import expand_scale

    w = (q.astype(jnp.float32) * expand_scale(s, q.shape, BLOCK)).astype(jnp.bfloat16)
    y = jnp.sum(w.astype(jnp.float32)[:, None, :] * x.astype(jnp.float32)[None], axis=-1)
    return y.T.astype(jnp.bfloat16)


def decode(args, bw):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hybrid_jax.layers.fp8 import row_reduce
    from pallas_kernels.fp8_gemv import fp8_gemv
    from pallas_kernels.fp8_stream import (
        Fp8StreamConfig,
        _kernel,
        default_splits,
        fp8_stream_matmul,
        reference,
    )

    sweep_stream = [Fp8StreamConfig(tn, st, sp, ot) for tn, st, sp, ot in
                    ((128, 4, 0, True), (64, 6, 0, True), (128, 8, 0, True), (128, 4, 1, True),
                     (128, 4, 0, False))]
    sweep_gemv = [dict(), dict(bn=128, num_warps=8), dict(num_warps=8, num_stages=4)]
    broken = set()
    for name in args.shapes:
        sweep = name in args.sweep_shapes and not args.quick
        stream_cfgs = sweep_stream if sweep else [Fp8StreamConfig()]
        gemv_cfgs = sweep_gemv if sweep else [dict()]
        n, k = SHAPES[name]
        chain = max(2, min(16, -(-4 * L2_BYTES // (n * k))))
        ws = weights(n, k, chain)
        wbytes = n * k + 4 * (-(-n // BLOCK)) * (k // BLOCK)
        for rows in args.rows:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            want = np.asarray(reference(x, ws[0][1], ws[0][2], jnp.float32))
            res = {"kind": "decode", "shape": name, "n": n, "k": k, "rows": rows, "chain": chain,
                   "copy_bw": bw}
            plain = jax.jit(lambda x, ws: [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))) for w in ws])
            deq = jax.jit(lambda x, ws: [reference(x, q, s) for q, s in ws])
            res["bf16"] = timed(plain, (x, [w for w, _, _ in ws]), args.reps) / chain
            res["fp8_deq"] = timed(deq, (x, [(q, s) for _, q, s in ws]), args.reps) / chain
            variants = [(f"stream:{c.tn},{c.stages},{c.splits},{int(c.out_tiled)}",
                         lambda x, q, s, c=c: fp8_stream_matmul(x, q, s, cfg=c)) for c in stream_cfgs]
            # the kernel alone: x already 8-row padded, the f32 partials left unsummed (what the
            # XLA glue around it costs is the difference from stream:128,4,0,1)
            xp = jnp.pad(x, ((0, -rows % 8), (0, 0)))
            sp = default_splits(xp.shape[0], n, k // BLOCK, 128)
            variants += [("raw:128,4", lambda x, q, s, xp=xp, sp=sp: _kernel(xp, q, s, 128, 4, sp, True))]
            variants += [("gemv:" + ",".join(f"{a}={b}" for a, b in g.items()),
                          lambda x, q, s, g=g: fp8_gemv(x, q, s, transposed=True, **g)) for g in gemv_cfgs]
            timed_keys = ["bf16", "fp8_deq"]
            if rows == 1:
                red = jax.jit(lambda x, ws: [jnp.sum(x[0].astype(jnp.float32) * w.astype(jnp.float32),
                                                     axis=-1).astype(jnp.bfloat16) for w in ws])
                res["bf16_reduce"] = timed(red, (x, [w for w, _, _ in ws]), args.reps) / chain
                timed_keys.append("bf16_reduce")
                variants = [(f"reduce:{2 if two else 1}", lambda x, q, s, two=two: row_reduce(
                    x[0], q, s, BLOCK, two)[None].astype(jnp.bfloat16)) for two in (True, False)] + variants
                variants = [("reduce:bf16", lambda x, q, s: row_reduce(  # the engine's form now
                    x[0], q, s, BLOCK, dtype=jnp.bfloat16)[None].astype(jnp.bfloat16))] + variants
            elif rows <= 8:  # a try, not the engine's path: the reduction with the rows innermost
                variants = [("reduce_rows", lambda x, q, s: fp8_rows_reduce(x, q, s))] + variants
            for vname, f in variants:
                if vname in broken:
                    continue
                try:
                    got = np.asarray(jax.jit(f)(x, ws[0][1], ws[0][2]).astype(jnp.float32))
                    if not vname.startswith("raw:"):  # raw: unsummed partials, timed only
                        res[vname + ":err"] = float(np.abs(got - want).max() / np.abs(want).max())
                    chainf = jax.jit(lambda x, qs, f=f: [f(x, q, s) for q, s in qs])
                    res[vname] = timed(chainf, (x, [(q, s) for _, q, s in ws]), args.reps) / chain
                    timed_keys.append(vname)
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a result
                    res[vname + ":error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    broken.add(vname)
                    if "stream" in vname and rows == args.rows[0]:
                        traceback.print_exc(limit=3)
            for key in timed_keys:
                b = 2 * n * k if key.startswith("bf16") else wbytes
                res[key + ":pct"] = round(100 * b / res[key] / bw, 1)
            res = {kk: (round(v * 1e6, 2) if isinstance(v, float) and not kk.endswith((":pct", ":err"))
                        and kk != "copy_bw" else v) for kk, v in res.items()}
            log(args.out, res)
            del x
        del ws


def prefill(args):
    import jax
    import jax.numpy as jnp

    from hybrid_jax.layers.fp8 import dequantize
    from pallas_kernels.fp8_stream import reference

    try:
        import torch
    except ImportError:
        torch = None
    for name in args.prefill_shapes:
        n, k = SHAPES[name]
        chain = 4
        ws = weights(n, k, chain)
        for rows in args.prefill_rows:
            flops = 2 * rows * n * k
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            res = {"kind": "prefill", "shape": name, "n": n, "k": k, "rows": rows}
            plain = jax.jit(lambda x, ws: [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))) for w in ws])
            deq = jax.jit(lambda x, ws: [reference(x, q, s) for q, s in ws])
            res["bf16"] = timed(plain, (x, [w for w, _, _ in ws]), 5) / chain
            res["fp8_deq"] = timed(deq, (x, [(q, s) for _, q, s in ws]), 5) / chain
            # the dequantized weight written apart (an optimization barrier keeps XLA from
            # fusing the dequantization into its GEMM), then the bf16 GEMM
            apart = jax.jit(lambda x, ws: [jax.lax.dot_general(
                x, jax.lax.optimization_barrier(dequantize(q, s, BLOCK, jnp.bfloat16)),
                (((1,), (1,)), ((), ()))) for q, s in ws])
            res["fp8_deq_apart"] = timed(apart, (x, [(q, s) for _, q, s in ws]), 5) / chain
            # XLA's own FP8 GEMM (cuBLASLt) with per-tensor scales: activations cast to e4m3
            try:
                def xla_fp8(x, ws):
                    xs = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448
                    xq = (x / xs).astype(jnp.float8_e4m3fn)
                    dims = (((1,), (1,)), ((), ()))
                    return [(jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32) * xs
                             ).astype(jnp.bfloat16) for q, _ in ws]
                res["xla_fp8_tensor"] = timed(jax.jit(xla_fp8), (x, [(q, s) for _, q, s in ws]), 5) / chain
            except Exception as e:  # noqa: BLE001
                res["xla_fp8_tensor:error"] = str(e)[:200]
            res.update(block_gemm(x, ws, args.gemm_configs))
            if torch is not None and torch.cuda.is_available():
                res.update(torch_prefill(torch, rows, n, k, chain))
            for key in list(res):
                if isinstance(res[key], float) and not key.endswith(":err"):
                    res[key + ":tflops"] = round(flops / res[key] / 1e12, 1)
                    res[key] = round(res[key] * 1e6, 1)
            log(args.out, res)
        del ws


def block_gemm(x, ws, configs):
    """pallas_kernels/fp8_gemm.py over the chain, per launch config; each first checked
    against the XLA reference on the first weight."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.fp8_gemm import Fp8GemmConfig, fp8_block_matmul

    out = {}
    q0, s0 = ws[0][1], ws[0][2]
    want = fp8_block_matmul(x, q0, s0, out_dtype=jnp.float32, impl="reference")
    for spec in configs:
        parts = spec.split(",")
        tn, stages = int(parts[0]), int(parts[1])
        name = f"gemm:tn{tn}s{stages}"
        cfg = Fp8GemmConfig(tn=tn, stages=stages)
        try:
            got = fp8_block_matmul(x, q0, s0, cfg=cfg, out_dtype=jnp.float32)
            out[name + ":err"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            fn = jax.jit(lambda x, ws, cfg=cfg: [fp8_block_matmul(x, q, s, cfg=cfg) for q, s in ws])
            out[name] = timed(fn, (x, [(q, s) for _, q, s in ws]), 5) / len(ws)
        except Exception as e:  # noqa: BLE001 - a launch that fails is a result
            out[name + ":error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=4)
    return out


def torch_prefill(torch, rows, n, k, chain):
    dev = "cuda"
    x, ws, xq, wq = torch_operands(torch, rows, k, n, chain)

    def t(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            s = (time.perf_counter() - t0) / reps / chain
            best = s if best is None else min(best, s)
        return best

    out = {"torch_bf16": t(lambda: [x @ w.t() for w in ws])}
    one = torch.ones((), device=dev)
    scales = {
        "tensor": (one, one),
        "rowwise": (torch.ones(rows, 1, device=dev), torch.ones(1, n, device=dev)),
        # DeepSeek-style: 1 x 128 activation groups (outer-dim-major), 128 x 128 weight blocks
        "block": (torch.ones(k // BLOCK, rows, device=dev).t(),
                  torch.ones(n // BLOCK, k // BLOCK, device=dev).t()),
    }
    for name, (sa, sb) in scales.items():
        try:
            torch._scaled_mm(xq, wq[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            out[f"scaled_mm_{name}"] = t(lambda sa=sa, sb=sb: [
                torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16) for w in wq])
        except Exception as e:  # noqa: BLE001 - a scaling this torch refuses is a result
            out[f"scaled_mm_{name}:error"] = str(e).splitlines()[0][:200]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["gate_up", "out", "in", "down", "35b_qkv", "large"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--sweep-shapes", nargs="+", default=["gate_up", "out"],
                   help="shapes that try every launch variant (the rest: the defaults)")
    p.add_argument("--prefill-shapes", nargs="+", default=["gate_up", "large"])
    p.add_argument("--prefill-rows", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--gemm-configs", nargs="*", default=["128,4", "256,3"],
                   help="fp8_gemm launches tried in prefill: tn,stages")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="default launches only")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from serving.entrypoints.bench.floor import copy_bandwidth

    bw = copy_bandwidth()
    log(a.out, {"kind": "device", "device": str(jax.devices()[0]), "jax": jax.__version__,
                "copy_bw_tb_s": round(bw / 1e12, 3),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    if not a.no_decode:
        decode(a, bw)
    if not a.no_prefill:
        prefill(a)


if __name__ == "__main__":
    main()
