"""FP8 weights on the GPU: the decode step, and the products, against bf16 and cuBLASLt.

`--decode` (default on): native-1b-parallel's decode step with bf16 weights and with
FP8 weights (`quantization="fp8"`: 128 x 128 block scales, bf16 activations), at batch
1 and 64, each in its own process through benchmarks/step_anatomy.py (engine step,
compiled step, GPU kernel time, byte floor from the weight bytes actually held). The
issue-43 targets: batch 1 <= 0.6x the bf16 step; batch 64 within 1.3x of its floor.

`--gemm`: the products at native-1b-parallel's fused shapes (K x N: in 2048 x 4384,
gate/up 2048 x 11264, out 4096 x 2048, down 5632 x 2048), kernels held [N, K] as the
engine's fused copy holds them, each timed as a jit of a chain of `--chain` products on
distinct weights (so they stream from HBM), per product:
  bf16        XLA's dot with bf16 weights (the engine's bf16 path)
  fp8_deq     hybrid_jax.layers.fp8.fp8_matmul's reference: dequantize then the bf16
              product (what the engine runs for FP8 weights at more than 64 rows)
  fp8_gemv    fp8_matmul's FP8 decode kernel at <= 64 rows on a GPU (on Hopper
              pallas_kernels/fp8_stream.py, else fp8_gemv.py: e4m3 weights and block
              scales streamed once, dequantized in registers)
  torch_bf16  torch.matmul, bf16 (cuBLAS), when torch with CUDA is importable
  scaled_mm   torch._scaled_mm, e4m3 x e4m3 -> bf16 with 1 x 128 activation and
              128 x 128 weight block scales where this torch takes them, else per-tensor
              scales (the `scaled_mm_scales` field says which)
at `--rows` (default prefill 8192 and 2048, decode 1, 8, 64). TFLOP/s and weight
bytes over the measured copy bandwidth are printed beside each time.

    PYTHONPATH=. python benchmarks/fp8.py                   # decode steps (4 processes)
    PYTHONPATH=. python benchmarks/fp8.py --kv-fp8 --batches 64 256   # + FP8 KV, bf16 state
    PYTHONPATH=. python benchmarks/fp8.py --gemm --no-decode [--rows 8192 1 64] [--out r.jsonl]
    PYTHONPATH=. python benchmarks/fp8.py --gemm --no-decode --rows 1 64   # the decode GEMV (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {"in": (2048, 4384), "gate_up": (2048, 11264), "out": (4096, 2048), "down": (5632, 2048)}
BLOCK = 128


def decode_steps(model: str, batches: list[int], prompt_len: int, steps: int, kv_fp8: bool) -> list[dict]:
    rows = []
    # (weights, K/V pages, recurrent state): bf16; FP8 weights; and with --kv-fp8 FP8 weights,
    # FP8 K/V pages and bf16 state (issue 43's fewest-bytes decode step)
    variants = [(None, "auto", None), ("fp8", "auto", None)]
    variants += [("fp8", "fp8", "bfloat16")] if kv_fp8 else []
    for batch in batches:
        for quant, kv, state in variants:
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
                cmd = [sys.executable, "benchmarks/step_anatomy.py", "--model", model, "--dtype", "bfloat16",
                       "--batch", str(batch), "--prompt-len", str(prompt_len), "--steps", str(steps),
                       "--top", "20", "--out", out.name, "--kv-cache-dtype", kv] + \
                    (["--quantization", quant] if quant else []) + (["--state-dtype", state] if state else [])
                subprocess.run(cmd, check=True, env=os.environ | {"PYTHONPATH": "."})
                with open(out.name) as f:
                    res = json.loads(f.read().splitlines()[-1])
            rows.append({k: res[k] for k in ("batch_run", "quantization", "kv_cache_dtype", "state_dtype",
                                             "engine_ms", "compiled_ms",
                                             "kernel_ms", "floor_ms", "engine_over_floor",
                                             "weight_bytes_by_dtype", "context")})
    print("batch | weights | KV | state | engine_ms | compiled_ms | kernel_ms | floor_ms | engine/floor "
          "| vs bf16")
    for r in rows:
        base = next(b for b in rows if b["batch_run"] == r["batch_run"] and b["quantization"] is None)
        print(f"{r['batch_run']} | {r['quantization'] or 'bf16'} | {r['kv_cache_dtype']} | "
              f"{r['state_dtype']} | "
              f"{r['engine_ms']:.3f} | "
              f"{r['compiled_ms']:.3f} | {r['kernel_ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{r['engine_over_floor']:.2f} | {r['engine_ms'] / base['engine_ms']:.2f}x")
    return rows


def _time(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def jax_products(rows: int, k: int, n: int, chain: int, reps: int) -> dict[str, float]:
    """Seconds per product: bf16 dot and fp8_matmul, chains of distinct [n, k] kernels."""
    import jax
    import jax.numpy as jnp

    from hybrid_jax.layers.fp8 import fp8_matmul, quantize
    from pallas_kernels.fp8_gemv import fits as gemv_fits

    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, k), jnp.bfloat16)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * k**-0.5 for i in range(chain)]
    bf16 = [w.astype(jnp.bfloat16) for w in ws]
    q = [quantize(w, BLOCK) for w in ws]
    del ws

    @jax.jit
    def plain(x, ws):
        return [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))) for w in ws]

    def fp8(impl):
        return jax.jit(lambda x, qs: [fp8_matmul(x, w, s, block=BLOCK, dtype=jnp.bfloat16, transposed=True,
                                                 impl=impl) for w, s in qs])

    out = {"bf16": _time(plain, (x, bf16), reps) / chain,
           "fp8_deq": _time(fp8("reference"), (x, q), reps) / chain}
    if gemv_fits(rows, k, n, BLOCK):
        # interpret mode off a GPU: a smoke run, not a timing
        out["fp8_gemv"] = _time(fp8("pallas" if jax.default_backend() == "gpu" else "interpret"),
                                (x, q), reps) / chain
    return out


def torch_operands(torch, rows: int, k: int, n: int, chain: int):
    """On the GPU: x [rows, k] and `chain` weights [n, k] (scaled to unit-size outputs), in
    bf16 and cast to e4m3 (the anchors' operands)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(chain)]
    return x, ws, x.to(torch.float8_e4m3fn), [w.to(torch.float8_e4m3fn) for w in ws]


def torch_products(rows: int, k: int, n: int, chain: int, reps: int) -> dict[str, object]:
    """Seconds per product: torch bf16 matmul and torch._scaled_mm (block scales if taken)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    dev = "cuda"
    x, ws, xq, wq = torch_operands(torch, rows, k, n, chain)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times) / chain

    out = {"torch_bf16": timed(lambda: [x @ w.t() for w in ws])}
    one = torch.ones((), device=dev, dtype=torch.float32)
    block_scales = (torch.ones(rows, k // BLOCK, device=dev),
                    torch.ones(k // BLOCK, -(-n // BLOCK), device=dev))
    for name, (sa, sb) in (("block", block_scales), ("tensor", (one, one))):
        try:  # 1 x 128 activation / 128 x 128 weight scales need a recent torch and cuBLASLt
            torch._scaled_mm(xq, wq[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError, TypeError) as err:
            out[f"scaled_mm_{name}_error"] = str(err).splitlines()[0][:200]
            continue
        out["scaled_mm"] = timed(lambda sa=sa, sb=sb: [
            torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16) for w in wq])
        out["scaled_mm_scales"] = name
        break
    return out


def gemms(rows_list: list[int], chain: int, reps: int) -> list[dict]:
    from serving.entrypoints.bench.floor import copy_bandwidth

    bw = copy_bandwidth()
    results = []
    print("rows | shape | product | us | TFLOP/s | %copy (weight bytes)")
    for rows in rows_list:
        for name, (k, n) in SHAPES.items():
            times = jax_products(rows, k, n, chain, reps) | torch_products(rows, k, n, chain, reps)
            res = {"rows": rows, "shape": name, "k": k, "n": n, **times}
            results.append(res)
            for prod, s in times.items():
                if not isinstance(s, float):
                    continue
                wbytes = k * n * (1 if prod in ("fp8_deq", "fp8_gemv", "scaled_mm") else 2)
                tflops = 2 * rows * k * n / s / 1e12
                print(f"{rows} | {name} {k}x{n} | {prod} | {1e6 * s:.1f} | {tflops:.1f} | "
                      f"{100 * wbytes / bw / s:.0f}%")
            for key in (k_ for k_ in times if k_.endswith("_error")):
                print(f"{rows} | {name} | {key}: {times[key]}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-step comparison")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kv-fp8", action="store_true",
                   help="also FP8 weights with FP8 K/V pages and bf16 recurrent state")
    p.add_argument("--gemm", action="store_true", help="also the product comparison")
    p.add_argument("--rows", type=int, nargs="+", default=[8192, 2048, 1, 8, 64])
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="append the results as JSON lines here")
    a = p.parse_args()
    # torch and JAX share the GPU in --gemm: JAX must not take 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    res: dict[str, object] = {}
    if not a.no_decode:
        res["decode"] = decode_steps(a.model, a.batches, a.prompt_len, a.steps, a.kv_fp8)
    if a.gemm:
        import jax

        res["device"] = str(jax.devices()[0])
        res["gemm"] = gemms(a.rows, a.chain, a.reps)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
