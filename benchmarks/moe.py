"""Routed-expert GEMMs at Granite-4.0-H-Small shapes: the grouped GEMM kernel against
ragged_dot, a batched-GEMM bound, the touched experts' byte floor and vLLM's fused MoE
Triton kernel.

Shapes (granite-4.0-h-small, one MoE layer, bf16): d 4096, 72 experts of width f 768
(gate/up stack [72, 4096, 1536], down stack [72, 768, 4096]: 1.36 GB), top-10 routing.
Tokens: prefill 4096, decode batch 1 / 8 / 64. Each token's 10 experts are drawn
uniformly without repetition (seeded), so the touched experts are those of a random router.

Variants (JAX ones compiled with the step executables' XLA options, inputs on device):
- `kernel[bm,bn,bk,warps,stages]`: `hybrid_jax.layers.moe.routed_experts` with the Pallas
  grouped GEMM (pallas_kernels/grouped_gemm.py) at these tiles; `kernel` alone is the
  engine's choice by row count. `gemm_us` is the two grouped kernels' share (the rest:
  sort, work table, unsort, weighted sum);
- `ragged`: the same routed sum with `jax.lax.ragged_dot` (the kernel's reference);
- `batched_anchor`: cuBLAS batched GEMM over all experts with every group padded to the
  largest group (`einsum` over [e, capacity, d]; group sizes known on the host: a bound,
  not a jittable path);
- `vllm[...]` (with --vllm DIR): vLLM's `fused_moe_kernel` from a local copy
  (DIR/fused_moe_vllm.py, never committed) in torch, its default config for this shape
  and tuned tile choices; `gemm_us` its two kernel launches, `us` the whole routed sum
  (alignment in torch, silu * up, sum over k).

Figures: GPU kernel time per call from a jax.profiler trace (JAX; wall time on a CPU for
the smoke run), triton's do_bench (torch); the byte floor = bytes of the touched experts'
weights at the copy bandwidth measured in the same process; TFLOP/s of the routed FLOPs
(2 * t * k * 3 d f). Every variant's output is checked against `routed_reference`
(dense: every expert on every token) and its relative error printed.

    PYTHONPATH=. python benchmarks/moe.py --vllm .anchors        # GPU: prefill 4096 + decode 1/8/64
    PYTHONPATH=. python benchmarks/moe.py --tokens 1 8 --reps 20
    PYTHONPATH=. python benchmarks/moe.py --shape granite-tiny --tokens 1 8 64 --variants kernel
    PYTHONPATH=. python benchmarks/moe.py --smoke              # CPU: tiny shapes, wall time
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.layers.moe import routed_experts, routed_reference
from pallas_kernels.grouped_gemm import DECODE, PREFILL, GroupedConfig, moe_config
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.entrypoints.bench.trace_report import gpu_kernel_events
from serving.runner.step_fns import compile_options

GRANITE_SMALL = dict(d=4096, e=72, f=768, k=10)
GRANITE_TINY = dict(d=1536, e=64, f=512, k=6)  # configs/models/granite-4.0-h-tiny.json
SMOKE = dict(d=64, e=8, f=32, k=2)
# Tile choices tried beside the engine's
# (bm, bn, bk, warps, stages, cols_major)
DECODE_TRIES = [(16, 128, 64, 4, 4, False), (16, 64, 128, 4, 4, False), (16, 256, 64, 8, 3, False),
                (16, 32, 128, 4, 4, False), (16, 64, 128, 4, 6, False), (16, 64, 64, 4, 6, False)]
PREFILL_TRIES = [(128, 128, 64, 8, 4, False), (64, 128, 64, 4, 4, True)]
# vLLM fused_moe_kernel configs tried beside its default (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, warps, stages).
VLLM_DECODE = [(16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4)]
VLLM_PREFILL = [(64, 128, 64, 16, 4, 4), (128, 128, 64, 16, 8, 4)]


def _time_us(fn, args: tuple, reps: int) -> tuple[float, int, float]:
    """(us per call, kernels per call, us per call in the grouped GEMM kernels): GPU kernel
    time from a trace, else wall time."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(reps):
                    jax.block_until_ready(fn(*args))
            evs = [ev for _, ev in gpu_kernel_events(d)]
        gemm = sum(e.duration_ns for e in evs if "grouped" in e.name) * 1e-3 / reps
        return sum(e.duration_ns for e in evs) * 1e-3 / reps, len(evs) // reps, gemm
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) * 1e6 / reps, 0, 0.0


def routing(t: int, e: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform top-k routing: experts [t, k] without repetition, weights [t, k] summing to 1."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    return experts, w / w.sum(1, keepdims=True)


def jax_variants(t: int, k: int, smoke: bool) -> dict:
    def kernel(cfg):
        impl = "interpret" if smoke else "pallas"
        return lambda x, w, ex, gu, dn: routed_experts(x, w, ex, gu, dn, activation="silu",
                                                       gated=True, impl=impl, cfg=cfg)

    def ragged(x, w, ex, gu, dn):
        return routed_experts(x, w, ex, gu, dn, activation="silu", gated=True, impl="reference")

    def batched_anchor(padded, gu, dn):  # [e, capacity, d]
        h = jnp.einsum("ecd,edw->ecw", padded, gu)
        g, u = jnp.split(h, 2, axis=-1)
        return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, dn)

    out = {"kernel": kernel(None), "ragged": ragged, "batched_anchor": batched_anchor}
    if not smoke:
        if t <= 64:  # the decode tiles beside the engine's choice (few rows: DECODE_FEW)
            tries = [dataclasses.astuple(DECODE)[:6]] + DECODE_TRIES
        else:  # prefill, or between: both regimes' tiles
            both = [dataclasses.astuple(DECODE), dataclasses.astuple(PREFILL)]
            tries = PREFILL_TRIES if t >= 4096 else both
        for c in tries:
            out[f"kernel{list(c)}".replace(" ", "")] = kernel(GroupedConfig(*c))
    return out


def vllm_variants(anchor_dir: str, t: int, e: int):
    """name -> config dicts for vLLM's kernel: its default for this shape, then tuned tries."""
    path = os.path.join(anchor_dir, "fused_moe_vllm.py")
    spec = importlib.util.spec_from_file_location("fused_moe_vllm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    configs = {"vllm_default": mod.get_default_config(t, e)}
    for bm, bn, bk, gm, w, st in VLLM_DECODE if t * 10 <= 1024 else VLLM_PREFILL:
        configs[f"vllm[{bm},{bn},{bk},{gm},{w},{st}]"] = dict(
            BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=st)
    return mod, configs


def run_vllm(mod, configs, x, weights, experts, gu, dn, want, flops, floor_us, row):
    import torch

    tx = torch.from_dlpack(x)
    w1 = torch.from_dlpack(gu).permute(0, 2, 1).contiguous()  # vLLM's [E, 2f, d]
    w2 = torch.from_dlpack(dn).permute(0, 2, 1).contiguous()  # [E, d, f]
    tw = torch.from_dlpack(jnp.asarray(weights))
    te = torch.from_dlpack(jnp.asarray(experts))
    want = np.asarray(want)
    for name, cfg in configs.items():
        try:
            out = mod.fused_experts(tx, w1, w2, tw, te, cfg)
            err = float(np.abs(out.float().cpu().numpy() - want).max() / (np.abs(want).max() + 1e-9))
            us, gemm = _vllm_times(mod, cfg, tx, w1, w2, tw, te)
            _record(row, name, us, 0, gemm, floor_us, flops, err)
        except Exception as e:  # e.g. a tile choice out of shared memory
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: FAILED {row[name]['error']}", flush=True)


def _vllm_times(mod, cfg, tx, w1, w2, tw, te) -> tuple[float, float]:
    """(us of the whole routed sum, us of its two fused_moe_kernel launches), do_bench medians."""
    import torch
    from triton.testing import do_bench

    sorted_ids, expert_ids, ntp = mod.moe_align_block_size(te, cfg["BLOCK_SIZE_M"], w1.shape[0])
    m, k = te.shape
    c1 = torch.empty((m, k, w1.shape[1]), device=tx.device, dtype=tx.dtype)
    c2 = torch.empty((m * k, w1.shape[1] // 2), device=tx.device, dtype=tx.dtype)
    c3 = torch.empty((m, k, w2.shape[1]), device=tx.device, dtype=tx.dtype)

    def gemms():
        mod.invoke_fused_moe_kernel(tx, w1, c1, tw, sorted_ids, expert_ids, ntp, False, k, cfg)
        mod.invoke_fused_moe_kernel(c2, w2, c3, tw, sorted_ids, expert_ids, ntp, True, 1, cfg)

    us = do_bench(lambda: mod.fused_experts(tx, w1, w2, tw, te, cfg), warmup=5, rep=60) * 1e3
    return us, do_bench(gemms, warmup=5, rep=60) * 1e3


def _record(row, name, us, kernels, gemm, floor_us, flops, err):
    row[name] = {"us": us, "gemm_us": gemm, "floor_ratio": us / floor_us,
                 "gemm_floor_ratio": gemm / floor_us, "tflops": flops / us / 1e6,
                 "kernels": kernels, "rel_err": err}
    print(f"t={row['tokens']} {name}: {us:.1f} us (GEMMs {gemm:.1f} us), {us / floor_us:.2f}x / "
          f"{gemm / floor_us:.2f}x the byte floor ({floor_us:.1f} us), {flops / us / 1e6:.1f} TFLOP/s, "
          f"{kernels} kernels, rel err {err:.1e}", flush=True)


def run_case(t: int, shapes: dict, gu, dn, bw: float, reps: int, opts, smoke: bool, vllm: str | None,
             only: list[str] | None = None) -> dict:
    d, e, f, k = shapes["d"], shapes["e"], shapes["f"], shapes["k"]
    experts, weights = routing(t, e, k, seed=t)
    x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
    sizes = np.bincount(experts.reshape(-1), minlength=e).astype(np.int32)
    cap = int(sizes.max())
    order = np.argsort(experts.reshape(-1), kind="stable")
    padded = jnp.zeros((e, cap, d), jnp.bfloat16)
    padded = padded.at[np.repeat(np.arange(e), sizes), np.concatenate([np.arange(s) for s in sizes])].set(
        x[order // k])
    touched = int((sizes > 0).sum())
    floor_us = touched * (d * 2 * f + f * d) * 2 / bw * 1e6
    flops = 2 * t * k * 3 * d * f
    routed = (x, jnp.asarray(weights), jnp.asarray(experts), gu, dn)
    want = jax.jit(lambda *a: routed_reference(*a, activation="silu", gated=True))(*routed)
    row = {"tokens": t, "touched_experts": touched, "floor_us": floor_us,
           "routed_tflop": flops / 1e12, "max_group": cap, "engine_config": str(moe_config(t * k))}
    for name, fn in jax_variants(t, k, smoke).items():
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            _jax_one(name, fn, routed, (padded, gu, dn), (e, k, sizes, order), want, reps, opts,
                     floor_us, flops, row)
        except Exception as err:  # a tile choice that fails to lower is a figure too
            row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"t={t} {name}: FAILED {row[name]['error']}", flush=True)
    if vllm:
        run_vllm(*vllm_variants(vllm, t, e), *routed[:3], gu, dn, want, flops, floor_us, row)
    return row


def _jax_one(name, fn, routed, batched, layout, want, reps, opts, floor_us, flops, row):
    e, k, sizes, order = layout
    t, d = routed[0].shape
    args = batched if name == "batched_anchor" else routed
    compiled = jax.jit(fn).lower(*args).compile(opts)
    out = compiled(*args)
    if name == "batched_anchor":  # back to (token, j) rows, weighted: the same routed sum
        y = out[np.repeat(np.arange(e), sizes), np.concatenate([np.arange(s) for s in sizes])]
        y = jnp.zeros((t * k, d), y.dtype).at[order].set(y).reshape(t, k, d)
        out = jnp.einsum("tkd,tk->td", y.astype(jnp.float32), routed[1])
    err = float(jnp.abs(out - want).max() / (jnp.abs(want).max() + 1e-9))
    us, kernels, gemm = _time_us(compiled, args, reps)
    _record(row, name, us, kernels, gemm or us, floor_us, flops, err)


def run_head(shapes: dict, bw: float) -> dict:
    """The first JSON line of a run: device, copy bandwidth, shapes, date, jax version."""
    return {"device": str(jax.devices()[0]), "copy_TBps": bw / 1e12, "shapes": shapes,
            "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__}


def random_experts(shapes: dict) -> tuple[jax.Array, jax.Array]:
    """bf16 expert stacks (gate/up [e, d, 2f], down [e, f, d]), scaled to unit-size outputs."""
    d, e, f = shapes["d"], shapes["e"], shapes["f"]
    key = jax.random.key(0)
    gu = jax.random.normal(key, (e, d, 2 * f), jnp.bfloat16) * d**-0.5
    dn = jax.random.normal(jax.random.fold_in(key, 1), (e, f, d), jnp.bfloat16) * f**-0.5
    return gu, dn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 1, 8, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    p.add_argument("--shape", choices=["granite-small", "granite-tiny"], default="granite-small",
                   help="expert shapes (granite-tiny: d 1536, 64 experts of width 512, top 6)")
    p.add_argument("--vllm", metavar="DIR", help="folder of the local vLLM fused-MoE copy (torch, GPU)")
    p.add_argument("--out", help="also append each row as a JSON line here")
    p.add_argument("--variants", nargs="+", help="only the JAX variants whose names start so")
    a = p.parse_args()
    shapes = SMOKE if a.smoke else GRANITE_TINY if a.shape == "granite-tiny" else GRANITE_SMALL
    bw = copy_bandwidth(1 << 24 if a.smoke else 1 << 30)
    head = run_head(shapes, bw)
    print(json.dumps(head), flush=True)
    gu, dn = random_experts(shapes)
    opts = compile_options()
    for t in a.tokens:
        row = run_case(t, shapes, gu, dn, bw, a.reps, opts, a.smoke, a.vllm, a.variants)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as fh:
                fh.write(json.dumps({**head, **row}) + "\n")


if __name__ == "__main__":
    main()
