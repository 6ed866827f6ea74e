"""Each mixer's and channel block's shapes: the sub-configs of `ModelConfig`
(hybrid_jax/config.py, which re-exports them). Frozen, self-validating dataclasses; every
architecture quirk that changes numerics is an explicit field. This module knows nothing
of weights, checkpoints or serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _positive(**values: float | int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name}={value} must be > 0")


@dataclass(frozen=True)
class AttentionConfig:
    """Attention shapes and quirks. `rotary_dim` < head_dim rotates only the first dims."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rotary_dim: int | None = None  # None: the whole head_dim
    qkv_bias: bool = False
    o_bias: bool = False
    softcap: float | None = None  # logits = c * tanh(logits / c)
    key_multiplier: float = 1.0  # Falcon-H1: keys scaled BEFORE rotary
    scale: float | None = None  # None: head_dim ** -0.5
    qk_norm: bool = False  # RMS norm of each q and k head before rotary (LFM2, Gemma 3)
    rope: bool = True  # False: no positional encoding (NoPE: Nemotron-H, Granite-4.0-H)
    rope_scaling: float = 1.0  # linear RoPE scaling of global layers (inv_freq / factor)
    sliding_rope_theta: float | None = None  # theta of windowed layers (Gemma 3); None: rope_theta
    # Qwen3-Next / 3.5 gated attention: q_proj yields, per head, the query then a gate of
    # head_dim; the attention output is multiplied by sigmoid(gate) before o_proj.
    output_gate: bool = False

    def __post_init__(self) -> None:
        _positive(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        _positive(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)
        if self.sliding_rope_theta is not None:
            _positive(sliding_rope_theta=self.sliding_rope_theta)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        rd = self.rotary_dim
        if rd is not None and (rd <= 0 or rd > self.head_dim or rd % 2):
            raise ValueError(f"rotary_dim={rd} must be even and in (0, head_dim={self.head_dim}]")
        if self.softcap is not None:
            _positive(softcap=self.softcap)

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def q_width(self) -> int:
        """Columns of q_proj's output: the queries, and with `output_gate` their gates."""
        return self.num_heads * self.head_dim * (2 if self.output_gate else 1)

    @property
    def query_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def rope_params(self, window: int | None) -> tuple[float, float]:
        """(theta, linear scaling factor) of a layer with this window (None = global)."""
        if window is not None and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, 1.0
        return self.rope_theta, self.rope_scaling


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 mixer. in_proj -> [z | x B C | dt]; conv over x B C; SSD; gated norm; out_proj."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    in_proj_bias: bool = False
    out_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    gated_norm: bool = True  # False (Falcon-H1 mamba_rms_norm=false): y * silu(z), no norm
    norm_before_gate: bool = False  # Mamba2: gate first, then grouped RMS norm
    norm_eps: float = 1e-5
    # Falcon-H1 muP: in_proj output segments (z, x, B, C, dt) scaled; not in checkpoints.
    in_proj_multipliers: tuple[float, float, float, float, float] | None = None

    def __post_init__(self) -> None:
        _positive(num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size)
        _positive(n_groups=self.n_groups, conv_kernel=self.conv_kernel, chunk_size=self.chunk_size)
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}"
            )
        lo, hi = self.dt_limit
        if not 0.0 <= lo < hi:
            raise ValueError(f"dt_limit={self.dt_limit} must satisfy 0 <= low < high")
        if self.in_proj_multipliers is not None and len(self.in_proj_multipliers) != 5:
            raise ValueError(f"in_proj_multipliers={self.in_proj_multipliers} must have 5 entries")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_width(self) -> int:
        """Columns of in_proj's output: z, xBC, dt."""
        return self.d_inner + self.conv_dim + self.num_heads


MAMBA1_NORMS = ("none", "unweighted", "weighted")


@dataclass(frozen=True)
class Mamba1Config:
    """Mamba1 mixer: in_proj -> [x | z] (d_inner each); x = silu(conv1d(x)); x_proj(x) ->
    [dt (dt_rank) | B (n) | C (n)], each optionally RMS-normalised (`bcdt_norm`:
    "unweighted" Falcon-Mamba, "weighted" Jamba, "none" Mamba); dt = softplus(dt_proj(dt));
    s = exp(dt A) s + dt x B with A = -exp(A_log) [d_inner, n]; y = (s . C + D x) * silu(z);
    out_proj."""

    d_inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj biases (use_bias / mamba_proj_bias)
    bcdt_norm: str = "none"  # one of MAMBA1_NORMS
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _positive(d_inner=self.d_inner, state_size=self.state_size, dt_rank=self.dt_rank,
                  conv_kernel=self.conv_kernel, norm_eps=self.norm_eps)
        if self.bcdt_norm not in MAMBA1_NORMS:
            raise ValueError(f"bcdt_norm={self.bcdt_norm!r} must be one of {MAMBA1_NORMS}")

    @property
    def x_proj_width(self) -> int:
        return self.dt_rank + 2 * self.state_size


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5 `linear_attention` layers).

    in_proj_qkv -> [q (hk dk) | k (hk dk) | v (hv dv)], a causal depthwise conv (no bias)
    and silu over them; q, k L2-normalised; in_proj_z (hv dv) gates the output, in_proj_b
    and in_proj_a (hv each) give beta = sigmoid(b) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias); value head i reads key head i // (hv / hk);
    output: per-head RMS norm (weight w, not zero-centred) times silu(z), out_proj.
    `grouped_projections` (Qwen3-Next): q, k, v, z come from one projection `in_proj_qkvz`
    and b, a from `in_proj_ba`, their columns grouped per key head ([q_h, k_h, v_h*, z_h*]
    and [b_h*, a_h*] for key head h and its hv / hk value heads), as the checkpoints store them.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64  # the prefill kernel's tile
    grouped_projections: bool = False
    # Kimi Delta Attention (Kimi Linear's `linear_attention`, hybrid_jax/layers/kda.py):
    # q_proj, k_proj, v_proj apart (hk = hv, conv over [q | k | v]); a per-channel log decay
    # g [hv, dk] = -exp(A_log_h) * softplus(f_b(f_a(x)) + dt_bias) from a rank-`gate_rank`
    # forget gate; output norm(o) * w * sigmoid(g_b(g_a(x))) (rank `gate_rank`).
    kimi_delta: bool = False
    gate_rank: int | None = None  # KDA's low-rank gates' inner width (None: head_k_dim)

    def __post_init__(self) -> None:
        _positive(num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim,
                  chunk_size=self.chunk_size)
        if self.kimi_delta and (self.num_k_heads != self.num_v_heads or self.grouped_projections):
            raise ValueError(f"kimi_delta=True needs num_k_heads={self.num_k_heads} == "
                             f"num_v_heads={self.num_v_heads} and grouped_projections=False")
        if self.gate_rank is not None:
            _positive(gate_rank=self.gate_rank)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_k_heads={self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Conv channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def low_rank(self) -> int:
        """KDA's forget / output gates' inner width."""
        return self.head_k_dim if self.gate_rank is None else self.gate_rank


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention as Kimi Linear uses it (DeepSeek-V2's MLA without RoPE).

    q = q_proj(x) (or q_b_proj(norm(q_a_proj(x))) with `q_lora_rank`) [h, dn + dr];
    [c | k_r] = kv_a_proj_with_mqa(x) [r + dr]; [k_n | v] = kv_b_proj(norm(c)) per head
    [h, dn + dv]; k = [k_n | k_r] (k_r shared by every head); softmax scale (dn + dr)^-1/2;
    o_proj over [h dv]. `rope` False: no positional encoding at all (Kimi Linear's
    attention is NoPE; the "rope" part is only a shared key slice). The engine's pages hold
    the latent cache: per token one row [norm(c) | k_r] of `latent_width` = r + dr values,
    attended with the absorbed projections (hybrid_jax/layers/mla.py).
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    bias: bool = False  # attention_bias: kv_a_proj_with_mqa, q_a_proj and o_proj
    rope: bool = False

    def __post_init__(self) -> None:
        _positive(num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                  qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim)
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be >= 0")
        if self.q_lora_rank is not None:
            _positive(q_lora_rank=self.q_lora_rank)
        if self.rope:
            raise ValueError("rope=True: MLA with rotary embeddings is not implemented "
                             "(Kimi Linear's MLA is NoPE)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token and MLA layer: the normed latent and the shared key slice."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RGLRUConfig:
    """Griffin recurrent block: width c split in `num_heads` blocks for the gates."""

    width: int
    num_heads: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        _positive(width=self.width, num_heads=self.num_heads, conv_kernel=self.conv_kernel)
        if self.width % self.num_heads:
            raise ValueError(f"width={self.width} must be a multiple of num_heads={self.num_heads}")


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short conv: in_proj d -> 3d (B, C, x), y = C * conv_k(B * x), out_proj."""

    conv_kernel: int = 3
    bias: bool = False  # in_proj, conv and out_proj biases (LFM2's conv_bias)
    channels: int | None = None  # conv channels; None: hidden_size (a tensor-parallel shard: its share)

    def __post_init__(self) -> None:
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")


@dataclass(frozen=True)
class SharedBlockConfig:
    """Zamba2's shared attention + MLP blocks, reused by the SHARED_BLOCK layers in turn.

    The j-th SHARED_BLOCK layer uses block j % num_blocks and its own LoRA adapters
    (rank `adapter_rank`) on gate_up (always) and on q, k, v (`attention_adapters`).
    The attention takes concat(h, embeddings) [2d] (shapes in `ModelConfig.attention`);
    the MLP is down(act(gate) * up) of width `intermediate_size`.
    """

    num_blocks: int
    intermediate_size: int
    adapter_rank: int
    attention_adapters: bool = False
    activation: str = "gelu"
    rope: bool = True  # Zamba2's use_mem_rope

    def __post_init__(self) -> None:
        _positive(num_blocks=self.num_blocks, intermediate_size=self.intermediate_size,
                  adapter_rank=self.adapter_rank)
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATION_NAMES}")


ACTIVATION_NAMES = ("silu", "gelu_tanh", "gelu", "relu2")  # relu2: relu(x) ** 2


@dataclass(frozen=True)
class MLPConfig:
    """Gated MLP: down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier.

    gated=False (Nemotron-H): down(act(up(x))). fused_gate_up (Granite's shared MLP):
    one projection [d, 2f] whose first half is the gate, second half the up branch.
    """

    intermediate_size: int
    activation: str = "silu"  # one of ACTIVATION_NAMES ("gelu" is the exact erf form)
    bias: bool = False
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0
    gated: bool = True
    fused_gate_up: bool = False

    def __post_init__(self) -> None:
        _positive(intermediate_size=self.intermediate_size)
        if self.fused_gate_up and not self.gated:
            raise ValueError("fused_gate_up=True needs gated=True")
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATION_NAMES}")


ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: a router picks `top_k` of `num_experts` experts per token.

    Scores are softmax or sigmoid of the router logits (computed in f32). The experts are
    chosen by the top-k of score + `expert_bias` (a per-expert bias stored with the
    weights, used ONLY for the choice: LFM2-MoE, Nemotron-H, DeepSeek-style), optionally
    within the best `topk_group` of `n_group` expert groups (a group's score: the sum of
    its two best biased scores). The chosen experts' weights are their unbiased scores,
    renormalised to sum 1 when `norm_topk` (divided by sum + `norm_eps`; softmax scores
    renormalised are the softmax of the chosen logits, computed so), times
    `routed_scaling`. Each expert is the gated MLP act(x @ gate) * (x @ up) @ down of
    width `intermediate_size` (`gated`=False: act(x @ up) @ down). The optional
    `shared_expert` is a dense MLP every token passes through, added to the routed sum;
    `shared_expert_gate` scales it by sigmoid(x @ w) per token (Qwen).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str = "silu"
    gated: bool = True
    scores: str = "softmax"  # one of ROUTER_SCORES
    norm_topk: bool = True
    norm_eps: float = 0.0
    expert_bias: bool = False
    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert: MLPConfig | None = None
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        _positive(num_experts=self.num_experts, top_k=self.top_k,
                  intermediate_size=self.intermediate_size, routed_scaling=self.routed_scaling,
                  n_group=self.n_group, topk_group=self.topk_group)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATION_NAMES}")
        if self.scores not in ROUTER_SCORES:
            raise ValueError(f"scores={self.scores!r} must be one of {ROUTER_SCORES}")
        if self.norm_eps < 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be >= 0")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} "
                             f"and be >= topk_group={self.topk_group}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"top_k={self.top_k} exceeds the experts of topk_group="
                             f"{self.topk_group} groups")
        if self.shared_expert_gate and self.shared_expert is None:
            raise ValueError("shared_expert_gate=True needs a shared_expert")
