"""What a prompt costs the decodes that share its step: decode-only vs mixed steps, by kernel.

A batch of B sequences decodes at context C; then, one step at a time, a new request with
a P-token prompt (max_tokens 1) joins, so that step carries the B decodes plus the whole
prompt. For each P the script reports the step's wall time (median over --reps, the
synchronous loop so a step's time is its own), the bucket the runner picked, and, from a
jax.profiler trace of one such step, GPU kernel time by kernel family against the
decode-only step's: where the extra time of a mixed step goes.

  PYTHONPATH=. python benchmarks/mixed_step.py --batch 32 --context 512 --prompts 16,128,512,2048
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jax
import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.probe import decoding_batch
from serving.entrypoints.bench.trace_report import gpu_kernel_events, kernel_family, trace_calls
from serving.sample.sampling_params import SamplingParams


def kernels(fn, n: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(kernel ms per call, {family: (ms per call, launches per call)}) of fn under a trace."""
    d = trace_calls(fn, n)
    by: dict[str, list[float]] = collections.defaultdict(list)
    for _, ev in gpu_kernel_events(d):
        by[kernel_family(ev.name[:90])].append(ev.duration_ns / 1e6)
    fams = {k: (sum(v) / n, len(v) / n) for k, v in by.items()}
    return sum(ms for ms, _ in fams.values()), fams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prompts", default="16,128,512,2048")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-chunk", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="kernel families printed per prompt length")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    lm = load_model(a.model, dtype=a.dtype)
    chunk = a.max_prefill_chunk or a.max_num_batched_tokens
    steps = 64 + (len(prompts) + 1) * (a.reps + 4)
    cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                       compile_in_background=False,  # all executables built before timing
                       max_prefill_chunk=chunk, max_model_len=max(a.context, max(prompts)) + steps + 64,
                       page_size=16, dtype=a.dtype, memory_fraction=0.85, async_scheduling=False)
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    runner = engine.runner
    picked: list[tuple[int, int, bool]] = []
    orig = runner.dispatch

    def spy(arrays, sampling, *args, **kwargs):
        b = runner.pick(arrays)
        picked.append((b.tokens, b.seqs, b.decode))
        return orig(arrays, sampling, *args, **kwargs)

    runner.dispatch = spy
    rng = np.random.default_rng(1)
    vocab = lm.config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    with decoding_batch(engine, a.batch, a.context, max_tokens=steps):
        times = []
        for _ in range(8):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        base_ms, base = kernels(engine.step, 4)
        picked.clear()
        engine.step()
        rows.append({"prompt": 0, "bucket": picked[-1], "step_ms": 1e3 * statistics.median(times),
                     "kernel_ms": base_ms, "families": base})
        for plen in prompts:
            times = []
            for _ in range(a.reps + 1):
                engine.add_request(prompt_token_ids=rng.integers(3, vocab, plen).tolist(), params=one)
                picked.clear()
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
                bucket = picked[0]
            engine.add_request(prompt_token_ids=rng.integers(3, vocab, plen).tolist(), params=one)
            ms, fams = kernels(engine.step, 1)
            rows.append({"prompt": plen, "bucket": bucket, "step_ms": 1e3 * statistics.median(times[1:]),
                         "kernel_ms": ms, "families": fams})
    runner.dispatch = orig
    print(f"{a.model} {a.dtype} B={a.batch} context={a.context} {jax.devices()[0]} startup {startup:.1f} s")
    print(f"{'prompt':>7} {'bucket(t,b,dec)':>18} {'step ms':>8} {'kernel ms':>9} {'extra':>7}")
    for r in rows:
        print(f"{r['prompt']:>7} {str(r['bucket']):>18} {r['step_ms']:8.2f} {r['kernel_ms']:9.2f} "
              f"{r['kernel_ms'] - base_ms:7.2f}")
    for r in rows[1:]:
        delta = {k: v[0] - base.get(k, (0.0, 0))[0] for k, v in r["families"].items()}
        top = sorted(delta.items(), key=lambda kv: -kv[1])[:a.top]
        print(f"prompt {r['prompt']}: extra kernel ms by family (launches per step)")
        for k, ms in top:
            print(f"   {ms:7.3f}  x{r['families'][k][1]:<5.0f} {k}")
    print("decode-only step: kernel ms by family")
    for k, (ms, n) in sorted(base.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"   {ms:7.3f}  x{n:<5.0f} {k}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "device": str(jax.devices()[0]), "startup_s": startup,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
