"""What the device runs each step: the jitted step functions.

The padded shapes (decode and mixed buckets) come from serving/runner/buckets.py; the
builders here return the pure functions `ModelRunner` (serving/runner/runner.py) compiles once per bucket:
`_forward_fn` (feed the previous samples, the ragged forward, penalty statistics, the
plain sampler, and with prefix caching the checkpoint copies), `_verify_fn` (speculative
verification: forward over q tokens, acceptance, state choice), `_multi_fn` (multi-step
decoding: q decode steps in a loop on the device) and `_sampler_fn` (the full sampler:
penalties, filters, top-n logprobs, from a step's logits). Parameters are
an argument, never baked into the HLO; host inputs arrive as one int32 buffer
(serving/runner/host_pack.py). Nothing here holds device state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import switches
from hybrid_jax import tensor_parallel as tp
from hybrid_jax.cache import CacheStacks, RaggedBatch, states_of, with_states
from hybrid_jax.mtp_ragged import mtp_propose
from hybrid_jax.ragged import choose, forward_ragged, forward_verify
from pallas_kernels.stage_copy import write_into
from serving.runner.host_pack import HostLayout
from serving.runner.packing import PackLayout, unpack
from serving.sample.penalties import TokenStats, apply_logit_bias, apply_penalties, update_token_stats
from serving.sample.sampling import sample
from serving.spec_decode.speculative import accept

TOP_LOGPROBS = 20  # top-n logprobs computed every step (n <= 20 per request)


def compile_options() -> dict[str, object]:
    """XLA options for the step executables.

    dot-merger (the pass name has a hyphen) is off: it merges the projections that share
    an input (q/k/v and the Mamba2 in_proj of a hybrid layer) by concatenating their
    WEIGHTS inside the step, a full copy of them on every call (0.47 ms per step on the
    H100 for native-1b-parallel at batch 64).

    Triton GEMM fusions are off: XLA then emits the step's matmuls as cuBLAS calls. The
    Triton kernels were faster (1.40 against 1.82 ms of GEMM time per step), but inside
    the step's CUDA graph the GPU idled ~8.7 us before each of them (1.9 ms per step for
    216 GEMMs of native-1b-parallel, H100, batch 64; 0.15 ms idle in the whole step with
    cuBLAS; `benchmarks/step_anatomy.py` prints the idle time per kernel family).
    HYBRID_JAX_XLA_OPTIONS (JSON) adds or overrides options, for experiments.
    """
    opts: dict[str, object] = {"xla_disable_hlo_passes": "dot-merger", "xla_gpu_enable_triton_gemm": False}
    opts |= switches.xla_options()
    return {k: v for k, v in opts.items() if v is not None}


class CkptOps(NamedTuple):
    """Checkpoint copies of one step, each [K] int32 (unused rows: 0, the dummies)."""

    restore_ckpt: jax.Array  # checkpoint -> ...
    restore_slot: jax.Array  # ... slot, before the forward; the slot's statistics restart
    save_slot: jax.Array  # slot (after the forward) -> ...
    save_ckpt: jax.Array  # ... checkpoint


def _restore(caches: CacheStacks, ckpts: CacheStacks, stats: TokenStats, ops: CkptOps):
    st = jax.tree.map(lambda x, p: x.at[:, ops.restore_slot].set(p[:, ops.restore_ckpt]),
                      states_of(caches), ckpts)
    stats = stats._replace(counts=stats.counts.at[ops.restore_slot].set(0),
                           seen=stats.seen.at[ops.restore_slot].set(False))
    return with_states(caches, st), stats


def _save(ckpts: CacheStacks, caches: CacheStacks, ops: CkptOps) -> CacheStacks:
    return jax.tree.map(lambda p, x: p.at[:, ops.save_ckpt].set(x[:, ops.save_slot]),
                        ckpts, states_of(caches))


class Shardings(NamedTuple):
    """Tensor parallelism: the mesh and the specs of what the step splits over it."""

    mesh: Mesh
    params: NamedSharding  # every packed buffer: split in N equal per-device parts
    caches: object  # pytree of NamedSharding, like the caches
    ckpts: object  # pytree of NamedSharding, like the checkpoint pool (None: no pool)

    def specs(self, tree):
        return jax.tree.map(lambda s: s.spec, tree)


def _forward_fn(graphdef: nnx.GraphDef, layout: PackLayout, decode: bool, host: HostLayout,
                ckpt_ops: bool = False, sh: Shardings | None = None, *, max_seqs: int,
                hidden: bool = False) -> Callable:
    """A step: feed the last step's samples, forward, penalty statistics, plain sampling.

    Returns (caches, stats, logits, plain samples[, checkpoints]): the plain sampler
    (`_sample` with full=False) runs inside the step, so a step whose rows need no
    penalties, filters or top-n logprobs is one executable call (the host's enqueue of a
    second one cost ~0.2-0.3 ms per step, on the critical path at small batches); the
    host runs the full sampler executable on `logits` for the other steps.

    The step's host inputs arrive as one int32 buffer (`host`: sampling arrays, sampler
    slot ids, the ragged batch, feed rows and, with `ckpt_ops`, the checkpoint copies).
    `feed[i] >= 0` takes token i from `last_tokens[feed[i]]` (the previous step's samples,
    still on the device: the overlapped loop never waits for them). Statistics are
    updated unconditionally (cheap; a lax.cond would read its predicate on the host).
    With `ckpt_ops` the step also restores and saves state checkpoints (`CkptOps`).
    With `sh` (tensor parallelism) the model runs per device on its shard under
    `shard_map`; logits come out replicated, and the step's in/out shardings are fixed.

    `outs` (last argument, donated): buffers shaped as (logits, plain samples) that the
    results are written into. On a GPU, XLA places temporaries of the whole step inside
    its output buffers; an output allocated afresh each call has a new address, and the
    CUDA graph's update then touches every node using those temporaries (~80 per decode
    step). The logits buffer is the same every call (serving/runner/result_buffers.py), so what
    XLA puts in it never moves; the sample buffers cycle (the host reads them after the next
    step is dispatched), and `write_into` (pallas_kernels/stage_copy.py) keeps them free of
    temporaries by reading them, so only its node is updated when they change
    (docs/history/benchmarks-2026.md, seventh pass).

    `hidden` (speculative_method="mtp"): the step also returns the LM head's input at every
    token [t, d], last (the MTP step's input: `_mtp_fn`); without it the executable is the
    plain one, untouched.
    """

    def inner(params, caches, batch):
        model = nnx.merge(graphdef, unpack(layout, params))
        return forward_ragged(model, batch, caches, decode=decode, hidden=hidden)

    if sh is not None:
        cache_specs = sh.specs(sh.caches)
        inner = jax.shard_map(inner, mesh=sh.mesh,
                              in_specs=(PartitionSpec(tp.AXIS), cache_specs, PartitionSpec()),
                              out_specs=(PartitionSpec(), cache_specs) + ((PartitionSpec(),) * hidden),
                              check_vma=False)

    def model_forward(params, caches, batch):  # -> (logits, caches, hidden states or None)
        out = inner(params, caches, batch)
        return out if hidden else (*out, None)
    jit = functools.partial(jax.jit, keep_unused=True)  # `outs` is donated, never read
    if sh is not None:
        r = NamedSharding(sh.mesh, PartitionSpec())
        ins = (sh.params, sh.caches, r, r, r) + ((sh.ckpts,) if ckpt_ops else ()) + (r,)
        outs = (sh.caches, r, r, r) + ((sh.ckpts,) if ckpt_ops else ()) + ((r,) if hidden else ())
        jit = functools.partial(jit, in_shardings=ins, out_shardings=outs)

    def model_step(params, caches, stats: TokenStats, batch: RaggedBatch, feed, last_tokens, prompt_len):
        tokens = jnp.where(feed >= 0, last_tokens[jnp.maximum(feed, 0)], batch.tokens)
        batch = batch._replace(tokens=tokens)
        logits, caches, hid = model_forward(params, caches, batch)
        stats = update_token_stats(stats, tokens, batch.positions, batch.cu_seqlens, batch.slot_ids,
                                   batch.has_initial, prompt_len, continues=decode)
        return caches, stats, logits, hid

    def plain(logits, stats, sampling, slot_ids):
        return _sample(logits, stats, sampling, slot_ids, full=False, max_seqs=max_seqs)

    def results(outs, samples):
        # The samples go into their donated buffers by `write_into` (single device; see above).
        return write_into(outs[1], samples) if sh is None else samples

    if not ckpt_ops:
        def forward(params, caches, stats, buf, last_tokens, outs):
            sampling, slot_ids, batch, feed = host.unpack(buf, stage=sh is None)
            caches, stats, logits, hid = model_step(params, caches, stats, batch, feed, last_tokens,
                                                    sampling.prompt_len)
            out = caches, stats, logits, results(outs, plain(logits, stats, sampling, slot_ids))
            return (*out, hid) if hidden else out

        return jit(forward, donate_argnums=(1, 2, 5))

    def forward_ckpt(params, caches, stats, buf, last_tokens, ckpts, outs):
        sampling, slot_ids, batch, feed, ops = host.unpack(buf, stage=sh is None)
        caches, stats = _restore(caches, ckpts, stats, ops)
        caches, stats, logits, hid = model_step(params, caches, stats, batch, feed, last_tokens,
                                                sampling.prompt_len)
        samples = results(outs, plain(logits, stats, sampling, slot_ids))
        out = caches, stats, logits, samples, _save(ckpts, caches, ops)
        return (*out, hid) if hidden else out

    return jit(forward_ckpt, donate_argnums=(1, 2, 5, 6))


def _verify_fn(graphdef: nnx.GraphDef, layout: PackLayout, q: int, host: HostLayout,
               filters: bool, hidden: bool = False, sh: Shardings | None = None) -> Callable:
    """A verification step: forward over q tokens per sequence, acceptance, state choice.

    One executable: the forward keeps every recurrent state after each of the q
    positions (candidates), `accept` decides on the device how many drafts each row
    keeps, and `choose` writes the state after the last accepted position into the
    slots. Penalty statistics are not updated (rows with penalties are never verified).
    `filters`: top-k / top-p / min-p (a vocabulary sort per token; off when no row asks).
    `hidden`: also return the LM head's input at every token [t, d], last (`_mtp_fn`).
    With `sh` (tensor parallelism) all of it runs per device under `shard_map`: the
    logits come out of the forward whole on every device, so each device accepts the
    same drafts and chooses its own shard of the states.
    """

    def core(params, caches, batch, num_drafts, sampling):
        model = nnx.merge(graphdef, unpack(layout, params))
        logits, caches, candidates, *hid = forward_verify(model, batch, caches, q, hidden=hidden)
        b = batch.slot_ids.shape[0]
        out, accepted = accept(logits.reshape(b, q, -1), batch.tokens.reshape(b, q), num_drafts, sampling,
                               filters=filters)
        return choose(caches, candidates, batch.slot_ids, accepted, model.cfg), out, accepted, *hid

    jit = functools.partial(jax.jit, keep_unused=True)
    if sh is not None:
        rep, cache_specs = PartitionSpec(), sh.specs(sh.caches)
        core = jax.shard_map(core, mesh=sh.mesh,
                             in_specs=(PartitionSpec(tp.AXIS), cache_specs, rep, rep, rep),
                             out_specs=(cache_specs, rep, rep) + ((rep,) if hidden else ()), check_vma=False)
        r = NamedSharding(sh.mesh, rep)
        jit = functools.partial(jit, in_shardings=(sh.params, sh.caches, r, r),
                                out_shardings=(sh.caches, r, r) + ((r,) if hidden else ()))

    def verify(params, caches, buf, outs):
        del outs  # donated: the results are written into these buffers (see `_forward_fn`)
        batch, num_drafts, sampling = host.unpack(buf, stage=sh is None)
        return core(params, caches, batch, num_drafts, sampling)

    return jit(verify, donate_argnums=(1, 3))


def _mtp_fn(graphdef: nnx.GraphDef, layout: PackLayout, k: int, host: HostLayout,
            decode: bool, sh: Shardings | None = None, mtp_shardings=None) -> Callable:
    """The MTP step after a target step (serving/spec_decode/mtp.py): the head over the
    step's tokens shifted by one, with the target's hidden states, then k greedy drafts
    per sequence (hybrid_jax/mtp_ragged.py `mtp_propose`).

    Host inputs: the shifted batch (the shared group's page tables only; `last_token`
    the last valid token of each row) and `feed` [t] (>= 0: the token is row feed[i] of
    `src`, the target step's samples still on the device). Returns (the head's K/V,
    drafts [b, k] int32); the head's K/V are donated. With `sh` (tensor parallelism) the
    head runs per device on its shard under `shard_map` (`mtp_shardings`: its K/V's).
    """

    def core(params, mtp_caches, hidden, batch):
        model = nnx.merge(graphdef, unpack(layout, params))
        drafts, mtp_caches = mtp_propose(model, batch, mtp_caches, hidden, k, decode=decode)
        return mtp_caches, drafts

    jit = jax.jit
    if sh is not None:
        rep, specs = PartitionSpec(), sh.specs(mtp_shardings)
        core = jax.shard_map(core, mesh=sh.mesh, in_specs=(PartitionSpec(tp.AXIS), specs, rep, rep),
                             out_specs=(specs, rep), check_vma=False)
        r = NamedSharding(sh.mesh, rep)
        jit = functools.partial(jit, in_shardings=(sh.params, mtp_shardings, r, r, r),
                                out_shardings=(mtp_shardings, r))

    def mtp_step(params, mtp_caches, hidden, buf, src):
        batch, feed = host.unpack(buf, stage=sh is None)
        tokens = jnp.where(feed >= 0, src[jnp.maximum(feed, 0)], batch.tokens)
        return core(params, mtp_caches, hidden, batch._replace(tokens=tokens))

    return jit(mtp_step, donate_argnums=(1,))


def decode_rows(batch: RaggedBatch, q: int) -> Callable[[jax.Array], RaggedBatch]:
    """Step j (0 <= j < q) of a multi-step batch, as the host would build a decode step.

    `batch` holds q tokens per real sequence (sequence-major, as a verification step:
    positions and slot mappings for all q, `lengths` after the q-th); padding rows come
    last and own no tokens. Returns j -> a batch with one token per row of the bucket:
    row i's j-th token (the caller substitutes the sampled ids), the lengths after it,
    and the decode bucket's padding (empty rows, zero lengths, slot and page 0). What
    does not depend on j is built once, outside the caller's loop.
    """
    b = batch.slot_ids.shape[0]
    real = batch.cu_seqlens[1:] > batch.cu_seqlens[:-1]
    steps = lambda x: x.reshape(b, q)
    tokens, positions = steps(batch.tokens), steps(batch.positions)
    slots = tuple(steps(m) for m in batch.slot_mappings)
    base = batch._replace(
        cu_seqlens=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(real, dtype=jnp.int32)]),
        last_token=jnp.where(real, jnp.arange(b, dtype=jnp.int32), 0))

    def at(j) -> RaggedBatch:
        col = lambda x: jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False)
        return base._replace(tokens=col(tokens), positions=col(positions),
                             lengths=jnp.where(real, batch.lengths - (q - 1 - j), 0),
                             slot_mappings=tuple(col(m) for m in slots))

    return at


def _multi_fn(graphdef: nnx.GraphDef, layout: PackLayout, q: int, host: HostLayout,
              filters: bool) -> Callable:
    """Multi-step decoding: q decode steps of every row in one executable.

    A `lax.fori_loop` runs the decode forward (the same computation as a decode step of
    this many rows), the penalty statistics and the sampler q times; step j's samples
    are step j + 1's tokens and fold the key (seed, output index + j), so the tokens
    equal q ordinary decode steps'. The host reserved pages for all q positions
    (`decode_rows`). Rows have no penalties and ask for no top-n logprobs (the host
    sends no others): `_sample` without them, and with `filters` (top-k / top-p / min-p)
    as the full sampler applies them. Returns (caches, stats, tokens [b, q], logprobs
    [b, q]); the host keeps each row's tokens up to its stop (later ones were computed,
    never shown).
    """

    def multi(params, caches, stats, buf, outs):
        del outs  # donated: the results are written into these buffers (see `_forward_fn`)
        sampling, batch = host.unpack(buf, stage=True)
        model = nnx.merge(graphdef, unpack(layout, params))
        b = batch.slot_ids.shape[0]
        rows_at = decode_rows(batch, q)

        def body(j, carry):
            caches, stats, tok, out, lps = carry
            rows = rows_at(j)._replace(tokens=tok)
            logits, caches = forward_ragged(model, rows, caches, decode=True)
            stats = update_token_stats(stats, tok, rows.positions, rows.cu_seqlens, rows.slot_ids,
                                       rows.has_initial, sampling.prompt_len, continues=True)
            nxt, lp, _, _ = _sample(logits, stats, sampling._replace(step=sampling.step + j),
                                    rows.slot_ids, full=False, filters=filters, max_seqs=b)
            out = jax.lax.dynamic_update_index_in_dim(out, nxt, j, axis=1)
            lps = jax.lax.dynamic_update_index_in_dim(lps, lp, j, axis=1)
            return caches, stats, nxt, out, lps

        init = (caches, stats, rows_at(0).tokens,
                jnp.zeros((b, q), jnp.int32), jnp.zeros((b, q), jnp.float32))
        caches, stats, _, out, lps = jax.lax.fori_loop(0, q, body, init)
        return caches, stats, out, lps

    return jax.jit(multi, donate_argnums=(1, 2, 4), keep_unused=True)


def _sample(logits, stats: TokenStats, sampling, slot_ids, *, full: bool, max_seqs: int,
            filters: bool | None = None):
    """(tokens padded to max_seqs, logprobs, top ids, top logprobs) of a step's logits;
    see `_sampler_fn`. `filters` (default: `full`) applies top-k / top-p / min-p."""
    b = logits.shape[0]
    shaped = logits
    if full:
        shaped = apply_penalties(apply_logit_bias(logits, stats, slot_ids), stats, slot_ids,
                                 sampling.repetition, sampling.presence, sampling.frequency)
    tokens, _ = sample(shaped, sampling, filters=full if filters is None else filters)
    raw = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    if full:
        top_lp, top_ids = jax.lax.top_k(raw, TOP_LOGPROBS)
    else:
        top_lp, top_ids = jnp.zeros((b, TOP_LOGPROBS), raw.dtype), jnp.zeros((b, TOP_LOGPROBS), jnp.int32)
    padded = jnp.zeros((max_seqs,), jnp.int32).at[:b].set(tokens)
    return padded, logprobs, top_ids.astype(jnp.int32), top_lp


def _sampler_fn(max_seqs: int, host: HostLayout, replicated: NamedSharding | None = None) -> Callable:
    """The full sampler of a step's logits: logit bias, penalties, top-k/p/min-p and
    top-n logprobs.

    The plain sampler (`_sample` with full=False: none of those) runs inside the forward
    executable; a row without those features samples the same token either way, so the
    host calls this one only for a step where some row needs them. Tokens come back
    padded to `max_seqs` rows: the buffer the next step feeds from. Logprobs (of the
    sampled token and the top-n) are the model's raw distribution, before bias, penalties
    and filters. The sampling arrays and slot ids are the leading fields of the step's host
    buffer.
    """

    def sampler(logits, stats: TokenStats, buf):
        sampling, slot_ids = host.unpack(buf)
        return _sample(logits, stats, sampling, slot_ids, full=True, max_seqs=max_seqs)

    if replicated is None:
        return jax.jit(sampler)
    return jax.jit(sampler, in_shardings=replicated, out_shardings=replicated)
