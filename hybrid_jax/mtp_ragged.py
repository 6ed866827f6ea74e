"""The MTP head (hybrid_jax/layers/mtp.py) on the serving path: paged K/V, ragged batches.

The head's decoder layers keep their K/V in pages of their own, indexed by the page
tables of the target's window group whose window they have (`mtp_group`): a page the
scheduler gives a sequence holds, at the same offsets, the target's K/V of that group
and the head's. So pages freed, shared by prefix caching or recomputed after a
preemption carry the head's K/V along with the target's, with no bookkeeping of their
own; K/V written at rejected positions are overwritten by the next step, as the target's.

`mtp_forward` runs the head over a ragged batch whose token i is x_{p+1} for position p
(the target's batch shifted by one) with the target's hidden state at p; `mtp_propose`
then drafts k tokens greedily: draft 1 from the head's output at each sequence's last
valid position, drafts 2..k from k - 1 one-token steps fed the previous draft and the
head's own output hidden state (as vLLM's MTP proposer does). This module knows nothing
of scheduling.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrid_jax.cache import (
    CacheStacks,
    RaggedBatch,
    flatten_stacks,
    init_caches,
    layer_batches,
    layer_cache,
    layer_sites,
    store_layer,
    unflatten_stacks,
)
from hybrid_jax.config import ModelConfig
from hybrid_jax.layers.mtp import mtp_layer_spec
from hybrid_jax.model import CausalLM
from hybrid_jax.ragged import block_ragged


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """A config whose layers are the head's (for cache shapes and layer sites only)."""
    spec = mtp_layer_spec(cfg)
    return dataclasses.replace(cfg, layers=(spec,) * cfg.mtp_num_hidden_layers, mtp_num_hidden_layers=0,
                               separate_mlp_layers=False)


def with_mtp_layers(cfg: ModelConfig) -> ModelConfig:
    """The target's config with the head's layers appended (memory planning: each page of
    the shared group then also holds the head's K/V)."""
    spec = mtp_layer_spec(cfg)
    return dataclasses.replace(cfg, layers=cfg.layers + (spec,) * cfg.mtp_num_hidden_layers)


def mtp_group(cfg: ModelConfig) -> int:
    """The target's window group whose page tables the head's K/V share."""
    return cfg.windows.index(mtp_layer_spec(cfg).window)


def mtp_init_caches(cfg: ModelConfig, *, num_pages: int, page_size: int, dtype) -> CacheStacks:
    """Zeroed K/V of the head's layers: `num_pages` pages (those of `mtp_group`)."""
    return init_caches(mtp_config(cfg), num_pages=(num_pages,), page_size=page_size, num_slots=1,
                       dtype=dtype)


def mtp_forward(model: CausalLM, batch: RaggedBatch, caches: CacheStacks, hidden: jax.Array, *,
                decode: bool) -> tuple[jax.Array, CacheStacks]:
    """The head over the ragged tokens: batch.tokens [t] are x_{p+1}, hidden [t, d] the
    target's h_p; batch's page tables and slot mappings are the shared group's only.
    Returns (the head's normed output g [t, d], the head's caches)."""
    head = model.mtp
    x = head.combine(model.embed_tokens(batch.tokens), hidden)
    flat, geom = flatten_stacks(caches)
    sites = layer_sites(mtp_config(model.cfg))
    for block, site, lb in zip(head.layers, sites, layer_batches(batch, sites, geom), strict=True):
        x, cache = block_ragged(block, x, lb, layer_cache(flat, site), site.group, decode)
        flat = store_layer(flat, site, cache)
    return head.norm(x.astype(head.dtype)), unflatten_stacks(flat, caches)


def mtp_propose(model: CausalLM, batch: RaggedBatch, caches: CacheStacks, hidden: jax.Array,
                k: int, *, decode: bool) -> tuple[jax.Array, CacheStacks]:
    """`mtp_forward`, then k greedy drafts per sequence -> (drafts [b, k] int32, caches).

    batch.last_token [b]: each sequence's last valid token (its draft 1 is predicted
    there; position p of that token: drafts 2..k are written at p + 1 .. p + k - 1, in
    pages the caller reserved or, past them, wherever the ring row points: a draft's K/V
    is only ever read by the drafts after it, and overwritten by the next step).
    Padding rows (empty) draft garbage from the dummy page.
    """
    g, caches = mtp_forward(model, batch, caches, hidden, decode=decode)
    b = batch.slot_ids.shape[0]
    last = jnp.take(g, batch.last_token, axis=0)  # [b, d]
    tok = jnp.argmax(model.head(last), axis=-1).astype(jnp.int32)
    drafts = [tok]
    if k > 1:
        real = batch.cu_seqlens[1:] > batch.cu_seqlens[:-1]
        p0 = jnp.take(batch.positions, batch.last_token)
        table = batch.page_tables[0]
        s, width = caches.kv[0].k.shape[3], table.shape[1]
        rows = jnp.arange(b, dtype=jnp.int32)
        base = batch._replace(cu_seqlens=jnp.concatenate([jnp.zeros(1, jnp.int32),
                                                          jnp.cumsum(real, dtype=jnp.int32)]),
                              last_token=jnp.where(real, rows, 0))
        for j in range(1, k):
            pos = p0 + j
            mapping = table[rows, (pos // s) % width] * s + pos % s
            step = base._replace(tokens=tok, positions=jnp.where(real, pos, 0),
                                 lengths=jnp.where(real, pos + 1, 0),
                                 slot_mappings=(jnp.where(real, mapping, 0).astype(jnp.int32),))
            last, caches = mtp_forward(model, step, caches, last, decode=True)
            tok = jnp.argmax(model.head(last), axis=-1).astype(jnp.int32)
            drafts.append(tok)
    return jnp.stack(drafts, axis=1), caches
