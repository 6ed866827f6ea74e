"""Zamba2ForCausalLM: Mamba2 layers; "hybrid" layers add a shared attention + MLP block first.

Quirks that change numerics, each handled here:
- `layers_block_type`: "mamba" / "linear_attention" -> MAMBA2, "hybrid" -> SHARED_BLOCK;
  the j-th hybrid layer uses shared block j % `num_mem_blocks`;
- the shared attention takes concat(h, embeddings) (2d wide), head_dim = 2d / heads and
  scale (head_dim / 2)^-0.5; rotary only with `use_mem_rope`; per-depth LoRA adapters on
  q, k, v with `use_shared_attention_adapter` and always on the MLP's fused gate_up;
  the MLP activation is `hidden_act` (exact GELU by default);
- the Mamba2 conv always has a bias (whatever `use_conv_bias`), the gated norm's eps is
  1e-5, dt is clamped below at `time_step_min` (transformers does so in prefill only);
- tied shared-block weights are stored once, under the first hybrid layer that uses each
  block (`model.layers.{i}.shared_transformer.*`, adapters indexed by j there too); copies
  under later hybrid layers, if a file has them, are ignored as transformers ties them.
Refused: `add_bias_linear` (biases in the shared MLP) and `use_long_context` (RoPE rescaling).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import hf_fields, names
from hybrid_jax.config import (
    AttentionConfig,
    LayerKind,
    LayerSpec,
    Mamba2Config,
    ModelConfig,
    SharedBlockConfig,
)

ARCHITECTURE = "Zamba2ForCausalLM"
KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "hybrid": "shared_block"}
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "silu": "silu"}
# transformers' default pattern (Zamba2-2.7B), used when config.json does not give one.
DEFAULT_TYPES = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"]
                 + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2)


def _refuse(hf: dict[str, Any]) -> None:
    for name in ("add_bias_linear", "use_long_context"):
        if hf.get(name, False):
            raise ValueError(f"{name}={hf[name]} is not supported for Zamba2")
    if hf.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for Zamba2 "
                         f"(supported: {sorted(ACTIVATIONS)})")


def _layers(hf: dict[str, Any]) -> tuple[LayerSpec, ...]:
    types = hf.get("layers_block_type") or DEFAULT_TYPES
    bad = sorted(set(types) - set(KINDS))
    if bad or len(types) != hf["num_hidden_layers"]:
        raise ValueError(f"layers_block_type={types} must hold num_hidden_layers="
                         f"{hf['num_hidden_layers']} entries of {sorted(KINDS)} (unsupported: {bad})")
    return tuple(LayerSpec(KINDS[t]) for t in types)


def _mamba(hf: dict[str, Any]) -> Mamba2Config:
    d_inner = int(hf.get("mamba_expand", 2) * hf["hidden_size"])
    heads = hf.get("n_mamba_heads", 8)
    if d_inner % heads:
        raise ValueError(f"mamba_expand * hidden_size ({d_inner}) must be a multiple of "
                         f"n_mamba_heads ({heads})")
    return Mamba2Config(
        num_heads=heads, head_dim=d_inner // heads, state_size=hf.get("mamba_d_state", 64),
        n_groups=hf.get("mamba_ngroups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("chunk_size", 256), conv_bias=True,
        dt_limit=(hf_fields.as_float(hf.get("time_step_min", 0.001)), float("inf")),
        gated_norm=True, norm_before_gate=False, norm_eps=1e-5)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    _refuse(hf)
    hf_fields.check_rope_type(hf)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = 2 * d // heads
    layers = _layers(hf)
    hybrid = [s for s in layers if s.kind == LayerKind.SHARED_BLOCK]
    return ModelConfig(
        architecture="zamba2",
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        layers=layers,
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim, rope_theta=hf_fields.rope_theta(hf), scale=(head_dim / 2) ** -0.5),
        mamba2=_mamba(hf),
        shared_block=None if not hybrid else SharedBlockConfig(
            num_blocks=min(hf.get("num_mem_blocks", 1), len(hybrid)),
            intermediate_size=hf.get("intermediate_size") or 4 * d,
            adapter_rank=hf.get("adapter_rank", 128),
            attention_adapters=hf.get("use_shared_attention_adapter", False),
            activation=ACTIVATIONS[hf.get("hidden_act", "gelu")],
            rope=hf.get("use_mem_rope", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        **hf_fields.special_tokens(hf),
    )


def _first_layers(cfg: ModelConfig) -> list[int]:
    """Layer index of the first hybrid layer of each shared block (where its weights live)."""
    hybrid = [i for i, s in enumerate(cfg.layers) if s.kind == LayerKind.SHARED_BLOCK]
    return hybrid[:cfg.shared_block.num_blocks]


def _lora(hf: str, path: names.Path) -> names.WeightMap:
    return (names.linear(f"{hf}.0", (*path, "down"), bias=False)
            | names.linear(f"{hf}.1", (*path, "up"), bias=False))


def _shared_block(hf: str, path: names.Path) -> names.WeightMap:
    out = names.vector(f"{hf}.input_layernorm.weight", (*path, "input_norm", "weight"))
    out |= names.vector(f"{hf}.pre_ff_layernorm.weight", (*path, "mlp_norm", "weight"))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out |= names.linear(f"{hf}.self_attn.{name}", (*path, name), bias=False)
    for name in ("gate_up_proj", "down_proj"):
        out |= names.linear(f"{hf}.feed_forward.{name}", (*path, name), bias=False)
    return out


def _hybrid_layer(cfg: ModelConfig, i: int, j: int, shared: str) -> names.WeightMap:
    p = f"model.layers.{i}"
    depth = names.layer_path(i, "depth")
    out = names.vector(f"{p}.mamba_decoder.input_layernorm.weight",
                       names.layer_path(i, "temporal_norm", "weight"))
    out |= names.mamba2(f"{p}.mamba_decoder.mamba", names.layer_path(i, "mamba"), cfg.mamba2)
    out |= names.linear(f"{p}.linear", (*depth, "linear"), bias=False)
    out |= _lora(f"{shared}.feed_forward.gate_up_proj_adapter_list.{j}", (*depth, "gate_up"))
    if cfg.shared_block.attention_adapters:
        for x in "qkv":
            out |= _lora(f"{shared}.self_attn.linear_{x}_adapter_list.{j}", (*depth, x))
    return out


def weight_map(cfg: ModelConfig) -> names.WeightMap:
    out = names.trunk("model.embed_tokens.weight", "model.final_layernorm.weight", cfg)
    shared = [f"model.layers.{i}.shared_transformer" for i in _first_layers(cfg)]
    for b, prefix in enumerate(shared):
        out |= _shared_block(prefix, ("shared_blocks", b))
    j = 0
    for i, spec in enumerate(cfg.layers):
        if spec.kind == LayerKind.SHARED_BLOCK:
            out |= _hybrid_layer(cfg, i, j, shared[j % len(shared)])
            j += 1
        else:
            p = f"model.layers.{i}"
            out |= names.vector(f"{p}.input_layernorm.weight",
                                names.layer_path(i, "temporal_norm", "weight"))
            out |= names.mamba2(f"{p}.mamba", names.layer_path(i, "mamba"), cfg.mamba2)
    return out


def tied_copies(cfg: ModelConfig) -> set[str]:
    """Names of shared-block tensors under later hybrid layers: copies of the tied weights."""
    firsts = _first_layers(cfg)
    hybrid = [i for i, s in enumerate(cfg.layers) if s.kind == LayerKind.SHARED_BLOCK]
    stored = [n for n in weight_map(cfg) if ".shared_transformer." in n]
    out = set()
    for j, i in enumerate(hybrid[len(firsts):], start=len(firsts)):
        first = f"model.layers.{firsts[j % len(firsts)]}.shared_transformer."
        out |= {n.replace(first, f"model.layers.{i}.shared_transformer.") for n in stored
                if n.startswith(first)}
    return out
