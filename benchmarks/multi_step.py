"""Multi-step decoding at small batches: engine time per decode step, against the byte floor.

For each `--k` (num_scheduler_steps; 1 = off) an engine fills a batch of B sequences with
prompts of length P, runs until every sequence decodes, then times `LLMEngine.step()`
over calls in which the WHOLE batch decodes (a multi-step call for k > 1, checked) and
reports the wall time per decode step: the measured window's seconds over the tokens
each sequence gained. The floor is step_anatomy's (weights + in-window K/V + recurrent
state read and written, over the copy bandwidth measured in this process) at the
measured steps' real contexts. Every request then runs to max_tokens, and
`tokens_digest` hashes all output tokens: greedy runs with different k must agree.

  PYTHONPATH=. python benchmarks/multi_step.py --batch 1 --prompt-len 2000 --k 1 8
  PYTHONPATH=. python benchmarks/multi_step.py --batch 1 --k 1 8 --quantization fp8   # FP8 weights
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time

import jax
import numpy as np

from benchmarks.step_anatomy import timed
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine, freeze_heap
from serving.entrypoints.bench.floor import copy_bandwidth, engine_floor_bytes
from serving.sample.sampling_params import SamplingParams


def measure(lm, a: argparse.Namespace, k: int, bw: float) -> dict:
    rows = max(a.batch, a.seq_bucket)
    # Output tokens per request, the same for every k. Sequences admitted first decode while
    # later ones prefill: room for that lead too, so none finishes inside the window.
    total = a.warm + a.tokens + 2 * max(a.k) + 8 + 2 * -(-a.batch * a.prompt_len // a.chunk)
    cfg = EngineConfig(max_num_seqs=rows, max_num_batched_tokens=max(a.chunk, rows),
                       compile_in_background=False,  # all executables built before timing
                       max_prefill_chunk=a.chunk, max_model_len=a.prompt_len + total + 8,
                       page_size=16, dtype=a.dtype, memory_fraction=a.memory_fraction,
                       seq_buckets=(rows,), token_buckets=(max(a.chunk, rows),),
                       num_scheduler_steps=k, multi_step_max_seqs=rows)
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    freeze_heap()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=rng.integers(3, lm.config.vocab_size, a.prompt_len).tolist(),
                              params=params) for _ in range(a.batch)]
    out: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for d in engine.step():
            out[d.request_id] += d.token_ids

    while min(len(v) for v in out.values()) < a.warm:  # prefill, then decode a while
        step()
    calls: list[tuple[int, int, np.ndarray]] = []  # (sequences, decoding, seq_lens) per call
    runner = engine.runner
    name = "multi" if k > 1 else "dispatch"
    orig = getattr(runner, name)

    def spy(arrays, *args, **kwargs):
        calls.append((len(arrays.slot_ids), int(arrays.num_decodes), arrays.seq_lens.copy()))
        return orig(arrays, *args, **kwargs)

    setattr(runner, name, spy)
    # Host time per call by part (wall): scheduling, the runner's call (padding, transfer,
    # enqueue, and for k > 1 the wait), the executable's enqueue alone, the wait for results
    # (device_get), the scheduler's update and the deltas (detokenization, stops).
    host: dict[str, float] = {}
    undo = [(engine.scheduler, "schedule"), (engine.scheduler, "update"), (engine, "_delta"),
            (jax, "device_get"), (jax, "device_put")]
    for obj, attr in undo:
        timed(obj, attr, host)
    exes = runner.multisteps if k > 1 else runner.compiled
    saved = dict(exes)
    for key, fn in saved.items():
        def wrapped(*args, _fn=fn):
            t = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                host["enqueue"] = host.get("enqueue", 0.0) + time.perf_counter() - t
        exes[key] = wrapped
    start = {i: len(v) for i, v in out.items()}
    t = time.perf_counter()
    while min(len(out[i]) - start[i] for i in ids) < a.tokens:
        if not engine.has_unfinished():
            raise RuntimeError("a sequence finished inside the measured window")
        step()
    elapsed = time.perf_counter() - t
    gained = min(len(out[i]) - start[i] for i in ids)
    runner.__dict__.pop(name, None)
    for obj, attr in undo:
        if obj is jax:  # a module attribute: put the original back
            setattr(jax, attr, getattr(jax, attr).__wrapped__)
        else:  # an instance attribute shadowing the method: drop it
            obj.__dict__.pop(attr, None)
    exes.update(saved)
    full = all(n == a.batch and (k > 1 or d == a.batch) for n, d, _ in calls)
    # Multi-step calls carry k positions per sequence: its last one is the step's context.
    lens = np.stack([x.reshape(a.batch, -1)[:, -1] if k > 1 else x for _, _, x in calls])
    fb = engine_floor_bytes(engine, lens.mean(axis=0).round().astype(np.int64))
    while engine.has_unfinished():
        step()
    digest = hashlib.sha256(json.dumps([out[i] for i in ids]).encode()).hexdigest()[:16]
    stats = engine.stats()
    ms = 1e3 * elapsed / gained
    floor_ms = 1e3 * fb["total"] / bw
    return {"model": a.model, "dtype": a.dtype, "quantization": a.quantization, "batch_run": a.batch,
            "rows": rows, "k": k,
            "context": round(float(lens.mean()), 1), "context_min": int(lens.min()),
            "context_max": int(lens.max()), "device": str(jax.devices()[0]),
            "startup_s": round(startup, 1), "calls": len(calls), "all_full_batch": full,
            "tokens_per_seq": gained, "engine_ms_per_step": ms, "tokens_per_s": a.batch * 1e3 / ms,
            "floor_ms": floor_ms, "engine_over_floor": ms / floor_ms, "copy_TBps": bw / 1e12,
            "floor_bytes": fb, "tokens_digest": digest,
            "multi_step_calls": stats.get("multi_step_calls", 0),
            "host_ms_per_call": {key: round(1e3 * v / len(calls), 3) for key, v in host.items()},
            "outputs": [out[i] for i in ids] if a.keep_tokens else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="FP8 decoder weights (load_model's quantization; issue 43's batch-1 step "
                   "without the host loop)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-bucket", type=int, default=8, help="rows of the decode bucket (>= batch)")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--warm", type=int, default=24, help="tokens per sequence before measuring")
    p.add_argument("--tokens", type=int, default=96, help="measured tokens per sequence")
    p.add_argument("--k", type=int, nargs="+", default=[1, 8], help="num_scheduler_steps values")
    p.add_argument("--memory-fraction", type=float, default=0.4)
    p.add_argument("--out", default=None)
    p.add_argument("--keep-tokens", action="store_true", help="every output token in the JSON")
    a = p.parse_args()
    lm = load_model(a.model, dtype=a.dtype, quantization=a.quantization)
    bw = copy_bandwidth()
    print("batch | k | context | engine ms/step | tok/s | floor ms | x floor | full batch | digest")
    for k in a.k:
        r = measure(lm, a, k, bw)
        gc.collect()  # the engine's pools, before the next one plans its memory
        print(f"{r['batch_run']} | {k} | {r['context']} | {r['engine_ms_per_step']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['floor_ms']:.3f} | {r['engine_over_floor']:.2f} | "
              f"{r['all_full_batch']} | {r['tokens_digest']}", flush=True)
        print("  host ms per call:", r["host_ms_per_call"], flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
