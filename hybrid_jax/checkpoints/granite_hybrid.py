"""GraniteMoeHybridForCausalLM: Granite-4.0-H, dense (Micro) or mixture-of-experts (Tiny, Small).

Mamba2 / attention layers per `layer_types` ("mamba" | "linear_attention",
"attention" | "full_attention"), each followed by the shared MLP. Quirks that change
numerics, each handled here:
- multipliers: the embedding by `embedding_multiplier`; both sub-block outputs by
  `residual_multiplier` before their residual add; logits divided by `logits_scaling`;
  attention scores scaled by `attention_multiplier` (not head_dim ** -0.5);
- NoPE: attention has no positional encoding unless `position_embedding_type` is "rope";
- the shared MLP keeps gate and up in one `input_linear` [2f, d] (gate first);
- the Mamba2 mixer reads the same `mamba_*` fields as Bamba;
- with num_local_experts > 0 every layer's channel sub-block is a mixture of experts:
  softmax over the top-k router logits (top-k of the softmax, renormalised), experts of
  width `intermediate_size` stored as stacks `block_sparse_moe.input_linear` [e, 2f, d]
  (gate rows first) and `output_linear` [e, d, f], router `router.layer` [e, d]; the
  shared MLP is the shared expert, always added, without a gate.
transformers' in-memory names of the expert tensors (`experts.gate_up_proj`, `router.weight`)
are accepted as aliases of the stored ones.
"""

from __future__ import annotations

import re
from typing import Any

from hybrid_jax.checkpoints import bamba, hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, MLPConfig, ModelConfig, MoEConfig

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
          "full_attention": "attention"}


_RENAMED = ((r"\.block_sparse_moe\.experts\.gate_up_proj$", ".block_sparse_moe.input_linear.weight"),
            (r"\.block_sparse_moe\.experts\.down_proj$", ".block_sparse_moe.output_linear.weight"),
            (r"\.block_sparse_moe\.router\.weight$", ".block_sparse_moe.router.layer.weight"))


def canonical_name(name: str) -> str:
    """transformers' in-memory expert names -> the names Granite checkpoints store."""
    for pattern, stored in _RENAMED:
        name = re.sub(pattern, stored, name)
    return name


def _layers(hf: dict[str, Any]) -> tuple[LayerSpec, ...]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = set(types) - set(_KINDS)
    if unknown:
        raise ValueError(f"layer_types contains unsupported kinds {sorted(unknown)}")
    moe = _experts(hf) > 0
    return tuple(LayerSpec(_KINDS[t], moe=moe) for t in types)


def _experts(hf: dict[str, Any]) -> int:
    return hf.get("num_local_experts", 0) or 0


def _check_supported(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    pe = hf.get("position_embedding_type")
    if pe not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type={pe!r} is not supported ('rope' or 'nope')")
    if pe == "rope":
        hf_fields.check_rope_type(hf)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    _check_supported(hf)
    layers = _layers(hf)
    has_attention = any(s.kind.has_attention for s in layers)
    shared = MLPConfig(hf["shared_intermediate_size"], activation="silu", fused_gate_up=True)
    moe = None
    if _experts(hf) > 0:
        moe = MoEConfig(num_experts=_experts(hf), top_k=hf["num_experts_per_tok"],
                        intermediate_size=hf["intermediate_size"], activation="silu",
                        scores="softmax", norm_topk=True, shared_expert=shared)
    attention = AttentionConfig(
        **bamba.attention_shape(hf), rope=hf.get("position_embedding_type") == "rope",
        rope_theta=hf_fields.rope_theta(hf), scale=float(hf.get("attention_multiplier", 1.0)))
    return ModelConfig(
        architecture="granite_hybrid",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=layers,
        attention=attention if has_attention else None,
        mamba2=bamba.mamba_config(hf, eps=1e-6) if any(s.kind.has_mamba2 for s in layers)
        else None,
        mlp=None if moe is not None else shared,
        moe=moe,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        embedding_scale=float(hf.get("embedding_multiplier", 1.0)),
        logits_multiplier=1.0 / float(hf.get("logits_scaling", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.norm.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.pre_norms(p, i)
        if spec.kind.has_attention:
            att = cfg.attention
            out |= names.attention(f"{p}.self_attn", names.layer_path(i, "attention"),
                                   qkv_bias=att.qkv_bias, o_bias=att.o_bias)
        else:
            out |= names.mamba2(f"{p}.mamba", names.layer_path(i, "mamba"), cfg.mamba2)
        mlp = names.layer_path(i, "mlp")
        if spec.moe:
            moe = names.layer_path(i, "moe")
            mlp = (*moe, "shared_expert")
            out[f"{p}.block_sparse_moe.router.layer.weight"] = names.Target((*moe, "router"), "linear")
            out |= names.moe_experts({"gate_up": f"{p}.block_sparse_moe.input_linear.weight",
                                      "down": f"{p}.block_sparse_moe.output_linear.weight"},
                                     None, moe, cfg.moe, {})
        out |= names.linear(f"{p}.shared_mlp.input_linear", (*mlp, "gate_up_proj"), bias=False)
        out |= names.linear(f"{p}.shared_mlp.output_linear", (*mlp, "down_proj"), bias=False)
    return out
