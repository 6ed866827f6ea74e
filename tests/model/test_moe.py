"""Mixture of experts: the grouped-GEMM routed sum against its dense reference, the three
MoE architectures' logits against transformers, strict loading of stacked and per-expert
tensors, and the config round trip.

References are independent: `routed_reference` runs every expert on every token and
weights them by a dense combine matrix (no sorting, no groups); transformers' tiny random
models (tests/model/hf_models.py, expert-choice biases set non-zero) check the routers
(softmax top-k renormalised; sigmoid with expert bias, eps and scaling; group-limited
choice) and the expert layouts. Engine greedy parity is in
tests/serving/test_engine_parity_hybrids.py, tensor parallelism in
tests/serving/tensor_parallel_child.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.checkpoints import CheckpointError, load_hf  # noqa: E402
from hybrid_jax.config import ModelConfig  # noqa: E402
from hybrid_jax.layers.moe import routed_experts, routed_reference  # noqa: E402
from tests.model import hf_models  # noqa: E402


@pytest.mark.parametrize(("gated", "activation"), [(True, "silu"), (False, "relu2")])
def test_grouped_gemm_equals_dense_reference(gated, activation):
    t, d, e, k, f = 37, 32, 8, 3, 24
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d))
    # Experts 0..5 only (6 and 7 get no token: empty groups), in random order per token.
    experts = jnp.argsort(jax.random.uniform(keys[1], (t, 6)), axis=1)[:, :k].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (t, k))
    first = jax.random.normal(keys[3], (e, d, 2 * f if gated else f)) * d**-0.5
    down = jax.random.normal(keys[4], (e, f, d)) * f**-0.5
    kw = dict(activation=activation, gated=gated)
    got = jax.jit(lambda *a: routed_experts(*a, **kw))(x, weights, experts, first, down)
    want = routed_reference(x, weights, experts, first, down, **kw)
    assert got.shape == (t, d) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


MOE_ARCHS = ("granite_moe", "lfm2_moe", "nemotron_h_moe")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    hf_model = hf_models.build(arch, tmp_path, seed=1)
    model, cfg = load_hf(tmp_path)
    assert any(s.moe for s in cfg.layers)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(("arch", "drop", "extra", "bad"), [
    # per-expert tensors (LFM2-MoE): one expert's up half missing, an expert too many, a
    # mis-shaped expert down-projection
    ("lfm2_moe", "model.layers.1.feed_forward.experts.2.w3.weight",
     "model.layers.1.feed_forward.experts.6.w1.weight", "model.layers.2.feed_forward.experts.0.w2.weight"),
    # stacked tensors (Granite): the router missing, a stray tensor, a stack of too few experts
    ("granite_moe", "model.layers.0.block_sparse_moe.router.layer.weight",
     "model.layers.0.block_sparse_moe.extra.weight", "model.layers.3.block_sparse_moe.input_linear.weight"),
])
def test_loader_reports_missing_unexpected_and_misshaped_together(arch, drop, extra, bad, tmp_path):
    hf_models.build(arch, tmp_path, seed=0)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors[extra] = np.zeros((2, 2), np.float32)
    tensors[bad] = tensors[bad][:-1]
    del tensors[drop]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    assert err.value.missing == [drop] and err.value.unexpected == [extra]
    assert len(err.value.misshaped) == 1 and bad in err.value.misshaped[0]


def test_granite_accepts_transformers_in_memory_expert_names(tmp_path):
    """transformers' names of Granite's expert stacks (`experts.gate_up_proj`,
    `router.weight`) load like the stored ones."""
    hf_model = hf_models.build("granite_moe", tmp_path, seed=0)
    file = tmp_path / "model.safetensors"
    names = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
             "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
             "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
    renamed = {}
    for n, x in load_file(file).items():
        for stored, in_memory in names.items():
            n = n.replace(stored, in_memory)
        renamed[n] = x
    save_file(renamed, file, metadata={"format": "pt"})
    model, cfg = load_hf(tmp_path)
    ids = np.arange(12)[None] % cfg.vocab_size
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
