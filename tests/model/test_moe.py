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


# transformers' in-memory names of Granite's expert stacks, accepted as aliases of the stored ones
GRANITE_IN_MEMORY = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
                     "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
                     "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    """Granite's checkpoint is rewritten with transformers' in-memory expert names (the
    stored names load in the engine tests)."""
    hf_model = hf_models.build(arch, tmp_path, seed=1)
    if arch == "granite_moe":
        file = tmp_path / "model.safetensors"
        renamed = {}
        for n, x in load_file(file).items():
            for stored, in_memory in GRANITE_IN_MEMORY.items():
                n = n.replace(stored, in_memory)
            renamed[n] = x
        assert renamed.keys() != load_file(file).keys()
        save_file(renamed, file, metadata={"format": "pt"})
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


def _np_route(x, router, bias, cfg):
    """float64 numpy routing, written from MoEConfig's contract."""
    logits = x @ router
    if cfg.scores == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    t, e = choice.shape
    if cfg.n_group > 1:
        g = choice.reshape(t, cfg.n_group, -1)
        group = np.sort(g, -1)[..., -2:].sum(-1)
        drop = np.argsort(-group, -1)[:, cfg.topk_group:]
        for i in range(t):
            g[i, drop[i]] = -np.inf
        choice = g.reshape(t, e)
    experts = np.argsort(-choice, -1, kind="stable")[:, :cfg.top_k]
    w = np.take_along_axis(scores, experts, -1)
    if cfg.norm_topk:
        w = w / (w.sum(-1, keepdims=True) + cfg.norm_eps)
    return w * cfg.routed_scaling, experts


@pytest.mark.parametrize("kw", [
    dict(scores="softmax", norm_topk=False),  # Jamba / Qwen-MoE without renormalisation
    dict(scores="softmax", norm_topk=True, routed_scaling=2.0),
    dict(scores="sigmoid", norm_topk=True, norm_eps=1e-6, expert_bias=True, n_group=4,
         topk_group=2, routed_scaling=1.3),
    dict(scores="sigmoid", norm_topk=False, expert_bias=True)])
def test_router_matches_float64_numpy(kw):
    from hybrid_jax.config import MoEConfig
    from hybrid_jax.layers.moe import route

    cfg = MoEConfig(num_experts=8, top_k=3, intermediate_size=16, **kw)
    rng = np.random.default_rng(0)
    x, router = rng.normal(size=(50, 16)), rng.normal(size=(16, 8)) / 4
    bias = rng.normal(size=8) * 0.2 if cfg.expert_bias else None
    w, ex = route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32),
                  None if bias is None else jnp.asarray(bias, jnp.float32), cfg)
    want_w, want_ex = _np_route(x, router, bias, cfg)
    # Same experts (as sets: top_k's order among equals may differ), same weights per expert.
    for i in range(x.shape[0]):
        got = dict(zip(np.asarray(ex[i]).tolist(), np.asarray(w[i]).tolist(), strict=True))
        want = dict(zip(want_ex[i].tolist(), want_w[i].tolist(), strict=True))
        assert got.keys() == want.keys(), i
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5)


def test_router_logits_of_bf16_tokens_keep_f32_precision():
    """router_logits for bf16 tokens (one bf16 GEMM over the f32 router split in three
    bf16 terms) against float64: errors of f32's size, like the f32 GEMM's, where a router
    rounded to bf16 would be off by ~2^-9 relative and flip near-ties."""
    from hybrid_jax.layers.moe import router_logits

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(64, 384)), jnp.bfloat16)
    router = rng.normal(size=(384, 48)) / 20
    r32 = jnp.asarray(router, jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(r32, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(r32, np.float64))
    got = np.asarray(router_logits(x, r32), np.float64)
    f32_gemm = np.asarray(router_logits(x.astype(jnp.float32), r32), np.float64)
    assert np.abs(got - want).max() <= 1e-6 * scale.max()
    assert np.abs(got - want).max() <= 4 * np.abs(f32_gemm - want).max() + 1e-7
    rounded = np.asarray(x, np.float64) @ np.asarray(r32.astype(jnp.bfloat16), np.float64)
    assert np.abs(rounded - want).max() > 100 * np.abs(got - want).max()  # what the split avoids


def test_gated_shared_expert_adds_sigmoid_gated_mlp():
    """A Qwen-style shared expert: y = routed(x) + sigmoid(x @ w) * shared(x)."""
    from flax import nnx

    from hybrid_jax.config import MLPConfig, MoEConfig
    from hybrid_jax.layers.moe import MoE

    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=8,
                    shared_expert=MLPConfig(intermediate_size=12), shared_expert_gate=True)
    moe = MoE(16, cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))

    def want(flat):
        w, ex = moe.route(flat)
        routed = routed_reference(flat, w, ex, moe.gate_up[...], moe.down[...], activation="silu",
                                  gated=True)
        sm = moe.shared_expert
        shared = (jax.nn.silu(flat @ sm.gate_proj.kernel[...]) * (flat @ sm.up_proj.kernel[...])) \
            @ sm.down_proj.kernel[...]
        return routed + jax.nn.sigmoid(flat @ moe.shared_gate[...]) * shared

    got, ref = jax.jit(lambda x: (moe(x).reshape(10, 16), want(x.reshape(10, 16))))(x)  # one compile
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_fused_copy_holds_the_router_terms_and_routes_the_same():
    """fuse_projections gives a bf16 MoE layer its router's three bf16 terms once
    (`MoE.router_split`); routing through them equals splitting in the step, and the
    unfused model holds none (it splits per call)."""
    from flax import nnx

    from hybrid_jax.fusion import fuse_projections
    from hybrid_jax.layers.moe import MoE, route, router_terms
    from hybrid_jax.loading import load_model

    model = load_model("qwen3.5-moe-tiny", dtype="bfloat16").model
    fused = fuse_projections(model)
    pairs = [(a.moe, b.moe) for a, b in zip(model.layers, fused.layers, strict=True)
             if isinstance(a.moe, MoE)]
    assert pairs
    x = jax.random.normal(jax.random.key(0), (16, pairs[0][0].router.shape[0]), jnp.bfloat16)
    for plain, moe in pairs:
        assert plain.router_split is None and moe.router_split is not None
        terms = moe.router_split[...]
        d, e = plain.router.shape
        assert terms.dtype == jnp.bfloat16 and terms.shape == (d, 3 * e)
        np.testing.assert_array_equal(np.asarray(terms, np.float32),
                                      np.asarray(router_terms(plain.router[...]), np.float32))
        bias = None if plain.expert_bias is None else plain.expert_bias[...]
        want = route(x, plain.router[...], bias, plain.cfg)
        for a, b in zip(moe.route(x), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "router_split" in str(nnx.state(fused)) and "router_split" not in str(nnx.state(model))
