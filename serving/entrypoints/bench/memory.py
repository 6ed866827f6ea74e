"""KV-page and state arithmetic from the model config: bytes in use, pages a pure
sliding-window model needs, and the largest batch that fits a memory budget.

Written from the definitions (a query at position q reads keys q-W < k <= q; page i
holds positions [i*s, (i+1)*s)), not from the engine's block table, so that the
benchmarks can check the engine against it.
"""

from __future__ import annotations

import math

from hybrid_jax.cache import kv_head_dim
from hybrid_jax.config import LayerKind, ModelConfig
from serving.entrypoints.bench.floor import DTYPE_BYTES


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str) -> tuple[int, ...]:
    """Bytes of one page across the layers of each window group (cfg.windows order)."""
    out = []
    for w in cfg.windows:
        layers = sum(1 for s in cfg.layers if s.kind.has_attention and s.window == w)
        a = cfg.attention
        # MLA caches one latent row per token (r + dr values), no V; others K and V per KV head
        width = (cfg.mla.latent_width if cfg.mla is not None
                 else 2 * a.num_kv_heads * kv_head_dim(a.head_dim))
        out.append(layers * page_size * width * DTYPE_BYTES[dtype])
    return tuple(out)


def state_bytes(cfg: ModelConfig, dtype: str, state_dtype: str = "float32") -> int:
    """Recurrent state of one sequence: conv and SSM states of Mamba2 and Mamba1 layers, RG-LRU
    states, Gated DeltaNet conv and delta-rule states."""
    total = 0
    for spec in cfg.layers:
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            total += m.num_heads * m.head_dim * m.state_size * DTYPE_BYTES[state_dtype]
            total += (m.conv_kernel - 1) * m.conv_dim * DTYPE_BYTES[dtype]
        if spec.kind == LayerKind.MAMBA1:
            m1 = cfg.mamba1
            total += m1.d_inner * m1.state_size * DTYPE_BYTES[state_dtype]
            total += (m1.conv_kernel - 1) * m1.d_inner * DTYPE_BYTES[dtype]
        if spec.kind == LayerKind.RGLRU:
            r = cfg.rglru
            total += r.width * 4 + (r.conv_kernel - 1) * r.width * DTYPE_BYTES[dtype]
        if spec.kind == LayerKind.GATED_DELTANET:
            g = cfg.gated_deltanet
            total += g.num_v_heads * g.head_k_dim * g.head_v_dim * DTYPE_BYTES[state_dtype]
            total += (g.conv_kernel - 1) * g.conv_dim * DTYPE_BYTES[dtype]
    return total


def swa_pages(window: int | None, cached: int, page_size: int) -> int:
    """Pages a sequence with `cached` tokens must hold for its next query (at position `cached`).

    That query reads keys max(0, cached - W + 1) .. cached; the last is being written, so
    the cached ones it needs are positions [max(0, cached - W + 1), cached), plus the
    partly filled page the next token goes into (it holds cached - 1 unless W = 1).
    """
    first = 0 if window is None else max(0, cached - window + 1)
    if cached == 0:
        return 0
    return (cached - 1) // page_size - first // page_size + 1


def fit_batch(cfg: ModelConfig, *, context: int, budget_bytes: float, page_size: int, dtype: str,
              prefill_chunk: int, state_dtype: str = "float32") -> int:
    """Most sequences at `context` tokens whose decode pages and states fit `budget_bytes`, with the
    extra pages of ONE prefill chunk reserved once (not per sequence)."""
    pb = page_bytes(cfg, page_size, dtype)
    per_seq = sum(swa_pages(w, context, page_size) * b for w, b in zip(cfg.windows, pb, strict=True))
    per_seq += state_bytes(cfg, dtype, state_dtype)
    chunk = sum((math.ceil(prefill_chunk / page_size) + 1) * b for b in pb)
    return max(0, int((budget_bytes - chunk) // per_seq)) if per_seq else 0


def in_use_bytes(cfg: ModelConfig, stats: dict, page_size: int, dtype: str,
                 state_dtype: str = "float32") -> dict[str, int]:
    """KV and state bytes in use from LLMEngine.stats() (pages per group, slots)."""
    pb = page_bytes(cfg, page_size, dtype)
    pages = list(stats["pages_in_use"].values())
    kv = sum(n * b for n, b in zip(pages, pb, strict=True))
    st = stats["slots_in_use"] * state_bytes(cfg, dtype, state_dtype)
    return {"kv_in_use_bytes": kv, "state_in_use_bytes": st, "pages_in_use": stats["pages_in_use"]}
