"""Building blocks of the per-architecture name maps: HF tensor name -> native param.

A map is `dict[hf_name, Target]`. `Target.path` is the path of the parameter in the
model's flat NNX state; `Target.transform` says how the HF tensor becomes ours:
  "linear"  torch Linear weight [out, in] -> kernel [in, out] (transpose)
  "conv"    torch depthwise Conv1d weight [c, 1, k] -> [c, k]
  "experts" a stack of torch Linear weights [e, out, in] -> [e, in, out]
  "heads"   a per-head vector stored [1, 1, h, 1] (Kimi Linear's A_log) -> [h]
  "same"    copied as is
`Target.index`, when set, places the tensor in a part of the parameter (numpy basic
indexing of the parameter: an expert's row, a column range): checkpoints that store
each expert's projections apart fill one stacked parameter from many tensors.
Pure data: nothing here touches tensors.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from hybrid_jax.config import Mamba1Config, Mamba2Config, MoEConfig

Transform = Literal["linear", "conv", "experts", "heads", "same"]
Path = tuple[str | int, ...]
Index = tuple[int | slice, ...]


class Target(NamedTuple):
    path: Path
    transform: Transform
    index: Index | None = None  # the part of the parameter this tensor fills (None: all)


WeightMap = dict[str, Target]


def linear(hf: str, path: Path, *, bias: bool) -> WeightMap:
    """A Linear layer: `{hf}.weight` (+ `{hf}.bias`) -> path + kernel (+ bias)."""
    out = {f"{hf}.weight": Target((*path, "kernel"), "linear")}
    if bias:
        out[f"{hf}.bias"] = Target((*path, "bias"), "same")
    return out


def vector(hf: str, path: Path) -> WeightMap:
    return {hf: Target(path, "same")}


def pre_norms(layer: str, i: int) -> WeightMap:
    """A pre-norm block's two norms: `{layer}.input_layernorm` (before the mixer) and
    `{layer}.post_attention_layernorm` (before the MLP) -> layer i's temporal_norm, mlp_norm."""
    return (vector(f"{layer}.input_layernorm.weight", layer_path(i, "temporal_norm", "weight"))
            | vector(f"{layer}.post_attention_layernorm.weight", layer_path(i, "mlp_norm", "weight")))


def trunk(embed: str, final_norm: str, cfg) -> WeightMap:
    """The embedding, the final norm and (untied) the LM head `lm_head.weight`."""
    out = vector(embed, ("embed", "embedding")) | vector(final_norm, ("final_norm", "weight"))
    if not cfg.tie_embeddings:
        out |= linear("lm_head", ("lm_head",), bias=False)
    return out


def attention(hf: str, path: Path, *, qkv_bias: bool, o_bias: bool) -> WeightMap:
    out: WeightMap = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        out |= linear(f"{hf}.{name}", (*path, name), bias=qkv_bias)
    return out | linear(f"{hf}.o_proj", (*path, "o_proj"), bias=o_bias)


def gated_mlp(hf: str, path: Path, *, bias: bool) -> WeightMap:
    out: WeightMap = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        out |= linear(f"{hf}.{name}", (*path, name), bias=bias)
    return out


def mamba2(hf: str, path: Path, cfg: Mamba2Config) -> WeightMap:
    out = linear(f"{hf}.in_proj", (*path, "in_proj"), bias=cfg.in_proj_bias)
    out |= linear(f"{hf}.out_proj", (*path, "out_proj"), bias=cfg.out_proj_bias)
    out[f"{hf}.conv1d.weight"] = Target((*path, "conv_weight"), "conv")
    if cfg.conv_bias:
        out |= vector(f"{hf}.conv1d.bias", (*path, "conv_bias"))
    for name in ("dt_bias", "A_log", "D"):
        out |= vector(f"{hf}.{name}", (*path, name))
    if cfg.gated_norm:
        out |= vector(f"{hf}.norm.weight", (*path, "norm", "weight"))
    return out


def mamba1(hf: str, path: Path, cfg: Mamba1Config) -> WeightMap:
    """A Mamba1 mixer: dt_proj's bias is our dt_bias (added inside the scan)."""
    out = linear(f"{hf}.in_proj", (*path, "in_proj"), bias=cfg.proj_bias)
    out |= linear(f"{hf}.out_proj", (*path, "out_proj"), bias=cfg.proj_bias)
    out |= linear(f"{hf}.x_proj", (*path, "x_proj"), bias=False)
    out |= linear(f"{hf}.dt_proj", (*path, "dt_proj"), bias=False)
    out |= vector(f"{hf}.dt_proj.bias", (*path, "dt_bias"))
    out[f"{hf}.conv1d.weight"] = Target((*path, "conv_weight"), "conv")
    if cfg.conv_bias:
        out |= vector(f"{hf}.conv1d.bias", (*path, "conv_bias"))
    for name in ("A_log", "D"):
        out |= vector(f"{hf}.{name}", (*path, name))
    if cfg.bcdt_norm == "weighted":  # Jamba's dt/B/C norms
        for hf_name, ours in (("dt_layernorm", "dt_norm"), ("b_layernorm", "b_norm"),
                              ("c_layernorm", "c_norm")):
            out |= vector(f"{hf}.{hf_name}.weight", (*path, ours, "weight"))
    return out


def moe_experts(hf_stacked: dict[str, str] | None, hf_per_expert: str | None, path: Path,
                cfg: MoEConfig, parts: dict[str, tuple[str, int, int]]) -> WeightMap:
    """The routed experts' stacks of a MoE layer.

    hf_stacked: our param name ("gate_up", "up", "down") -> HF name of a stored stack
    [e, out, in] (Granite's `input_linear` / `output_linear`). hf_per_expert: the HF prefix of
    per-expert Linears, `{prefix}.{j}.{name}.weight`, with `parts`: HF name -> (our param,
    first output column in it, width) (LFM2-MoE's w1 / w3 into gate_up's two halves).
    """
    out: WeightMap = {}
    for ours, hf in (hf_stacked or {}).items():
        out[hf] = Target((*path, ours), "experts")
    if hf_per_expert is not None:
        for j in range(cfg.num_experts):
            for hf, (ours, start, width) in parts.items():
                index = (j, slice(None), slice(start, start + width))
                out[f"{hf_per_expert}.{j}.{hf}.weight"] = Target((*path, ours), "linear", index)
    return out


def layer_path(i: int, *rest: str) -> Path:
    return ("layers", i, *rest)
