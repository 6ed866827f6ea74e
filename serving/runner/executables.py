"""The executables a ModelRunner compiles at start-up, as (key, lowering, store key) jobs.

For each shape bucket: the forward step (with the plain sampler inside it), the full
sampler per sequence count, and where configured the verification steps (speculative
decoding, with and without sampling filters), the MTP head's step and the multi-step
decode calls. Each is named by its install key (`ModelRunner._install`) and described
for the executable store (serving/runner/exec_store.py). This module says what to build;
serving/runner/compile_pool.py builds it; the runner installs and dispatches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from serving.runner.step_fns import _forward_fn, _mtp_fn, _multi_fn, _sampler_fn, _verify_fn

if TYPE_CHECKING:
    from serving.runner.runner import ModelRunner


def add_executables(r: ModelRunner, add: Callable[[object, Callable, tuple, tuple], None]) -> None:
    """Call `add(key, jitted function, its arguments (shapes), store description)` for
    every executable `r` serves with."""
    for part in (_forwards, _verifiers, _mtp_steps, _multisteps, _samplers):
        part(r, add)


def _forwards(r: ModelRunner, add) -> None:
    for bucket in r.buckets:
        host = r.host_layouts[bucket]
        ckpt = bool(r.ckpt_ops) and not bucket.decode
        hidden = bool(r.mtp_k)
        fwd = _forward_fn(r.graphdef, r.layout, bucket.decode, host, ckpt, r.shardings,
                          max_seqs=r.max_seqs, hidden=hidden)
        extra = (r.ckpts,) if ckpt else ()
        buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
        outs = r.results.forward_shapes(bucket.seqs)
        add(bucket, fwd, (r.params, r.caches, r.stats, buf, r.last_tokens, *extra, outs),
            # max_seqs: the samples' padding; hidden: the MTP step's variant
            ("forward", bucket, ckpt, r.max_seqs, repr(host), hidden))


def _verifiers(r: ModelRunner, add) -> None:
    for bucket in r.verify_buckets:
        host = r.verify_layouts[bucket]
        buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
        outs = r.results.sync_shapes("verify", bucket)
        for filters in (False, True):
            fn = _verify_fn(r.graphdef, r.layout, r.spec_q, host, filters, bool(r.mtp_k),
                            r.shardings)
            add((bucket, filters), fn, (r.params, r.caches, buf, outs),
                ("verify", bucket, filters, r.spec_q, repr(host), bool(r.mtp_k)))


def _mtp_steps(r: ModelRunner, add) -> None:
    for bucket, host in r.mtp_layouts.items():
        buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
        hid = jax.ShapeDtypeStruct((bucket.tokens, r.cfg.hidden_size), r.dtype)
        add(("mtp", bucket), _mtp_fn(r.graphdef, r.layout, r.mtp_k, host, bucket.decode,
                                     r.shardings, r.mtp_shardings),
            (r.params, r.mtp_caches, hid, buf, r.last_tokens),
            ("mtp", bucket, r.mtp_k, repr(host)))


def _multisteps(r: ModelRunner, add) -> None:
    for bucket in r.multi_buckets:
        host = r.multi_layouts[bucket]
        buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
        outs = r.results.sync_shapes("multi", bucket)
        for filters in (False, True):
            fn = _multi_fn(r.graphdef, r.layout, r.multi_q, host, filters)
            add(("multi", bucket, filters), fn, (r.params, r.caches, r.stats, buf, outs),
                ("multi", bucket, filters, r.multi_q, repr(host)))


def _samplers(r: ModelRunner, add) -> None:
    rep = r.replicated if r.shardings is not None else None
    for b in sorted({bk.seqs for bk in r.buckets}):
        logits = jax.ShapeDtypeStruct((b, r.cfg.vocab_size), jnp.float32, sharding=rep)
        host = r.sampler_layouts[b]
        buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
        # The plain sampler runs inside each forward executable (`_forward_fn`).
        add(b, _sampler_fn(r.max_seqs, host, rep), (logits, r.stats, buf),
            ("sampler", b, r.max_seqs, repr(host)))
