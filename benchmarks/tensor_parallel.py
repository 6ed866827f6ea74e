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
  vs_tp1           this step / the TP=1 step of the same preset and batch

Prints one JSON line per (preset, tp, batch); `--out FILE` appends them. The issue's
target: TP=2 decode step <= 0.6x TP=1 for native-7b-parallel at batch 64.

  PYTHONPATH=. python benchmarks/tensor_parallel.py --tp 1 2 --batch 64 256 \\
      --presets native-1b-parallel native-7b-parallel --out tp.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import jax

from benchmarks.arch_figures import measure_decode
from hybrid_jax import tensor_parallel as tp
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.common import emit
from serving.entrypoints.bench.floor import copy_bandwidth, decode_floor_bytes
from serving.entrypoints.bench.probe import decoding_batch
from serving.entrypoints.bench.trace_report import gpu_kernel_events, trace_calls

COLLECTIVE = ("nccl", "all-reduce", "allreduce", "all_reduce", "all-gather", "allgather", "all_gather")


def trace_steps(engine: LLMEngine, steps: int) -> dict[str, dict[str, float]]:
    """GPU kernel ms per step, per device plane: {'/device:GPU:0': {'kernel_ms', 'collective_ms'}}."""
    d = trace_calls(engine.step, steps + 1)  # the last dispatched step resolves in the extra call
    out: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"kernel_ms": 0.0, "collective_ms": 0.0})
    for plane, ev in gpu_kernel_events(d):
        ms = ev.duration_ns / 1e6 / (steps + 1)  # steps + 1 dispatches were traced
        out[plane]["kernel_ms"] += ms
        if any(c in ev.name.lower() for c in COLLECTIVE):
            out[plane]["collective_ms"] += ms
    return dict(out)


def run_preset(name: str, n: int, a: argparse.Namespace, bw: float, base_steps: dict) -> None:
    lm = load_model(name, dtype=a.dtype, device=tp.host_device() if n > 1 else None)
    big = max(a.batch)
    cfg = EngineConfig(max_num_seqs=big, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk,
                       max_model_len=a.context + a.steps + 128, dtype=a.dtype, memory_fraction=0.85,
                       seq_buckets=tuple(sorted(set(a.batch))), token_buckets=(a.chunk,),
                       tensor_parallel_size=n)
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    per_device = engine.runner.param_bytes_per_device
    local = tp.local_config(lm.config, n)
    for b in sorted(a.batch, reverse=True):
        step_s, ran = measure_decode(engine, b, a.context, a.steps)
        fb = decode_floor_bytes(local, batch=ran, context=a.context + a.steps // 2,
                                weight_bytes=per_device, dtype=a.dtype)
        prof = {}
        if a.trace_steps:
            prof = _traced(engine, b, a)
        row = {"model": name, "tp": n, "batch_run": ran, "context": a.context, "dtype": a.dtype,
               "device": str(jax.devices()[0]), "devices": n, "date": time.strftime("%Y-%m-%d"),
               "startup_s": round(startup, 1), "param_bytes_per_device": per_device,
               "step_ms": 1e3 * step_s, "tok_s": ran / step_s, "floor_ms": 1e3 * fb["total"] / bw,
               "floor_bytes_per_device": fb, "over_floor": step_s / (fb["total"] / bw),
               "copy_TBps": bw / 1e12, "profile": prof}
        base_steps[(name, n, b)] = step_s
        if (name, 1, b) in base_steps:
            row["vs_tp1"] = step_s / base_steps[(name, 1, b)]
        emit(a.out, row)
    del engine


def _traced(engine: LLMEngine, batch: int, a: argparse.Namespace) -> dict:
    """Profile a few full-batch decode steps (prefilled first, as in measure_decode)."""
    with decoding_batch(engine, batch, a.context, max_tokens=a.trace_steps + 64, seed=3):
        return trace_steps(engine, a.trace_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["native-1b-parallel", "native-7b-parallel"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunk", type=int, default=4096,
                   help="tokens per prefill step (large: the whole batch must reach decode "
                        "before its first sequences finish)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--trace-steps", type=int, default=5, help="steps profiled (0: no profile)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_bandwidth()
    base: dict = {}
    for name in a.presets:
        for n in sorted(a.tp):
            if n > len(jax.local_devices()):
                print(json.dumps({"model": name, "tp": n, "skipped": f"{len(jax.local_devices())} devices"}))
                continue
            run_preset(name, n, a, bw, base)


if __name__ == "__main__":
    main()
