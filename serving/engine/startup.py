"""The LLM engine's start-up helpers: loading the model as the engine serves it,
building its runner, the compile progress line, process-level settings.

Quantization (`quantization="fp8"` on a copy of a given model), the FP8 Linears that
tensor parallelism cannot split on whole scale blocks held dense, the persistent
compilation cache, the progress bar of the start-up compilation and the heap freeze of
a process that serves one engine for its life. None of this runs in the engine step
(serving/engine/llm_engine.py: schedule, run, update).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax import tensor_parallel as tp
from hybrid_jax.kv_quant import kv_dtype
from hybrid_jax.loading import DTYPES, LoadedModel, load_model
from hybrid_jax.quantization import left_as_loaded, quantize_model
from serving.core.block_table import ring_width
from serving.core.scheduler_config import SchedulerConfig
from serving.engine.engine_config import EngineConfig
from serving.runner.runner import ModelRunner

# The start-up lines keep the engine's logger name (as before they moved here: log
# configurations that name the engine's logger still see them).
log = logging.getLogger("serving.engine.llm_engine")


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic GC's reach (gc.freeze).

    For a process that serves one engine for its life (the CLI, the server): after
    start-up the heap holds millions of long-lived objects (JAX, the model, the
    executables), and each full collection walks them all, which stalls one step by
    100-200 ms every few hundred steps at batch 256 (docs/history/benchmarks-2026.md). Frozen,
    a full collection walks only what was made after start-up. An object frozen here
    is never collected as part of a reference cycle later, so a process that builds
    and drops engines (tests, notebooks) should not call this.
    """
    gc.collect()
    gc.freeze()


def use_compilation_cache(path: str | None) -> None:
    """Use the persistent compilation cache at `path` unless one is set already."""
    if path is not None and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))


def compile_progress(i: int, n: int, key) -> None:
    """The start-up compilation's progress bar on stderr (`ModelRunner.compile_all`)."""
    bar = "#" * (20 * i // n)
    if hasattr(key, "seqs"):
        what = f"t={key.tokens}, b={key.seqs}{', decode' if key.decode else ''}"
    elif isinstance(key, int):  # a sampler (its sequence count)
        what = f"sampler b={key}"
    elif key[0] == "multi":  # a multi-step decoder (("multi", bucket, filters))
        what = f"multi-step b={key[1].seqs}"
    elif key[0] == "mtp":  # the MTP head's step (("mtp", bucket))
        what = f"mtp t={key[1].tokens}, b={key[1].seqs}"
    else:  # a verifier ((bucket, filters))
        what = f"verify b={key[0].seqs}"
    print(f"\rcompiling step executables [{bar:<20}] {i}/{n} ({what})".ljust(78),
          end="\n" if i == n else "", file=sys.stderr, flush=True)


def describe_bytes(by_dtype: dict[str, int]) -> str:
    """"float8_e4m3fn 1.2 MiB, float32 0.3 MiB": the weights held, by dtype."""
    return ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in sorted(by_dtype.items()))


def quantized_copy(lm: LoadedModel, quantization: str | None) -> LoadedModel:
    """`lm` with its model quantized as EngineConfig.quantization asks: a copy (the caller's
    model is left as it was), or `lm` itself when there is nothing to do."""
    if quantization is None or left_as_loaded(lm.model):
        return lm
    copy = nnx.merge(*nnx.split(lm.model))
    return dataclasses.replace(lm, model=quantize_model(copy, quantization))


def tp_aligned(lm: LoadedModel, n: int, copy: bool) -> LoadedModel:
    """`lm` with the FP8 Linears that n devices cannot split on whole scale blocks held in
    the compute dtype (tensor_parallel.dequantize_unaligned: same outputs); on a copy when
    `copy` (the caller's model), `lm` itself when every FP8 Linear splits."""
    if not tp.unaligned_fp8_linears(lm.model, n):
        return lm
    if copy:  # new modules over the same arrays: the caller's model keeps its FP8 Linears
        lm = dataclasses.replace(lm, model=nnx.merge(*nnx.split(lm.model)))
    dense = tp.dequantize_unaligned(lm.model, n)
    log.info("tensor_parallel_size=%d: %d FP8 Linear(s) whose split would cut a scale block are "
             "held in %s (%s)", n, len(dense), np.dtype(lm.model.dtype).name,
             ", ".join(dense[:4]) + (", ..." if len(dense) > 4 else ""))
    return lm


def load_for_engine(model: str | LoadedModel, cfg: EngineConfig, n: int,
                    device: jax.Device | None = None) -> LoadedModel:
    """The model as an engine of `cfg` on n devices serves it: loaded (on the host when
    n > 1: each device then receives only its shard; else on `device`, the engine's own,
    which for a data-parallel replica is not the first) or a given one quantized on a
    copy, its FP8 Linears that n devices cannot split held dense; ValueError naming
    `tensor_parallel_size` if it cannot be split."""
    if isinstance(model, LoadedModel):
        lm = quantized_copy(model, cfg.quantization)
    else:  # tensor parallel: load on the host, each device then receives only its shard
        lm = load_model(model, dtype=cfg.dtype, device=tp.host_device() if n > 1 else device,
                        quantization=cfg.quantization)
    tp.check_shardable(lm.config, n)
    if n > 1:
        lm = tp_aligned(lm, n, copy=lm is model)
        tp.check_weights_shardable(lm.model, n)
    return lm


def make_runner(lm: LoadedModel, cfg: EngineConfig, sc: SchedulerConfig, mesh: Mesh, multi_seqs: int,
                kv_scales) -> ModelRunner:
    """The engine's runner over the planned pools `sc` (pages, slots, buckets, checkpoints)."""
    return ModelRunner(
        lm.model, num_pages=tuple(g.num_pages for g in sc.groups), page_size=sc.page_size,
        num_slots=sc.num_slots,
        ring_widths=tuple(ring_width(g.window, sc.page_size, sc.max_prefill_chunk,
                                     sc.max_model_len) for g in sc.groups),
        max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
        seq_sizes=cfg.seq_buckets, token_sizes=cfg.token_buckets,
        state_dtype=DTYPES[cfg.ssm_state_dtype], num_checkpoints=sc.num_checkpoints,
        ckpt_ops=sc.max_checkpoint_ops if sc.prefix_caching else 0,
        spec_q=cfg.spec_q, spec_max_seqs=min(cfg.spec_max_seqs, sc.max_num_seqs),
        multi_q=cfg.multi_q, multi_max_seqs=multi_seqs, mesh=mesh,
        kv_dtype=kv_dtype(cfg.kv_cache_dtype, lm.model.dtype), kv_scales=kv_scales,
        mtp_k=cfg.num_speculative_tokens if cfg.speculative_method == "mtp" else 0)
