"""Test helpers for the MTP head: a tiny target with a head, and a head trained briefly
on the target's own greedy outputs (so that its drafts agree with the target often)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.loading import LoadedModel
from hybrid_jax.model import CausalLM
from tests.serving.test_engine_parity import native_hybrid


def native_with_mtp(seed: int = 0) -> LoadedModel:
    """The native test hybrid (parallel hybrid + SWA + Mamba2 layers) with a one-layer head."""
    cfg = dataclasses.replace(native_hybrid().config, mtp_num_hidden_layers=1)
    return LoadedModel(CausalLM(cfg, rngs=nnx.Rngs(seed)), cfg, None, "test")


def greedy_batch(model: CausalLM, prompts: np.ndarray, new: int) -> np.ndarray:
    """Greedy continuations of equal-length prompts [b, p] -> [b, p + new] (full forward
    recomputed per token: one compilation)."""
    b, p = prompts.shape
    ids = np.zeros((b, p + new), np.int32)
    ids[:, :p] = prompts
    top = jax.jit(lambda x: jnp.argmax(model(x), axis=-1))
    for cur in range(p, p + new):
        ids[:, cur] = np.asarray(top(jnp.asarray(ids)))[:, cur - 1]
    return ids


def agreeing_head(lm: LoadedModel, damp: float) -> None:
    """Make `lm`'s head agree with its target by construction, in place.

    The target's sub-block outputs (o_proj, out_proj, down_proj) are scaled by `damp`, so
    its next token is mostly decided by the current token's embedding, and context
    (attention, Mamba2 state) flips it now and then. The head is built to compute exactly
    that embedding-only prediction for token t + 2 from x_{t+1}: fc keeps the normed
    embedding part, its decoder layer adds nothing (zero o_proj and down_proj), and its
    norm is the target's final norm. So drafts agree with the target often, not always."""
    m = lm.model
    for block in m.layers:
        for lin in (getattr(block.attention, "o_proj", None), getattr(block.mamba, "out_proj", None),
                    getattr(block.mlp, "down_proj", None)):
            if lin is not None:
                lin.kernel[...] = lin.kernel[...] * damp
    head, d = m.mtp, lm.config.hidden_size
    head.fc.kernel[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))]).astype(head.fc.kernel.dtype)
    for layer in head.layers:
        layer.attention.o_proj.kernel[...] = jnp.zeros_like(layer.attention.o_proj.kernel[...])
        layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
    head.norm.weight[...] = m.final_norm.weight[...]
