"""End-to-end engine benchmark: start-up compile, prefill and decode throughput, TTFT.

Runs a batch of identical-length random requests through `LLMEngine` (continuous
batching, chunked prefill, paged SWA KV, slot-indexed state, on-device sampling)
and times every step with a device sync (the step returns host tokens). Prints a
table; `--out FILE` writes JSON; `--trace DIR` records a jax.profiler trace of a
few decode steps. Measure on the GPU: CPU timings mean nothing.

  PYTHONPATH=. python benchmarks/bench_engine.py --model native-1b-parallel \
      --dtype bfloat16 --batch 64 --prompt-len 512 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--chunk", type=int, default=256, help="tokens per step (one bucket)")
    p.add_argument("--trace", default=None, help="write a jax.profiler trace here")
    p.add_argument("--out", default=None, help="write JSON results here")
    return p.parse_args()


def main() -> None:
    a = parse()
    t0 = time.perf_counter()
    lm = load_model(a.model, dtype=a.dtype)
    cfg = EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(a.chunk, a.batch),
                       max_prefill_chunk=a.chunk, max_model_len=a.prompt_len + a.output_len,
                       page_size=16, dtype=a.dtype, memory_fraction=0.8,
                       seq_buckets=(a.batch,), token_buckets=(max(a.chunk, a.batch),))
    engine = LLMEngine(lm, cfg)
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    t_submit = time.perf_counter()
    for _ in range(a.batch):
        engine.add_request(prompt_token_ids=rng.integers(3, lm.config.vocab_size, a.prompt_len).tolist(),
                           params=params)
    first_token: dict[str, float] = {}
    prefill_s, decode_s, decode_steps, decode_tokens = 0.0, [], 0, 0
    traced = False
    while engine.has_unfinished():
        decode = len(first_token) == a.batch
        if decode and a.trace and not traced and decode_steps == 8:
            jax.profiler.start_trace(a.trace)
            traced = True
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        if traced and decode_steps == 16:
            jax.profiler.stop_trace()
        for d in deltas:
            first_token.setdefault(d.request_id, time.perf_counter() - t_submit)
        if decode:
            decode_s.append(dt)
            decode_steps += 1
            decode_tokens += len(deltas)
        else:
            prefill_s += dt
    stats = engine.stats()
    med = statistics.median(decode_s)
    res = {
        "model": a.model, "dtype": a.dtype, "batch": a.batch, "prompt_len": a.prompt_len,
        "output_len": a.output_len, "chunk": a.chunk, "device": str(jax.devices()[0]),
        "startup_s": round(startup, 1), "buckets": len(engine.runner.buckets),
        "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(a.batch * a.prompt_len / prefill_s),
        "decode_step_median_ms": round(1e3 * med, 3),
        "decode_tok_s": round(a.batch / med),
        "decode_tokens": decode_tokens,
        "ttft_median_s": round(statistics.median(first_token.values()), 3),
        "kv_MiB": round(stats["kv_bytes"] / 2**20), "state_MiB": round(stats["state_bytes"] / 2**20),
        "preemptions": stats["num_preemptions"],
    }
    for k, v in res.items():
        print(f"{k:>24}: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
