"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet + gated attention hybrids.

Architectures: `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the
text part of the published multimodal checkpoints `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` (e.g. Qwen/Qwen3.5-35B-A3B): their config nests the
text model under `text_config` and names its tensors `model.language_model.*`, read here
as `model.*`. Quirks, each from transformers 5.24's modeling_qwen3_next.py / qwen3_5*.py:
- `layer_types`: "linear_attention" -> Gated DeltaNet, "full_attention" -> global gated
  attention (missing: every `full_attention_interval`-th layer, default 4);
- every RMSNorm is zero-centred, (1 + w) in f32 (input, post-attention, final, q/k norms),
  except the Gated DeltaNet output norm (plain w, norm before the silu(z) gate);
- attention: q_proj yields per head [query | gate] (sigmoid gate on the output), q/k
  RMSNorm over head_dim, partial rotary (`partial_rotary_factor`, default 0.25), GQA;
- Qwen3-Next's Gated DeltaNet projections are fused and grouped per key head
  (`in_proj_qkvz`, `in_proj_ba`; `GatedDeltaNetConfig.grouped_projections`), Qwen3.5's
  apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
- MoE (Qwen3-Next: layers not in `mlp_only_layers` with (i + 1) % decoder_sparse_step == 0;
  Qwen3.5-MoE: every layer): softmax router, top-k renormalised (`norm_topk_prob`;
  always for Qwen3.5), shared expert scaled by sigmoid(x @ shared_expert_gate);
  experts stored one Linear each (`experts.{j}.gate_proj` ...) or stacked
  (`experts.gate_up_proj` [e, 2f, d], `experts.down_proj` [e, d, f]), either accepted.
- Qwen3.5's text rotary is M-RoPE; for text, all three position streams are equal and it
  is the plain rotary of the first rotary dims (`mrope_section` has no effect).

Tensors not loaded into the trunk: `mtp.*` (the multi-token-prediction head, which
transformers ignores: hf.py loads it into the model's MTP head when the config's
`mtp_num_hidden_layers` says there is one, for speculative_method="mtp", FP8 weights and
`modules_to_not_convert` read as the trunk's; `mtp_tensors(path)` reads it raw) and the
vision tower `model.visual.*` (skipped: images are not supported; text prompts give the
text model's output exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import (
    AttentionConfig,
    GatedDeltaNetConfig,
    LayerKind,
    LayerSpec,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURE = "Qwen3NextForCausalLM"
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
MTP_PREFIX = "mtp."
_SKIPPED = ("model.visual.",)
_KINDS = {"linear_attention": LayerKind.GATED_DELTANET, "full_attention": LayerKind.ATTENTION}


def _family(hf: dict[str, Any]) -> str:
    """"next", "dense" (Qwen3.5) or "moe" (Qwen3.5-MoE), from architectures / model_type."""
    archs = " ".join(hf.get("architectures") or []) + " " + str(hf.get("model_type", ""))
    if "Qwen3Next" in archs or "qwen3_next" in archs:
        return "next"
    if "Qwen3_5Moe" in archs or "qwen3_5_moe" in archs:
        return "moe"
    if "Qwen3_5" in archs or "qwen3_5" in archs:
        return "dense"
    raise ValueError(f"architectures={hf.get('architectures')} is not a Qwen3-Next / Qwen3.5 model")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` of a multimodal config (top-level token
    ids and tie_word_embeddings win), or the config itself."""
    if "text_config" not in hf:
        return hf
    text = dict(hf["text_config"])
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if hf.get(key) is not None:
            text[key] = hf[key]
    return text


def _layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    if len(types) != hf["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(types)} entries for "
                         f"num_hidden_layers={hf['num_hidden_layers']}")
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise ValueError(f"layer_types={unknown} not supported (only {sorted(_KINDS)})")
    return [_KINDS[t] for t in types]


def _moe_layers(hf: dict[str, Any], family: str, n: int) -> list[bool]:
    if family == "dense" or not hf.get("num_experts"):
        return [False] * n
    if family == "moe":
        return [True] * n
    only, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1)
    return [i not in only and (i + 1) % step == 0 for i in range(n)]


def config_from_hf(hf_top: dict[str, Any]) -> ModelConfig:
    family = _family(hf_top)
    hf = text_config(hf_top)
    hf_fields.check_rope_type(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    kinds = _layer_kinds(hf)
    moe_at = _moe_layers(hf, family, len(kinds))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rotary = int(head_dim * hf_fields.partial_rotary_factor(hf, 0.25))
    eps = hf.get("rms_norm_eps", 1e-6)
    bias = hf.get("attention_bias", False)
    attention = AttentionConfig(num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                                head_dim=head_dim, rope_theta=hf_fields.rope_theta(hf),
                                rotary_dim=rotary, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                output_gate=True)
    gdn = GatedDeltaNetConfig(
        num_k_heads=hf["linear_num_key_heads"], num_v_heads=hf["linear_num_value_heads"],
        head_k_dim=hf["linear_key_head_dim"], head_v_dim=hf["linear_value_head_dim"],
        conv_kernel=hf.get("linear_conv_kernel_dim", 4), norm_eps=eps,
        grouped_projections=family == "next")
    moe = None
    if any(moe_at):
        moe = MoEConfig(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                        intermediate_size=hf["moe_intermediate_size"], activation="silu",
                        scores="softmax", norm_topk=hf.get("norm_topk_prob", True) or family == "moe",
                        shared_expert=MLPConfig(hf["shared_expert_intermediate_size"]),
                        shared_expert_gate=True)
    dense = not all(moe_at)
    return ModelConfig(
        architecture={"next": "qwen3_next", "dense": "qwen3_5", "moe": "qwen3_5_moe"}[family],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec(k, moe=m) for k, m in zip(kinds, moe_at, strict=True)),
        attention=attention if LayerKind.ATTENTION in kinds else None,
        gated_deltanet=gdn if LayerKind.GATED_DELTANET in kinds else None,
        mlp=MLPConfig(hf["intermediate_size"], activation="silu") if dense else None,
        moe=moe,
        norm_eps=eps,
        norm_offset=True,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        # the checkpoint's MTP head (speculative_method="mtp"; hf.py drops it when the
        # files hold no mtp.* tensors)
        mtp_num_hidden_layers=int(hf.get("mtp_num_hidden_layers") or 0),
        **hf_fields.special_tokens(hf),
    )


def canonical_name(name: str) -> str:
    """Multimodal checkpoints' text tensors `model.language_model.*` -> `model.*`."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def skipped(name: str) -> bool:
    """The vision tower: not part of the served model (images are not supported)."""
    return name.startswith(_SKIPPED)


def _gdn_map(p: str, path: names.Path, cfg: GatedDeltaNetConfig) -> names.WeightMap:
    projs = ("in_proj_qkvz", "in_proj_ba") if cfg.grouped_projections else (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    out: names.WeightMap = {}
    for proj in (*projs, "out_proj"):
        out |= names.linear(f"{p}.{proj}", (*path, proj), bias=False)
    out[f"{p}.conv1d.weight"] = names.Target((*path, "conv_weight"), "conv")
    for name in ("dt_bias", "A_log"):
        out |= names.vector(f"{p}.{name}", (*path, name))
    return out | names.vector(f"{p}.norm.weight", (*path, "norm_weight"))


def _moe_map(p: str, path: names.Path, cfg: ModelConfig, stacked: bool) -> names.WeightMap:
    moe, f = cfg.moe, cfg.moe.intermediate_size
    out = {f"{p}.gate.weight": names.Target((*path, "router"), "linear"),
           f"{p}.shared_expert_gate.weight": names.Target((*path, "shared_gate"), "linear")}
    out |= names.gated_mlp(f"{p}.shared_expert", (*path, "shared_expert"), bias=False)
    if stacked:
        return out | names.moe_experts({"gate_up": f"{p}.experts.gate_up_proj",
                                        "down": f"{p}.experts.down_proj"}, None, path, moe, {})
    return out | names.moe_experts(None, f"{p}.experts", path, moe,
                                   {"gate_proj": ("gate_up", 0, f), "up_proj": ("gate_up", f, f),
                                    "down_proj": ("down", 0, cfg.hidden_size)})


def weight_map(cfg: ModelConfig, stored: set[str] | None = None) -> names.WeightMap:
    """HF name (canonical, `model.*`) -> param. `stored`: the checkpoint's canonical names,
    which say whether the experts are stored stacked or one Linear each (default: apart)."""
    stacked = stored is not None and any(n.endswith(".experts.gate_up_proj") for n in stored)
    out = names.trunk("model.embed_tokens.weight", "model.norm.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.pre_norms(p, i)
        if spec.kind == LayerKind.ATTENTION:
            a, bias = names.layer_path(i, "attention"), cfg.attention.qkv_bias
            out |= names.attention(f"{p}.self_attn", a, qkv_bias=bias, o_bias=bias)
            out |= names.vector(f"{p}.self_attn.q_norm.weight", (*a, "q_norm", "weight"))
            out |= names.vector(f"{p}.self_attn.k_norm.weight", (*a, "k_norm", "weight"))
        else:
            out |= _gdn_map(f"{p}.linear_attn", names.layer_path(i, "gdn"), cfg.gated_deltanet)
        if spec.moe:
            out |= _moe_map(f"{p}.mlp", names.layer_path(i, "moe"), cfg, stacked)
        else:
            out |= names.gated_mlp(f"{p}.mlp", names.layer_path(i, "mlp"), bias=False)
    return out


def mtp_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """The checkpoint's MTP head: every `mtp.*` tensor by its stored name, as numpy arrays
    in their stored dtype (bfloat16 as ml_dtypes' bfloat16; an FP8 checkpoint's weights and
    `weight_scale_inv` scales as stored). Empty when the checkpoint has none. The main
    model's loader (`load_hf`) skips these tensors (`skipped`)."""
    from safetensors import safe_open

    from hybrid_jax.checkpoints.hf import _tensor_files

    out = {}
    for name, file in _tensor_files(Path(path)).items():
        if name.startswith(MTP_PREFIX):
            with safe_open(file, framework="flax") as f:
                out[name] = np.asarray(f.get_tensor(name))
    return out
