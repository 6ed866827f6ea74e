"""Gemma 3, Bamba, Granite-4.0-H and Nemotron-H: config variants' logits, refusals by name,
and the real-size presets.

Full-forward and greedy parity of the main tiny models is in test_hf_parity.py, the
engine's in tests/serving/test_engine_parity_hybrids.py. Here: the config variants
(logits only, against transformers), fields that change the math and are not
implemented (refused naming the field), both spellings of Gemma 3's RoPE fields, and
the real-size presets (published parameter counts; one forward with tiny overrides).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from hybrid_jax.checkpoints import (  # noqa: E402
    bamba,
    gemma3,
    gemma3_vlm,
    granite_hybrid,
    load_hf,
    nemotron_h,
)
from hybrid_jax.model import CausalLM  # noqa: E402
from hybrid_jax.presets import load_preset, preset_names  # noqa: E402
from tests.model import hf_models  # noqa: E402


@pytest.mark.parametrize("variant", ["granite_hybrid_rope", "gemma3_vlm", "gemma2"])
def test_variant_logits_match_transformers(variant, tmp_path):
    hf_model = hf_models.build(variant, tmp_path, seed=1)
    model, cfg = load_hf(tmp_path)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4


def hf_dict(name: str) -> dict:
    """The config.json dict of a tiny test model (as save_pretrained writes it)."""
    make_config, cls = hf_models.BUILDERS[name]
    d = make_config().to_dict()
    d["architectures"] = [cls.__name__]
    return d


REFUSALS = [
    (granite_hybrid, "granite_hybrid", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (granite_hybrid, "granite_hybrid", {"position_embedding_type": "alibi"},
     "position_embedding_type='alibi'"),
    (granite_hybrid, "granite_hybrid", {"layer_types": ["mamba", "moe"] * 2 + ["mamba"]},
     "layer_types"),
    (nemotron_h, "nemotron_h_moe", {"moe_latent_size": 32}, "moe_latent_size=32"),
    (nemotron_h, "nemotron_h", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    (nemotron_h, "nemotron_h", {"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
    (nemotron_h, "nemotron_h", {"attention_bias": True}, "attention_bias"),
    (bamba, "bamba", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (bamba, "bamba", {"attn_layer_indices": [7]}, "attn_layer_indices"),
    (gemma3, "gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    (gemma3, "gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn",
                                                               "rope_theta": 1e6}}},
     "rope_type='yarn'"),
]


@pytest.mark.parametrize(("module", "name", "change", "match"), REFUSALS,
                         ids=[f"{r[1]}-{r[3]}" for r in REFUSALS])
def test_unsupported_fields_are_refused_by_name(module, name, change, match):
    with pytest.raises(ValueError, match=match):
        module.config_from_hf(hf_dict(name) | change)


def test_gemma3_vlm_fills_hub_defaults_and_skips_the_vision_tower():
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "sliding_window": 1024,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    assert gemma3_vlm.config_from_hf(hub) == load_preset("gemma-3-4b")
    assert gemma3_vlm.skipped("vision_tower.vision_model.post_layernorm.weight")
    assert gemma3_vlm.canonical_name("language_model.model.norm.weight") == "model.norm.weight"


def test_gemma3_rope_fields_read_both_spellings():
    old = {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = {"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                  "factor": 8.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    want = {"rope_theta": 1e6, "rope_scaling": 8.0, "sliding_rope_theta": 1e4}
    assert gemma3.rope_fields(old) == gemma3.rope_fields(new) == want


def test_gemma3_pattern_from_sliding_window_pattern():
    d = {k: v for k, v in hf_dict("gemma3").items() if k != "layer_types"}
    cfg = gemma3.config_from_hf(d | {"num_hidden_layers": 12, "sliding_window_pattern": 6})
    assert [s.window for s in cfg.layers] == ([16] * 5 + [None]) * 2


# Published sizes (parameters, embeddings included once when tied), and the tolerance of
# the published figure: the MoE models' are rounded (32.2B, 8.3B total / 1.5B active, 7B
# total / 1B active), their active counts checked too.
PRESETS = {"gemma-3-1b": 1.000e9, "gemma-3-4b": 3.880e9, "nemotron-h-8b": 8.101e9,
           "bamba-9b": 9.780e9, "granite-4.0-h-micro": 3.191e9, "granite-4.0-h-small": 32.2e9,
           "lfm2-8b-a1b": 8.3e9, "granite-4.0-h-tiny": 7.0e9, "falcon-mamba-7b": 7.27e9,
           "jamba-mini-1.5": 52e9}
TOLERANCE = {"granite-4.0-h-small": 2e-3, "lfm2-8b-a1b": 6e-3, "granite-4.0-h-tiny": 1e-2,
             "jamba-mini-1.5": 1e-2}
# granite-4.0-h-tiny's "1B active" counts no embeddings (0.15B tied).
ACTIVE = {"granite-4.0-h-small": (9e9, 0.03), "lfm2-8b-a1b": (1.5e9, 0.04),
          "granite-4.0-h-tiny": (1.0e9, 0.5), "jamba-mini-1.5": (12e9, 0.02)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_real_size_preset_has_the_published_size(name):
    assert name in preset_names()
    cfg = load_preset(name)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert abs(n / PRESETS[name] - 1) < TOLERANCE.get(name, 1e-3), f"{name}: {n / 1e9:.3f}B parameters"
    if name in ACTIVE:  # all but the experts a token does not use
        moe, layer = cfg.moe, next(b for b in abstract.layers if b.moe is not None).moe
        per_expert = sum(x.size for x in (layer.gate_up, layer.up, layer.down) if x is not None) \
            // moe.num_experts
        idle = sum(s.moe for s in cfg.layers) * (moe.num_experts - moe.top_k) * per_expert
        want, tol = ACTIVE[name]
        assert abs((n - idle) / want - 1) < tol, f"{name}: {(n - idle) / 1e9:.3f}B active"


def tiny(cfg):
    """`cfg` with tiny widths and the fewest consecutive layers that keep every (kind, window)."""
    want = _kinds(cfg.layers)
    layers = next(cfg.layers[i:i + n] for n in range(1, cfg.num_layers + 1)
                  for i in range(cfg.num_layers) if _kinds(cfg.layers[i:i + n]) == want)
    rotary = None if cfg.attention.rotary_dim is None else 8
    subs = {"attention": dataclasses.replace(cfg.attention, num_heads=4, num_kv_heads=2,
                                             head_dim=16, rotary_dim=rotary)}
    if cfg.mamba2 is not None:
        subs["mamba2"] = dataclasses.replace(cfg.mamba2, num_heads=4, head_dim=32, state_size=16,
                                             n_groups=2, chunk_size=16)
    if cfg.mlp is not None:
        subs["mlp"] = dataclasses.replace(cfg.mlp, intermediate_size=96)
    if cfg.moe is not None:
        shared = cfg.moe.shared_expert
        subs["moe"] = dataclasses.replace(
            cfg.moe, num_experts=8, top_k=min(cfg.moe.top_k, 3), intermediate_size=32,
            shared_expert=shared and dataclasses.replace(shared, intermediate_size=48))
    return dataclasses.replace(cfg, vocab_size=128, hidden_size=64, bos_token_id=None,
                               eos_token_ids=(), pad_token_id=None,
                               layers=layers, **subs)


def _kinds(layers) -> set:
    return {(s.kind, s.window, s.moe) for s in layers}


# The MoE presets' tiny forms are the MoE test models' (tests/model/test_moe.py), Falcon-Mamba's
# the Mamba1 test models' (tests/model/test_mamba1.py): CI time.
@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(ACTIVE) - {"falcon-mamba-7b"}))
def test_real_size_preset_runs_one_step_with_tiny_overrides(name):
    full = load_preset(name)
    small = tiny(full)
    assert _kinds(small.layers) == _kinds(full.layers) and small.windows == full.windows
    model = CausalLM(small, rngs=nnx.Rngs(0))
    logits = jax.jit(lambda t: model(t))(jnp.arange(24, dtype=jnp.int32)[None] % 128)
    assert logits.shape == (1, 24, 128) and bool(jnp.isfinite(logits).all())
