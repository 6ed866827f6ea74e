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
Original checkpoints name the trunk `backbone.`; transformers renames it `model.`;
both are accepted. MoE layers and multi-token-prediction heads are refused.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig

ARCHITECTURE = "NemotronHForCausalLM"
_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention",
          "attention": "attention", "mlp": "mlp"}
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
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if moe:
        raise ValueError(f"layers_block_type has 'moe' layers at {moe}: mixture-of-experts "
                         "layers are not supported")
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


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    _check_supported(hf)
    layers = tuple(LayerSpec(_KINDS[t]) for t in _block_types(hf))
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
        mlp=mlp if "mlp" in kinds else None,
        separate_mlp_layers="mlp" in kinds,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        residual_in_fp32=hf.get("residual_in_fp32", False),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        **hf_fields.special_tokens(hf),
    )


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.vector("model.embeddings.weight", ("embed", "embedding"))
    out |= names.vector("model.norm_f.weight", ("final_norm", "weight"))
    if not cfg.tie_embeddings:
        out |= names.linear("lm_head", ("lm_head",), bias=False)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        norm = "mlp_norm" if spec.kind == "mlp" else "temporal_norm"
        out |= names.vector(f"{p}.norm.weight", names.layer_path(i, norm, "weight"))
        if spec.kind == "mlp":
            mlp = names.layer_path(i, "mlp")
            for proj in ("up_proj", "down_proj"):
                out |= names.linear(f"{p}.mixer.{proj}", (*mlp, proj), bias=cfg.mlp.bias)
        elif spec.kind.has_attention:
            out |= names.attention(f"{p}.mixer", names.layer_path(i, "attention"), qkv_bias=False,
                                   o_bias=False)
        else:
            out |= names.mamba2(f"{p}.mixer", names.layer_path(i, "mamba"), cfg.mamba2)
    return out
