"""Serving-path data: per-layer caches (typed pytrees) and the ragged batch metadata.

Caches are physical device arrays indexed by ints that the engine's host-side pools
hand out: KV pages `[k, num_pages, s, e]` per attention layer (layers of one window
group share page indices), and per-slot recurrent state. Index 0 of pages and slots
is a dummy that padded rows read and write. This module knows nothing of scheduling:
it only says what the arrays are and how big they are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.config import LayerKind, ModelConfig


class KVCache(NamedTuple):
    k: jax.Array  # [k, num_pages, s, e]
    v: jax.Array


class Mamba2State(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, conv_dim] (oldest input first)
    ssm: jax.Array  # [slots, h, p, n]


class RGLRUState(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, c]
    h: jax.Array  # [slots, c] f32


class ShortConvState(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, d] (LFM2's B * x inputs, oldest first)


class LayerCache(NamedTuple):
    kv: KVCache | None = None
    mamba: Mamba2State | None = None
    rglru: RGLRUState | None = None
    short_conv: ShortConvState | None = None


class RaggedBatch(NamedTuple):
    """One engine step's tokens, flattened over sequences (decodes and prefill chunks).

    tokens, positions  [t]      token ids and their absolute positions
    cu_seqlens         [b + 1]  sequence i owns tokens cu[i]:cu[i+1] (padding rows: empty)
    lengths            [b]      tokens in cache after this step (0 for padding rows)
    slot_ids           [b]      state slot of each sequence (0 for padding rows)
    has_initial        [b]      False: the sequence starts here (zero state)
    page_tables        per window group, [b, T] ring of physical pages
    slot_mappings      per window group, [t] physical_page * s + offset of each token
    last_token         [b]      index in t of each sequence's last token (for logits)
    """

    tokens: jax.Array
    positions: jax.Array
    cu_seqlens: jax.Array
    lengths: jax.Array
    slot_ids: jax.Array
    has_initial: jax.Array
    page_tables: tuple[jax.Array, ...]
    slot_mappings: tuple[jax.Array, ...]
    last_token: jax.Array


KERNEL_HEAD_DIMS = (64, 128, 256)


def kv_head_dim(head_dim: int) -> int:
    """Head dim of the KV pages: the smallest the paged kernels tile that holds head_dim.

    Smaller head dims (tiny test models) are zero-padded: zeros change neither q.k nor
    the attended values' real dims, at the price of the padded bytes.
    """
    for e in KERNEL_HEAD_DIMS:
        if head_dim <= e:
            return e
    return head_dim


def layer_groups(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Window group index of each layer (None for layers without attention)."""
    return tuple(cfg.windows.index(s.window) if s.kind.has_attention else None for s in cfg.layers)


def init_caches(cfg: ModelConfig, *, num_pages: tuple[int, ...], page_size: int, num_slots: int,
                dtype: jnp.dtype, state_dtype: jnp.dtype = jnp.float32) -> tuple[LayerCache, ...]:
    """Zeroed caches; `num_pages[g]` pages for window group g, `num_slots` state slots."""
    if len(num_pages) != len(cfg.windows):
        raise ValueError(f"num_pages={num_pages} needs one entry per window group {cfg.windows}")
    groups = layer_groups(cfg)
    out = []
    for spec, g in zip(cfg.layers, groups, strict=True):
        kv = mamba = rglru = short_conv = None
        if g is not None:
            a = cfg.attention
            shape = (a.num_kv_heads, num_pages[g], page_size, kv_head_dim(a.head_dim))
            kv = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            mamba = Mamba2State(jnp.zeros((num_slots, m.conv_kernel - 1, m.conv_dim), dtype),
                                jnp.zeros((num_slots, m.num_heads, m.head_dim, m.state_size),
                                          state_dtype))
        if spec.kind == LayerKind.RGLRU:
            r = cfg.rglru
            rglru = RGLRUState(jnp.zeros((num_slots, r.conv_kernel - 1, r.width), dtype),
                               jnp.zeros((num_slots, r.width), jnp.float32))
        if spec.kind == LayerKind.SHORT_CONV:
            k = cfg.short_conv.conv_kernel
            c = cfg.short_conv.channels or cfg.hidden_size
            short_conv = ShortConvState(jnp.zeros((num_slots, k - 1, c), dtype))
        out.append(LayerCache(kv, mamba, rglru, short_conv))
    return tuple(out)


def cache_bytes(cfg: ModelConfig, *, page_size: int, dtype: jnp.dtype,
                state_dtype: jnp.dtype = jnp.float32) -> tuple[tuple[int, ...], int]:
    """(bytes of one page per window group across its layers, bytes of one state slot).

    Derived from the shapes `init_caches` allocates (no arrays are created).
    """
    one = jax.eval_shape(lambda: init_caches(
        cfg, num_pages=(1,) * len(cfg.windows), page_size=page_size, num_slots=1, dtype=dtype,
        state_dtype=state_dtype))
    page = [0] * len(cfg.windows)
    slot = 0
    for cache, g in zip(one, layer_groups(cfg), strict=True):
        if cache.kv is not None:
            page[g] += sum(x.size * x.dtype.itemsize for x in cache.kv)
        states = (cache.mamba, cache.rglru, cache.short_conv)
        slot += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(states))
    return tuple(page), slot
