"""Gemma2ForCausalLM: Gemma 3's layer (gemma3.py) without q/k norms, one RoPE base for
every layer, and attention logits soft-capped by `attn_logit_softcapping` (50 in the
released models) besides the final soft-cap (30). Layers alternate sliding / global
(`layer_types`, default pattern 2).
"""

from __future__ import annotations

from typing import Any

from hybrid_jax.checkpoints import gemma3, hf_fields
from hybrid_jax.config import AttentionConfig, ModelConfig

ARCHITECTURE = "Gemma2ForCausalLM"
weight_map = gemma3.weight_map


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    gemma3.check_common(hf)
    hf_fields.check_rope_type(hf)
    attention = AttentionConfig(**gemma3.attention_fields(hf), rope_theta=hf_fields.rope_theta(hf),
                                softcap=hf.get("attn_logit_softcapping"))
    return gemma3.gemma_config(hf, architecture="gemma2", layers=gemma3.layer_specs(hf, 2),
                               attention=attention)
