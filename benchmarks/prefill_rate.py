"""Prefill throughput of the engine against the measured bf16 matmul ceiling.

Submits R requests of P prompt tokens with a prefill chunk of C tokens per step
(max_num_batched_tokens = C), times the steps in which only prefill chunks run, and
reports tokens/s and model FLOPs/s over the rate of a large bf16 matmul measured in
the same process. Model FLOPs per token: 2 x (parameters touched per token: every
weight but the embedding table; the tied head counts once) + attention 4 x heads x
head_dim x keys in the window + SSD 2 x 3 x heads x head_dim x state (per token,
chunked form counted at its matmul size) -- written out in
`serving.entrypoints.bench.floor.model_flops`.

  PYTHONPATH=. python benchmarks/prefill_rate.py --prompt-len 8192 --chunk 8192 --requests 4 [--trace]
  PYTHONPATH=. python benchmarks/prefill_rate.py --prompt-len 8192 --chunk 8192 --requests 12 --overlap
  HYBRID_JAX_FP8_GEMM=1 PYTHONPATH=. python benchmarks/prefill_rate.py --quantization fp8 ...

Each step is timed alone by default (the step ends when its caches are ready): the host's
scheduling of the next chunk then adds to every step. `--overlap` times the steady steps
back to back instead, as the engine serves them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

from configs import switches
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.common import emit
from serving.entrypoints.bench.floor import matmul_rate, model_flops
from serving.entrypoints.bench.trace_report import kernel_totals
from serving.sample.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="EngineConfig.quantization (fp8: FP8 decoder weights; prefill products take "
                        "the block-scaled FP8 GEMM with HYBRID_JAX_FP8_GEMM=1)")
    p.add_argument("--out", default=None)
    p.add_argument("--trace", action="store_true",
                   help="also trace one steady prefill step (not timed): GPU time per kernel")
    p.add_argument("--dump", default=None, help="write the prefill executable's optimised HLO here")
    p.add_argument("--overlap", action="store_true",
                   help="time the steady steps back to back (as served: the host's work for the next "
                        "step overlaps the device), not each step alone; needs >= 6 steps")
    a = p.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    cfg = EngineConfig(max_num_seqs=a.requests, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=a.prompt_len + 8, dtype=a.dtype, memory_fraction=0.8,
                       seq_buckets=(a.requests,), token_buckets=(a.chunk,), quantization=a.quantization)
    engine = LLMEngine(lm, cfg, show_progress=False)
    rng = np.random.default_rng(0)
    for _ in range(a.requests):
        engine.add_request(prompt_token_ids=rng.integers(3, lm.config.vocab_size, a.prompt_len).tolist(),
                           params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    times = []
    trace_dir = tempfile.mkdtemp() if a.trace else None
    traced = 2  # with --trace: the step traced (a steady prefill chunk), left out of the timing
    steps_per_prompt = -(-a.prompt_len // a.chunk)
    total_steps = a.requests * steps_per_prompt
    overlapped = None
    while engine.has_unfinished():
        if trace_dir and len(times) == traced:
            jax.profiler.start_trace(trace_dir)
        if a.overlap and len(times) == traced + 1 and total_steps - len(times) > 3:
            # Steps back to back, as a server runs them: the host's work for the next step
            # overlaps this one's kernels (the overlapped loop). The last chunks are left out.
            n = total_steps - len(times) - 2
            t = time.perf_counter()
            for _ in range(n):
                engine.step()
            jax.block_until_ready(engine.runner.caches)
            overlapped = (time.perf_counter() - t) / n
            times += [overlapped] * n
            continue
        t = time.perf_counter()
        engine.step()
        jax.block_until_ready(engine.runner.caches)
        times.append(time.perf_counter() - t)
        if trace_dir and len(times) == traced + 1:
            jax.profiler.stop_trace()
    steady = [t for i, t in enumerate(times) if 0 < i < len(times) - 1 and not (trace_dir and i == traced)]
    steady = steady or times
    step_s = overlapped if overlapped is not None else statistics.median(steady)
    # Steps timed alone before the back-to-back run (the warm-up step 0 and the traced one out).
    alone = [t for i, t in enumerate(times[:traced + 1]) if i > 0 and not (trace_dir and i == traced)]
    tok_s = a.chunk / step_s
    rate = matmul_rate()
    flops = model_flops(engine, a.prompt_len // 2) * tok_s
    res = {"model": a.model, "quantization": a.quantization, "fp8_gemm": switches.fp8_gemm(),
           "chunk_tokens": a.chunk, "requests": a.requests, "prompt_len": a.prompt_len,
           "device": str(jax.devices()[0]), "step_ms": 1e3 * step_s, "prefill_tok_s": tok_s,
           "model_TFLOPs": flops / 1e12, "matmul_TFLOPs": rate / 1e12, "fraction_of_ceiling": flops / rate,
           "steps": len(times), "timing": "overlapped" if overlapped is not None else "synchronous",
           "synchronous_step_ms": 1e3 * statistics.median(alone) if alone else None}
    if trace_dir and len(times) > traced:
        res["top_kernels"] = kernel_totals(trace_dir, steps=1)
    if a.dump:  # the prefill executable's optimised HLO (what each fusion in the trace is)
        exe = next(e for b, e in engine.runner.compiled.items() if not b.decode)
        with open(a.dump, "w") as f:
            f.write(exe.as_text())
    emit(a.out, res)


if __name__ == "__main__":
    main()
