"""The serving path: a forward over a ragged batch with paged K/V and slot-indexed state.

Same modules and weights as the full-sequence forward (`CausalLM.__call__`); only the
mixer cores change: K/V are written into pages and attended through the paged kernels,
the conv and scans read each sequence's state from its slot (zero when `has_initial`
is False) and write the final state back. `decode=True` is the one-token-per-sequence
specialisation (t == b). Kernels come from `pallas_kernels` under its one impl switch.
Cached decoding through this path reproduces the full forward token for token.

The caches arrive stacked by kind (`CacheStacks`, hybrid_jax/cache.py). A forward
merges each stack's layer rows into one pool and gives layer j its view: the pool,
with the batch's page table, slot mapping and slot ids offset to its rows
(`cache.layer_batches`); what a layer returns is the pool for the next layer of its kind.

The recurrent mixers' serving paths (Mamba2, Mamba1, RG-LRU, short conv, Gated DeltaNet)
live in `hybrid_jax/ragged_recurrent.py`; this module drives the layers, runs attention
over the paged K/V and merges the parallel hybrid's branches.

`forward_verify` is the speculative-decoding variant: every sequence has the same q
tokens (the last sampled token and q - 1 drafts). Attention takes the q-token queries
through the paged decode kernel's multi-query form; Mamba2 takes all q tokens in one
`mamba2_step` call (Mamba2 shapes the fused kernel does not take run the one-token decode
kernels q times on the sequences' gathered states); the RG-LRU's and short conv's convs
and the RG-LRU scan run as small elementwise XLA over the q positions (k shifted
multiply-adds; the scan unrolled over q). All keep the state after EACH position
(`Candidates`, [q, b, ...]) instead of writing it back: once the acceptance is known,
`choose` writes the state after the last accepted position into the slots. A rejected
token's effect never reaches a slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from configs import switches
from hybrid_jax import ragged_recurrent as rec
from hybrid_jax.cache import (
    CacheStacks,
    KVCache,
    LayerCache,
    Mamba2State,
    RaggedBatch,
    flatten_stacks,
    layer_batches,
    layer_cache,
    layer_sites,
    store_layer,
    unflatten_stacks,
)
from hybrid_jax.config import ModelConfig
from hybrid_jax.layers.attention import Attention, gated_heads
from hybrid_jax.layers.mla import MLAttention
from hybrid_jax.layers.rotary import rope_cos_sin
from hybrid_jax.layers.shared_block import DepthAttention, SharedBlock
from hybrid_jax.model import Block, CausalLM, _scale
from pallas_kernels import (
    add_rms_norm,
    attention_ssm_decode,
    decode_fused_fits,
    mamba2_step_fits,
    mixer_merge,
    mla_decode,
    mla_decode_fits,
    paged_attention_decode,
    paged_attention_decode_fused,
    paged_attention_prefill,
    write_kv,
)


def _attention(layer: Attention | DepthAttention, x: jax.Array | None, batch: RaggedBatch, kv: KVCache,
               group: int, decode: bool, q_len: int = 0,
               fused: tuple[jax.Array, tuple[int, int, int]] | None = None,
               project_out: bool = True, merge: bool = True) -> tuple[jax.Array, KVCache]:
    """Paged attention over the ragged tokens. q_len > 0 (verification): every sequence has
    q_len tokens, attended by the decode kernel's multi-query form (one program per
    sequence and KV head) instead of the prefill kernel.

    fused: (proj, q/k/v starting columns): a fused layer's projection, already computed
    (x unused). A decode step reads q/k/v there in place through
    `paged_attention_decode_fused` where `_fused_decode` allows; other steps slice them.
    project_out False returns the heads merged [t, h * e] before o_proj (the layer's
    fused_out takes it). merge False (a fused decode, `_merged_decode`): the decode
    kernel's output as `DecodeParts`, its splits not yet merged.
    """
    if isinstance(layer, MLAttention):  # never fused (hybrid_jax/fusion.py)
        return _mla_attention(layer, x, batch, kv, group, decode, q_len)
    raw = None
    if fused is not None:
        cfg, (proj, cols) = layer.cfg, fused
        widths = (cfg.q_width,) + (cfg.num_kv_heads * cfg.head_dim,) * 2
        raw = tuple(proj[..., c:c + w] for c, w in zip(cols, widths, strict=True))
    dtype = (x if raw is None else raw[0]).dtype
    common = dict(window=layer.window, softcap=layer.cfg.softcap, scale=layer.cfg.query_scale)
    table = batch.page_tables[group]
    if fused is not None and decode and not q_len and _fused_decode(layer, kv):
        # One kernel: q's and k's RoPE, the K/V page write and the attention.
        args = _fused_decode_args(layer, fused, batch, kv, group)
        o, k_pages, v_pages = paged_attention_decode_fused(**args, merge=merge)
        return (o if not merge else _attention_out(layer, o, project_out)), KVCache(k_pages, v_pages)
    gate = None
    if isinstance(layer, Attention):  # gated attention (output_gate) returns its gate too
        q, k, v, gate = layer.project_gated(x, batch.positions, raw)
    else:
        q, k, v = layer.project(x, batch.positions)
    e = q.shape[-1]
    pad = kv.k.shape[-1] - e  # pages may be wider than the head (see cache.kv_head_dim)
    if pad:
        q, k, v = (jnp.pad(a, [(0, 0), (0, 0), (0, pad)]) for a in (q, k, v))
    scales = {}
    if kv.k_scale is not None:  # FP8 pages: write_kv quantizes, attention dequantizes
        scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    else:
        k, v = k.astype(kv.k.dtype), v.astype(kv.v.dtype)
    k_pages, v_pages = write_kv(kv.k, kv.v, k, v, batch.slot_mappings[group], **scales)
    if decode or q_len:
        o = paged_attention_decode(q, k_pages, v_pages, batch.lengths, table,
                                   queries=max(q_len, 1), **common, **scales)
    else:
        o = paged_attention_prefill(q, k_pages, v_pages, batch.cu_seqlens,
                                    batch.lengths, table, **common, **scales)
    return (_attention_out(layer, gated_heads(o[..., :e].astype(dtype), gate), project_out),
            KVCache(k_pages, v_pages))


def _mla_attention(layer: MLAttention, x: jax.Array, batch: RaggedBatch, kv: KVCache, group: int,
                   decode: bool, q_len: int = 0) -> tuple[jax.Array, KVCache]:
    """MLA over the latent cache (hybrid_jax/layers/mla.py): each token's latent row [t, 1, L]
    written to its page slot, the queries absorbed into latent space [t, h, L], multi-query
    attention against the pages (one KV head; the same pages as K and V, whose first
    kv_lora_rank output columns are the attended latent), then W_uv and o_proj.

    Decode and verification (decode or q_len) run `mla_decode`: the Pallas kernel where the
    process runs kernels (a GPU, or HYBRID_JAX_KERNELS=interpret) and the latent fits it
    (`mla_decode_fits`: Kimi Linear's 512 + 64 does), else its XLA reference;
    only with HYBRID_JAX_MLA_KERNEL=1 (default off until the kernel is compiled and timed on
    a GPU: it is checked in interpret mode only). Prefill runs the paged prefill reference
    (XLA gathers): the Pallas prefill kernel tiles head widths of 64, 128 or 256, not L."""
    latent = layer.latent(x).astype(kv.k.dtype)
    flat = kv.k.reshape(1, -1, kv.k.shape[-1])
    # Real tokens' slots are distinct; only padding rows share slots of the dummy page 0.
    k_pages = flat.at[0, batch.slot_mappings[group]].set(latent, unique_indices=True).reshape(kv.k.shape)
    q = layer.absorb_q(x)
    rank, table = layer.mla.kv_lora_rank, batch.page_tables[group]
    if decode or q_len:
        # impl None: the process default (the kernel on a GPU, the reference on a CPU).
        impl = None if MLA_KERNEL and mla_decode_fits(rank, k_pages) else "reference"
        o = mla_decode(q, k_pages, batch.lengths, table, rank=rank, scale=layer.cfg.query_scale,
                       queries=max(q_len, 1), impl=impl)
    else:
        o = paged_attention_prefill(q, k_pages, k_pages, batch.cu_seqlens, batch.lengths, table,
                                    window=None, softcap=None, scale=layer.cfg.query_scale,
                                    impl="reference")
    return layer.absorbed_output(o.astype(q.dtype)), kv._replace(k=k_pages)


def _fused_decode_args(layer: Attention, fused: tuple[jax.Array, tuple[int, int, int]], batch: RaggedBatch,
                       kv: KVCache, group: int) -> dict:
    """`paged_attention_decode_fused`'s arguments for a decode step of this layer."""
    cfg, (proj, cols) = layer.cfg, fused
    cos, sin = rope_cos_sin(batch.positions, cfg.rope_dim, *cfg.rope_params(layer.window))
    return dict(proj=proj, cos=cos, sin=sin, k_pages=kv.k, v_pages=kv.v,
                slot_mapping=batch.slot_mappings[group], lengths=batch.lengths,
                page_table=batch.page_tables[group], heads=cfg.num_heads, cols=cols,
                key_multiplier=cfg.key_multiplier, window=layer.window, softcap=cfg.softcap,
                scale=cfg.query_scale)


def _fused_decode(layer: Attention | DepthAttention, kv: KVCache) -> bool:
    """Whether a decode step's attention of this layer runs `paged_attention_decode_fused`:
    RoPE on, no q/k norms, pages exactly as wide as the head, shapes the kernel takes, not
    FP8 (the fused kernel writes K/V in the pools' dtype, unscaled)."""
    cfg = layer.cfg
    return (isinstance(layer, Attention) and cfg.rope and not cfg.qk_norm and kv.k_scale is None
            and decode_fused_fits(cfg.head_dim, cfg.rope_dim, kv.k))


def _attention_out(layer: Attention | DepthAttention, o: jax.Array, project_out: bool) -> jax.Array:
    """o [t, h, e] -> o_proj's output, or the heads merged [t, h * e] (a fused layer's
    fused_out takes them)."""
    return layer.output(o) if project_out else o.reshape(*o.shape[:-2], -1)


def _shared_block(shared: SharedBlock, block: Block, h: jax.Array, e: jax.Array,
                  batch: RaggedBatch, kv: KVCache, group: int,
                  decode: bool, q: int = 0) -> tuple[jax.Array, KVCache]:
    """A SHARED_BLOCK layer's shared attention + MLP over paged K/V; mirrors SharedBlock."""
    view = DepthAttention(shared, block.depth)
    a, kv = _attention(view, shared.attention_input(h, e), batch, kv, group, decode, q)
    return shared.mlp(a, block.depth), kv


def block_ragged(block: Block, h: jax.Array, batch: RaggedBatch, cache: LayerCache,
                 group: int | None, decode: bool,
                 shared: jax.Array | None = None, q: int = 0) -> tuple[jax.Array, LayerCache]:
    """One residual layer over the ragged tokens h [t, d]; mirrors `Block.__call__`.

    q > 0: verification (every sequence has q tokens); the recurrent fields of the
    returned cache are candidates [q, b, ...] (see `forward_verify`), not slot arrays.
    """
    if block.temporal_norm is None:  # MLP-kind layer: no temporal mixer, no cache
        return block.mix(h, None), cache
    out, cache = _temporal(block, block.norm_input(h, shared), batch, cache, group, decode, q)
    return block.mix(h, out), cache


def _temporal(block: Block, u: jax.Array, batch: RaggedBatch, cache: LayerCache,
              group: int | None, decode: bool, q: int = 0,
              parts: bool = False) -> tuple[jax.Array, LayerCache]:
    """A layer's temporal mixers over its normed input u -> (their summed output, cache).
    parts: the output may be depth parts [S, t, d] f32 of the fused out-projection
    (`Linear.partials`; `_forward_decode_glued` sums them in the next norm's launch)."""
    cfg = block.cfg
    out = jnp.zeros_like(u)
    kv, mamba, rglru, short_conv = cache.kv, cache.mamba, cache.rglru, cache.short_conv
    mamba1, gdn = cache.mamba1, cache.gdn
    merged = _merged_decode(block, kv, decode, q)
    # A merged layer's small decode steps run the conv inside the Mamba2 state update; then
    # mixer_merge rolls B's and C's conv states (FOLD_CONV_ROWS).
    fold = merged and u.shape[0] <= FOLD_CONV_ROWS
    # Fused projections (hybrid_jax/fusion.py): one GEMM for the mixers' input projections
    # (their input multipliers are equal), read in place by column; one for o_proj + out_proj.
    proj, col, branches = None, 0, []  # branches: (output, or out-projection input; multiplier)
    if block.fused_in is not None:
        proj = block.fused_in(_scale(u, cfg.attention_in_multiplier if block.attention is not None
                                     else cfg.ssm_in_multiplier))
    project_out = block.fused_out is None
    if block.attention is not None:
        fused = None
        if proj is not None:
            acfg = block.attention.cfg
            qw, kw = acfg.q_width, acfg.num_kv_heads * acfg.head_dim
            fused, col = (proj, (0, qw, qw + kw)), qw + 2 * kw
    if merged and u.shape[0] <= PARALLEL_DECODE_ROWS:
        # Paged decode and the Mamba2 state update in one launch (pallas_kernels/parallel_decode.py).
        ssm_args, conv = rec.mamba2_decode_args(block.mamba, proj, col, batch, mamba, fold=fold)
        (a, k_pages, v_pages), (m, ssm, *folded) = attention_ssm_decode(
            _fused_decode_args(block.attention, fused, batch, kv, group), ssm_args)
        kv, mamba = KVCache(k_pages, v_pages), Mamba2State(folded[0] if folded else conv, ssm)
        branches += [(a, cfg.attention_out_multiplier), (m, cfg.ssm_out_multiplier)]
    else:
        if block.attention is not None:
            x = None if fused is not None else _scale(u, cfg.attention_in_multiplier)
            a, kv = _attention(block.attention, x, batch, kv, group, decode, q, fused, project_out,
                               merge=not merged)
            branches.append((a, cfg.attention_out_multiplier))
        if block.mamba is not None:
            x = None if proj is not None else _scale(u, cfg.ssm_in_multiplier)
            m, mamba = rec.mamba2(block.mamba, x, batch, mamba, decode, q, proj, col, project_out, raw=merged,
                              fold=fold)
            branches.append((m, cfg.ssm_out_multiplier))
    if merged:  # one launch from the kernels' outputs to fused_out's input (decode_glue.py)
        norm = block.mamba.norm
        common = dict(z_col=col, n_groups=norm.n_groups, eps=norm.eps,
                      norm_before_gate=norm.norm_before_gate, row=norm.stack_row)
        if fold:
            x, conv = mixer_merge(branches[0][0], branches[1][0], proj, norm.weight[...], **common,
                                  conv_states=mamba.conv, slot_ids=batch.slot_ids,
                                  xbc_col=col + block.mamba.cfg.d_inner)
            mamba = Mamba2State(conv, mamba.ssm)
        else:
            x = mixer_merge(branches[0][0], branches[1][0], proj, norm.weight[...], **common)
        split = block.fused_out.split_k_parts(x.shape[0])
        if parts and split > 1 and block.recurrent is None and block.conv is None and block.gdn is None:
            return block.fused_out.partials(x, split), LayerCache(kv, mamba, rglru, short_conv, mamba1, gdn)
        out = out + block.fused_out(x)
    elif project_out:
        for y, multiplier in branches:
            out = out + y * multiplier
    elif decode or q:  # multipliers 1: both out-projections as one GEMM over the stacked rows
        out = out + block.fused_out(jnp.concatenate([y for y, _ in branches], axis=-1))
    else:
        # A prefill's rows make the GEMMs compute-bound: one per branch, each over its rows
        # of the stacked weight. Concatenating [t, sum of widths] first cost more than the
        # GEMM saved (XLA built the concatenation transposed: ~2.8 ms of a 64 ms 8k-token
        # step on the H100).
        row, summed = 0, None
        for y, _ in branches:
            part = block.fused_out.product_rows(y, row)
            summed = part if summed is None else summed + part
            row += y.shape[-1]
        if block.fused_out.reduce_axis is not None:  # row-parallel (tensor parallel): one psum
            summed = jax.lax.psum(summed, block.fused_out.reduce_axis)
        out = out + summed
    if block.recurrent is not None:
        r, rglru = rec.rglru(block.recurrent, u, batch, rglru, decode, q)
        out = out + r
    if block.conv is not None:
        c, short_conv = rec.short_conv(block.conv, u, batch, short_conv, decode, q)
        out = out + c
    if block.mamba1 is not None:
        m1, mamba1 = rec.mamba1(block.mamba1, u, batch, mamba1, decode, q)
        out = out + m1
    if block.gdn is not None:
        y, gdn = rec.gated_deltanet(block.gdn, u, batch, gdn, decode, q)
        out = out + y
    return out, LayerCache(kv, mamba, rglru, short_conv, mamba1, gdn)


# Decode steps of fused models run the glue between their GEMMs as one launch where XLA
# took several kernels (pallas_kernels/decode_glue.py): `_merged_decode`, `_glued_residual`.
# HYBRID_JAX_DECODE_GLUE=0 turns both off (A/B measurements; the executable store keys on it).
DECODE_GLUE = switches.decode_glue()
# MLA's decode and verification attention runs the Pallas `mla_decode` kernel where the
# process runs kernels (`_mla_attention`) with HYBRID_JAX_MLA_KERNEL=1 (default: the XLA reference).
MLA_KERNEL = switches.mla_kernel()
# Decode steps of at most this many rows launch a merged layer's paged decode and Mamba2
# state update as one grid (`attention_ssm_decode`). HYBRID_JAX_PARALLEL_DECODE_ROWS=0: apart.
# H100, native-1b-parallel, the two kernels' time per step apart -> together: 0.226 -> 0.150
# ms at B = 1, 0.585 -> 0.521 at 8, 2.04 -> 1.92 at 64, 5.05 -> 4.97 at 128; 6.78 -> 6.90 at
# 256 (docs/history/benchmarks-2026.md, eleventh pass).
PARALLEL_DECODE_ROWS = switches.parallel_decode_rows()
# Decode steps of at most this many rows run a merged layer's conv inside the Mamba2 state
# update's programs (each rolls its x channels' conv state; mixer_merge rolls B's and C's):
# one launch less per layer. H100, native-1b-parallel, kernel time per step apart ->
# folded: 1.579 -> 1.538 ms at B = 1, 2.135 -> 2.111 at 8; slower from 16 rows (2.321 ->
# 2.354 at 16, 3.006 -> 3.078 at 32, 3.79 -> 3.95 at 64: every program convolving B and C
# costs more than the launch saved; docs/history/benchmarks-2026.md, twelfth pass).
# HYBRID_JAX_FOLD_CONV_ROWS=0: conv1d_decode apart.
FOLD_CONV_ROWS = switches.fold_conv_rows()


def _merged_decode(block: Block, kv: KVCache | None, decode: bool, q: int) -> bool:
    """Whether a decode step of this parallel hybrid layer (attention and Mamba2 summed by
    one fused out-projection) merges paged decode's splits, applies the gated norm and
    concatenates the two branches in one `mixer_merge` launch."""
    if not (DECODE_GLUE and decode and not q and block.fused_in is not None
            and block.fused_out is not None):
        return False
    mixer, norm = block.mamba, block.mamba.norm
    return (_fused_decode(block.attention, kv) and norm is not None and norm.stack_row is not None
            and norm.group_devices == 1 and mixer.cfg.in_proj_multipliers is None
            and not (rec.FUSED_MAMBA_DECODE and mamba2_step_fits(mixer.cfg.head_dim, mixer.cfg.state_size)))


def _glued_residual(model: CausalLM, decode: bool) -> bool:
    """Whether a decode step adds each branch to the residual stream in the launch that
    normalises the sum for the next sub-block (`add_rms_norm`): plain pre-norm residuals
    (no sandwich norms, multiplier or f32 stream, no shared blocks) whose norms the fused
    copy stacked (hybrid_jax/fusion.py)."""
    cfg = model.cfg
    norms = [n for b in model.layers for n in (b.temporal_norm, b.mlp_norm) if n is not None]
    return (DECODE_GLUE and decode and not cfg.sandwich_norm and not cfg.residual_in_fp32
            and cfg.residual_multiplier == 1.0 and model.shared_blocks is None
            and all(b.depth is None for b in model.layers)
            and all(n.stack_row is not None and n.weight.dtype == model.dtype for n in norms))


def _add_norm(h: jax.Array, delta: jax.Array | None, norm) -> tuple[jax.Array, jax.Array]:
    """(h + delta, norm(h + delta)); delta None: (h, norm(h))."""
    if delta is None:
        return h, norm(h)
    return add_rms_norm(h, delta, norm.weight[...], eps=norm.eps, offset=norm.offset,
                        row=norm.stack_row)


def _mlp_out(mlp, u: jax.Array) -> jax.Array:
    """The MLP's output, or its down-projection's depth parts [S, t, d] f32 where
    `Linear.split_k_parts` splits it (summed by the next `add_rms_norm`)."""
    down = mlp.down_proj
    split = down.split_k_parts(u.shape[0])
    if split == 1 or mlp.down_multiplier != 1.0:
        return mlp(u)
    return down.partials(mlp.hidden(u), split)


def _forward_decode_glued(model: CausalLM, batch: RaggedBatch, caches: CacheStacks
                          ) -> tuple[jax.Array, CacheStacks, jax.Array]:
    """`forward_ragged`'s decode step with each residual add done by the next norm's launch:
    a sub-block's output waits (`pending`) until the norm that reads the sum (`Block.mix`
    and `Block.norm_input` in one). The fused out-projection and the MLP's down-projection
    may leave their output as depth parts (`Linear.partials`), which that launch sums."""
    h = model.embed_tokens(batch.tokens)
    flat, geom = flatten_stacks(caches)
    sites = layer_sites(model.cfg)
    pending = None
    for block, site, lb in zip(model.layers, sites, layer_batches(batch, sites, geom), strict=True):
        if block.temporal_norm is not None:
            h, u = _add_norm(h, pending, block.temporal_norm)
            pending, cache = _temporal(block, u, lb, layer_cache(flat, site), site.group, True, parts=True)
            flat = store_layer(flat, site, cache)
        if block.mlp is not None:
            h, u = _add_norm(h, pending, block.mlp_norm)
            pending = _mlp_out(block.mlp, u)
        elif block.moe is not None:  # token-wise: the same call as the full-sequence forward
            h, u = _add_norm(h, pending, block.mlp_norm)
            pending = block.moe(u)
    if pending is not None:
        h = h + (jnp.sum(pending, axis=0) if pending.ndim == 3 else pending).astype(h.dtype)
    return model.logits(jnp.take(h, batch.last_token, axis=0)), unflatten_stacks(flat, caches), h


def _layers(model: CausalLM, batch: RaggedBatch, caches: CacheStacks, decode: bool, q: int = 0
            ) -> tuple[jax.Array, CacheStacks, tuple[LayerCache, ...]]:
    """Every layer over the flattened stacks -> (h, the flattened stacks after them, each
    layer's cache as the layer returned it)."""
    h = e = model.embed_tokens(batch.tokens)
    flat, geom = flatten_stacks(caches)
    sites = layer_sites(model.cfg)
    returned = []
    for block, site, lb in zip(model.layers, sites, layer_batches(batch, sites, geom), strict=True):
        shared, cache = None, layer_cache(flat, site)
        if block.depth is not None:  # the layer's K/V belong to its shared-block attention
            sb = model.shared_blocks[block.depth.block]
            shared, kv = _shared_block(sb, block, h, e, lb, cache.kv, site.group, decode, q)
            cache = cache._replace(kv=kv)
        h, cache = block_ragged(block, h, lb, cache, site.group, decode, shared, q)
        # Verification returns candidates in the recurrent fields: only K/V go back.
        flat = store_layer(flat, site, LayerCache(kv=cache.kv) if q else cache)
        returned.append(cache)
    return h, flat, tuple(returned)


def forward_ragged(model: CausalLM, batch: RaggedBatch, caches: CacheStacks, *,
                   decode: bool, hidden: bool = False):
    """Ragged forward -> (logits [b, v] f32 at each sequence's last token, new caches).

    hidden: also return the LM head's input at every token, [t, d] (after the final norm;
    what the MTP head takes, hybrid_jax/mtp_ragged.py)."""
    if _glued_residual(model, decode):
        logits, caches, h = _forward_decode_glued(model, batch, caches)
    else:
        h, flat, _ = _layers(model, batch, caches, decode)
        logits, caches = model.logits(jnp.take(h, batch.last_token, axis=0)), unflatten_stacks(flat, caches)
    if hidden:
        return logits, caches, model.final_norm(h.astype(model.dtype))
    return logits, caches


def forward_verify(model: CausalLM, batch: RaggedBatch, caches: CacheStacks, q: int,
                   hidden: bool = False) -> tuple[jax.Array, CacheStacks, tuple[LayerCache, ...]]:
    """Verification forward: every sequence has q tokens (t = b * q, sequence-major).

    Returns (logits [t, v] f32 at EVERY token, the caches with K/V pages written for all t
    tokens and the states untouched, and per layer its candidates: LayerCache whose
    recurrent fields are [q, b, ...], the state after each of the q positions; see `choose`).
    """
    h, flat, returned = _layers(model, batch, caches, False, q)
    candidates = tuple(c._replace(kv=None) for c in returned)
    if hidden:  # the LM head's input at every token, appended (see `forward_ragged`)
        normed = model.final_norm(h.astype(model.dtype))
        return model.head(normed), unflatten_stacks(flat, caches), candidates, normed
    return model.logits(h), unflatten_stacks(flat, caches), candidates


def choose(caches: CacheStacks, candidates: tuple[LayerCache, ...], slot_ids: jax.Array,
           index: jax.Array, cfg: ModelConfig) -> CacheStacks:
    """Write candidate state `index[i]` (0..q-1) of sequence i into slot `slot_ids[i]` of
    each recurrent layer's row of the stacks (`forward_verify`'s caches and candidates)."""
    rows = jnp.arange(slot_ids.shape[0])
    for site, cand in zip(layer_sites(cfg), candidates, strict=True):
        if site.state is None:
            continue
        stack = jax.tree.map(
            lambda s, c, r=site.state_rank: s.at[r, slot_ids].set(c[index, rows].astype(s.dtype)),
            getattr(caches, site.state), getattr(cand, site.state))
        caches = caches._replace(**{site.state: stack})
    return caches
