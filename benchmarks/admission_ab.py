"""TPOT tail against TTFT for admission intervals (EngineConfig.admission_interval_steps),
on one engine driven open-loop in one thread, as the server's engine loop drives it (no
RPC front: what the scheduling rule changes, not the transport).

Poisson arrivals at each rate, prompts 512 +- 50% random tokens, outputs 128 +- 50%
(greedy, EOS ignored), native-1b-parallel bf16, at most 64 sequences, 2048 tokens per
step, prefill chunk 512 (the http_vs_grpc.sh sizing); the same arrivals and prompts for
every interval (set on the scheduler between runs: one engine, one compile). `--rates`
takes "inf" for saturation (every request at once: output tokens/s). TTFT is arrival to
the first token's delta, TPOT (last - first) / (n - 1) per request, both from the step
loop's clock.

  PYTHONPATH=. python benchmarks/admission_ab.py --intervals 1,16 --rates 16,32,inf --out res.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.bench.common import emit
from serving.sample.sampling_params import SamplingParams


def run(engine: LLMEngine, rate: float, prompts: list[list[int]], outs: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = len(prompts)
    gaps = np.zeros(n) if rate == float("inf") else rng.exponential(1 / rate, n)
    arrive = np.cumsum(gaps)
    times: dict[str, list[float]] = {}
    t0, i, done = time.perf_counter(), 0, 0
    tag = f"{rate}-{engine.scheduler.config.admission_interval_steps}-"
    while done < n:
        now = time.perf_counter() - t0
        while i < n and arrive[i] <= now:
            engine.add_request(prompt_token_ids=prompts[i], request_id=f"{tag}{i}",
                               params=SamplingParams(temperature=0.0, max_tokens=outs[i], ignore_eos=True))
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrive[i] - now, 0.01)))
            continue
        deltas = engine.step()
        now = time.perf_counter() - t0
        for d in deltas:
            times.setdefault(d.request_id, []).extend([now] * len(d.token_ids))
            done += d.finished
    wall = time.perf_counter() - t0
    ttft, tpot = [], []
    for rid, ts in times.items():
        k = int(rid.rsplit("-", 1)[1])
        ttft.append(1e3 * (ts[0] - arrive[k]))
        tpot.append(1e3 * (ts[-1] - ts[0]) / (len(ts) - 1))
    pct = lambda x, q: round(float(np.percentile(x, q)), 2)  # noqa: E731
    return {"rate": rate, "admit_every": engine.scheduler.config.admission_interval_steps, "requests": n,
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
            "tpot_p99_over_p50": round(pct(tpot, 99) / pct(tpot, 50), 3),
            "output_tok_s": round(sum(outs) / wall, 1), "wall_s": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--intervals", default="1,16")
    p.add_argument("--rates", default="16,32,inf")
    p.add_argument("--num-requests", type=int, default=320)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    engine = LLMEngine(lm, EngineConfig(
        dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_prefill_chunk=a.max_prefill_chunk, memory_fraction=a.memory_fraction,
        max_model_len=a.max_model_len or 2 * (a.input_len + a.output_len), compile_in_background=False),
        show_progress=False)
    rng = np.random.default_rng(0)
    n, vocab = a.num_requests, lm.config.vocab_size
    lens = rng.integers(a.input_len // 2, a.input_len * 3 // 2 + 1, n)
    outs = [int(x) for x in rng.integers(a.output_len // 2, a.output_len * 3 // 2 + 1, n)]
    prompts = [[int(t) for t in rng.integers(1, vocab, k)] for k in lens]
    run(engine, 16.0, prompts[:16], outs[:16], seed=1)  # warm-up, not recorded
    results = []
    for rate in [float(r) for r in a.rates.split(",")]:
        for every in [int(x) for x in a.intervals.split(",")]:
            # one engine, the interval switched between runs (it only times admissions)
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                          admission_interval_steps=every)
            results.append(run(engine, rate, prompts, outs, seed=2))
            print(json.dumps(results[-1]), flush=True)
    emit(a.out, {"model": a.model, "dtype": a.dtype, "results": results})


if __name__ == "__main__":
    main()
