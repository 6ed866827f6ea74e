"""`hybrid-jax bench sweep`: window sizes x SSM state sizes x short/long prompts.

Each (window W, state size N) variant of a native preset (every attention window set
to W, the Mamba2 state size to N; random weights) gets one engine; a batch with
short prompts (below the window) and one with long prompts (past it) are prefilled
and decoded with the whole batch decoding. Reported per cell: prefill tokens/s,
decode step and tokens/s, KV and state bytes in use and reserved, and the check
that the KV pages in use (LLMEngine.stats()) equal what a pure sliding-window model
of the same windows needs for those sequences (`memory.swa_pages`, from the
definition of the window).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from hybrid_jax.config import LayerSpec, ModelConfig
from serving.entrypoints.bench import common, engine_setup, memory, plots
from serving.entrypoints.bench.probe import decode_budget, measure_decode


def variant(cfg: ModelConfig, window: int, state_size: int) -> ModelConfig:
    """`cfg` with every attention window set to `window` and the Mamba2 state size to `state_size`."""
    if cfg.mamba2 is None:
        raise ValueError(f"--model: {cfg.architecture} has no Mamba2 layers to vary the state of")
    layers = tuple(LayerSpec(s.kind, window if s.kind.has_attention else None) for s in cfg.layers)
    return dataclasses.replace(cfg, layers=layers,
                               mamba2=dataclasses.replace(cfg.mamba2, state_size=state_size))


def run(args: argparse.Namespace, out: Path) -> dict:
    from hybrid_jax.presets import load_preset

    if args.smoke:
        args.windows, args.state_sizes, args.sweep_batch, args.sweep_steps = "64,32", "16", 4, 2
        args.long_factor = 2.5
    args.max_prefill_chunk = args.max_prefill_chunk or 512
    base = load_preset(args.model)
    res = {"mode": "sweep", "model": args.model, "dtype": args.dtype, **common.environment(),
           "batch": args.sweep_batch, "page_size": args.page_size, "cells": []}
    t0 = time.perf_counter()
    for w in common.parse_ints(args.windows, "--windows"):
        for n in common.parse_ints(args.state_sizes, "--state-sizes"):
            res["cells"] += _variant_cells(variant(base, w, n), w, n, args)
            res["all_pages_match"] = all(c["pages_match"] for c in res["cells"])
            common.write_json(out, "sweep", res)  # after every variant: a killed run keeps its figures
            plots.sweep(res, out / "sweep.png")
    res["elapsed_s"] = time.perf_counter() - t0
    common.write_json(out, "sweep", res)
    return res


def _variant_cells(cfg: ModelConfig, window: int, state_size: int, args) -> list[dict]:
    lens = {"short": max(1, int(args.short_factor * window)), "long": max(1, int(args.long_factor * window))}
    steps, chunk = args.sweep_steps, args.max_prefill_chunk
    budget = {k: decode_budget(batch=args.sweep_batch, prompt_len=n, chunk=chunk, steps=steps, warmup=1)
              for k, n in lens.items()}
    lm, wbytes = engine_setup.from_config(cfg, args.dtype, args.seed)
    engine = engine_setup.build_engine(
        lm, args, max_model_len=max(n + budget[k] for k, n in lens.items()), max_num_seqs=args.sweep_batch,
        max_num_batched_tokens=max(chunk, args.sweep_batch), max_prefill_chunk=chunk,
        seq_buckets=(args.sweep_batch,), token_buckets=(max(chunk, args.sweep_batch),))
    rng = np.random.default_rng(args.seed)
    ahead = int(bool(getattr(engine.config, "async_scheduling", False)))  # one step in flight
    cells = []
    for kind, n in lens.items():
        run = measure_decode(engine, batch=args.sweep_batch, prompt_len=n, steps=steps, warmup=1,
                             max_tokens=budget[kind], vocab_size=cfg.vocab_size, rng=rng)
        # Per sequence: its last token is not cached yet, unless the step computing it is already
        # dispatched (then the engine has moved its pages on as if that step were done).
        cached = [n + out - 1 + ahead for out in run.outputs]
        expected = {g: sum(memory.swa_pages(w, c, args.page_size) for c in cached)
                    for g, w in zip(run.stats["pages_in_use"], cfg.windows, strict=True)}
        mem = memory.in_use_bytes(cfg, run.stats, args.page_size, args.dtype)
        cells.append({"window": window, "state_size": state_size, "prompt": kind, **run.summary(),
                      "cached_tokens": sorted(set(cached)), "step_in_flight": bool(ahead),
                      "pages_expected_swa": expected,
                      "pages_match": expected == run.stats["pages_in_use"], **mem,
                      "kv_reserved_bytes": run.stats["kv_bytes"],
                      "state_reserved_bytes": run.stats["state_bytes"], "weight_bytes": wbytes})
    del engine, lm
    engine_setup.collect()
    return cells
