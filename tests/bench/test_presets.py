"""The benchmark presets have the published shapes: parameter counts of the real models
(counted from abstract shapes, no weights are made), and the full-attention baseline is
native-1b-parallel's stack with global attention and no SSM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from hybrid_jax.config import LayerKind
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset


def _params(name: str) -> int:
    cfg = load_preset(name)
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(("name", "billions"), [
    ("recurrentgemma-2b", 2.68), ("mamba2-2.7b", 2.70), ("falcon-h1-1.5b", 1.48), ("mistral-7b", 7.24),
    ("native-1b-parallel", 1.46), ("native-1b-full-attention", 1.15),
    ("kimi-linear-48b-a3b", 49.12)])
def test_parameter_counts(name, billions):
    assert _params(name) / 1e9 == pytest.approx(billions, abs=0.01)


def test_layer_patterns():
    rg, m2, fh, ms = (load_preset(n) for n in ("recurrentgemma-2b", "mamba2-2.7b", "falcon-h1-1.5b",
                                                "mistral-7b"))
    assert [s.kind for s in rg.layers[:3]] == [LayerKind.RGLRU, LayerKind.RGLRU, LayerKind.ATTENTION]
    assert rg.num_layers == 26 and rg.windows == (2048,) and rg.attention.num_kv_heads == 1
    assert m2.num_layers == 64 and m2.windows == () and m2.mamba2.num_heads == 80
    assert fh.num_layers == 24 and fh.windows == (None,) and fh.mamba2.state_size == 256
    assert ms.num_layers == 32 and ms.windows == (4096,) and ms.attention.num_kv_heads == 8


def test_qwen_gated_deltanet_presets():
    """Shapes of the published configs (their parameter counts, 34.66B / 79.67B / 26.90B text
    models, are in each preset's extra.source: counting them here took ~20 s each)."""
    moe, nxt, dense = (load_preset(n) for n in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "qwen3.5-27b"))
    for cfg, n in ((moe, 40), (nxt, 48), (dense, 64)):
        kinds = [s.kind for s in cfg.layers]
        assert len(kinds) == n and kinds[:4] == [LayerKind.GATED_DELTANET] * 3 + [LayerKind.ATTENTION]
        assert cfg.windows == (None,) and cfg.attention.output_gate and cfg.attention.rope_dim == 64
        assert "source" in cfg.extra
    assert all(s.moe for s in moe.layers) and all(s.moe for s in nxt.layers)
    assert (moe.moe.num_experts, moe.moe.top_k, nxt.moe.num_experts, nxt.moe.top_k) == (256, 8, 512, 10)
    assert nxt.gated_deltanet.grouped_projections and not moe.gated_deltanet.grouped_projections
    assert dense.moe is None and dense.gated_deltanet.num_v_heads == 48
    assert moe.mtp_num_hidden_layers == 1  # the published checkpoint ships its MTP module


def test_kimi_linear_preset():
    """The published Kimi-Linear-48B-A3B shapes: KDA 3 : 1 MLA (and the last layer MLA)."""
    cfg = load_preset("kimi-linear-48b-a3b")
    kinds = [s.kind for s in cfg.layers]
    assert len(kinds) == 27 and kinds.count(LayerKind.ATTENTION) == 7
    assert kinds[3] == kinds[26] == LayerKind.ATTENTION
    assert cfg.gated_deltanet.kimi_delta and cfg.gated_deltanet.num_v_heads == 32
    assert (cfg.mla.qk_head_dim, cfg.mla.v_head_dim, cfg.mla.kv_lora_rank) == (192, 128, 512)
    assert [s.moe for s in cfg.layers] == [False] + [True] * 26 and cfg.moe.routed_scaling == 2.446
    assert "source" in cfg.extra


def test_full_attention_baseline_matches_the_hybrid_but_for_its_mixers():
    hybrid, full = load_preset("native-1b-parallel"), load_preset("native-1b-full-attention")
    assert full.num_layers == hybrid.num_layers and full.hidden_size == hybrid.hidden_size
    assert full.attention == hybrid.attention and full.mlp == hybrid.mlp
    assert all(s.kind == LayerKind.ATTENTION and s.window is None for s in full.layers)
    assert full.mamba2 is None
