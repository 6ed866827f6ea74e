"""A window of whole-batch decode steps for Nsight Compute: what each kernel of the step
moves to and from DRAM where it runs in the step (not alone).

The engine fills a batch of B sequences with prompts of length P and decodes until every
sequence decodes; then `cuProfilerStart`, `--steps` engine steps, `cuProfilerStop`. Run
under ncu with profiling off at start, caches and clocks left alone, so each kernel sees
the L2 the kernels before it left (dirty lines included):

  PYTHONPATH=. ncu --profile-from-start off --cache-control none --clock-control none \\
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
      --csv --log-file /tmp/ncu.csv python benchmarks/ncu_step.py --batch 64 --prompt-len 600
  PYTHONPATH=. python benchmarks/ncu_step.py --summarize /tmp/ncu.csv

`--summarize` groups the CSV by kernel: count, time, DRAM read and written per launch.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import json

import numpy as np


def drive(a: argparse.Namespace) -> None:
    from hybrid_jax.loading import load_model
    from serving.engine import LLMEngine
    from serving.engine_config import EngineConfig
    from serving.sampling_params import SamplingParams

    lm = load_model(a.model, dtype=a.dtype)
    total = 64 + a.steps + 2 * -(-a.batch * a.prompt_len // a.chunk)
    cfg = EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(a.chunk, a.batch),
                       max_prefill_chunk=a.chunk, max_model_len=a.prompt_len + total + 8,
                       dtype=a.dtype, memory_fraction=0.4, seq_buckets=(a.batch,),
                       token_buckets=(max(a.chunk, a.batch),))
    engine = LLMEngine(lm, cfg, show_progress=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=rng.integers(3, lm.config.vocab_size, a.prompt_len).tolist(),
                              params=params) for _ in range(a.batch)]
    got = {i: 0 for i in ids}
    while min(got.values()) < 8:  # prefill, then every sequence decodes a while
        for d in engine.step():
            got[d.request_id] += len(d.token_ids)
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        start, stop = cuda.cuProfilerStart, cuda.cuProfilerStop
    except OSError:  # no driver (a CPU run of this script): nothing to profile
        start = stop = lambda: None
    start()
    for _ in range(a.steps):
        engine.step()
    stop()
    print(json.dumps({"batch": a.batch, "prompt_len": a.prompt_len, "steps": a.steps}))


def summarize(path: str) -> None:
    rows = []
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        rows.append(r)
    per = collections.defaultdict(lambda: collections.defaultdict(float))
    launches = collections.defaultdict(set)
    scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
             "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    for r in rows:
        name = r["Kernel Name"].split("(")[0][:60]
        launches[name].add(r["ID"])
        per[name][r["Metric Name"]] += float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0)
    print(f"{'kernel':60s} {'n':>5s} {'us/launch':>10s} {'MB read':>9s} {'MB written':>10s} {'TB/s':>6s}")
    for name, m in sorted(per.items(), key=lambda kv: -kv[1]["gpu__time_duration.sum"]):
        n = len(launches[name])
        us = m["gpu__time_duration.sum"] / n
        rd, wr = m["dram__bytes_read.sum"] / n, m["dram__bytes_write.sum"] / n
        print(f"{name:60s} {n:5d} {us:10.2f} {rd:9.2f} {wr:10.2f} {(rd + wr) / us if us else 0:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--summarize", default=None, help="print an ncu CSV by kernel instead")
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
    else:
        drive(a)


if __name__ == "__main__":
    main()
