"""The stacked caches (hybrid_jax/cache.py): one array per kind, each layer at its own row.

Checked against the configs themselves (per-layer arithmetic written out here), not
against the code's own helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.cache import (
    cache_bytes,
    flatten_stacks,
    init_caches,
    kv_head_dim,
    layer_sites,
    unflatten_stacks,
)
from hybrid_jax.config import LayerKind
from hybrid_jax.presets import load_preset

PRESETS = ["gemma-3-1b", "lfm2-1.2b", "recurrentgemma-2b", "nemotron-h-8b", "zamba2-2.7b",
           "native-1b-parallel", "mamba2-2.7b"]


def _per_layer_bytes(cfg, page_size: int, itemsize: int, state_itemsize: int):
    """(bytes of one page per window group, bytes of one slot), summed layer by layer."""
    page, slot = [0] * len(cfg.windows), 0
    for spec in cfg.layers:
        if spec.kind.has_attention:
            a = cfg.attention
            e = kv_head_dim(a.head_dim)
            page[cfg.windows.index(spec.window)] += 2 * a.num_kv_heads * page_size * e * itemsize
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            slot += (m.conv_kernel - 1) * m.conv_dim * itemsize
            slot += m.num_heads * m.head_dim * m.state_size * state_itemsize
        if spec.kind == LayerKind.RGLRU:
            r = cfg.rglru
            slot += (r.conv_kernel - 1) * r.width * itemsize + r.width * 4
        if spec.kind == LayerKind.SHORT_CONV:
            c = cfg.short_conv
            slot += (c.conv_kernel - 1) * (c.channels or cfg.hidden_size) * itemsize
    return tuple(page), slot


@pytest.mark.parametrize("name", PRESETS)
def test_stacks_hold_every_layer_in_a_few_arrays(name):
    cfg = load_preset(name)
    pages, s, slots = tuple(range(7, 7 + len(cfg.windows))), 16, 5
    stacks = jax.eval_shape(lambda: init_caches(cfg, num_pages=pages, page_size=s, num_slots=slots,
                                                dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(stacks)
    # Two per window group (K, V) and at most two per state kind, whatever the depth.
    assert len(leaves) <= 2 * len(cfg.windows) + 2 * 3
    want_page, want_slot = _per_layer_bytes(cfg, s, 2, 4)
    assert cache_bytes(cfg, page_size=s, dtype=jnp.bfloat16) == (want_page, want_slot)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    assert total == sum(p * n for p, n in zip(want_page, pages, strict=True)) + want_slot * slots

    # Every layer of a kind has its own row: ranks count up from 0 within a group / kind.
    sites = layer_sites(cfg)
    for g, kv in enumerate(stacks.kv):
        ranks = [x.kv_rank for x in sites if x.group == g]
        assert ranks == list(range(len(ranks))) and kv.k.shape[1] == len(ranks)
    for field in ("mamba", "rglru", "short_conv"):
        ranks = [x.state_rank for x in sites if x.state == field]
        st = getattr(stacks, field)
        assert (st is None) == (not ranks)
        if st is not None:
            assert ranks == list(range(len(ranks)))
            assert all(x.shape[:2] == (len(ranks), slots) for x in st)


def test_flattening_is_a_reshape_that_keeps_every_row():
    cfg = load_preset("native-tiny")
    stacks = init_caches(cfg, num_pages=(3,), page_size=4, num_slots=2, dtype=jnp.float32)
    filled = jax.tree.map(lambda x: jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), stacks)
    flat, geom = flatten_stacks(filled)
    assert geom.pages == (3,) and geom.slots == 2 and geom.page_size == 4
    k = np.asarray(filled.kv[0].k)  # [k, n, P, s, e]; layer l's page p is flat page l * P + p
    np.testing.assert_array_equal(np.asarray(flat.kv[0].k)[:, 1 * 3 + 2], k[:, 1, 2])
    ssm = np.asarray(filled.mamba.ssm)  # [n, S, ...]; layer l's slot j is flat slot l * S + j
    np.testing.assert_array_equal(np.asarray(flat.mamba.ssm)[3 * 2 + 1], ssm[3, 1])
    back = unflatten_stacks(flat, filled)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(filled), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pools_that_overflow_int32_indices_are_refused():
    cfg = load_preset("native-1b-parallel")  # 24 attention layers in one window group
    limit = 2**31 / (24 * 16)  # pages per layer at which layer 23's slot mappings reach 2**31

    def init(pages: int):
        return jax.eval_shape(lambda: init_caches(cfg, num_pages=(pages,), page_size=16, num_slots=5,
                                                  dtype=jnp.bfloat16))

    with pytest.raises(ValueError, match="num_pages"):
        init(int(np.ceil(limit)))
    init(int(np.floor(limit)) - (limit == int(limit)))
