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
    longest = max(a + b for a, b in zip(ins, outs, strict=True))
    max_len = max(longest, args.max_model_len or 0)
    if args.data_parallel_size > 1:
        if args.profile:
            raise ValueError("--profile traces one engine; it does not apply with --data-parallel-size")
        lm, weight_bytes, got_out, elapsed, stats = _data_parallel(args, ins, outs, max_len, rng)
        scopes = None
    else:
        lm, weight_bytes = load(args.model, args.dtype, args.seed)
        engine = build_engine(lm, args, max_model_len=max_len, **smoke_buckets(args))
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
        "data_parallel_size": args.data_parallel_size,
        "elapsed_s": elapsed, "requests_per_s": len(got_out) / elapsed,
        "output_tok_s": sum(got_out) / elapsed, "total_tok_s": (sum(ins) + sum(got_out)) / elapsed,
        "profile": {"dir": args.profile, "scopes": scopes} if args.profile else None,
    }
    common.write_json(out, "throughput", res)
    plots.throughput(res, out / "throughput.png")
    return res


def _data_parallel(args: argparse.Namespace, ins: list[int], outs: list[int], max_len: int, rng):
    """The requests through --data-parallel-size replicas (replica i on device i, its own
    weights loaded there), all submitted at once to a DataParallelCore (least-live routing):
    the model, its weight bytes, output lengths, wall seconds, the summed stats."""
    import jax

    from serving.engine.data_parallel import DataParallelCore, check_devices
    from serving.engine.engine_config import EngineConfig
    from serving.entrypoints.bench.engine_setup import build_engine, load, smoke_buckets
    from serving.sample.sampling_params import SamplingParams

    n = args.data_parallel_size
    check_devices(EngineConfig(data_parallel_size=n))
    engines = []
    for i in range(n):
        lm, weight_bytes = load(args.model, args.dtype, args.seed, device=jax.local_devices()[i])
        engines.append(build_engine(lm, args, max_model_len=max_len, device_offset=i, **smoke_buckets(args)))
    prompts = common.random_prompts(ins, lm.config.vocab_size, rng)
    core = DataParallelCore(engines).start()
    try:
        t0 = time.perf_counter()
        streams = [core.submit(params=SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                               prompt_token_ids=p) for p, m in zip(prompts, outs, strict=True)]
        got_out = [sum(len(d.token_ids) for d in s) for s in streams]
        elapsed = time.perf_counter() - t0
        stats = core.stats()
    finally:
        core.shutdown()
    return lm, weight_bytes, got_out, elapsed, stats
