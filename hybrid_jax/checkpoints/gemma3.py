"""Gemma3ForCausalLM (text): sliding-window and global attention layers side by side.

Quirks that change numerics, each handled here:
- `layer_types` (or the older `sliding_window_pattern`, default 6: every 6th layer
  global) puts each layer in the window group (`sliding_window`) or the global group;
- RoPE per layer type: `rope_parameters` {sliding_attention, full_attention} (older
  files: `rope_local_base_freq` for sliding layers, `rope_theta` and `rope_scaling`
  for global ones); linear scaling (gemma-3-4b+: x8) applies to global layers only;
- scores scaled by `query_pre_attn_scalar` ** -0.5, not head_dim ** -0.5;
- q and k are RMS-normed per head (Gemma's (1 + w) norm) before rotary;
- sandwich norms: each sub-block's output is normed before the residual add;
- the embedding is scaled by sqrt(hidden) in the weight dtype; norms are (1 + w);
- optional final logit soft-capping. transformers' Gemma 3 ignores
  `attn_logit_softcapping` (its attention never applies it), so it is ignored here too.
Gemma 2 (gemma2.py) is the same model without q/k norms, with one RoPE base and
attention soft-capping.
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import AttentionConfig, LayerSpec, MLPConfig, ModelConfig

ARCHITECTURE = "Gemma3ForCausalLM"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def layer_specs(hf: dict[str, Any], default_pattern: int) -> tuple[LayerSpec, ...]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern") or default_pattern
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types contains unsupported kinds {sorted(unknown)}")
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ValueError("sliding_window=None but layer_types has sliding_attention layers")
    return tuple(LayerSpec("attention", window if t == "sliding_attention" else None)
                 for t in types)


def _rope(params: dict[str, Any], where: str) -> tuple[float, float]:
    """(theta, linear factor) of one layer type's rope parameters."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return hf_fields.as_float(params["rope_theta"]), 1.0
    if kind == "linear":
        return hf_fields.as_float(params["rope_theta"]), hf_fields.as_float(params["factor"])
    raise ValueError(f"rope_type={kind!r} ({where}) is not supported (only 'default', 'linear')")


def rope_fields(hf: dict[str, Any]) -> dict[str, float]:
    """AttentionConfig rope fields from either config.json spelling."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_theta": 1_000_000.0}
        sliding = params.get("sliding_attention") or {"rope_theta": 10_000.0}
    else:
        full = dict(hf.get("rope_scaling") or {})
        full["rope_theta"] = hf.get("rope_theta", 1_000_000.0)
        sliding = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    theta, scaling = _rope(full, "full_attention")
    local, local_scaling = _rope(sliding, "sliding_attention")
    if local_scaling != 1.0:
        raise ValueError(f"rope scaling factor={local_scaling} on sliding_attention layers "
                         "is not supported")
    return {"rope_theta": theta, "rope_scaling": scaling, "sliding_rope_theta": local}


def check_common(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation={act!r} is not supported for Gemma")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal LMs only)")


def gemma_config(hf: dict[str, Any], *, architecture: str, layers: tuple[LayerSpec, ...],
                 attention: AttentionConfig) -> ModelConfig:
    """The ModelConfig fields Gemma 2 and 3 share."""
    d = hf["hidden_size"]
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=layers,
        attention=attention,
        mlp=MLPConfig(hf["intermediate_size"], activation="gelu_tanh"),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_offset=True,
        sandwich_norm=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        embedding_scale=d**0.5,
        logits_softcap=hf.get("final_logit_softcapping"),
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
        **hf_fields.special_tokens(hf),
    )


def attention_fields(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    bias = hf.get("attention_bias", False)
    return {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "qkv_bias": bias, "o_bias": bias,
            "scale": hf.get("query_pre_attn_scalar", 256) ** -0.5}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    check_common(hf)
    attention = AttentionConfig(**attention_fields(hf), **rope_fields(hf), qk_norm=True)
    return gemma_config(hf, architecture="gemma3", layers=layer_specs(hf, 6), attention=attention)


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.norm.weight", cfg)
    att = cfg.attention
    norms = {"input_layernorm": "temporal_norm", "post_attention_layernorm": "post_temporal_norm",
             "pre_feedforward_layernorm": "mlp_norm",
             "post_feedforward_layernorm": "post_mlp_norm"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for hf_name, ours in norms.items():
            out |= names.vector(f"{p}.{hf_name}.weight", names.layer_path(i, ours, "weight"))
        path = names.layer_path(i, "attention")
        out |= names.attention(f"{p}.self_attn", path, qkv_bias=att.qkv_bias, o_bias=att.o_bias)
        if att.qk_norm:
            out |= names.vector(f"{p}.self_attn.q_norm.weight", (*path, "q_norm", "weight"))
            out |= names.vector(f"{p}.self_attn.k_norm.weight", (*path, "k_norm", "weight"))
        out |= names.gated_mlp(f"{p}.mlp", names.layer_path(i, "mlp"), bias=False)
    return out
