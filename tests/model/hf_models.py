"""Tiny random-weight transformers models for parity tests (independent references).

Each builder returns a transformers config small enough for CI (hidden <= 128, 3+
layers, windows and chunks shorter than the test sequence). `randomize_` reinitialises
every parameter with scales large enough that top-1/top-2 logit gaps are clear
(transformers' default std 0.02 leaves gaps near 1e-5).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers as T

SEQ_WINDOW = 16
CHUNK = 16


def mamba2_config() -> T.PretrainedConfig:
    return T.Mamba2Config(vocab_size=128, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                          n_groups=2, num_hidden_layers=3, chunk_size=CHUNK, expand=2,
                          tie_word_embeddings=False)


def mistral_config() -> T.PretrainedConfig:
    return T.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, sliding_window=SEQ_WINDOW, rope_theta=10000.0)


def recurrent_gemma_config() -> T.PretrainedConfig:
    # hidden 96: sqrt(96) = 9.798 is not exact in bf16 (9.8125), exercising the rounding quirk.
    return T.RecurrentGemmaConfig(vocab_size=128, hidden_size=96, intermediate_size=192,
                                  num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=1, lru_width=96,
                                  attention_window_size=SEQ_WINDOW, logits_soft_cap=30.0)


def falcon_h1_config(*, rms_norm: bool = True, norm_before_gate: bool = True) -> T.PretrainedConfig:
    return T.FalconH1Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=CHUNK,
        mamba_rms_norm=rms_norm, mamba_norm_before_gate=norm_before_gate,
        rope_theta=10000.0, key_multiplier=0.7, embedding_multiplier=1.3,
        lm_head_multiplier=0.8, attention_in_multiplier=0.9, attention_out_multiplier=1.1,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.85, mlp_multipliers=[1.2, 0.9],
        ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.7])


BUILDERS = {
    "mamba2": (mamba2_config, T.Mamba2ForCausalLM),
    "mistral": (mistral_config, T.MistralForCausalLM),
    "recurrent_gemma": (recurrent_gemma_config, T.RecurrentGemmaForCausalLM),
    "falcon_h1": (falcon_h1_config, T.FalconH1ForCausalLM),
    "falcon_h1_nonorm": (lambda: falcon_h1_config(rms_norm=False), T.FalconH1ForCausalLM),
    "falcon_h1_gate_first": (lambda: falcon_h1_config(norm_before_gate=False),
                             T.FalconH1ForCausalLM),
}


@torch.no_grad()
def randomize_(model: torch.nn.Module, *, seed: int, std: float = 0.2) -> None:
    """Reinitialise every parameter with clear-margin scales (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, mean: float, s: float) -> None:
        p.copy_(mean + s * torch.randn(p.shape, generator=gen))

    offset_norm = isinstance(model, T.RecurrentGemmaForCausalLM)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(1.0 + 7.0 * torch.rand(p.shape, generator=gen)))
        elif leaf == "dt_bias":
            normal(p, -1.0, 0.5)
        elif leaf == "recurrent_param":
            normal(p, 0.0, 0.5)
        elif "norm" in name and p.ndim == 1:
            normal(p, 0.0 if offset_norm else 1.0, 0.1)
        elif p.ndim == 1:
            normal(p, 0.0, 0.1)
        elif "conv" in name:
            normal(p, 0.0, 0.3)
        elif "embed" in name:
            normal(p, 0.0, 1.0)
        else:
            normal(p, 0.0, std * math.sqrt(64 / max(64, p.shape[-1])))


def build(name: str, out_dir: Path, *, seed: int = 0) -> torch.nn.Module:
    """Build, randomise and save_pretrained a tiny model; returns the torch model (eval, f32)."""
    make_config, cls = BUILDERS[name]
    cfg = make_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed=seed)
    model.save_pretrained(out_dir)
    return model
