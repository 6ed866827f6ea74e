"""The engine's host work per decode step, with the device work stubbed out.

`LLMEngine.step()` at batch B with every sequence decoding, where the compiled step and
the sampler are replaced by functions that return at once (the sampler returns
pre-made token arrays), so what is timed is the host alone: scheduling, flattening,
packing and transferring the step's inputs, updating the sequences, detokenizing and
building the deltas. This is the work that must fit under the device step for the
overlapped loop to keep the GPU busy (docs/engine.md); its absolute figures depend on
the host's CPU, so compare runs on one machine (the GPU host's own figures come from
`step_anatomy.py`'s host_ms_per_step).

    PYTHONPATH=. python benchmarks/host_step.py [--batch 64 256] [--steps 200] [--stop]
        [--profile] [--no-gc-freeze]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine, freeze_heap
from serving.runner.runner import TOP_LOGPROBS
from serving.sample.sampling_params import SamplingParams


def stub_device(engine: LLMEngine, vocab_lo: int = 3, vocab_hi: int = 200) -> None:
    """Replace the runner's executables with host-only stand-ins (rotating token arrays)."""
    runner = engine.runner
    rng = np.random.default_rng(0)
    max_seqs = runner.max_seqs
    toks = [jnp.asarray(rng.integers(vocab_lo, vocab_hi, max_seqs, dtype=np.int32)) for _ in range(8)]
    rest = {b: (jnp.zeros(b, jnp.float32), jnp.zeros((b, TOP_LOGPROBS), jnp.int32),
                jnp.zeros((b, TOP_LOGPROBS), jnp.float32)) for b in runner.samplers}
    count = iter(range(1 << 62))

    def samples(b: int):  # made beforehand: slicing a jax array here would be timed too
        return toks[next(count) % 8], *rest[b]

    def forward(bucket):  # (caches, stats, logits, plain samples[, checkpoints]); outs come last
        return lambda params, caches, stats, buf, last, *rest: (caches, stats, rest[-1][0],
                                                                 samples(bucket.seqs), *rest[:-1])

    runner.compiled = {b: forward(b) for b in runner.compiled}
    runner.samplers = {b: (lambda logits, stats, buf, _b=b: samples(_b)) for b in runner.samplers}


def measure(batch: int, steps: int, profile: bool, stop: bool, freeze: bool = True) -> dict:
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch),
                       max_model_len=4096, num_pages=batch * 6 + 32, seq_buckets=(batch,),
                       token_buckets=(batch, max(512, batch)), compilation_cache_dir=None)
    engine = LLMEngine("native-tiny", cfg, show_progress=False)
    stub_device(engine)
    if freeze:
        freeze_heap()  # as `serve` does
    params = SamplingParams(max_tokens=steps + 20, ignore_eos=True, temperature=0.0,
                            stop=("zzzz",) if stop else ())
    for i in range(batch):
        engine.add_request(prompt_token_ids=[3 + (i * 7 + j) % 50 for j in range(8)], params=params)
    for _ in range(4):  # admission and the first decodes
        engine.step()
    prof = cProfile.Profile() if profile else None
    times = []
    if prof:
        prof.enable()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    ms = np.asarray(times) * 1e3
    return {"batch": batch, "steps": steps, "stop_strings": stop, "gc_freeze": freeze,
            "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "max_ms": float(ms.max()), "us_per_seq": float(np.median(ms)) * 1e3 / batch,
            "device": str(jax.devices()[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop", action="store_true", help="every request has a stop string")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    p.add_argument("--no-gc-freeze", action="store_true", help="leave the start-up heap to the GC")
    a = p.parse_args()
    for b in a.batch:
        print(json.dumps(measure(b, a.steps, a.profile, a.stop, not a.no_gc_freeze)), flush=True)


if __name__ == "__main__":
    main()
