"""Lfm2MoeForCausalLM (LFM2-8B-A1B): LFM2's short-conv and attention layers with MoE MLPs.

The temporal layers are LFM2's (hybrid_jax/checkpoints/lfm2.py: `layer_types`, q/k
norms, B C x short conv). The channel sub-block differs, each quirk handled here:
- the first `num_dense_layers` layers keep a dense SwiGLU MLP of width `intermediate_size`
  taken as is (no `block_auto_adjust_ff_dim` rounding, unlike LFM2);
- the others are mixtures of experts: sigmoid scores of the router `gate` [e, d]; experts
  chosen by the top-k of score + `expert_bias` (a stored per-expert bias, used for the
  choice only) when `use_expert_bias`; their unbiased scores renormalised as
  w / (sum w + 1e-6) when `norm_topk_prob`, times `routed_scaling_factor`; no shared expert;
- checkpoints store each expert's Linears apart (`experts.{j}.w1` gate, `w3` up, `w2` down),
  stacked here into the [e, d, 2f] / [e, f, d] expert tensors.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, lfm2, names
from hybrid_jax.config import (
    LayerSpec,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURE = "Lfm2MoeForCausalLM"


def _moe(hf: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"], activation="silu", gated=True,
        scores="sigmoid", norm_topk=hf.get("norm_topk_prob", True), norm_eps=1e-6,
        expert_bias=hf.get("use_expert_bias", True),
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf_fields.check_rope_type(hf)
    d = hf["hidden_size"]
    dense = hf.get("num_dense_layers", 2)
    kinds = lfm2.layer_kinds(hf)
    return ModelConfig(
        architecture="lfm2_moe",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=tuple(LayerSpec(kind, moe=i >= dense) for i, kind in enumerate(kinds)),
        attention=lfm2.attention_config(hf),
        short_conv=lfm2.short_conv_config(hf),
        mlp=MLPConfig(hf["intermediate_size"], activation="silu") if dense > 0 else None,
        moe=_moe(hf) if dense < len(kinds) else None,
        norm_eps=hf.get("norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", hf.get("tie_embedding", True)),
        max_position_embeddings=hf.get("max_position_embeddings", 128_000),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = lfm2.trunk_map(cfg)
    for i, spec in enumerate(cfg.layers):
        ff = f"model.layers.{i}.feed_forward"
        if not spec.moe:
            out |= lfm2.dense_mlp_map(ff, names.layer_path(i, "mlp"))
            continue
        moe, f = names.layer_path(i, "moe"), cfg.moe.intermediate_size
        out[f"{ff}.gate.weight"] = names.Target((*moe, "router"), "linear")
        if cfg.moe.expert_bias:
            out |= names.vector(f"{ff}.expert_bias", (*moe, "expert_bias"))
        out |= names.moe_experts(None, f"{ff}.experts", moe, cfg.moe,
                                 {"w1": ("gate_up", 0, f), "w3": ("gate_up", f, f),
                                  "w2": ("down", 0, cfg.hidden_size)})
    return out
