"""Decode step against its byte floor and prefill tokens/s, per real-size preset (issue 16).

For each preset (random bf16 weights, f32 SSM state), one engine with sequence buckets
(1, 64) and 2048-token prefill steps measures, through `LLMEngine.step()`:

  prefill   R requests of P prompt tokens (max_tokens=1): prompt tokens / wall time of
            the steps that run them, against the model FLOPs at the bf16 matmul rate
            measured in the same process (serving.entrypoints.bench.floor.model_flops)
  decode    B = 64 and B = 1 sequences at context ~C: median `LLMEngine.step()` over
            steps in which the WHOLE batch decodes (checked on every measured step),
            against the byte floor (serving.entrypoints.bench.floor: weights + in-window K/V +
            recurrent state read and written, over the copy bandwidth measured here)

With `--long` (Gemma 3 by default), a second engine decodes one sequence at 4k and 32k
context: the sliding-window layers' cost stays flat, the global layers' grows with
their pages; the floor says by how much.

Appends one JSON line per figure to --out and prints a table row.

  PYTHONPATH=. python benchmarks/arch_figures.py --out /tmp/arch.jsonl
  PYTHONPATH=. python benchmarks/arch_figures.py --smoke   # CPU, tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.common import emit
from serving.entrypoints.bench.floor import (
    copy_bandwidth,
    decode_floor_bytes,
    matmul_rate,
    measured_touched_experts,
    model_flops,
)
from serving.entrypoints.bench.probe import decoding_batch
from serving.sample.sampling_params import SamplingParams

PRESETS = ("gemma-3-1b", "lfm2-1.2b", "granite-4.0-h-micro", "zamba2-2.7b", "nemotron-h-8b",
           "bamba-9b", "gemma-3-4b")


def _prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def measure_prefill(engine: LLMEngine, requests: int, length: int) -> float:
    """Prompt tokens per second over the steps that prefill `requests` prompts of `length`."""
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(prompt_token_ids=_prompts(rng, engine.model_config.vocab_size, 1, length)[0],
                       params=params)
    while engine.has_unfinished():  # warm-up: first calls of each executable
        engine.step()
    for p in _prompts(rng, engine.model_config.vocab_size, requests, length):
        engine.add_request(prompt_token_ids=p, params=params)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return requests * length / (time.perf_counter() - t)


def measure_decode(engine: LLMEngine, batch: int, context: int,
                   steps: int) -> tuple[float, int, list[list[int]]]:
    """(median step seconds over full-batch decode steps, batch actually run, the
    sequences' tokens after the measured steps)."""
    # Sequences admitted first decode while the last ones prefill (a step takes at most
    # max_num_batched_tokens): they must still be running when the whole batch decodes.
    fill = -(-batch * context // engine.scheduler.config.max_num_batched_tokens)
    with decoding_batch(engine, batch, context, max_tokens=steps + 64 + fill) as full:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        ok = sum(full)
        if ok != steps or len(full) != steps:
            raise RuntimeError(f"{ok} of {steps} measured steps decoded the whole batch of {batch} "
                               f"(max_num_seqs={engine.scheduler.config.max_num_seqs} after the memory plan)")
        seqs = [list(seq.token_ids) for seq in engine.scheduler.running]
    return statistics.median(times), batch, seqs


def run_preset(name: str, a: argparse.Namespace, bw: float, mm: float) -> None:
    lm = load_model(name, dtype=a.dtype)
    big = max(a.batch)
    cfg = EngineConfig(max_num_seqs=big, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=max(a.context, a.prompt_len) + a.steps + 128
                       + -(-big * a.context // a.chunk), dtype=a.dtype,
                       seq_buckets=tuple(sorted(set(a.batch))), token_buckets=(a.chunk,),
                       **({"memory_fraction": a.memory_fraction} if a.memory_fraction else {}))
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    wbytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    base = {"model": name, "dtype": a.dtype, "state_dtype": "float32", "device": str(jax.devices()[0]),
            "date": time.strftime("%Y-%m-%d"), "startup_s": round(startup, 1), "weight_bytes": wbytes,
            "copy_TBps": bw / 1e12, "matmul_TFLOPs": mm / 1e12}
    print(f"{name}: started in {startup:.1f} s; prefill", flush=True)
    rate = measure_prefill(engine, a.requests, a.prompt_len)
    flops = model_flops(engine, a.prompt_len // 2) * rate
    emit(a.out, {**base, "figure": "prefill", "requests": a.requests, "prompt_len": a.prompt_len,
                 "chunk": a.chunk, "tok_s": rate, "model_TFLOPs": flops / 1e12, "of_matmul": flops / mm})
    for b in sorted(a.batch, reverse=True):
        print(f"{name}: decode batch {b}", flush=True)
        step_s, ran, seqs = measure_decode(engine, b, a.context, a.steps)
        # A mixture of experts: the experts these steps touched, from the model's routing
        # (random-weight routers can be far from uniform: serving/entrypoints/bench/floor.py).
        moe = lm.config.moe is not None and any(s.moe for s in lm.config.layers)
        touched = measured_touched_experts(lm.model, seqs, a.steps) if moe else None
        fb = decode_floor_bytes(lm.config, batch=ran, context=a.context + a.steps // 2,
                                weight_bytes=wbytes, dtype=a.dtype, touched=touched)
        floor = fb["total"] / bw
        emit(a.out, {**base, "figure": "decode", "batch_run": ran, "context": a.context,
                     "step_ms": 1e3 * step_s, "tok_s": ran / step_s, "floor_ms": 1e3 * floor,
                     "floor_bytes": fb, "over_floor": step_s / floor, "touched_experts": touched})
    del engine
    if name.startswith("gemma") and a.long:
        longest = max(a.long)
        cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk,
                           compile_in_background=False,  # all executables built before timing
                           max_model_len=longest + a.steps + 128, dtype=a.dtype,
                           seq_buckets=(1,), token_buckets=(a.chunk,))
        engine = LLMEngine(lm, cfg, show_progress=False)
        for c in a.long:
            step_s, ran, _ = measure_decode(engine, 1, c, a.steps)
            fb = decode_floor_bytes(lm.config, batch=1, context=c + a.steps // 2, weight_bytes=wbytes,
                                    dtype=a.dtype)
            emit(a.out, {**base, "figure": "decode_long", "batch_run": ran, "context": c,
                         "step_ms": 1e3 * step_s, "floor_ms": 1e3 * fb["total"] / bw,
                         "floor_bytes": fb, "over_floor": step_s / (fb["total"] / bw)})
        del engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(PRESETS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="64,1")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--long", default="4096,32768", help="Gemma contexts for batch-1 decode ('' = none)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="EngineConfig.memory_fraction (default: the engine's): more pages and slots, "
                        "for batches the default plan cannot hold (granite-4.0-h-tiny at 256)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (native-tiny, small shapes)")
    a = p.parse_args()
    a.batch = [int(x) for x in a.batch.split(",")]
    a.long = [int(x) for x in a.long.split(",") if x]
    if a.smoke:
        a.models, a.dtype, a.batch, a.context, a.steps = "native-tiny", "float32", [4, 1], 40, 3
        a.chunk, a.requests, a.prompt_len, a.long = 64, 2, 64, []
    bw = copy_bandwidth(64 << 20 if a.smoke else 1 << 30)
    mm = matmul_rate(256 if a.smoke else 8192)
    print(f"devices {jax.devices()}  copy {bw / 1e12:.2f} TB/s  bf16 matmul {mm / 1e12:.0f} TFLOP/s",
          flush=True)
    for name in a.models.split(","):
        try:
            run_preset(name, a, bw, mm)
        except Exception as e:  # one preset's failure must not lose the others' figures
            print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
