"""Gemma3ForConditionalGeneration, text only: gemma-3-4b and larger ship as this class.

The language model is Gemma3ForCausalLM's (gemma3.py) under `text_config`; its
tensors are named `language_model.model.*` (hub files) or `model.language_model.*`
(transformers' in-memory names); the vision tower and the multimodal projector are
skipped: images are not supported, text prompts give the text model's output exactly.
Hub files list only the text_config fields that differ from Gemma3TextConfig's
defaults, so the defaults below fill the rest. transformers' Gemma3ForConditionalGeneration
never applies `final_logit_softcapping` (only Gemma3ForCausalLM does; the released
configs leave it null), so it is dropped here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.checkpoints import gemma3
from hybrid_jax.config import ModelConfig

ARCHITECTURE = "Gemma3ForConditionalGeneration"
weight_map = gemma3.weight_map

# Gemma3TextConfig's defaults (transformers 5.x) for the fields config_from_hf reads.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "max_position_embeddings": 131_072, "final_logit_softcapping": None,
    "attention_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
             "language_model.lm_head.": "lm_head."}
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
            "model.multi_modal_projector.")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    text = TEXT_DEFAULTS | (hf.get("text_config") or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # top level wins
        if hf.get(key) is not None:
            text[key] = hf[key]
    return dataclasses.replace(gemma3.config_from_hf(text), logits_softcap=None)


def canonical_name(name: str) -> str:
    for old, new in _PREFIXES.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def skipped(name: str) -> bool:
    """Tensors of the vision tower and projector: not loaded."""
    return name.startswith(_SKIPPED)
