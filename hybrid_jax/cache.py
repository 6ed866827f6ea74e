"""Serving-path data: the caches (typed pytrees, stacked by kind) and the ragged batch metadata.

Caches are physical device arrays indexed by ints that the engine's host-side pools
hand out: KV pages `[k, num_pages, s, e]` per attention layer (layers of one window
group share page indices), and per-slot recurrent state. Index 0 of pages and slots
is a dummy that padded rows read and write. The engine holds every layer's cache of
one kind in one array (`CacheStacks`); a forward gives each layer its view
(`layer_cache`, `layer_batches`). This module knows nothing of
scheduling: it only says what the arrays are and how big they are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.config import LayerKind, LayerSpec, ModelConfig
from pallas_kernels import offset_indices


class KVCache(NamedTuple):
    """K/V pages [k, num_pages, s, e]. MLA models (`ModelConfig.mla`) cache the latent
    instead: k holds one row [norm(c) | k_r] of width L = kv_lora_rank + qk_rope_head_dim
    per token, [1, num_pages, s, L] (one "KV head" every query head reads; the values are
    its first kv_lora_rank columns), and v is empty, [1, num_pages, s, 0]. FP8
    (float8_e4m3fn) pages carry their scales, f32, one per KV head and layer (the real K/V
    are page values x scale): [k, n] in the stacks (n layers of the group), [k] in a
    layer's view (`layer_cache`). None otherwise."""

    k: jax.Array  # [k, num_pages, s, e]
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


class Mamba2State(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, conv_dim] (oldest input first)
    ssm: jax.Array  # [slots, h, p, n]


class Mamba1State(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, d_inner] (oldest input first)
    ssm: jax.Array  # [slots, d_inner, n]


class RGLRUState(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, c]
    h: jax.Array  # [slots, c] f32


class ShortConvState(NamedTuple):
    conv: jax.Array  # [slots, conv_kernel - 1, d] (LFM2's B * x inputs, oldest first)


class GDNState(NamedTuple):
    """Gated DeltaNet: conv inputs (q, k, v channels) and the delta-rule state per value head."""

    conv: jax.Array  # [slots, conv_kernel - 1, 2 hk dk + hv dv] (oldest input first)
    ssm: jax.Array  # [slots, hv, dk, dv] (f32, or bf16 with ssm_state_dtype)


class LayerCache(NamedTuple):
    kv: KVCache | None = None
    mamba: Mamba2State | None = None
    rglru: RGLRUState | None = None
    short_conv: ShortConvState | None = None
    mamba1: Mamba1State | None = None
    gdn: GDNState | None = None


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


class CacheStacks(NamedTuple):
    """Every layer's cache, stacked by kind: a few device arrays instead of several per layer.

    Each array of an executable call costs the host ~3 us to enqueue (H100 hosts,
    docs/history/benchmarks-2026.md, thirteenth pass): per-layer arrays made 96 of a 24-layer decode step's
    arguments. Stacked, a step takes one K and one V array per window group and one
    array per state field.

    kv          per window group g: K and V [k, n_g, P_g, s, e], row j the pages of the
                group's j-th attention layer (`LayerSite.kv_rank`)
    mamba       Mamba2State of [n, S, ...]: row j the slots of the j-th Mamba2 layer
    rglru       RGLRUState of [n, S, ...] (RG-LRU layers), or None
    short_conv  ShortConvState of [n, S, ...] (short-conv layers), or None
    mamba1      Mamba1State of [n, S, ...] (Mamba1 layers), or None
    gdn         GDNState of [n, S, ...] (Gated DeltaNet layers), or None

    Inside a forward the rows are flattened ([k, n_g * P_g, s, e], [n * S, ...]: free
    reshapes) and each layer's page and slot indices are offset to its row (`layer_batches`):
    kernels see one pool whose pages and slots are numbered across layers.
    """

    kv: tuple[KVCache, ...]
    mamba: Mamba2State | None = None
    rglru: RGLRUState | None = None
    short_conv: ShortConvState | None = None
    mamba1: Mamba1State | None = None
    gdn: GDNState | None = None


_STATE_FIELDS = ("mamba", "rglru", "short_conv", "mamba1", "gdn")


class LayerSite(NamedTuple):
    """Where a layer's cache lies in the stacks (static, from the config)."""

    group: int | None  # window group of its K/V (None: no attention)
    kv_rank: int  # its row in the group's K/V stacks
    state: str | None  # its recurrent state's field of CacheStacks (None: no state)
    state_rank: int  # its row in that field's stacks


def _state_field(spec: LayerSpec) -> str | None:
    if spec.kind.has_mamba2:
        return "mamba"
    if spec.kind == LayerKind.RGLRU:
        return "rglru"
    if spec.kind == LayerKind.SHORT_CONV:
        return "short_conv"
    if spec.kind == LayerKind.MAMBA1:
        return "mamba1"
    if spec.kind == LayerKind.GATED_DELTANET:
        return "gdn"
    return None


def layer_sites(cfg: ModelConfig) -> tuple[LayerSite, ...]:
    """Each layer's rows in the stacks: layers are numbered in order within their window
    group (K/V) and within their state kind."""
    kv_count, state_count, out = {}, {}, []
    for spec in cfg.layers:
        g = cfg.windows.index(spec.window) if spec.kind.has_attention else None
        field = _state_field(spec)
        kv_rank = kv_count.get(g, 0) if g is not None else 0
        state_rank = state_count.get(field, 0) if field is not None else 0
        if g is not None:
            kv_count[g] = kv_rank + 1
        if field is not None:
            state_count[field] = state_rank + 1
        out.append(LayerSite(g, kv_rank, field, state_rank))
    return tuple(out)


def init_caches(cfg: ModelConfig, *, num_pages: tuple[int, ...], page_size: int, num_slots: int,
                dtype: jnp.dtype, state_dtype: jnp.dtype = jnp.float32,
                kv_dtype: jnp.dtype | None = None) -> CacheStacks:
    """Zeroed stacks; `num_pages[g]` pages per layer of window group g, `num_slots` state
    slots per recurrent layer. K/V pages in `kv_dtype` (default `dtype`); FP8 pages get
    scales of 1 (the engine sets calibrated ones: hybrid_jax/kv_quant.py)."""
    if len(num_pages) != len(cfg.windows):
        raise ValueError(f"num_pages={num_pages} needs one entry per window group {cfg.windows}")
    sites = layer_sites(cfg)
    per_group = [sum(1 for s in sites if s.group == g) for g in range(len(cfg.windows))]
    per_state = {f: sum(1 for s in sites if s.state == f) for f in _STATE_FIELDS}
    # Layer j's pages and slots are indexed at j * P + page (slot mappings: times the page
    # size) and j * S + slot in int32: the merged pools must stay under 2**31 of each.
    for g, n in enumerate(per_group):
        if n * num_pages[g] * page_size >= 2**31:
            raise ValueError(f"num_pages={num_pages[g]} x page_size={page_size} x {n} layers of window "
                             f"group {g} reaches 2**31 token positions: lower num_pages or memory_fraction")
    if (deepest := max(per_state.values())) * num_slots >= 2**31:
        raise ValueError(f"num_slots={num_slots} x {deepest} layers reaches 2**31")
    a = cfg.attention
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    if cfg.mla is not None and kv_dtype == jnp.float8_e4m3fn:
        raise ValueError("kv_cache_dtype='fp8' is not supported for MLA latent pages (the latent "
                         "row mixes the normed latent and the key slice under one scale): use 'auto'")
    kv = []
    for g, n in enumerate(per_group):
        if cfg.mla is not None:  # the latent cache (KVCache's doc): no V pages
            shape = (1, n, num_pages[g], page_size, cfg.mla.latent_width)
            kv.append(KVCache(jnp.zeros(shape, kv_dtype), jnp.zeros(shape[:-1] + (0,), kv_dtype)))
            continue
        shape = (a.num_kv_heads, n, num_pages[g], page_size, kv_head_dim(a.head_dim))
        scales = ((jnp.ones((a.num_kv_heads, n), jnp.float32),) * 2
                  if kv_dtype == jnp.float8_e4m3fn else ())
        kv.append(KVCache(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype), *scales))
    mamba = rglru = short_conv = None
    if n := per_state["mamba"]:
        m = cfg.mamba2
        mamba = Mamba2State(jnp.zeros((n, num_slots, m.conv_kernel - 1, m.conv_dim), dtype),
                            jnp.zeros((n, num_slots, m.num_heads, m.head_dim, m.state_size), state_dtype))
    if n := per_state["rglru"]:
        r = cfg.rglru
        rglru = RGLRUState(jnp.zeros((n, num_slots, r.conv_kernel - 1, r.width), dtype),
                           jnp.zeros((n, num_slots, r.width), jnp.float32))
    if n := per_state["short_conv"]:
        k = cfg.short_conv.conv_kernel
        c = cfg.short_conv.channels or cfg.hidden_size
        short_conv = ShortConvState(jnp.zeros((n, num_slots, k - 1, c), dtype))
    mamba1 = None
    if n := per_state["mamba1"]:
        m1 = cfg.mamba1
        mamba1 = Mamba1State(jnp.zeros((n, num_slots, m1.conv_kernel - 1, m1.d_inner), dtype),
                             jnp.zeros((n, num_slots, m1.d_inner, m1.state_size), state_dtype))
    gdn = None
    if n := per_state["gdn"]:
        d = cfg.gated_deltanet
        gdn = GDNState(jnp.zeros((n, num_slots, d.conv_kernel - 1, d.conv_dim), dtype),
                       jnp.zeros((n, num_slots, d.num_v_heads, d.head_k_dim, d.head_v_dim), state_dtype))
    return CacheStacks(tuple(kv), mamba, rglru, short_conv, mamba1, gdn)


def states_of(stacks: CacheStacks) -> CacheStacks:
    """The recurrent part of the stacks (every per-slot state; K/V left out): each leaf
    [n, S, ...], slots on axis 1."""
    return stacks._replace(kv=())


def with_states(stacks: CacheStacks, states: CacheStacks) -> CacheStacks:
    """`stacks` with its recurrent fields from `states` (`states_of`'s form)."""
    return states._replace(kv=stacks.kv)


class Geometry(NamedTuple):
    """Rows per layer in the flattened stacks: pages per window group, state slots."""

    pages: tuple[int, ...]
    slots: int
    page_size: int


def flatten_stacks(stacks: CacheStacks) -> tuple[CacheStacks, Geometry]:
    """Rows merged: K/V [k, n_g * P_g, s, e], states [n * S, ...] (reshapes, no copies)."""
    pages = tuple(kv.k.shape[2] for kv in stacks.kv)
    leaves = jax.tree.leaves(states_of(stacks))
    slots = leaves[0].shape[1] if leaves else 0

    def merge_kv(x):
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])

    kv = tuple(c._replace(k=merge_kv(c.k), v=merge_kv(c.v)) for c in stacks.kv)  # scales stay [k, n]
    states = jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), states_of(stacks))
    page_size = stacks.kv[0].k.shape[3] if stacks.kv else 0
    return with_states(stacks._replace(kv=kv), states), Geometry(pages, slots, page_size)


def unflatten_stacks(flat: CacheStacks, like: CacheStacks) -> CacheStacks:
    """`flatten_stacks` undone: each leaf back to the shape of `like`'s."""
    return jax.tree.map(lambda x, y: x.reshape(y.shape), flat, like)


def layer_cache(flat: CacheStacks, site: LayerSite) -> LayerCache:
    """A layer's cache as the kernels take it: the flattened stacks of its kinds (indexed
    through `layer_batches`' offset pages and slots), FP8 scales the layer's own [k]."""
    kv = flat.kv[site.group] if site.group is not None else None
    if kv is not None and kv.k_scale is not None:
        kv = kv._replace(k_scale=kv.k_scale[:, site.kv_rank], v_scale=kv.v_scale[:, site.kv_rank])
    return LayerCache(kv=kv, **({site.state: getattr(flat, site.state)} if site.state else {}))


def store_layer(flat: CacheStacks, site: LayerSite, cache: LayerCache) -> CacheStacks:
    """The flattened stacks with what a layer returned (its kinds' updated stacks).
    Fields of `cache` that are None are left as they are; so are FP8 scales (never written
    by a step)."""
    if site.group is not None and cache.kv is not None:
        kv = list(flat.kv)
        kv[site.group] = kv[site.group]._replace(k=cache.kv.k, v=cache.kv.v)
        flat = flat._replace(kv=tuple(kv))
    if site.state is not None and getattr(cache, site.state) is not None:
        flat = flat._replace(**{site.state: getattr(cache, site.state)})
    return flat


def layer_batches(batch: RaggedBatch, sites: tuple[LayerSite, ...], geom: Geometry
                  ) -> tuple[RaggedBatch, ...]:
    """Each layer's view of the batch over the flattened stacks: its slot ids offset to its
    state row, its window group's page table and slot mapping to its page row. Padding rows
    (slot 0, page 0) land on the layer's own dummy slot and page. Every layer's copy of
    every index array comes from one launch (`offset_indices`)."""
    def offsets(values) -> tuple[int, ...]:
        return tuple(sorted(set(values) - {0}))

    slot_offs = offsets(s.state_rank * geom.slots for s in sites if s.state is not None)
    page_offs = [offsets(s.kv_rank * pages for s in sites if s.group == g)
                 for g, pages in enumerate(geom.pages)]
    map_offs = [tuple(o * geom.page_size for o in offs) for offs in page_offs]
    shifted = iter(offset_indices((batch.slot_ids, *batch.page_tables, *batch.slot_mappings),
                                  (slot_offs, *page_offs, *map_offs)))

    def by_offset(x: jax.Array, offs: tuple[int, ...]) -> dict[int, jax.Array]:
        return {0: x, **dict(zip(offs, next(shifted), strict=True))}  # maps: keyed by page offset

    slots = by_offset(batch.slot_ids, slot_offs)
    tables = [by_offset(t, offs) for t, offs in zip(batch.page_tables, page_offs, strict=True)]
    maps = [by_offset(m, offs) for m, offs in zip(batch.slot_mappings, page_offs, strict=True)]
    out = []
    for s in sites:
        view = batch
        if s.state is not None:
            view = view._replace(slot_ids=slots[s.state_rank * geom.slots])
        if s.group is not None:
            o = s.kv_rank * geom.pages[s.group]
            view = view._replace(
                page_tables=tuple(t[o] if g == s.group else t[0] for g, t in enumerate(tables)),
                slot_mappings=tuple(m[o] if g == s.group else m[0] for g, m in enumerate(maps)))
        out.append(view)
    return tuple(out)


def cache_bytes(cfg: ModelConfig, *, page_size: int, dtype: jnp.dtype,
                state_dtype: jnp.dtype = jnp.float32,
                kv_dtype: jnp.dtype | None = None) -> tuple[tuple[int, ...], int]:
    """(bytes of one page per window group across its layers, bytes of one state slot
    across the recurrent layers). Derived from the shapes `init_caches` allocates (no
    arrays are created); FP8 pages count one byte per value (their per-layer scales are
    not per page)."""
    one = jax.eval_shape(lambda: init_caches(
        cfg, num_pages=(1,) * len(cfg.windows), page_size=page_size, num_slots=1, dtype=dtype,
        state_dtype=state_dtype, kv_dtype=kv_dtype))
    page = tuple(sum(x.size * x.dtype.itemsize for x in (kv.k, kv.v)) for kv in one.kv)
    slot = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(states_of(one)))
    return page, slot
