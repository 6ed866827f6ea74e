"""Tensor parallelism: decode step and throughput at TP = 1 vs N, byte floor per device,
and the collectives' time from a profile.

For each preset and tensor_parallel_size, one engine (bf16, random weights) serves
batches of B sequences at a context of C tokens; on steps where the whole batch decodes:

  step_ms          `LLMEngine.step()` wall time (median), tok_s = B / step
  floor_ms         bytes ONE device must move per step (its weight shard, its KV heads'
                   in-window K/V, its SSM heads' state read + written) over the copy
                   bandwidth measured here: the TP floor is ~1/N of the TP=1 floor
  collective_ms    per step and device, GPU time of all-reduce / all-gather kernels
                   (NCCL) in a jax.profiler trace of a few steps; kernel_ms the time of
                   all kernels of that device
  top_kernels      per device, the kernels taking the most time per step (name, ms, calls),
                   every stream line of the trace counted (collectives included)
  vs_tp1           this step / the TP=1 step of the same preset and batch
  greedy           with --greedy-check: greedy tokens of a few prompts (bf16, random
                   weights) against TP=1's, compared while TP=1's top-2 margin is clear

`--tp` takes sizes N with optional flags: `N:unfused` (HYBRID_JAX_FUSE_PROJECTIONS=0: the
tensor-parallel step as it was before it fused each device's local model, the A/B),
`1:sharded` (HYBRID_JAX_SHARDED_RUNNER=1: the tensor-parallel step on a one-device mesh),
`N:local` (one device running the local model of TP = N alone: a device's share of the
TP = N step without its collectives, measurable on one GPU). One model is
loaded per preset and serves every variant. Prints one JSON line per (preset, tp,
batch); `--out FILE` appends them. The issue's target: TP=2 decode step <= 0.6x TP=1
for native-7b-parallel at batch 64.

  PYTHONPATH=. python benchmarks/tensor_parallel.py --tp 1 2 2:unfused --batch 64 \\
      --presets native-7b-parallel --greedy-check --out tp.jsonl

The reference workload's model, its decode step traced kernel by kernel at TP = 1 and 2:

  PYTHONPATH=. python benchmarks/tensor_parallel.py --presets qwen3.5-35b-a3b --quantization fp8 \\
      --tp 1 2 --batch 16 64 --context 4400 --steps 10 --trace-steps 3 --chunk 8192 --out tp35.jsonl
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.arch_figures import measure_decode
from hybrid_jax import tensor_parallel as tp
from hybrid_jax.loading import DTYPES, LoadedModel, load_model
from hybrid_jax.model import CausalLM
from hybrid_jax.quantization import on_accelerator
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.common import emit
from serving.entrypoints.bench.floor import copy_bandwidth, decode_floor_bytes, measured_touched_experts
from serving.entrypoints.bench.probe import decoding_batch
from serving.entrypoints.bench.trace_report import trace_calls
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams

# XLA names the kernel of an all-reduce it runs itself (not through NCCL) after the HLO op:
# shard_map's psum becomes `psum_<id>_0_fusion...` (2 x H200, jax 0.11.2: 56 of them a
# native-7b-parallel step, on streams of their own, none named nccl).
COLLECTIVE = ("nccl", "all-reduce", "allreduce", "all_reduce", "all-gather", "allgather", "all_gather",
              "psum")


def trace_steps(engine: LLMEngine, steps: int, top: int = 12) -> dict[str, dict]:
    """GPU kernel ms per step, per device plane: {'/device:GPU:0': {'kernel_ms',
    'collective_ms', 'lines': {line: ms}, 'line_kernels': {line: [[name, ms], ...]} (each
    line's top 3), 'top_kernels': [[name, ms, calls], ...]}}. Every
    line of the plane but XLA's per-op / per-module summaries counts (collectives run on
    streams of their own: `gpu_kernel_events` keeps only lines named 'Stream #...')."""
    from jax.profiler import ProfileData

    d = trace_calls(engine.step, steps + 1)  # the last dispatched step resolves in the extra call
    path = next(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".xplane.pb"))
    res = {}
    for plane in ProfileData.from_file(path).planes:
        if "GPU" not in plane.name:
            continue
        lines: dict[str, float] = collections.defaultdict(float)
        kernels: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
        per_line: dict = collections.defaultdict(lambda: collections.defaultdict(float))
        total = coll = 0.0
        for line in plane.lines:
            if line.name.startswith("XLA") or "launch" in line.name.lower():
                continue
            for ev in line.events:
                if "memcpy" in ev.name.lower():
                    continue
                ms = ev.duration_ns / 1e6 / (steps + 1)  # steps + 1 dispatches were traced
                total += ms
                lines[line.name[:40]] += ms
                per_line[line.name[:40]][ev.name[:60]] += ms
                if any(c in ev.name.lower() for c in COLLECTIVE):
                    coll += ms
                k = kernels[ev.name[:80]]
                k[0] += ms
                k[1] += 1 / (steps + 1)
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        res[plane.name] = {"kernel_ms": total, "collective_ms": coll,
                           "lines": {k: round(v, 4) for k, v in lines.items()},
                           "line_kernels": {k: [[n, round(ms, 4)] for n, ms in sorted(
                               v.items(), key=lambda kv: -kv[1])[:3]] for k, v in per_line.items()},
                           "top_kernels": [[n, round(ms, 4), round(c, 1)] for n, (ms, c) in ranked]}
    return res


PROMPT_LEN, GREEDY_TOKENS = 40, 24


def greedy(engine: LLMEngine, vocab: int) -> list:
    """Greedy tokens and top-2 logprobs of 8 prompts (random tokens, fixed seed)."""
    rng = np.random.default_rng(5)
    ps = [rng.integers(0, vocab, PROMPT_LEN).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.logprobs) for o in LLM.from_engine(engine).generate(
        prompt_token_ids=ps, sampling_params=params)]


def compare_greedy(ref: list, out: list, margin: float = 0.05) -> dict:
    """Tokens compared while the reference's top-2 margin exceeds `margin` (bf16 sums in
    another order may rightly part at a near tie): compared, equal, first mismatch."""
    compared = equal = 0
    first = None
    for i, ((rt, rl), (ot, _)) in enumerate(zip(ref, out, strict=True)):
        for j, (a, b, lp) in enumerate(zip(rt, ot, rl, strict=True)):
            top = sorted(lp.values(), reverse=True)
            if top[0] - top[1] <= margin:
                break
            compared += 1
            if a != b:
                first = first or [i, j]
                break
            equal += 1
    return {"compared": compared, "equal": equal, "first_mismatch": first}


FLAGS = {"unfused": ("HYBRID_JAX_FUSE_PROJECTIONS", "0"), "sharded": ("HYBRID_JAX_SHARDED_RUNNER", "1")}


def variant(spec: str) -> tuple[int, set[str]]:
    """'2' -> (2, {}); '2:unfused' -> (2, {'unfused'}); flags (module doc): unfused,
    sharded, local."""
    n, *flags = spec.split(":")
    bad = set(flags) - {*FLAGS, "local"}
    if bad:
        raise ValueError(f"--tp {spec!r}: unknown {sorted(bad)}, expected N[:unfused][:sharded][:local]")
    return int(n), set(flags)


def run_variant(name: str, lm, spec: str, a: argparse.Namespace, bw: float, base: dict) -> None:
    n, flags = variant(spec)
    saved = {k: os.environ.get(k) for k, _ in FLAGS.values()}
    for f in flags & set(FLAGS):
        os.environ[FLAGS[f][0]] = FLAGS[f][1]
    try:
        if "local" in flags:  # device d's work at TP = n, alone on one device (no collectives)
            cfg = tp.local_config(lm.config, n)
            model = CausalLM(cfg, dtype=DTYPES[a.dtype], rngs=nnx.Rngs(1))
            _run(name, LoadedModel(model, cfg, None, name), spec, 1, a, bw, base)
        else:
            _run(name, lm, spec, n, a, bw, base)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gc.collect()


def _run(name: str, lm, spec: str, n: int, a: argparse.Namespace, bw: float, base: dict) -> None:
    big = max(a.batch)
    cfg = EngineConfig(max_num_seqs=big, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=a.context + a.steps + 128, dtype=a.dtype,
                       memory_fraction=a.memory_fraction,
                       seq_buckets=tuple(sorted({*a.batch, 8})), token_buckets=(a.chunk,),
                       tensor_parallel_size=n, quantization=a.quantization)
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    per_device = engine.runner.param_bytes_per_device
    # FP8 experts: one byte a weight plus an f32 scale per 128 x 128 block (quantize-at-load's)
    itemsize = 1 + 4 / 128**2 if a.quantization == "fp8" else None
    local = tp.local_config(lm.config, n)
    check = {}
    if a.greedy_check and "local" not in spec:  # a local model has other weights
        got = greedy(engine, lm.config.vocab_size)
        if (name, "greedy") in base:
            check = compare_greedy(base[(name, "greedy")], got)
        else:
            base[(name, "greedy")] = got
    for b in sorted(a.batch, reverse=True):
        step_s, ran, seqs = measure_decode(engine, b, a.context, a.steps)
        # A mixture of experts: the experts these steps touched, from the model's routing
        # where the model is on an accelerator (a full forward of a host copy would take
        # minutes); else uniform routing's (floor.touched_experts: it flatters the step).
        touched = (measured_touched_experts(lm.model, seqs, a.steps)
                   if local.moe is not None and on_accelerator(jax.tree.leaves(nnx.state(lm.model))[0])
                   else None)
        fb = decode_floor_bytes(local, batch=ran, context=a.context + a.steps // 2,
                                weight_bytes=per_device, dtype=a.dtype, expert_itemsize=itemsize,
                                touched=touched)
        prof = _traced(engine, b, a) if a.trace_steps else {}
        row = {"model": name, "tp": spec, "batch_run": ran, "context": a.context, "dtype": a.dtype,
               "device": str(jax.devices()[0]), "devices": n, "date": time.strftime("%Y-%m-%d"),
               "startup_s": round(startup, 1), "param_bytes_per_device": per_device,
               "step_ms": 1e3 * step_s, "tok_s": ran / step_s, "floor_ms": 1e3 * fb["total"] / bw,
               "floor_bytes_per_device": fb, "over_floor": step_s / (fb["total"] / bw),
               "copy_TBps": bw / 1e12, "profile": prof, "greedy_vs_first": check,
               "touched_experts": touched}
        if (name, 1, b) in base:
            row["vs_tp1"] = step_s / base[(name, 1, b)]
        elif n == 1:
            base[(name, 1, b)] = step_s
        emit(a.out, row)
    del engine


def _traced(engine: LLMEngine, batch: int, a: argparse.Namespace) -> dict:
    """Profile a few full-batch decode steps (prefilled first, as in measure_decode)."""
    with decoding_batch(engine, batch, a.context, max_tokens=a.trace_steps + 64, seed=3):
        return trace_steps(engine, a.trace_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["native-1b-parallel", "native-7b-parallel"])
    p.add_argument("--tp", nargs="+", default=["1", "2"], help="sizes, or N:unfused (module doc)")
    p.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunk", type=int, default=4096,
                   help="tokens per prefill step (large: the whole batch must reach decode "
                        "before its first sequences finish)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--memory-fraction", type=float, default=0.85,
                   help="the engine's memory plan (lower leaves the compiler room for a model that fills "
                        "the device: qwen3.5-35b-a3b FP8 on one 80 GB GPU needs ~0.7)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="FP8 weights at load (the reference workload's qwen3.5-35b-a3b: "
                        "--presets qwen3.5-35b-a3b --quantization fp8 --batch 16 64 --context 4400)")
    p.add_argument("--trace-steps", type=int, default=5, help="steps profiled (0: no profile)")
    p.add_argument("--greedy-check", action="store_true",
                   help="greedy tokens of each variant against the first (module doc)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_bandwidth()
    base: dict = {}
    for name in a.presets:
        # One model serves every variant: on the first device, whence each tensor-parallel
        # runner copies each device's shard (a model larger than one device: load on the host).
        lm = load_model(name, dtype=a.dtype, quantization=a.quantization)
        for spec in a.tp:
            n, flags = variant(spec)
            if "local" not in flags and n > len(jax.local_devices()):
                have = len(jax.local_devices())
                print(json.dumps({"model": name, "tp": spec, "skipped": f"{have} devices"}))
                continue
            run_variant(name, lm, spec, a, bw, base)
        del lm

if __name__ == "__main__":
    main()
