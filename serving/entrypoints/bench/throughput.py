"""`hybrid-jax bench throughput`: offline, N requests through the Python API (`LLM.generate`).

Input and output lengths are fixed or sampled; outputs run to their length (EOS
ignored). Reports requests/s, output tokens/s and total (prompt + output) tokens/s
over the wall time of `generate`, plus the lengths actually run and the engine's
planned batch (max_num_seqs after the memory plan).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from serving.entrypoints.bench import common, plots
from serving.entrypoints.bench.probe import StepTracer, trace_scopes


def run(args: argparse.Namespace, out: Path) -> dict:
    from serving.entrypoints.bench.engine_setup import build_engine, load, smoke_buckets
    from serving.entrypoints.llm import LLM
    from serving.sample.sampling_params import SamplingParams

    if args.smoke:
        args.num_requests, args.input_len, args.output_len = 6, 24, 6
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    rng = np.random.default_rng(args.seed)
    ins = common.LengthDist(args.input_len, args.len_dist, args.range_ratio).sample(args.num_requests, rng)
    outs = common.LengthDist(args.output_len, args.len_dist, args.range_ratio).sample(args.num_requests, rng)
    lm, weight_bytes = load(args.model, args.dtype, args.seed)
    longest = max(a + b for a, b in zip(ins, outs, strict=True))
    engine = build_engine(lm, args, max_model_len=max(longest, args.max_model_len or 0),
                          **smoke_buckets(args))
    prompts = common.random_prompts(ins, lm.config.vocab_size, rng)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    llm = LLM.from_engine(engine)
    tracer = StepTracer(args.profile)
    with trace_scopes(engine) as scopes:
        tracer.start()
        t0 = time.perf_counter()
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
        tracer.stop()
    got_out = [len(r.token_ids) for r in results]
    stats = engine.stats()
    res = {
        "mode": "throughput", "model": args.model, "dtype": args.dtype, **common.environment(),
        "num_requests": args.num_requests, "len_dist": args.len_dist, "range_ratio": args.range_ratio,
        "input_lens": ins, "output_lens": got_out, "output_lens_requested": outs,
        "max_num_seqs": stats["slots_total"], "weight_bytes": weight_bytes,
        "kv_bytes": stats["kv_bytes"], "state_bytes": stats["state_bytes"],
        "elapsed_s": elapsed, "requests_per_s": len(results) / elapsed,
        "output_tok_s": sum(got_out) / elapsed, "total_tok_s": (sum(ins) + sum(got_out)) / elapsed,
        "profile": {"dir": args.profile, "scopes": scopes} if args.profile else None,
    }
    common.write_json(out, "throughput", res)
    plots.throughput(res, out / "throughput.png")
    return res
