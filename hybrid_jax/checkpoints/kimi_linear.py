"""Kimi Linear (`KimiLinearForCausalLM`): KDA + MLA (NoPE) hybrid with a sigmoid-routed MoE.

Quirks, each from transformers 5.24's modeling_kimi_linear.py / configuration_kimi_linear.py
and the published moonshotai/Kimi-Linear-48B-A3B-Instruct config:
- the layer pattern comes from `layer_types` ("linear_attention" -> KDA, "full_attention"
  -> MLA) or, in the published config, `linear_attn_config.kda_layers` /
  `full_attn_layers`, 1-indexed; the dense / MoE pattern from `mlp_layer_types` or
  `first_k_dense_replace` (the first k layers dense, the rest MoE; `moe_layer_freq` 1);
- the published config names MoE fields `num_experts`, `num_experts_per_token`,
  `num_expert_group`, `moe_renormalize`, `num_shared_experts`, `model_max_length`;
  transformers' attribute names (`num_local_experts`, `num_experts_per_tok`, `n_group`,
  `norm_topk_prob`, `n_shared_experts`, `max_position_embeddings`) are read too;
- KDA (hybrid_jax/layers/kda.py): per-channel decay from the low-rank forget gate
  (`f_a_proj` [r, d], `f_b_proj`, `dt_bias` [h dk], `A_log` stored [1, 1, h, 1]), the
  q/k/v convs stored apart (`q_conv1d` ...: concatenated into one conv), output norm with
  a sigmoid gate (`g_a_proj`, `g_b_proj`, `o_norm`), eps `rms_norm_eps`;
- MLA (hybrid_jax/layers/mla.py): NoPE (no rotary anywhere: `rope_theta` has no effect;
  `mla_use_nope` false is refused), latent norms with eps 1e-6 (transformers' default, not
  `rms_norm_eps`), softmax scale (dn + dr)^-1/2, K/V heads = query heads;
- MoE: sigmoid scores, an `e_score_correction_bias` used for the choice only, group-limited
  top-k (`num_expert_group`, `topk_group`), weights renormalised (sum + 1e-20) when
  `moe_renormalize`, times `routed_scaling_factor`; shared experts (an ungated MLP of
  `moe_intermediate_size * num_shared_experts`) added. Experts stored one Linear each
  (`experts.{j}.w1` gate, `w3` up, `w2` down);
- MoE and dense MLP tensors live under `block_sparse_moe.` (what transformers writes for
  every layer) or `mlp.` (the published dense layer 0): both read as `mlp.`.
Refused by name: other activations or router functions, rotary MLA, an MLA output gate,
KDA's full-rank gate or gate lower bound (Kimi K3's), MTP layers (`num_nextn_predict_layers`).
Tensor parallelism splits KDA and MLA by head (hybrid_jax/tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import (
    AttentionConfig,
    GatedDeltaNetConfig,
    LayerKind,
    LayerSpec,
    MLAConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURE = "KimiLinearForCausalLM"
_KINDS = {"linear_attention": LayerKind.GATED_DELTANET, "full_attention": LayerKind.ATTENTION}


def _get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` present (the published name, then transformers' attribute)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def _refuse_unsupported(hf: dict[str, Any], lin: dict[str, Any]) -> None:
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
        ("moe_router_activation_func", hf.get("moe_router_activation_func", "sigmoid"), "sigmoid"),
        ("mla_use_nope", hf.get("mla_use_nope", True), True),
        ("mla_use_output_gate", hf.get("mla_use_output_gate", False), False),
        ("moe_layer_freq", hf.get("moe_layer_freq", 1), 1),
        ("num_nextn_predict_layers", hf.get("num_nextn_predict_layers") or 0, 0),
        ("linear_attn_config.use_full_rank_gate", lin.get("use_full_rank_gate", False), False),
        ("linear_attn_config.gate_lower_bound", lin.get("gate_lower_bound"), None),
    ]
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"{name}={got!r} is not supported for {ARCHITECTURE} (only {want!r})")
    heads = hf["num_attention_heads"]
    if (kv := hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"num_key_value_heads={kv} must equal num_attention_heads={heads} "
                         "(MLA expands K/V to every query head)")


def _layer_kinds(hf: dict[str, Any], lin: dict[str, Any]) -> list[LayerKind]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        if "full_attn_layers" not in lin:
            raise ValueError("neither layer_types nor linear_attn_config.full_attn_layers is set")
        full = set(lin["full_attn_layers"])  # 1-indexed
        kda = set(lin.get("kda_layers", set(range(1, n + 1)) - full))
        if full & kda or full | kda != set(range(1, n + 1)):
            raise ValueError(f"linear_attn_config: full_attn_layers={sorted(full)} and "
                             f"kda_layers={sorted(kda)} must split layers 1..{n}")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise ValueError(f"layer_types={unknown} not supported (only {sorted(_KINDS)})")
    return [_KINDS[t] for t in types]


def _moe_layers(hf: dict[str, Any], n: int) -> list[bool]:
    types = hf.get("mlp_layer_types")
    if types is None:
        k = hf.get("first_k_dense_replace", 1)
        return [i >= k for i in range(n)]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types} must hold {n} of 'dense' / 'sparse'")
    return [t == "sparse" for t in types]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    lin = hf.get("linear_attn_config") or {}
    _refuse_unsupported(hf, lin)
    kinds = _layer_kinds(hf, lin)
    moe_at = _moe_layers(hf, len(kinds))
    eps = hf.get("rms_norm_eps", 1e-5)
    heads = hf["num_attention_heads"]
    mla = MLAConfig(num_heads=heads, kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf.get("v_head_dim") or 128, q_lora_rank=hf.get("q_lora_rank"),
                    bias=hf.get("attention_bias", False))
    attention = AttentionConfig(num_heads=heads, num_kv_heads=heads, head_dim=mla.qk_head_dim,
                                rope=False)
    lh = _get(lin, "num_heads", default=hf.get("linear_num_heads", 32))
    ld = _get(lin, "head_dim", default=hf.get("linear_head_dim", 128))
    kda = GatedDeltaNetConfig(
        num_k_heads=lh, num_v_heads=lh, head_k_dim=ld, head_v_dim=ld,
        conv_kernel=_get(lin, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4)),
        norm_eps=eps, kimi_delta=True)
    moe = None
    if any(moe_at):
        f = hf["moe_intermediate_size"]
        shared = _get(hf, "num_shared_experts", "n_shared_experts", default=1)
        moe = MoEConfig(
            num_experts=_get(hf, "num_experts", "num_local_experts"),
            top_k=_get(hf, "num_experts_per_token", "num_experts_per_tok"),
            intermediate_size=f, activation="silu", scores="sigmoid",
            norm_topk=_get(hf, "moe_renormalize", "norm_topk_prob", default=True), norm_eps=1e-20,
            expert_bias=True, routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
            n_group=_get(hf, "num_expert_group", "n_group", default=1),
            topk_group=hf.get("topk_group") or 1,
            shared_expert=MLPConfig(f * shared) if shared else None)
    return ModelConfig(
        architecture="kimi_linear",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(LayerSpec(k, moe=m) for k, m in zip(kinds, moe_at, strict=True)),
        attention=attention if LayerKind.ATTENTION in kinds else None,
        mla=mla if LayerKind.ATTENTION in kinds else None,
        gated_deltanet=kda if LayerKind.GATED_DELTANET in kinds else None,
        mlp=MLPConfig(hf["intermediate_size"], activation="silu") if not all(moe_at) else None,
        moe=moe,
        norm_eps=eps,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=_get(hf, "model_max_length", "max_position_embeddings", default=1 << 20),
        **hf_fields.special_tokens(hf),
    )


def canonical_name(name: str) -> str:
    """`block_sparse_moe.` (MoE and, as transformers writes them, dense layers) -> `mlp.`."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def _kda_map(p: str, path: names.Path, cfg: GatedDeltaNetConfig) -> names.WeightMap:
    out: names.WeightMap = {}
    for proj in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                 "b_proj", "o_proj"):
        out |= names.linear(f"{p}.{proj}", (*path, proj), bias=False)
    widths = {"q": cfg.key_dim, "k": cfg.key_dim, "v": cfg.value_dim}
    start = 0
    for part, width in widths.items():  # one conv over [q | k | v]: each fills its rows
        rows = (slice(start, start + width), slice(None))
        out[f"{p}.{part}_conv1d.weight"] = names.Target((*path, "conv_weight"), "conv", rows)
        start += width
    out[f"{p}.A_log"] = names.Target((*path, "A_log"), "heads")
    return out | names.vector(f"{p}.dt_bias", (*path, "dt_bias")) | names.vector(
        f"{p}.o_norm.weight", (*path, "norm_weight"))


def _mla_map(p: str, path: names.Path, mla: MLAConfig) -> names.WeightMap:
    if mla.q_lora_rank is None:
        out = names.linear(f"{p}.q_proj", (*path, "q_proj"), bias=False)
    else:
        out = names.linear(f"{p}.q_a_proj", (*path, "q_a_proj"), bias=mla.bias)
        out |= names.vector(f"{p}.q_a_layernorm.weight", (*path, "q_a_layernorm", "weight"))
        out |= names.linear(f"{p}.q_b_proj", (*path, "q_b_proj"), bias=False)
    out |= names.linear(f"{p}.kv_a_proj_with_mqa", (*path, "kv_a_proj_with_mqa"), bias=mla.bias)
    out |= names.vector(f"{p}.kv_a_layernorm.weight", (*path, "kv_a_layernorm", "weight"))
    out |= names.linear(f"{p}.kv_b_proj", (*path, "kv_b_proj"), bias=False)
    return out | names.linear(f"{p}.o_proj", (*path, "o_proj"), bias=mla.bias)


def _moe_map(p: str, path: names.Path, cfg: ModelConfig) -> names.WeightMap:
    moe, f = cfg.moe, cfg.moe.intermediate_size
    out = {f"{p}.gate.weight": names.Target((*path, "router"), "linear"),
           f"{p}.gate.e_score_correction_bias": names.Target((*path, "expert_bias"), "same")}
    if moe.shared_expert is not None:
        out |= names.gated_mlp(f"{p}.shared_experts", (*path, "shared_expert"), bias=False)
    return out | names.moe_experts(None, f"{p}.experts", path, moe,
                                   {"w1": ("gate_up", 0, f), "w3": ("gate_up", f, f),
                                    "w2": ("down", 0, cfg.hidden_size)})


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    """HF name (canonical: `mlp.` for `block_sparse_moe.`) -> param."""
    out = names.trunk("model.embed_tokens.weight", "model.norm.weight", cfg)
    for i, spec in enumerate(cfg.layers):
        p = f"model.layers.{i}"
        out |= names.pre_norms(p, i)
        if spec.kind == LayerKind.ATTENTION:
            out |= _mla_map(f"{p}.self_attn", names.layer_path(i, "attention"), cfg.mla)
        else:
            out |= _kda_map(f"{p}.self_attn", names.layer_path(i, "gdn"), cfg.gated_deltanet)
        if spec.moe:
            out |= _moe_map(f"{p}.mlp", names.layer_path(i, "moe"), cfg)
        else:
            out |= names.gated_mlp(f"{p}.mlp", names.layer_path(i, "mlp"), bias=False)
    return out
