"""Tiny random-weight transformers models for parity tests (independent references).

Each builder returns a transformers config small enough for CI (hidden <= 128, 3+
layers, windows and chunks shorter than the test sequence). `randomize_` reinitialises
every parameter with scales large enough that top-1/top-2 logit gaps are clear
(transformers' default std 0.02 leaves gaps near 1e-5).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
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


def lfm2_config(*, conv_bias: bool = False) -> T.PretrainedConfig:
    # MLP width: int(2 * 128 / 3) = 85, rounded up to a multiple of 32 = 96.
    return T.Lfm2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                        conv_bias=conv_bias, block_multiple_of=32, tie_word_embeddings=True,
                        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"])


def zamba2_config(*, adapters: bool = True, rope: bool = True,
                  mem_blocks: int = 2) -> T.PretrainedConfig:
    # Hybrid layers 1, 3, 4 use shared blocks 0, 1, 0. transformers clamps dt to
    # time_step_min in prefill only: a tiny minimum keeps its cached decode exact.
    return T.Zamba2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        mamba_d_state=16, n_mamba_heads=4, mamba_ngroups=2, chunk_size=CHUNK,
        intermediate_size=64, num_mem_blocks=mem_blocks, adapter_rank=8,
        use_shared_attention_adapter=adapters, use_mem_rope=rope, time_step_min=1e-6)


def gemma3_config() -> T.PretrainedConfig:
    # Global layers use theta 1e6 with linear scaling x8 (gemma-3-4b+), sliding ones 1e4;
    # query_pre_attn_scalar differs from head_dim so the score scale is exercised.
    return T.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=SEQ_WINDOW, final_logit_softcapping=25.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                            "factor": 8.0}})


def gemma3_vlm_config() -> T.PretrainedConfig:
    # The text model of gemma3_config under a one-layer vision tower (skipped on load).
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return T.Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision,
                          mm_tokens_per_image=4)


def gemma2_config() -> T.PretrainedConfig:
    return T.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=SEQ_WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=30.0)


MAMBA_FIELDS = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                    mamba_chunk_size=CHUNK, mamba_expand=2)


def bamba_config() -> T.PretrainedConfig:
    return T.BambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         attn_layer_indices=[1, 3], **MAMBA_FIELDS)


def granite_hybrid_config(*, rope: bool = False) -> T.PretrainedConfig:
    return T.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, shared_intermediate_size=96,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
        layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
        position_embedding_type="rope" if rope else "nope", embedding_multiplier=1.7,
        residual_multiplier=0.6, attention_multiplier=0.1, logits_scaling=2.5,
        tie_word_embeddings=True, **MAMBA_FIELDS)


def nemotron_h_config() -> T.PretrainedConfig:
    # transformers clamps dt to time_step_min in prefill only: a tiny minimum keeps its
    # cached decode exact (see hybrid_jax/checkpoints/nemotron_h.py).
    return T.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, chunk_size=CHUNK, time_step_min=1e-6,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp",
                           "linear_attention", "mlp"])


def granite_moe_config() -> T.PretrainedConfig:
    # 6 experts, 2 per token; intermediate_size is the experts' width.
    return T.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, shared_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
        num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "attention"],
        position_embedding_type="nope", embedding_multiplier=1.7, residual_multiplier=0.6,
        attention_multiplier=0.1, logits_scaling=2.5, tie_word_embeddings=True, **MAMBA_FIELDS)


def lfm2_moe_config() -> T.PretrainedConfig:
    # Layer 0 dense (num_dense_layers=1), the rest MoE: sigmoid scores, expert bias (set
    # non-zero by randomize_), renormalised top-k, a routed scaling factor.
    return T.Lfm2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
        num_dense_layers=1, num_experts=6, num_experts_per_tok=3, routed_scaling_factor=1.5,
        layer_types=["conv", "full_attention", "conv", "full_attention"])


def nemotron_h_moe_config() -> T.PretrainedConfig:
    # MoE layers: non-gated relu2 experts, sigmoid scores with a correction bias,
    # group-limited choice (3 groups of 2 experts, best 2 groups), scaling, shared expert.
    return T.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, chunk_size=CHUNK, time_step_min=1e-6,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=3, topk_group=2,
        routed_scaling_factor=1.3, norm_topk_prob=True)


def mamba_config() -> T.PretrainedConfig:
    return T.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8,
                         time_step_rank=4, expand=2, tie_word_embeddings=False)


def falcon_mamba_config() -> T.PretrainedConfig:
    return T.FalconMambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3, state_size=8,
                               time_step_rank=4, expand=2, mixer_rms_eps=1e-6)


def jamba_config() -> T.PretrainedConfig:
    # Layers: mamba (dense MLP), attention (MoE), mamba (dense), mamba (MoE). Softmax router,
    # top-2 of 4 experts not renormalised; weighted dt/B/C norms; attention without RoPE.
    return T.JambaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2)


def _qwen_gdn_fields() -> dict:
    # 2 key heads, 4 value heads (grouped), partial rotary 0.25 of head_dim 16 (4 dims).
    return dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention", "linear_attention",
                             "linear_attention"])


def qwen3_next_config() -> T.PretrainedConfig:
    # Layer 0 dense (mlp_only_layers), the rest MoE: softmax top-2 of 4 renormalised, gated
    # shared expert; Gated DeltaNet projections fused and grouped per key head.
    return T.Qwen3NextConfig(**_qwen_gdn_fields(), num_hidden_layers=4, intermediate_size=96,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, mlp_only_layers=[0])


def qwen3_5_config() -> T.PretrainedConfig:
    return T.Qwen3_5TextConfig(**_qwen_gdn_fields(), num_hidden_layers=4, intermediate_size=96)


def qwen3_5_moe_vlm_config() -> T.PretrainedConfig:
    # The published layout (Qwen/Qwen3.5-35B-A3B): the text model under text_config, tensors
    # model.language_model.*, a (tiny) vision tower model.visual.* that the loader skips.
    text = _qwen_gdn_fields() | dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=48)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    return T.Qwen3_5MoeConfig(text_config=text, vision_config=vision)


def kimi_linear_config(**kw) -> T.PretrainedConfig:
    # The published config's layout (linear_attn_config, 1-indexed layers; first_k_dense_replace):
    # KDA, KDA, MLA, KDA; layer 0 dense, then MoE: sigmoid top-2 of 8 in the best 1 of 2
    # groups, renormalised, scaled 2.5, a shared expert. MLA qk 16 + 16, v 16, kv_lora_rank 16
    # (the engine's latent pages hold 16 + 16 values per token: both parts powers of two
    # >= 16, the shapes the MLA decode kernel takes).
    return T.KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
        first_k_dense_replace=1) if not kw else T.KimiLinearConfig(**(
            kimi_linear_config().to_dict() | kw))


BUILDERS = {
    "mamba2": (mamba2_config, T.Mamba2ForCausalLM),
    "mistral": (mistral_config, T.MistralForCausalLM),
    "recurrent_gemma": (recurrent_gemma_config, T.RecurrentGemmaForCausalLM),
    "falcon_h1": (falcon_h1_config, T.FalconH1ForCausalLM),
    "falcon_h1_nonorm": (lambda: falcon_h1_config(rms_norm=False), T.FalconH1ForCausalLM),
    "falcon_h1_gate_first": (lambda: falcon_h1_config(norm_before_gate=False),
                             T.FalconH1ForCausalLM),
    "lfm2": (lfm2_config, T.Lfm2ForCausalLM),
    "zamba2": (zamba2_config, T.Zamba2ForCausalLM),
    "gemma3": (gemma3_config, T.Gemma3ForCausalLM),
    "bamba": (bamba_config, T.BambaForCausalLM),
    "granite_hybrid": (granite_hybrid_config, T.GraniteMoeHybridForCausalLM),
    "nemotron_h": (nemotron_h_config, T.NemotronHForCausalLM),
    "granite_moe": (granite_moe_config, T.GraniteMoeHybridForCausalLM),
    "lfm2_moe": (lfm2_moe_config, T.Lfm2MoeForCausalLM),
    "nemotron_h_moe": (nemotron_h_moe_config, T.NemotronHForCausalLM),
}

# Config variants checked by their logits only (tests/model/test_zamba2_lfm2.py), to keep
# test_hf_parity's greedy runs (the slow part) to one model per architecture.
VARIANTS = {
    "lfm2_bias": (lambda: lfm2_config(conv_bias=True), T.Lfm2ForCausalLM),
    "zamba2_plain": (lambda: zamba2_config(adapters=False, rope=False, mem_blocks=1),
                     T.Zamba2ForCausalLM),
    "granite_hybrid_rope": (lambda: granite_hybrid_config(rope=True),
                            T.GraniteMoeHybridForCausalLM),
    "gemma3_vlm": (gemma3_vlm_config, T.Gemma3ForConditionalGeneration),
    "gemma2": (gemma2_config, T.Gemma2ForCausalLM),
    # Mamba1 models: logits in tests/model/test_mamba1.py, the engine in
    # tests/serving/test_mamba1_engine.py (CI time: no greedy_steps run here).
    "mamba": (mamba_config, T.MambaForCausalLM),
    # Gated DeltaNet models: logits in tests/model/test_qwen3_next.py, the engine in
    # tests/serving/test_gated_deltanet_engine.py (CI time: no greedy_steps run here). The
    # logits test runs test_hf_parity's sequences; qwen3_5_moe_vlm's have an ill-conditioned
    # position, where f32 rounding is amplified (`check_ill_conditioned`).
    "qwen3_next": (qwen3_next_config, T.Qwen3NextForCausalLM),
    "qwen3_5": (qwen3_5_config, T.Qwen3_5ForCausalLM),
    "qwen3_5_moe_vlm": (qwen3_5_moe_vlm_config, T.Qwen3_5MoeForConditionalGeneration),
    # Kimi Linear (KDA + MLA + MoE): logits and the engine in tests/model/test_kimi_linear.py.
    "kimi_linear": (kimi_linear_config, T.KimiLinearForCausalLM),
    # MLA with a query LoRA (q_a_proj, q_a_layernorm, q_b_proj) and attention biases.
    "kimi_linear_qlora": (lambda: kimi_linear_config(q_lora_rank=24, attention_bias=True),
                          T.KimiLinearForCausalLM),
    "falcon_mamba": (falcon_mamba_config, T.FalconMambaForCausalLM),
    "jamba": (jamba_config, T.JambaForCausalLM),
}

# Zamba2 at std 0.2 is ill-conditioned: transformers' own f32 forward is 2.6e-4 (relative)
# from its float64 forward. At 0.1 both f32 implementations sit within 1e-6 of float64.
INIT_STD = {"zamba2": 0.1, "zamba2_plain": 0.1}


@torch.no_grad()
def randomize_(model: torch.nn.Module, *, seed: int, std: float = 0.2) -> None:
    """Reinitialise every parameter with clear-margin scales (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, mean: float, s: float) -> None:
        p.copy_(mean + s * torch.randn(p.shape, generator=gen))

    offset_norm = isinstance(model, (T.RecurrentGemmaForCausalLM, T.Gemma3ForCausalLM,
                                     T.Gemma2ForCausalLM, T.Gemma3ForConditionalGeneration,
                                     T.Qwen3NextForCausalLM, T.Qwen3_5ForCausalLM,
                                     T.Qwen3_5MoeForConditionalGeneration))
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(1.0 + 7.0 * torch.rand(p.shape, generator=gen)))
        elif leaf == "dt_bias":
            normal(p, -1.0, 0.5)
        elif leaf == "recurrent_param":
            normal(p, 0.0, 0.5)
        elif "linear_attn.norm" in name or "o_norm" in name:  # GDN / KDA output norm: plain w
            normal(p, 1.0, 0.1)
        elif "norm" in name and p.ndim == 1:
            normal(p, 0.0 if offset_norm else 1.0, 0.1)
        elif p.ndim == 1:
            normal(p, 0.0, 0.1)
        elif "conv" in name and p.ndim == 3:  # conv kernels [c, 1, k]
            normal(p, 0.0, 0.3)
        elif "embed" in name:
            normal(p, 0.0, 1.0)
        else:
            normal(p, 0.0, std * math.sqrt(64 / max(64, p.shape[-1])))
    # Expert-choice biases are buffers, zero at init: a loader that ignored them would pass.
    for name, b in model.named_buffers():
        if name.endswith(("expert_bias", "e_score_correction_bias")):
            normal(b, 0.0, 0.1)


def build(name: str, out_dir: Path, *, seed: int = 0) -> torch.nn.Module:
    """Build, randomise and save_pretrained a tiny model; returns the torch model (eval, f32)."""
    make_config, cls = (BUILDERS | VARIANTS)[name]
    cfg = make_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed=seed, std=INIT_STD.get(name, 0.2))
    model.save_pretrained(out_dir)
    return model


TOL = 1e-4
# Ours may differ from float64 by this multiple of transformers' own f32 error where that
# error is large (see check_ill_conditioned).
ILL = 25


def check_ill_conditioned(arch: str, hf_model, ids: np.ndarray, ours: np.ndarray, ref: np.ndarray) -> None:
    """Logits beyond TOL of transformers' f32 ones pass only at positions where the model
    itself is ill-conditioned: measured against transformers' float64 forward, each
    position's error must stay within TOL or ILL times transformers' own f32 error there.

    The case (qwen3_5_moe_vlm, seed 0, row 0, position 62: 2.8e-4): f32 rounding, amplified.
    Each of our layers fed transformers' float64 input of that layer gives its float64 output
    within 5e-6 at every position (1e-6 at 62); no router top-k is near a tie there (the
    smallest gap between the 2nd and 3rd expert probabilities is 0.017). Chained, the error at
    62 grows from 8e-6 to 3.9e-4 in layer 3 (Gated DeltaNet) alone: that layer amplifies a
    random 1e-6 relative input perturbation 15x at 62 and 10x at 69 (median 1.7x; three of
    its four heads' outputs before the gated norm are 5-10x below the median RMS there: a
    cancellation in S_t q_t), and 62 and 69 are exactly where transformers' own f32 forward
    is furthest from its float64 one (2.1e-5 and 5.1e-5 against a median of 2.8e-6). Ours
    is 3.0e-4 from float64 at 62: 15x transformers' own there.
    """
    hf64 = copy.deepcopy(hf_model).double()
    for c in {id(m.config): m.config for m in hf64.modules() if hasattr(m, "config")}.values():
        c._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    with torch.no_grad():
        ref64 = hf64(torch.tensor(ids)).logits.numpy()
    scale = np.abs(ref64).max()
    ours_err = np.abs(ours - ref64).max(-1) / scale  # [b, t]
    own_err = np.abs(ref - ref64).max(-1) / scale
    bad = np.argwhere(ours_err > np.maximum(TOL, ILL * own_err))
    assert not len(bad), (f"{arch}: relative logit error {ours_err.max():.2e} against float64 at "
                          f"{bad.tolist()}, where transformers' f32 error is "
                          f"{[float(f'{own_err[tuple(i)]:.2e}') for i in bad]}")
    print(f"{arch}: {ours_err.max():.2e} from float64 at ill-conditioned positions "
          f"{np.argwhere(ours_err > TOL).tolist()} (transformers' own f32 error there up to "
          f"{own_err[ours_err > TOL].max():.2e})")
