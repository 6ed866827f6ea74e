"""NemotronHForCausalLM: Mamba2, attention and MLP layers, each a residual block of its own.

`layers_block_type` (older files: `hybrid_override_pattern`, M = Mamba2, * = attention,
- = MLP, E = MoE) gives one mixer per layer: `h = h + mixer(norm(h))`. Quirks that
change numerics, each handled here:
- attention has no positional encoding (NoPE) and no biases;
- the MLP is not gated: down(relu(up(x)) ** 2) (`mlp_hidden_act` relu2);
- the Mamba2 mixer: d_inner = mamba_num_heads * mamba_head_dim (not expand * hidden),
  grouped gated RMS norm (n_groups groups, gate first), `use_bias` on in/out_proj;
- dt is clamped to `time_step_limit` in prefill and decode alike. transformers' port
  clamps to `time_step_min` in prefill only (its decode path does not), which makes its
  own cached logits drift from its uncached ones; the original implementation and the
  released configs use time_step_limit (0, inf). Tests use a tiny time_step_min.
- MoE layers (Nemotron-H MoE, Nemotron 3): `h = h + moe(norm(h))`, a channel-only layer
  whose experts are NOT gated (relu2(x @ up) @ down, like the MLP); sigmoid scores of the
  router `gate` (kept in f32); experts chosen by the top-k of score +
  `e_score_correction_bias` within the best `topk_group` of `n_group` groups (a group's
  score: the sum of its two best); weights renormalised as w / (sum w + 1e-20) when
  `norm_topk_prob`, times `routed_scaling_factor`; one ungated shared expert of width
  `moe_shared_expert_intermediate_size` always added (transformers reads no other
  shared-expert field). Checkpoints store each expert's up/down Linears apart.
Original checkpoints name the trunk `backbone.`; transformers renames it `model.`;
both are accepted. MoE latent projections (`moe_latent_size`) and multi-token-prediction
heads are refused.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import (
    AttentionConfig,
    LayerSpec,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURE = "NemotronHForCausalLM"
_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention",
          "attention": "attention", "mlp": "mlp", "moe": "mlp"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def canonical_name(name: str) -> str:
    """Original checkpoints' `backbone.` trunk -> transformers' `model.`."""
    return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name


def _block_types(hf: dict[str, Any]) -> list[str]:
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("config has neither layers_block_type nor hybrid_override_pattern")
        unknown = set(pattern) - set(_PATTERN)
        if unknown:
            raise ValueError(f"hybrid_override_pattern has unknown letters {sorted(unknown)}")
        types = [_PATTERN[c] for c in pattern]
    unknown = set(types) - set(_KINDS)
    if unknown:
        raise ValueError(f"layers_block_type contains unsupported kinds {sorted(unknown)}")
    return list(types)


def _check_supported(hf: dict[str, Any]) -> None:
    for field, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if hf.get(field, want) != want:
            raise ValueError(f"{field}={hf[field]!r} is not supported (only {want!r})")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (Nemotron-H attention has no biases)")
    if hf.get("moe_latent_size") is not None:
        raise ValueError(f"moe_latent_size={hf['moe_latent_size']}: MoE latent projections are "
                         "not supported")
    if hf.get("num_nextn_predict_layers"):
        raise ValueError(f"num_nextn_predict_layers={hf['num_nextn_predict_layers']}: "
                         "multi-token-prediction layers are not supported")


def _mamba(hf: dict[str, Any]) -> Mamba2Config:
    bias = hf.get("use_bias", False)
    return Mamba2Config(
        num_heads=hf["mamba_num_heads"], head_dim=hf["mamba_head_dim"],
        state_size=hf["ssm_state_size"], n_groups=hf.get("n_groups", 8),
        conv_kernel=hf.get("conv_kernel", 4), chunk_size=hf.get("chunk_size", 128),
        conv_bias=hf.get("use_conv_bias", True), in_proj_bias=bias, out_proj_bias=bias,
        dt_limit=hf_fields.time_step_limit(hf), gated_norm=True, norm_before_gate=False,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def _moe(hf: dict[str, Any]) -> MoEConfig:
    shared = MLPConfig(hf["moe_shared_expert_intermediate_size"], activation="relu2",
                       bias=hf.get("mlp_bias", False), gated=False)
    return MoEConfig(
        num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"], intermediate_size=hf["moe_intermediate_size"],
        activation="relu2", gated=False, scores="sigmoid",
        norm_topk=hf.get("norm_topk_prob", True), norm_eps=1e-20, expert_bias=True,
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=hf.get("n_group", 1), topk_group=hf.get("topk_group", 1), shared_expert=shared)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    _check_supported(hf)
    types = _block_types(hf)
    layers = tuple(LayerSpec(_KINDS[t], moe=t == "moe") for t in types)
    kinds = {s.kind.value for s in layers}
    heads = hf["num_attention_heads"]
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope=False)
    mlp = MLPConfig(hf["intermediate_size"], activation="relu2", bias=hf.get("mlp_bias", False),
                    gated=False)
    return ModelConfig(
        architecture="nemotron_h",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=layers,
        attention=attention if "attention" in kinds else None,
        mamba2=_mamba(hf) if "mamba2" in kinds else None,
        mlp=mlp if "mlp" in types else None,
        moe=_moe(hf) if "moe" in types else None,
        separate_mlp_layers="mlp" in kinds,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        residual_in_fp32=hf.get("residual_in_fp32", False),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embeddings.weight", "model.norm_f.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        norm = "mlp_norm" if spec.kind == "mlp" else "temporal_norm"
        out |= names.vector(f"{p}.norm.weight", names.layer_path(i, norm, "weight"))
        if spec.moe:
            out |= _moe_map(f"{p}.mixer", names.layer_path(i, "moe"), cfg)
        elif spec.kind == "mlp":
            mlp = names.layer_path(i, "mlp")
            for proj in ("up_proj", "down_proj"):
                out |= names.linear(f"{p}.mixer.{proj}", (*mlp, proj), bias=cfg.mlp.bias)
        elif spec.kind.has_attention:
            out |= names.attention(f"{p}.mixer", names.layer_path(i, "attention"), qkv_bias=False,
                                   o_bias=False)
        else:
            out |= names.mamba2(f"{p}.mixer", names.layer_path(i, "mamba"), cfg.mamba2)
    return out


def _moe_map(hf: str, moe: names.Path, cfg: ModelConfig) -> names.WeightMap:
    out = {f"{hf}.gate.weight": names.Target((*moe, "router"), "linear")}
    out |= names.vector(f"{hf}.gate.e_score_correction_bias", (*moe, "expert_bias"))
    out |= names.moe_experts(None, f"{hf}.experts", moe, cfg.moe,
                             {"up_proj": ("up", 0, cfg.moe.intermediate_size),
                              "down_proj": ("down", 0, cfg.hidden_size)})
    bias = cfg.moe.shared_expert.bias
    for proj in ("up_proj", "down_proj"):
        out |= names.linear(f"{hf}.shared_experts.{proj}", (*moe, "shared_expert", proj), bias=bias)
    return out
