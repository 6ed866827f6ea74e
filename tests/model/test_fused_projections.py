"""Fused projections (hybrid_jax/fusion.py): the serving path of a fused model reproduces
the unfused model's full forward (greedy tokens, logits), for each kind of layer and the
configurations that switch a fusion off; the argument model is left as it was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.fusion import MAMBA_STACKED, fuse_projections, is_fused
from hybrid_jax.generate import greedy_generate
from hybrid_jax.layers.linear import Linear
from hybrid_jax.model import CausalLM
from tests.model.test_ragged_forward import MAX_LEN, Harness, all_kinds_config, serve_greedy


def _hybrid_config(**kw) -> ModelConfig:
    mamba = kw.pop("mamba2", Mamba2Config(4, 16, 16, n_groups=2, chunk_size=16))
    attention = kw.pop("attention", AttentionConfig(4, 2, 16))
    return ModelConfig(
        architecture="native", vocab_size=64, hidden_size=32,
        layers=(LayerSpec("hybrid", 6), LayerSpec("attention", None), LayerSpec("mamba2"),
                LayerSpec("hybrid", None)),
        attention=attention, mamba2=mamba, mlp=MLPConfig(64), max_position_embeddings=MAX_LEN, **kw)


def _randomize_biases(model: CausalLM, seed: int) -> None:
    """Non-zero biases, so a misplaced bias column shows."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path and path[-1] == "bias":
            var.value = jnp.asarray(0.2 * rng.standard_normal(var.value.shape), var.value.dtype)


CONFIGS = {
    "hybrid": _hybrid_config(),
    # Biases on q/k/v only (zeros fill in_proj's columns), muP in_proj multipliers; an
    # output multiplier: no fused_out.
    "qkv_bias_muP": _hybrid_config(
        attention=AttentionConfig(4, 2, 16, qkv_bias=True),
        mamba2=Mamba2Config(4, 16, 16, n_groups=2, chunk_size=16,
                            in_proj_multipliers=(1.0, 0.5, 2.0, 1.5, 0.7)),
        attention_out_multiplier=0.5),
    "unequal_in": _hybrid_config(ssm_in_multiplier=0.5),  # no fused_in for hybrids, fused_out kept
    "all_kinds": all_kinds_config(),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request):
    model = CausalLM(CONFIGS[request.param], rngs=nnx.Rngs(0))
    _randomize_biases(model, 3)
    return request.param, model, fuse_projections(model)


def test_which_layers_fuse(case):
    name, model, fused = case
    kinds = [spec.kind.value for spec in model.cfg.layers]
    fin = [b.fused_in is not None for b in fused.layers]
    fout = [b.fused_out is not None for b in fused.layers]
    has_attention = [k in ("hybrid", "attention") for k in kinds]
    want_in = [k == "attention" for k in kinds] if name == "unequal_in" else has_attention
    want_out = [k == "hybrid" and name != "qkv_bias_muP" for k in kinds]
    assert fin == want_in and fout == want_out
    assert all(b.mlp.gate_up_proj is not None and b.mlp.gate_proj is None for b in fused.layers)
    assert is_fused(fused) and not is_fused(model)


def test_fused_weights_are_the_originals(case):
    """The fused Linears hold the originals concatenated, transposed ([out, in]), and
    every other plain Linear of the layers is held transposed too."""
    _, model, fused = case
    for orig, new in zip(model.layers, fused.layers, strict=True):
        if new.fused_in is not None:
            parts = [orig.attention.q_proj, orig.attention.k_proj, orig.attention.v_proj] \
                if orig.attention is not None else []
            parts += [orig.mamba.in_proj] if orig.mamba is not None else []
            assert new.fused_in.transposed
            np.testing.assert_array_equal(
                new.fused_in.kernel[...], jnp.concatenate([p.kernel[...] for p in parts], axis=1).T)
            if new.fused_in.bias is not None:
                want = [p.bias[...] if p.bias is not None else jnp.zeros(p.kernel.shape[1])
                        for p in parts]
                np.testing.assert_array_equal(new.fused_in.bias[...], jnp.concatenate(want))
        if new.fused_out is not None:
            assert new.fused_out.transposed
            np.testing.assert_array_equal(new.fused_out.kernel[...], jnp.concatenate(
                [orig.attention.o_proj.kernel[...], orig.mamba.out_proj.kernel[...]], axis=0).T)
        assert new.mlp.gate_up_proj.transposed and new.mlp.down_proj.transposed
        np.testing.assert_array_equal(new.mlp.gate_up_proj.kernel[...], jnp.concatenate(
            [orig.mlp.gate_proj.kernel[...], orig.mlp.up_proj.kernel[...]], axis=1).T)
        np.testing.assert_array_equal(new.mlp.down_proj.kernel[...], orig.mlp.down_proj.kernel[...].T)
        assert not orig.mlp.down_proj.transposed  # the argument model keeps [in, out]
        for _, node in nnx.iter_graph(new):
            if isinstance(node, Linear):
                assert node.transposed
    # Mamba2 parameters: one stack per name, shared by the layers, row i = layer i's.
    mixers = [(o.mamba, n.mamba) for o, n in zip(model.layers, fused.layers, strict=True)
              if o.mamba is not None]
    for name in MAMBA_STACKED:
        if getattr(mixers[0][0], name) is None:
            continue
        assert len({id(getattr(n, name)) for _, n in mixers}) == 1  # one shared Variable
        for i, (o, n) in enumerate(mixers):
            assert n.stack_row == i
            np.testing.assert_array_equal(n.param(name), getattr(o, name)[...])
    leaves = jax.tree.leaves(nnx.state(fused))
    assert len(leaves) == len({id(x) for x in leaves})  # shared stacks appear once


def test_argument_model_unchanged_and_fused_refuses_full_forward(case):
    _, model, fused = case
    tokens = jnp.asarray([[1, 2, 3]])
    assert all(b.mlp.gate_proj is not None for b in model.layers)
    model(tokens)  # still runs
    with pytest.raises(ValueError, match="fused projections"):
        fused(tokens)


PROMPTS = [np.random.default_rng(n).integers(0, 64, n).tolist() for n in (1, 9, 17, 30)]
NEW = 8


@pytest.mark.parametrize("case", ["qkv_bias_muP"], indirect=True)
def test_fused_serving_matches_unfused_full_forward(case):
    """Greedy tokens in chunked prefill + decode, one configuration (CI time; the logits
    test below covers every one, and the engine's parity tests run fused models)."""
    _, model, fused = case
    reference = [greedy_generate(model, p, NEW) for p in PROMPTS]
    assert serve_greedy(fused, PROMPTS, NEW, 5, True) == reference


def test_fused_logits_match_unfused(case):
    _, model, fused = case
    prompt = np.random.default_rng(5).integers(0, 64, 20).tolist()
    got, want = Harness(fused, 1), Harness(model, 1)
    for part, decode in ((prompt[:13], False), (prompt[13:], False), (prompt[:1], True)):
        np.testing.assert_allclose(got.run({0: part}, decode=decode)[0],
                                   want.run({0: part}, decode=decode)[0], rtol=1e-5, atol=1e-5)


def test_tensor_parallel_marks_block_fusion():
    model = CausalLM(CONFIGS["hybrid"], rngs=nnx.Rngs(0))
    model.layers[0].attention.k_proj.gather_axis = "tp"
    model.layers[0].mlp.up_proj.reduce_axis = "tp"
    fused = fuse_projections(model)
    assert fused.layers[0].fused_in is None and fused.layers[0].mlp.gate_up_proj is None
    assert fused.layers[3].fused_in is not None


def test_config_in_proj_width():
    cfg = Mamba2Config(4, 16, 16, n_groups=2)
    assert cfg.in_proj_width == cfg.d_inner + cfg.conv_dim + cfg.num_heads
    assert dataclasses.replace(cfg, num_heads=8).in_proj_width == 8 * 16 * 2 + 2 * 2 * 16 + 8
