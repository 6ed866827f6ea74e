"""A fused model's decode step with its glue in single launches (pallas_kernels/decode_glue.py:
`add_rms_norm` for every residual add and the norm after it, `mixer_merge` for a parallel
hybrid layer's split merge, gated norm and concatenation; `attention_ssm_decode` for its
paged decode and Mamba2 state update) gives the logits and caches of
the same model with the glue as XLA ops (`ragged.DECODE_GLUE` off). The kernels run in
interpret mode, paged decode with three splits, so the merge of split partial states is
the kernel's. Also: which models take the glued path, and that the unfused model never
does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.paged_attention as pa
from hybrid_jax import ragged, ragged_recurrent
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.fusion import fuse_projections
from hybrid_jax.layers import linear
from hybrid_jax.model import CausalLM
from pallas_kernels import (
    add_rms_norm,
    attention_ssm_decode,
    conv1d_decode,
    mixer_merge,
    paged_attention_decode_fused,
    ssm_decode_packed,
)
from tests.model.test_ragged_forward import MAX_LEN, Harness, decode_after


def _config(**kw) -> ModelConfig:
    return ModelConfig(
        architecture="native", vocab_size=64, hidden_size=32,
        layers=(LayerSpec("hybrid", None), LayerSpec("mamba2"), LayerSpec("hybrid", 6),
                LayerSpec("attention", None), LayerSpec("mlp")),
        attention=AttentionConfig(4, 2, 64), mamba2=Mamba2Config(4, 16, 16, n_groups=2, chunk_size=16),
        mlp=MLPConfig(64), max_position_embeddings=MAX_LEN, **kw)


def _randomize_norms(model: CausalLM, seed: int) -> None:
    """Norm weights away from their initial ones (ones / zeros), so a wrong row shows."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and len(path) > 1 and "norm" in str(path[-2]) and path[-1] == "weight":
            var.value = jnp.asarray(1 + 0.3 * rng.standard_normal(var.value.shape), var.value.dtype)


@pytest.mark.parametrize("cfg,split_k,one_launch,fold", [
    (_config(), False, False, False), (_config(), True, False, True), (_config(), True, True, False),
    (_config(), True, True, True),
    (_config(norm_offset=True, attention_out_multiplier=0.5), True, True, True),
], ids=["parallel", "parallel-split-k-conv-folded", "parallel-split-k-one-launch",
        "parallel-split-k-one-launch-conv-folded", "offset-norms-no-fused-out-split-k"])
def test_glued_decode_equals_xla_glue(monkeypatch, cfg, split_k, one_launch, fold):
    """split_k: the fused out-projections and down-projections leave depth parts
    (`Linear.partials`, two here) that `add_rms_norm` sums (as on a GPU at 2-64 rows).
    one_launch: each merged layer's paged decode and Mamba2 state update run as one
    interpret-mode launch (`attention_ssm_decode`); else paged decode alone is a kernel.
    fold: a merged layer's conv runs in the state update's programs (`ragged.FOLD_CONV_ROWS`),
    mixer_merge rolling B's and C's conv states; else conv1d_decode runs apart."""
    monkeypatch.setattr(linear, "SPLIT_K", split_k)  # off means off on a GPU too
    monkeypatch.setattr(linear, "SPLIT_K_ANY_BACKEND", split_k)
    monkeypatch.setattr(ragged, "PARALLEL_DECODE_ROWS", 64 if one_launch else 0)
    monkeypatch.setattr(ragged, "FOLD_CONV_ROWS", 64 if fold else 0)
    model = CausalLM(cfg, rngs=nnx.Rngs(4))
    _randomize_norms(model, 1)
    fused = fuse_projections(model)
    prompts = [np.random.default_rng(n).integers(0, 64, n).tolist() for n in (3, 9, 14)]
    calls = {"add_rms_norm": 0, "mixer_merge": 0, "partials": 0, "attention_ssm_decode": 0,
             "conv1d_decode": 0}
    partials = linear.Linear.partials

    def count_partials(self, x, parts):
        calls["partials"] += 1
        return partials(self, x, parts)

    monkeypatch.setattr(linear.Linear, "partials", count_partials)

    def counted(fn, name):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw, impl="interpret")
        return run

    monkeypatch.setattr(pa, "default_splits", lambda *_: 3)

    def serve(glue: bool):
        h = Harness(fused, len(prompts), fresh=True)
        h.run(dict(enumerate(prompts)), decode=False)
        with monkeypatch.context() as m:
            m.setattr(ragged, "DECODE_GLUE", glue)
            m.setattr(ragged, "add_rms_norm", counted(add_rms_norm, "add_rms_norm"))
            m.setattr(ragged, "mixer_merge", counted(mixer_merge, "mixer_merge"))
            m.setattr(ragged_recurrent, "conv1d_decode", counted(conv1d_decode, "conv1d_decode"))
            m.setattr(ragged_recurrent, "ssm_decode_packed",
                      lambda *a, **kw: ssm_decode_packed(*a, **kw | {"impl": "interpret"}))
            m.setattr(ragged, "paged_attention_decode_fused",
                      lambda *a, **kw: paged_attention_decode_fused(*a, **kw, impl="interpret"))

            def one_launch(attention, ssm):
                calls["attention_ssm_decode"] += 1
                return attention_ssm_decode(attention | {"impl": "interpret"}, ssm | {"impl": "interpret"})

            m.setattr(ragged, "attention_ssm_decode", one_launch)
            logits = decode_after(h, prompts, MAX_LEN - 14 - 1)  # past the window of 6 and pages
        return logits, h.caches

    got, got_caches = serve(True)
    # Per trace of the decode step (one on the CPU; a GPU may trace twice): 8 norms after
    # an add in 5 layers (the first layer's input norm has nothing pending), one
    # mixer_merge per parallel layer with fused_out, parts from every MLP's
    # down-projection (5) and each merged layer's fused out-projection.
    traces = calls["add_rms_norm"] // 8
    assert traces >= 1 and calls["add_rms_norm"] == 8 * traces
    assert calls["mixer_merge"] == traces * (2 if cfg.attention_out_multiplier == 1.0 else 0)
    assert calls["partials"] == (5 * traces + calls["mixer_merge"] if split_k else 0)
    assert calls["attention_ssm_decode"] == (calls["mixer_merge"] if one_launch else 0)
    # Three Mamba2 layers per trace: the conv of each merged one folded (if on), the plain one's apart.
    assert calls["conv1d_decode"] == 3 * traces - (calls["mixer_merge"] if fold else 0)
    seen = dict(calls)
    want, want_caches = serve(False)
    assert calls == seen | {"conv1d_decode": calls["conv1d_decode"]}, \
        "the run with DECODE_GLUE off took a glued path"
    unglued = calls["conv1d_decode"] - seen["conv1d_decode"]  # every conv apart (its own traces)
    assert unglued >= 3 and unglued % 3 == 0
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(jax.tree.leaves(got_caches), jax.tree.leaves(want_caches), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_which_models_glue():
    fused = fuse_projections(CausalLM(_config(), rngs=nnx.Rngs(0)))
    assert ragged._glued_residual(fused, decode=True)
    assert not ragged._glued_residual(fused, decode=False)
    # Unfused: the norms are not stacked (each would be copied before the custom call).
    assert not ragged._glued_residual(CausalLM(_config(), rngs=nnx.Rngs(0)), decode=True)
    for change in (dict(sandwich_norm=True), dict(residual_in_fp32=True), dict(residual_multiplier=0.5)):
        other = fuse_projections(CausalLM(dataclasses.replace(_config(), **change), rngs=nnx.Rngs(0)))
        assert not ragged._glued_residual(other, decode=True), change


def test_norm_stacks_are_the_originals():
    model = CausalLM(_config(), rngs=nnx.Rngs(0))
    _randomize_norms(model, 2)
    fused = fuse_projections(model)
    for mine, theirs in zip(fused.layers, model.layers, strict=True):
        for name in ("temporal_norm", "mlp_norm"):
            a, b = getattr(mine, name), getattr(theirs, name)
            if b is None:
                continue
            assert a.stack_row is not None and b.stack_row is None
            np.testing.assert_array_equal(np.asarray(a.value()), np.asarray(b.weight[...]))
        if theirs.mamba is not None:
            np.testing.assert_array_equal(np.asarray(mine.mamba.norm.value()),
                                          np.asarray(theirs.mamba.norm.weight[...]))
    stacks = {id(b.temporal_norm.weight) for b in fused.layers if b.temporal_norm is not None}
    assert len(stacks) == 1
