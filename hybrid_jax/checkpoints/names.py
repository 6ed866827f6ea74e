"""Building blocks of the per-architecture name maps: HF tensor name -> native param.

A map is `dict[hf_name, Target]`. `Target.path` is the path of the parameter in the
model's flat NNX state; `Target.transform` says how the HF tensor becomes ours:
  "linear"  torch Linear weight [out, in] -> kernel [in, out] (transpose)
  "conv"    torch depthwise Conv1d weight [c, 1, k] -> [c, k]
  "same"    copied as is
Pure data: nothing here touches tensors.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from hybrid_jax.config import Mamba2Config

Transform = Literal["linear", "conv", "same"]
Path = tuple[str | int, ...]


class Target(NamedTuple):
    path: Path
    transform: Transform


WeightMap = dict[str, Target]


def linear(hf: str, path: Path, *, bias: bool) -> WeightMap:
    """A Linear layer: `{hf}.weight` (+ `{hf}.bias`) -> path + kernel (+ bias)."""
    out = {f"{hf}.weight": Target((*path, "kernel"), "linear")}
    if bias:
        out[f"{hf}.bias"] = Target((*path, "bias"), "same")
    return out


def vector(hf: str, path: Path) -> WeightMap:
    return {hf: Target(path, "same")}


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


def layer_path(i: int, *rest: str) -> Path:
    return ("layers", i, *rest)
