"""`hybrid-jax bench MODE`: benchmarks that write OUT/MODE.json and OUT/MODE.png.

  throughput  offline: N requests through the Python API; tokens/s and requests/s
  serving     a gRPC load generator (Poisson rate or fixed concurrency) against
              `hybrid-jax serve` (--server, or a child process it starts and stops);
              TTFT, TPOT, ITL, E2E percentiles, failures by code
  scaling     decode step, tokens/s and memory vs context, a hybrid against its
              full-attention baseline, at several batches; largest batch that fits
  sweep       window x SSM state size x short/long prompts of a native hybrid, with
              the check that KV pages in use equal a pure sliding-window model's need

`--smoke` runs a mode on a tiny preset in seconds (CPU); `--profile DIR` writes a
jax.profiler trace with named scopes. Decode figures come only from steps in which
the whole batch decodes, and every figure records the batch actually run. See
docs/benchmarks.md for commands and results. The engine is driven only through its
public API (LLM, LLMEngine.add_request/step/stats, the gRPC server and client).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from serving.entrypoints.bench.args import MODES, add_args

__all__ = ["MODES", "add_args", "main"]


def main(args: argparse.Namespace) -> int:
    import importlib

    from serving.entrypoints.request_log import OwnLevelFilter

    root = logging.getLogger()
    if not root.handlers:  # (a caller that set up logging keeps its own)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        root.handlers[0].addFilter(OwnLevelFilter(logging.INFO))  # others' INFO lines are internals
    args.model = args.model or ("native-tiny" if args.smoke else "native-1b-parallel")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    if args.smoke:  # one engine shape for all modes, so a compilation cache serves the later ones
        args.page_size, args.max_num_seqs, args.max_num_batched_tokens = 8, 4, 32
        args.max_prefill_chunk, args.max_model_len = 32, 128
    if args.mode in ("throughput", "serving"):
        args.max_prefill_chunk = args.max_prefill_chunk or 512
    elif args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} applies to the throughput and "
                         f"serving modes, not {args.mode}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} must be >= 1")
    out = Path(args.out)
    # Only the chosen mode is imported: serving pulls in gRPC, the others JAX and the engine.
    module = {"throughput": "throughput", "serving": "serving_mode", "scaling": "scaling", "sweep": "sweep"}
    res = importlib.import_module(f"serving.entrypoints.bench.{module[args.mode]}").run(args, out)
    print(f"wrote {out / (args.mode + '.json')} and {out / (args.mode + '.png')}")
    _print_summary(res)
    return 0


def _print_summary(res: dict) -> None:
    if res.get("note"):
        print(f"note: {res['note']}")
    keys = ("requests_per_s", "output_tok_s", "peak_output_tok_s", "total_tok_s", "sent", "completed",
            "failures_by_code",
            "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "all_pages_match")
    for k in keys:
        if k in res:
            print(f"{k:>18}: {res[k]}")
    for p in res.get("points", []):
        print(f"  {p['model']:>28} b={p['batch']:<4} ctx={p['context']:<8} step {p['step_ms_median']:.2f} ms "
              f"({p['decode_tok_s']:.0f} tok/s), floor {p['floor_ms']:.2f} ms ({p['gap_x']:.2f}x)")
    for s in res.get("skipped", []):
        print(f"  skipped {s['model']} b={s['batch']} ctx={s['context']}: {s['reason']}")
