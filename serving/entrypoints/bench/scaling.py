"""`hybrid-jax bench scaling`: decode step, tokens/s and memory as the context grows.

For each model (a hybrid and its full-attention baseline by default) and each batch,
one engine is built for the largest context that fits (by the engine's own pool
plan) and every context up to it is run: the batch's prompts are prefilled, then
steps in which the whole batch decodes are timed (see `probe.measure_decode`).
Contexts whose predicted prefill time exceeds `--max-prefill-s` (prefill time grows
linearly with context for windowed/recurrent models and quadratically with global
attention) or that come after `--time-budget` are recorded as skipped, with the
reason. Each point carries its byte floor (weights + in-window K/V + state, over
the copy bandwidth measured in this run), and the KV and state bytes in use. The
largest batch that fits at `--fit-contexts` is reported by the engine's pool plan
and by decode-page arithmetic (one prefill chunk reserved once). Results are
written after every point, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np

from hybrid_jax.config import LayerSpec, ModelConfig
from serving.entrypoints.bench import common, engine_setup, memory, plots, trace_report
from serving.entrypoints.bench.floor import copy_bandwidth, floor_report
from serving.entrypoints.bench.probe import StepTracer, decode_budget, measure_decode, trace_scopes

FULL_ATTENTION = ":full-attention"


def model_config(name: str) -> ModelConfig:
    from hybrid_jax.presets import load_preset

    if name.endswith(FULL_ATTENTION):
        cfg = load_preset(name.removesuffix(FULL_ATTENTION))
        return dataclasses.replace(cfg, layers=tuple(LayerSpec("attention", None) for _ in cfg.layers),
                                   mamba2=None, rglru=None)
    return load_preset(name)


def run(args: argparse.Namespace, out: Path) -> dict:
    if args.smoke:
        args.models, args.contexts, args.batches, args.fit_contexts = (
            "native-tiny,native-tiny:full-attention", "32,160", "4", "128,512")
        args.decode_steps, args.warmup_steps = 3, 1
    args.max_prefill_chunk = args.max_prefill_chunk or 4096
    contexts = common.parse_ints(args.contexts, "--contexts")
    batches = common.parse_ints(args.batches, "--batches")
    t_start = time.perf_counter()
    res = {"mode": "scaling", "dtype": args.dtype, **common.environment(),
           "page_size": args.page_size, "prefill_chunk": args.max_prefill_chunk,
           "copy_bandwidth_Bps": copy_bandwidth(64 << 20 if args.smoke else 1 << 30, 3 if args.smoke else 10),
           "points": [], "skipped": [], "fit": []}
    tracer = StepTracer(args.profile)
    # Batch-major, so that with a time budget every model gets measured at the first batch;
    # each (batch, model) group gets an equal share of the budget left when it starts.
    groups = [(b, name) for b in batches for name in args.models.split(",")]
    for i, (batch, name) in enumerate(groups):
        left = args.time_budget - (time.perf_counter() - t_start) if args.time_budget else math.inf
        deadline = time.perf_counter() + left / (len(groups) - i)
        cfg = model_config(name)
        lm, wbytes = engine_setup.from_config(cfg, args.dtype, args.seed)
        if i < len(groups) // len(batches):
            res["fit"] += _fit(cfg, name, wbytes, args)
        _model_batch(res, cfg, name, lm, wbytes, batch, contexts, args, out, deadline, tracer)
        del lm
        engine_setup.collect()
    res["elapsed_s"] = time.perf_counter() - t_start
    common.write_json(out, "scaling", res)
    plots.scaling(res, out / "scaling.png")
    return res


def _model_batch(res, cfg, name, lm, wbytes, batch, contexts, args, out, deadline, tracer) -> None:
    budget = lambda c: decode_budget(batch=batch, prompt_len=c, chunk=args.max_prefill_chunk,
                                     steps=args.decode_steps, warmup=args.warmup_steps)
    fits = []
    for c in contexts:
        why = _unfit_reason(cfg, c + budget(c), batch, wbytes, args)
        if why:
            res["skipped"].append({"model": name, "batch": batch, "context": c, "reason": why})
        else:
            fits.append(c)
    if not fits or time.perf_counter() > deadline:
        res["skipped"] += [{"model": name, "batch": batch, "context": c, "reason": "time budget"}
                           for c in fits]
        return
    engine = engine_setup.build_engine(
        lm, args, max_model_len=max(fits) + budget(max(fits)), max_num_seqs=batch,
        max_num_batched_tokens=max(args.max_prefill_chunk, batch), max_prefill_chunk=args.max_prefill_chunk,
        seq_buckets=(batch,), token_buckets=(max(args.max_prefill_chunk, batch),), **_prefix_overrides(args))
    rng = np.random.default_rng(args.seed)
    history: list[tuple[int, float]] = []  # (context, prefill s) of the points run
    with trace_scopes(engine) if args.profile else _null() as scopes:
        for c in fits:
            why = _skip_reason(c, history, args, deadline)
            if why:
                res["skipped"].append({"model": name, "batch": batch, "context": c, "reason": why})
                continue
            shared = _shared_prefix(args, cfg, c)
            run = measure_decode(engine, batch=batch, prompt_len=c, steps=args.decode_steps,
                                 warmup=args.warmup_steps, max_tokens=budget(c), vocab_size=cfg.vocab_size,
                                 rng=rng, tracer=tracer, shared_prefix=shared)
            history.append((c, run.prefill_s))
            point = _point(name, cfg, run, wbytes, args, res["copy_bandwidth_Bps"], engine)
            if shared:  # the prefill figures cover the batch's own tokens (and the prefix once)
                point |= {"shared_prefix": shared,
                          "prefix_cache_hit_tokens": run.stats.get("prefix_cache_hit_tokens"),
                          "prefill_tok_s": (batch * (c - shared) + shared) / run.prefill_s}
            res["points"].append(point)
            if scopes and "profile" not in res and tracer.state == "done":
                res["profile"] = {"dir": args.profile, "scopes": scopes, "model": name, "batch": batch,
                                  "context": c, **trace_report.summarize(args.profile, scopes)}
            common.write_json(out, "scaling", res)  # after every point: a killed run keeps its figures
            plots.scaling(res, out / "scaling.png")
            logging.getLogger(__name__).info("scaling %s", res["points"][-1])
    del engine
    engine_setup.collect()


def _prefix_overrides(args) -> dict:
    """Engine settings for --shared-prefix: prefix caching, a small checkpoint pool (the
    batch needs one checkpoint: the prefix's end), checkpoints every prefill chunk."""
    if not args.shared_prefix:
        return {}
    return {"enable_prefix_caching": True, "prefix_state_checkpoints": 16,
            "prefix_state_stride": args.max_prefill_chunk}


def _shared_prefix(args, cfg, context: int) -> int:
    """Tokens of --shared-prefix for one context: all but the sequence's own last tokens,
    which must cover the largest window so that every in-window page is the sequence's own
    (its memory is then that of any sequence at this context). 0 for a model with global
    attention (its prompts stay distinct: shared pages would flatter its memory)."""
    if not args.shared_prefix or any(s.kind.has_attention and s.window is None for s in cfg.layers):
        return 0  # global attention: every page is in the window, so none may be shared
    own = max([s.window or 0 for s in cfg.layers] + [args.page_size])
    return max(0, min(args.shared_prefix, context - own))


def _null():
    import contextlib

    return contextlib.nullcontext(None)


def _skip_reason(c: int, history: list[tuple[int, float]], args, deadline: float) -> str | None:
    predicted = predict_prefill_s(history, c)
    if predicted > args.max_prefill_s:
        return f"predicted prefill {predicted:.0f} s > --max-prefill-s {args.max_prefill_s:.0f}"
    if time.perf_counter() + predicted > deadline:
        return f"time budget (predicted prefill {predicted:.0f} s past this group's share)"
    return None


def predict_prefill_s(history: list[tuple[int, float]], context: int) -> float:
    """Prefill time at `context` from the last points: t ~ context^k, k from the last two
    points clipped to [1, 2] (linear for windows and SSMs, quadratic for global attention)."""
    if not history:
        return 0.0
    c1, t1 = history[-1]
    k = 1.0
    if len(history) >= 2:
        c0, t0 = history[-2]
        if c1 > c0 and t1 > 0 and t0 > 0:
            k = min(2.0, max(1.0, math.log(t1 / t0) / math.log(c1 / c0)))
    return t1 * (context / c1) ** k


def _point(name, cfg, run, wbytes, args, bandwidth, engine) -> dict:
    summary = run.summary()
    context = run.prompt_len + run.num_output_tokens - 1  # cached tokens at the last timed step
    state_dtype = getattr(engine.config, "ssm_state_dtype", "float32")
    floor = floor_report(cfg, batch=run.batch, context=context, weight_bytes=wbytes, dtype=args.dtype,
                         step_s=run.median_s, bandwidth=bandwidth, state_dtype=state_dtype)
    mem = memory.in_use_bytes(cfg, run.stats, args.page_size, args.dtype, state_dtype)
    return {"model": name, **summary, "weight_bytes": wbytes, "ssm_state_dtype": state_dtype, **floor, **mem,
            "kv_reserved_bytes": run.stats["kv_bytes"], "state_reserved_bytes": run.stats["state_bytes"],
            "device_memory": engine_setup.device_memory()}


def _free_bytes() -> int | None:
    mem = engine_setup.device_memory()
    return mem["bytes_limit"] - mem["bytes_in_use"] if "bytes_limit" in mem else None


def _plan(cfg, max_len, max_seqs, wbytes, args):
    """The engine's own pool plan for this model and sizing (None if its API changed)."""
    from hybrid_jax.loading import DTYPES
    from serving.engine.engine_config import EngineConfig

    try:
        from serving.engine.engine_config import plan_pools

        ec = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=args.max_prefill_chunk,
                          max_prefill_chunk=args.max_prefill_chunk, max_model_len=max_len,
                          page_size=args.page_size, memory_fraction=args.memory_fraction, dtype=args.dtype,
                          **_prefix_overrides(args))
        return plan_pools(cfg, ec, free_bytes=_free_bytes(), weight_bytes=wbytes, dtype=DTYPES[args.dtype])
    except (ImportError, TypeError):
        return None


def _unfit_reason(cfg, max_len, batch, wbytes, args) -> str | None:
    """Why an engine for `batch` sequences of `max_len` tokens cannot be built (None: it can)."""
    if max_len > cfg.max_position_embeddings:
        return f"prompt + decode steps {max_len} > max_position_embeddings {cfg.max_position_embeddings}"
    try:
        plan = _plan(cfg, max_len, batch, wbytes, args)
    except ValueError:
        return "memory: one sequence does not fit (engine plan)"
    if plan is not None and plan.scheduler.max_num_seqs < batch:
        return f"memory: {plan.scheduler.max_num_seqs} sequences fit (engine plan)"
    return None


def _fit(cfg, name, wbytes, args) -> list[dict]:
    """Largest batch at each fit context: by the engine's plan and by decode-page arithmetic."""
    out = []
    free = _free_bytes() or 4 << 30
    # "lowered to N" is the answer here
    logging.getLogger("serving.engine.engine_config").setLevel(logging.ERROR)
    for c in common.parse_ints(args.fit_contexts, "--fit-contexts"):
        try:
            plan = _plan(cfg, c + 64, 1 << 20, wbytes, args)
            planned = plan.scheduler.max_num_seqs if plan is not None else None
        except ValueError:
            planned = 0
        ideal = memory.fit_batch(cfg, context=c, budget_bytes=args.memory_fraction * (free - wbytes),
                                 page_size=args.page_size, dtype=args.dtype,
                                 prefill_chunk=args.max_prefill_chunk)
        out.append({"model": name, "context": c, "engine_plan_max_batch": planned,
                    "decode_pages_max_batch": ideal, "ran": False})
    return out
