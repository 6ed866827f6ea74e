"""Kimi Linear (KDA + MLA + MoE): logits against transformers, strict loading, refusals, engine.

The reference is transformers' tiny random KimiLinearForCausalLM (tests/model/hf_models.py
`kimi_linear_config`: the published config's layout, KDA / MLA / KDA pattern, a dense
first layer then sigmoid-routed grouped MoE with a score-correction bias and a shared
expert; MLA with K wider than V), saved and loaded from disk.

1. Teacher-forced logits in f32 on CPU within test_hf_parity's tolerance (also with MLA's
   query LoRA and attention biases).
2. The loader reports missing, unexpected and mis-shaped tensors together; unsupported
   config fields (Kimi K3's, rotary MLA, other routers) are refused by name, and so is a
   tensor-parallel size that cannot split the heads.
3. One engine (prefill chunks of 7, prefix caching with state checkpoints every 16
   tokens, too few pages for the batch: preemption by recompute): greedy tokens are
   transformers' argmax wherever its top-1/top-2 gap is clear; each request alone gives
   its batched tokens (a prefix-cache hit == the miss); whole prompts in one chunk
   (a second engine, same compiled shapes, its decode steps' MLA attention through the
   Pallas `mla_decode` kernel in interpret mode) give the same tokens. The pages hold the
   MLA latent (kv_lora_rank + qk_rope_head_dim values per token and layer, no V pages).
4. The absorbed attention (queries in latent space, one KV head of latent rows, W_uv
   after) equals the expanded per-head form, in float64 numpy on random weights.
Speculative verification of KDA layers runs Gated DeltaNet's serving path
(`ragged_recurrent.gated_deltanet`, q > 0) with a per-channel g; its candidates are checked
in tests/kernels/test_kda.py and tests/kernels/test_gated_delta.py (an engine with a
speculation slot compiles its verification buckets: ~50 s more of CI, left out).
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

from hybrid_jax import ragged  # noqa: E402
from hybrid_jax.checkpoints import CheckpointError, load_hf  # noqa: E402
from hybrid_jax.checkpoints.kimi_linear import config_from_hf  # noqa: E402
from hybrid_jax.config import LayerKind, ModelConfig  # noqa: E402
from hybrid_jax.loading import load_model  # noqa: E402
from hybrid_jax.tensor_parallel import check_shardable  # noqa: E402
from pallas_kernels import mla_decode  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from tests.model import hf_models  # noqa: E402
from tests.serving.test_engine_parity_hybrids import (  # noqa: E402
    NEW,
    check_against_transformers,
    engine_tokens,
)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_linear")
    return hf_models.build("kimi_linear", d, seed=0), d


def test_logits_match_transformers(kimi):
    hf_model, d = kimi
    model, cfg = load_hf(d)
    assert [s.kind for s in cfg.layers] == [LayerKind.GATED_DELTANET] * 2 + [
        LayerKind.ATTENTION, LayerKind.GATED_DELTANET]
    assert [s.moe for s in cfg.layers] == [False, True, True, True]
    assert cfg.gated_deltanet.kimi_delta and cfg.mla.qk_head_dim == 32 and cfg.mla.v_head_dim == 16
    assert cfg.moe.scores == "sigmoid" and cfg.moe.expert_bias and cfg.moe.n_group == 2
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 80))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() < hf_models.TOL
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_query_lora_and_biases_match_transformers(tmp_path):
    hf_model = hf_models.build("kimi_linear_qlora", tmp_path, seed=1)
    model, cfg = load_hf(tmp_path)
    assert cfg.mla.q_lora_rank == 24 and cfg.mla.bias
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() < hf_models.TOL


def test_strict_loading_and_refusals(kimi, tmp_path):
    _, d = kimi
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_conv1d.weight"]
    kv_b = "model.layers.2.self_attn.kv_b_proj.weight"
    tensors[kv_b] = tensors[kv_b][:8]
    tensors["model.layers.1.self_attn.A_log"] = tensors["model.layers.1.self_attn.A_log"].reshape(-1)[:3]
    tensors["model.layers.3.self_attn.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    e = err.value
    assert e.missing == ["model.layers.0.self_attn.k_conv1d.weight"]
    assert e.unexpected == ["model.layers.3.self_attn.extra.weight"]
    assert len(e.misshaped) == 2 and {"kv_b_proj" in m or "A_log" in m for m in e.misshaped} == {True}
    hf = json.loads((d / "config.json").read_text())
    for field, value in [("mla_use_output_gate", True), ("moe_router_activation_func", "softmax"),
                         ("mla_use_nope", False), ("num_nextn_predict_layers", 1)]:
        with pytest.raises(ValueError, match=field):
            config_from_hf(hf | {field: value})
    with pytest.raises(ValueError, match="use_full_rank_gate"):
        config_from_hf(hf | {"linear_attn_config": hf["linear_attn_config"] | {"use_full_rank_gate": True}})
    with pytest.raises(ValueError, match="tensor_parallel_size=8 cannot split the 4 attention heads"):
        check_shardable(config_from_hf(hf), 8)


def _engine(d, chunk: int, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_prefill_chunk": chunk,
                          "max_model_len": 64, "page_size": 8, "seq_buckets": (4,),
                          "token_buckets": (32,)} | kw)
    return LLMEngine(load_model(str(d)), cfg, show_progress=False)


def test_engine_equals_transformers_and_invariants(kimi, monkeypatch):
    hf_model, d = kimi
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 16, 30)]
    eng = _engine(d, 7, enable_prefix_caching=True, prefix_state_stride=16, num_pages=10)
    outs = engine_tokens(eng, prompts)
    compared = sum(check_against_transformers(hf_model, p, t) for p, t in zip(prompts, outs, strict=True))
    assert compared >= 0.8 * NEW * len(prompts), f"only {compared} clear-gap tokens"
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert [engine_tokens(eng, [p])[0] for p in prompts] == outs  # batched == solo; hit == miss
    s = eng.stats()
    assert s["prefix_cache_hit_tokens"] > hits and s["prefix_state_checkpoints_cached"] > 0
    assert s["num_preemptions"] > 0
    # The latent cache: per token and MLA layer kv_lora_rank + qk_rope_head_dim values (f32),
    # one row, no V (the expanded form held 2 x heads x qk_head_dim).
    cfg = eng.model_config
    mla_layers = sum(1 for x in cfg.layers if x.kind.has_attention)
    per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
    assert eng.plan.page_bytes == (mla_layers * 8 * per_token,)
    assert s["kv_bytes"] == eng.plan.scheduler.groups[0].num_pages * mla_layers * 8 * per_token
    assert eng.runner.caches.kv[0].v.size == 0
    # Whole prompts in one chunk, no prefix cache, pages enough, and the decode steps' MLA
    # attention through the Pallas kernel (interpret mode; the CPU's default is the
    # reference): the same tokens.
    kernel_calls = []

    def interpreted(*a, impl=None, **kw):
        kernel_calls.append(impl)
        return mla_decode(*a, **kw, impl="interpret" if impl is None else impl)

    monkeypatch.setattr(ragged, "mla_decode", interpreted)
    monkeypatch.setattr(ragged, "MLA_KERNEL", True)  # HYBRID_JAX_MLA_KERNEL=1
    assert engine_tokens(_engine(d, 32), prompts) == outs
    assert kernel_calls and set(kernel_calls) == {None}  # traced, and the shapes fit the kernel
    monkeypatch.undo()
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for MLA"):
        _engine(d, 32, kv_cache_dtype="fp8")


def test_absorbed_latent_attention_equals_expanded():
    """The serving path's MLA (latent rows written to pages, absorbed queries, one KV head,
    W_uv after: ragged._mla_attention) on random weights, a 5-token prefill then a decode
    of a 6th token, against the expanded per-head attention in float64 numpy."""
    from flax import nnx

    from hybrid_jax.cache import KVCache, RaggedBatch
    from hybrid_jax.config import AttentionConfig, MLAConfig
    from hybrid_jax.layers.mla import MLAttention
    from hybrid_jax.ragged import _mla_attention

    h, r, dn, dr, dv, d, s, t = 3, 8, 4, 2, 5, 12, 4, 6
    mla = MLAConfig(num_heads=h, kv_lora_rank=r, qk_nope_head_dim=dn, qk_rope_head_dim=dr,
                    v_head_dim=dv, q_lora_rank=6, bias=True)
    layer = MLAttention(d, mla, AttentionConfig(num_heads=h, num_kv_heads=h, head_dim=dn + dr, rope=False),
                        dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for node in (layer.q_a_layernorm, layer.kv_a_layernorm):  # non-trivial norm weights
        node.weight = nnx.Param(jnp.asarray(rng.uniform(0.5, 1.5, node.weight.shape), jnp.float32))
    for lin in (layer.q_a_proj, layer.kv_a_proj_with_mqa, layer.o_proj):
        lin.bias = nnx.Param(jnp.asarray(rng.normal(size=lin.bias.shape), jnp.float32))
    x = rng.normal(size=(t, d)).astype(np.float32)

    # Expanded form, float64 numpy, from the layer's weights.
    W = lambda lin: np.asarray(lin.kernel[...], np.float64)  # noqa: E731
    B = lambda lin: np.asarray(lin.bias[...], np.float64)  # noqa: E731

    def rms(v, norm):
        w = np.asarray(norm.weight[...], np.float64)
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * w

    x64 = x.astype(np.float64)
    q_a = rms(x64 @ W(layer.q_a_proj) + B(layer.q_a_proj), layer.q_a_layernorm)
    q = (q_a @ W(layer.q_b_proj)).reshape(t, h, -1)
    ckr = x64 @ W(layer.kv_a_proj_with_mqa) + B(layer.kv_a_proj_with_mqa)
    kv = (rms(ckr[:, :r], layer.kv_a_layernorm) @ W(layer.kv_b_proj)).reshape(t, h, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(ckr[:, None, r:], (t, h, dr))], -1)
    logits = np.einsum("qhe,khe->hqk", q, k) * (dn + dr) ** -0.5
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hqk,khv->qhv", p, kv[..., dn:]).reshape(t, -1) @ W(layer.o_proj) + B(layer.o_proj)

    # Serving path: one sequence in pages 1 and 2 (page 0 the dummy), prefill 5 then decode 1.
    pages = KVCache(jnp.zeros((1, 3, s, r + dr)), jnp.zeros((1, 3, s, 0)))
    table = jnp.asarray([[1, 2]], jnp.int32)

    def batch(lo, hi):
        pos = np.arange(lo, hi, dtype=np.int32)
        i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
        return RaggedBatch(i32(np.zeros(hi - lo)), i32(pos), i32([0, hi - lo]), i32([hi]), i32([0]),
                           jnp.asarray([lo > 0]), (table,), (i32(1 + pos // s) * s + i32(pos % s),),
                           i32([hi - lo - 1]))

    got_prefill, pages = _mla_attention(layer, jnp.asarray(x[:5]), batch(0, 5), pages, 0, decode=False)
    got_decode, pages = _mla_attention(layer, jnp.asarray(x[5:]), batch(5, 6), pages, 0, decode=True)
    got = np.concatenate([np.asarray(got_prefill), np.asarray(got_decode)])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert pages.k.shape == (1, 3, s, r + dr)  # the pages hold latent rows only
