"""Model configuration: frozen, self-validating dataclasses; the layer pattern is data.

A model is a stack of residual layers described by `ModelConfig.layers`, a tuple of
`LayerSpec(kind, window)`. Every layer has a temporal sub-block (pre-norm, then one
or more mixers on the same normed input, summed into the residual) and, when
`ModelConfig.mlp` is set, a channel sub-block (pre-norm, gated MLP). The mixers are:

- ATTENTION: GQA/MQA attention, sliding (`window` = W: a query at q sees keys
  q-W < k <= q) or global (`window` None).
- MAMBA2: the Mamba2 mixer (SSD).
- MAMBA1: the Mamba1 mixer (selective scan: per-channel dt, A [d_inner, n]; Falcon-Mamba, Jamba).
- RGLRU: Griffin's recurrent block (conv1d + RG-LRU).
- HYBRID: attention AND Mamba2 in parallel on the same input, outputs summed
  (Falcon-H1's layer; with a window it is hybrid-jax's native parallel hybrid layer).
- SHORT_CONV: LFM2's gated short convolution (in_proj -> B, C, x; C * conv(B * x)).
- SHARED_BLOCK: Zamba2's hybrid layer: one of the model's shared attention + MLP
  blocks (`ModelConfig.shared_block`, fed concat(h, embeddings), per-depth LoRA
  adapters) whose output is added to the input of this layer's Mamba2 mixer.
- MLP: no temporal sub-block, only the channel one (Nemotron-H's MLP and MoE layers).
- GATED_DELTANET: Gated DeltaNet (Qwen3-Next / Qwen3.5's linear attention): short conv over
  q, k, v, the gated delta rule with a [d_k, d_v] state per value head, gated RMS norm.
  With `GatedDeltaNetConfig.kimi_delta` it is Kimi Delta Attention (KDA, Kimi Linear): the
  same rule and state with a per-channel (per key dim) decay.
- ATTENTION with `ModelConfig.mla` set: multi-head latent attention (Kimi Linear, NoPE);
  `ModelConfig.attention` then describes the per-head K/V the pages hold.

The channel sub-block of a layer is the dense gated MLP (`ModelConfig.mlp`) or, where
its `LayerSpec.moe` is set, the mixture of experts (`ModelConfig.moe`: router, routed
experts, optional shared expert). With `separate_mlp_layers` the channel sub-block lives
only in MLP layers (Nemotron-H: every layer is one residual block around one mixer);
otherwise every layer has one when `mlp` is set or its spec says `moe`.

Sub-configs hold each mixer's shapes; architecture quirks that change numerics are
explicit fields, never inferred from the architecture name. This module knows
nothing of weights, checkpoints or serving.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any


class LayerKind(enum.StrEnum):
    ATTENTION = "attention"
    MAMBA2 = "mamba2"
    MAMBA1 = "mamba1"
    RGLRU = "rglru"
    HYBRID = "hybrid"
    SHORT_CONV = "short_conv"
    SHARED_BLOCK = "shared_block"
    MLP = "mlp"
    GATED_DELTANET = "gated_deltanet"

    @property
    def has_attention(self) -> bool:
        return self in (LayerKind.ATTENTION, LayerKind.HYBRID, LayerKind.SHARED_BLOCK)

    @property
    def has_mamba2(self) -> bool:
        return self in (LayerKind.MAMBA2, LayerKind.HYBRID, LayerKind.SHARED_BLOCK)


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the pattern: its kind, for attention kinds its window (None = global),
    and whether its channel sub-block is the mixture of experts (`moe`) or the dense MLP."""

    kind: LayerKind
    window: int | None = None
    moe: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayerKind(self.kind))
        if self.window is not None:
            if not self.kind.has_attention:
                raise ValueError(f"window={self.window} given for a {self.kind} layer, which has none")
            if self.window < 1:
                raise ValueError(f"window={self.window} must be >= 1 (or None for global)")


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


@dataclass(frozen=True)
class ModelConfig:
    """A whole causal LM. Build presets in `configs/`; loaders build it from HF configs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    attention: AttentionConfig | None = None
    mamba2: Mamba2Config | None = None
    mamba1: Mamba1Config | None = None
    rglru: RGLRUConfig | None = None
    mlp: MLPConfig | None = None
    short_conv: ShortConvConfig | None = None
    shared_block: SharedBlockConfig | None = None
    moe: MoEConfig | None = None
    gated_deltanet: GatedDeltaNetConfig | None = None
    mla: MLAConfig | None = None  # attention layers are MLA (ATTENTION's doc in the module doc)
    norm_eps: float = 1e-6
    norm_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma family)
    tie_embeddings: bool = False
    embedding_scale: float = 1.0
    logits_multiplier: float = 1.0
    logits_softcap: float | None = None
    residual_in_fp32: bool = False
    sandwich_norm: bool = False  # Gemma: each sub-block's output is normed before the add
    residual_multiplier: float = 1.0  # Granite: h = h + branch * m for both sub-blocks
    separate_mlp_layers: bool = False  # Nemotron-H: the MLP only in MLP-kind layers
    # Branch multipliers of the temporal sub-block (Falcon-H1 muP); 1.0 elsewhere.
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Multi-token-prediction head (hybrid_jax/layers/mtp.py): its decoder layers (0: none).
    mtp_num_hidden_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _positive(vocab_size=self.vocab_size, hidden_size=self.hidden_size, norm_eps=self.norm_eps)
        _positive(max_position_embeddings=self.max_position_embeddings)
        layers = tuple(s if isinstance(s, LayerSpec) else LayerSpec(**s) for s in self.layers)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if not layers:
            raise ValueError("layers=() must hold at least one layer")
        kinds = {s.kind for s in layers}
        needs = {
            "attention": any(k.has_attention for k in kinds),
            "mamba2": any(k.has_mamba2 for k in kinds),
            "mamba1": LayerKind.MAMBA1 in kinds,
            "rglru": LayerKind.RGLRU in kinds,
            "short_conv": LayerKind.SHORT_CONV in kinds,
            "shared_block": LayerKind.SHARED_BLOCK in kinds,
            "gated_deltanet": LayerKind.GATED_DELTANET in kinds,
        }
        for name, needed in needs.items():
            if needed and getattr(self, name) is None:
                raise ValueError(f"{name}=None but the layer pattern has {name} layers")
        if any(s.kind == LayerKind.MLP and not s.moe for s in layers) and self.mlp is None:
            raise ValueError("mlp=None but the layer pattern has mlp layers")
        if any(s.moe for s in layers) and self.moe is None:
            raise ValueError("moe=None but the layer pattern has moe layers")
        if self.separate_mlp_layers and LayerKind.MLP not in kinds:
            raise ValueError("separate_mlp_layers=True but the layer pattern has no mlp layers")
        if self.logits_softcap is not None:
            _positive(logits_softcap=self.logits_softcap)
        if self.mla is not None:
            _check_mla(self.mla, self.attention, layers)
        if self.mtp_num_hidden_layers < 0:
            raise ValueError(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers} must be >= 0")
        if self.mtp_num_hidden_layers and not any(k.has_attention for k in kinds):
            raise ValueError(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers}: the MTP head's "
                             "attention layer needs a model with attention layers")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"eos_token_ids contains {tok}, outside [0, {self.vocab_size})")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_has_mlp(self, spec: LayerSpec) -> bool:
        """Whether a layer's channel sub-block is the dense MLP."""
        if self.mlp is None or spec.moe:
            return False
        return spec.kind == LayerKind.MLP or not self.separate_mlp_layers

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Distinct attention windows in pattern order (None = global): the KV groups."""
        seen: list[int | None] = []
        for spec in self.layers:
            if spec.kind.has_attention and spec.window not in seen:
                seen.append(spec.window)
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (inf written as the string "inf")."""
        d = dataclasses.asdict(self)
        d["layers"] = [{"kind": s.kind.value, "window": s.window} | ({"moe": True} if s.moe else {})
                       for s in self.layers]
        if self.mamba2 is not None:
            d["mamba2"]["dt_limit"] = [_float_out(x) for x in self.mamba2.dt_limit]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        subs = {"attention": AttentionConfig, "mamba2": Mamba2Config, "mamba1": Mamba1Config,
                "rglru": RGLRUConfig,
                "mlp": MLPConfig, "short_conv": ShortConvConfig,
                "shared_block": SharedBlockConfig, "moe": MoEConfig,
                "gated_deltanet": GatedDeltaNetConfig, "mla": MLAConfig}
        for name, sub in subs.items():
            if d.get(name) is not None:
                d[name] = _sub_from_dict(sub, d[name])
        if d.get("moe") is not None and d["moe"].shared_expert is not None:
            shared = d["moe"].shared_expert
            if isinstance(shared, dict):
                d["moe"] = dataclasses.replace(d["moe"], shared_expert=_sub_from_dict(MLPConfig, shared))
        d["layers"] = tuple(LayerSpec(**s) for s in d["layers"])
        return cls(**d)


def _check_mla(mla: MLAConfig, a: AttentionConfig | None, layers: tuple[LayerSpec, ...]) -> None:
    """MLA layers are global ATTENTION layers; `attention` gives their query heads and
    softmax scale (qk_head_dim^-1/2). Their pages hold the latent (`MLAConfig.latent_width`)."""
    want = (mla.num_heads, mla.num_heads, mla.qk_head_dim, False, None)
    got = None if a is None else (a.num_heads, a.num_kv_heads, a.head_dim, a.rope, a.scale)
    if got != want:
        raise ValueError(f"mla={mla} needs attention (num_heads, num_kv_heads, head_dim, rope, "
                         f"scale) = {want}, got {got}")
    if any(s.kind != LayerKind.ATTENTION for s in layers if s.kind.has_attention) or any(
            s.window is not None for s in layers if s.kind.has_attention):
        raise ValueError("mla is set: every attention layer must be a global ATTENTION layer")


def _float_out(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def _sub_from_dict(sub: type, d: dict[str, Any]) -> Any:
    d = dict(d)
    unknown = set(d) - {f.name for f in dataclasses.fields(sub)}
    if unknown:
        raise ValueError(f"unknown {sub.__name__} fields: {sorted(unknown)}")
    if "dt_limit" in d:
        d["dt_limit"] = tuple(float(x) for x in d["dt_limit"])
    if d.get("in_proj_multipliers") is not None:
        d["in_proj_multipliers"] = tuple(d["in_proj_multipliers"])
    return sub(**d)
