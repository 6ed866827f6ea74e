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

from hybrid_jax.layer_configs import (  # noqa: F401  (re-exported: callers import them from here)
    AttentionConfig,
    GatedDeltaNetConfig,
    Mamba1Config,
    Mamba2Config,
    MLAConfig,
    MLPConfig,
    MoEConfig,
    RGLRUConfig,
    SharedBlockConfig,
    ShortConvConfig,
    _positive,
)


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
