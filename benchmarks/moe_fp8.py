"""FP8 routed experts at the qwen3.5-35b-a3b preset's shapes: the grouped GEMM on FP8 expert
stacks (e4m3 + 128 x 128 block scales, read in place) against the same kernel on bf16
stacks and against each one's touched-experts byte floor; and (--fit) the whole preset
quantized at load on one device: its weight bytes as stats() reports them and one engine
step.

Shapes (hybrid_jax/presets.py, configs/models/qwen3.5-35b-a3b.json; one MoE layer): d 2048,
256 experts of width f 512 (gate/up [256, 2048, 1024], down [256, 512, 2048]), top-8
routing, each token's experts drawn uniformly without repetition (benchmarks/moe.py's
`routing`). Tokens: prefill 4096, decode batch 1 / 16 / 64.

Variants: `bf16` and `fp8` run `hybrid_jax.layers.moe.routed_experts` with the Pallas kernel
at the engine's tiles (`moe_config`: decode tiles scale each partial product by its block's
scale, prefill tiles scale the weight tile); `fp8_scale_other` the same tiles with the
other choice (`GroupedConfig.fp8_scale`);
`fp8[bm,bn,bk,warps,stages]` other tiles. Times are
GPU kernel time per call from a profiler trace (`us`: the whole routed sum; `gemm_us`: the
two grouped GEMM launches), the floor = bytes of the touched experts' weights (bf16: 2 B per
weight; FP8: 1 B per weight + their f32 scales) at the copy bandwidth measured in the same
process. Errors: each variant against `routed_reference` on its own weights (FP8:
dequantized), and FP8 against bf16 (the quantization error itself).

    PYTHONPATH=. python benchmarks/moe_fp8.py --fit                  # GPU
    PYTHONPATH=. python benchmarks/moe_fp8.py --smoke --fit native-tiny   # CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe import _time_us, random_experts, routing, run_head
from hybrid_jax.layers.fp8 import quantize_stack
from hybrid_jax.layers.moe import routed_experts, routed_reference
from hybrid_jax.presets import load_preset
from pallas_kernels.grouped_gemm import GroupedConfig, moe_config
from serving.entrypoints.bench.floor import copy_bandwidth
from serving.runner.step_fns import compile_options

PRESET = "qwen3.5-35b-a3b"
SMOKE = dict(d=256, e=8, f=128, k=2)
BLOCK = 128
# FP8 tiles tried beside the engine's (bm, bn, bk, warps, stages, cols_major)
DECODE_TRIES = [(16, 64, 128, 4, 4, False), (16, 128, 128, 4, 4, False)]
PREFILL_TRIES = [(128, 128, 128, 8, 3, True), (64, 128, 64, 4, 4, True)]


def parse_try(spec: str) -> GroupedConfig:
    """"bm,bn,bk,warps,stages[,c][,sN][,w]" -> GroupedConfig: `c` column-major grid, `sN` N
    k splits, `w` the FP8 scale on the weight tile."""
    parts = spec.split(",")
    kw = dict(zip(("bm", "bn", "bk", "num_warps", "num_stages"), map(int, parts[:5]), strict=True))
    for flag in parts[5:]:
        if flag == "c":
            kw["cols_major"] = True
        elif flag == "w":
            kw["fp8_scale"] = "weights"
        elif flag.startswith("s"):
            kw["splits"] = int(flag[1:])
        else:
            raise ValueError(f"--tries: unknown flag {flag!r} in {spec!r}")
    return GroupedConfig(**kw)


def shapes_of(preset: str) -> dict:
    moe = load_preset(preset).moe
    return dict(d=load_preset(preset).hidden_size, e=moe.num_experts, f=moe.intermediate_size, k=moe.top_k)


def run_case(t: int, s: dict, stacks: dict, bw: float, reps: int, smoke: bool, tries: bool,
             given: list[str] | None = None, bf16_tries: bool = False) -> dict:
    d, e, f, k = s["d"], s["e"], s["f"], s["k"]
    experts, weights = routing(t, e, k, seed=t)
    x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
    touched = int((np.bincount(experts.reshape(-1), minlength=e) > 0).sum())
    per_expert = 3 * d * f
    scale_bytes = 4 * (stacks["sgu"][0].size + stacks["sdn"][0].size)
    floors = {"bf16": touched * per_expert * 2 / bw * 1e6,
              "fp8": touched * (per_expert + scale_bytes) / bw * 1e6}
    impl = "interpret" if smoke else "pallas"
    routed = (x, jnp.asarray(weights), jnp.asarray(experts))
    # Weights are arguments, never closed over: a closed-over array is a constant of the
    # executable (slow to compile, and carried into every profiler trace).
    args = {"bf16": (*routed, stacks["gu"], stacks["dn"]),
            "fp8": (*routed, stacks["qgu"], stacks["qdn"], stacks["sgu"], stacks["sdn"])}
    opts = compile_options()
    row = {"tokens": t, "touched_experts": touched, "floor_us": floors,
           "engine_config": str(moe_config(t * k)), "engine_config_fp8": str(moe_config(t * k, fp8=True))}

    def bf16(cfg):
        return lambda x, w, ex, gu, dn: routed_experts(x, w, ex, gu, dn, activation="silu", gated=True,
                                                       impl=impl, cfg=cfg)

    def fp8(cfg):
        return lambda x, w, ex, gu, dn, sgu, sdn: routed_experts(
            x, w, ex, gu, dn, activation="silu", gated=True, impl=impl, cfg=cfg, fp8=(sgu, sdn, BLOCK))

    want_bf16 = jax.jit(lambda x, w, ex, gu, dn: routed_reference(x, w, ex, gu, dn, activation="silu",
                                                                  gated=True))(*args["bf16"])
    want_fp8 = jax.jit(lambda x, w, ex, gu, dn, sgu, sdn: routed_reference(
        x, w, ex, gu, dn, activation="silu", gated=True, fp8=(sgu, sdn, BLOCK)))(*args["fp8"])
    variants = {"bf16": (bf16(None), want_bf16, "bf16"), "fp8": (fp8(None), want_fp8, "fp8"),
                # the engine's tiles, each block's scale applied the other way than the engine's
                # choice for this row count (GroupedConfig.fp8_scale): on the weight tile or
                # on each partial product
                "fp8_scale_other": (fp8(dataclasses.replace(
                    moe_config(t * k, fp8=True), fp8_scale="output"
                    if moe_config(t * k, fp8=True).fp8_scale == "weights" else "weights")), want_fp8, "fp8")}
    if given:  # --tries: these tiles (FP8, and bf16 with --bf16-tries)
        for spec in given:
            variants[f"fp8[{spec}]"] = (fp8(parse_try(spec)), want_fp8, "fp8")
            if bf16_tries:
                variants[f"bf16[{spec}]"] = (bf16(parse_try(spec)), want_bf16, "bf16")
    elif not smoke and tries:
        for c in DECODE_TRIES if t <= 64 else PREFILL_TRIES:
            variants[f"fp8{list(c[:5])}".replace(" ", "")] = (fp8(GroupedConfig(*c)), want_fp8, "fp8")
    rel = lambda a, b: float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-9))  # noqa: E731
    for name, (fn, want, kind) in variants.items():
        try:
            compiled = jax.jit(fn).lower(*args[kind]).compile(opts)
            out = compiled(*args[kind])
            us, kernels, gemm = _time_us(compiled, args[kind], reps)
            gemm = gemm or us
            row[name] = {"us": us, "gemm_us": gemm, "floor_ratio": us / floors[kind],
                         "gemm_floor_ratio": gemm / floors[kind], "kernels": kernels,
                         "rel_err": rel(out, want), "rel_err_vs_bf16": rel(out, want_bf16)}
            print(f"t={t} {name}: {us:.1f} us (GEMMs {gemm:.1f} us), {gemm / floors[kind]:.2f}x its byte "
                  f"floor ({floors[kind]:.1f} us), rel err {row[name]['rel_err']:.1e} "
                  f"(vs bf16 {row[name]['rel_err_vs_bf16']:.1e})", flush=True)
        except Exception as err:  # a tile choice that fails to lower is a figure too
            row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"t={t} {name}: FAILED {row[name]['error']}", flush=True)
    return row


def fit(model: str, out: str | None) -> dict:
    """Load `model` with quantization="fp8" (bf16 compute) into an engine on one device,
    report stats()' weight bytes and device memory, run one prompt through two steps."""
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine
    from serving.entrypoints.llm import LLM
    from serving.sample.sampling_params import SamplingParams

    t0 = time.perf_counter()
    cfg = EngineConfig(dtype="bfloat16", quantization="fp8", max_num_seqs=4, max_num_batched_tokens=64,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=512, seq_buckets=(4,), token_buckets=(64,), compilation_cache_dir=None)
    eng = LLMEngine(model, cfg, show_progress=False)
    built = time.perf_counter() - t0
    stats = eng.stats()
    t1 = time.perf_counter()
    outs = LLM.from_engine(eng).generate(prompt_token_ids=[list(range(1, 17))],
                                         sampling_params=SamplingParams(temperature=0.0, max_tokens=2,
                                                                        ignore_eos=True))
    mem = jax.devices()[0].memory_stats() or {}
    row = {"fit_model": model, "engine_build_s": round(built, 1),
           "generate_s": round(time.perf_counter() - t1, 1), "tokens": outs[0].token_ids,
           "quantization": stats.get("quantization"), "weight_bytes": stats.get("weight_bytes"),
           "weight_bytes_by_dtype": stats.get("weight_bytes_by_dtype"),
           "device_bytes_in_use": mem.get("bytes_in_use"), "device_peak_bytes": mem.get("peak_bytes_in_use"),
           "device_bytes_limit": mem.get("bytes_limit")}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 1, 16, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    p.add_argument("--fit", nargs="?", const=PRESET, help="also load this model (default the preset) "
                   "quantized and run one engine step")
    p.add_argument("--no-tries", action="store_true", help="the engine's tiles only")
    p.add_argument("--tries", nargs="+", help="tiles to time instead of the built-in tries: "
                   "bm,bn,bk,warps,stages[,c][,sN][,w] (c: column-major grid, sN: N k splits, "
                   "w: FP8 scale on the weight tile)")
    p.add_argument("--bf16-tries", action="store_true", help="time --tries on the bf16 stacks too")
    p.add_argument("--preset", default=PRESET, help="the expert shapes of this preset")
    p.add_argument("--out", help="also append each row as a JSON line here")
    a = p.parse_args()
    s = SMOKE if a.smoke else shapes_of(a.preset)
    bw = copy_bandwidth(1 << 24 if a.smoke else 1 << 30)
    head = run_head(s, bw)
    print(json.dumps(head), flush=True)
    gu, dn = random_experts(s)
    qgu, sgu = quantize_stack(gu, BLOCK, glu=True)
    qdn, sdn = quantize_stack(dn, BLOCK)
    stacks = dict(gu=gu, dn=dn, qgu=qgu, sgu=sgu, qdn=qdn, sdn=sdn)
    rows = []
    for t in a.tokens:
        rows.append(run_case(t, s, stacks, bw, a.reps, a.smoke, not a.no_tries, a.tries, a.bf16_tries))
    del gu, dn, qgu, qdn, stacks
    if a.fit:
        rows.append(fit(a.fit, a.out))
    if a.out:
        with open(a.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps({**head, **row}) + "\n")


if __name__ == "__main__":
    main()
