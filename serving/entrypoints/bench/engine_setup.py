"""Building the model and the engine for a benchmark, from the command line's sizing.

Weights are random for presets (benchmarks measure speed and memory, not text). The
weight bytes are counted here, from the loaded parameters, for the byte floor.
"""

from __future__ import annotations

import argparse
import gc

import jax
from flax import nnx

from hybrid_jax.config import ModelConfig
from hybrid_jax.loading import LoadedModel, load_model


def weight_bytes(lm: LoadedModel) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(lm.model))))


def load(model: str, dtype: str, seed: int, device: jax.Device | None = None) -> tuple[LoadedModel, int]:
    lm = load_model(model, dtype=dtype, seed=seed, device=device)
    return lm, weight_bytes(lm)


def from_config(cfg: ModelConfig, dtype: str, seed: int) -> tuple[LoadedModel, int]:
    """A random-weight model of `cfg` (the sweep's variants of a preset)."""
    from hybrid_jax.loading import DTYPES
    from hybrid_jax.model import CausalLM

    lm = LoadedModel(CausalLM(cfg, dtype=DTYPES[dtype], rngs=nnx.Rngs(seed)), cfg, None, "bench")
    return lm, weight_bytes(lm)


def build_engine(lm: LoadedModel, args: argparse.Namespace, *, max_model_len: int, **overrides):
    """An LLMEngine sized by the CLI's engine flags; `overrides` win (EngineConfig field names)."""
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine

    kw = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
          "max_prefill_chunk": args.max_prefill_chunk, "page_size": args.page_size,
          "memory_fraction": args.memory_fraction, "dtype": args.dtype, "max_model_len": max_model_len,
          # a benchmark measures the full engine from its first request, not the start-up limits
          "compile_in_background": False}
    kw.update(overrides)
    return LLMEngine(lm, EngineConfig(**kw), seed=args.seed, show_progress=not args.smoke)


def smoke_buckets(args: argparse.Namespace) -> dict:
    """Bucket ladders: --seq-buckets / --token-buckets, or one of each for --smoke runs."""
    from serving.entrypoints.bench.common import parse_ints

    if args.smoke:
        return {"seq_buckets": (args.max_num_seqs,), "token_buckets": (args.max_num_batched_tokens,)}
    out = {}
    if getattr(args, "seq_buckets", None):
        out["seq_buckets"] = parse_ints(args.seq_buckets, "--seq-buckets")
    if getattr(args, "token_buckets", None):
        out["token_buckets"] = parse_ints(args.token_buckets, "--token-buckets")
    return out


def collect() -> None:
    """After the caller dropped its engine: collect, so the next engine gets its device memory."""
    gc.collect()


def device_memory() -> dict[str, int]:
    """bytes_limit / bytes_in_use / peak_bytes_in_use of device 0 (empty on CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use") if k in stats}
