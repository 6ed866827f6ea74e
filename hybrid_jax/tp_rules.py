"""Tensor parallelism's parameter rules: which slice of each global parameter a device holds.

`shard_params` cuts device d's parameters (in the local model's leaf order, checked
against its shapes) out of the global ones; `shard_param` / `shard_shape` apply one
parameter's rule to its data / shape. A rule (`_rule` and the per-mixer `_*_rule`) is
(axis, parts) or None (replicated): `parts` lists the segments of a fused matrix, each
(size, unit count), split unit by unit so a device's shard of a fused matrix is laid out
as the local model expects; the table in hybrid_jax/tensor_parallel.py says what splits
how. FP8 weights split on their scale blocks: `fp8_layout` names them, the block scales
follow the rows / columns their kernel's device holds, and `check_weights_shardable` /
`dequantize_unaligned` deal with the Linears whose split would cut a block.
hybrid_jax/tensor_parallel.py builds the local model and re-exports these names.
Numpy on the host; knows nothing of meshes or serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from hybrid_jax.config import ModelConfig

ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "linear_out")
Fp8Layout = dict[str, tuple[int, object]]  # FP8 Linear's / expert stack's path -> (block, scale dtype)
MOE_SCALES = ("gate_up_scale", "up_scale", "down_scale")


def vocab_split(cfg: ModelConfig, n: int) -> bool:
    """Whether embeddings and the LM head are split by vocabulary (else replicated)."""
    return n > 1 and cfg.vocab_size % n == 0


# -- parameters ---------------------------------------------------------------------------

def _units(x: np.ndarray, axis: int, count: int, n: int, d: int) -> np.ndarray:
    """Device d's share of `count` equal units along `axis` (one unit, replicated, when count < n)."""
    if count % n == 0:
        k = count // n
        unit = x.shape[axis] // count
        return np.take(x, np.arange(d * k * unit, (d + 1) * k * unit), axis=axis)
    unit = x.shape[axis] // count
    u = d * count // n
    return np.take(x, np.arange(u * unit, (u + 1) * unit), axis=axis)


def _segments(x: np.ndarray, axis: int, parts: Sequence[tuple[int, int]], n: int, d: int) -> np.ndarray:
    """Concatenate device d's share of each segment (size, unit count) along `axis`."""
    out, at = [], 0
    for size, count in parts:
        seg = np.take(x, np.arange(at, at + size), axis=axis)
        out.append(_units(seg, axis, count, n, d))
        at += size
    assert at == x.shape[axis], (at, x.shape)
    return np.concatenate(out, axis=axis)


def _rule(names: tuple, cfg: ModelConfig, n: int):
    """(axis, parts) to split a parameter, or None to replicate it. parts: [(size, count)]."""
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    mod = names[-3] if len(names) > 2 else ""
    top = names[0]
    a, m, r, mlp, sb = cfg.attention, cfg.mamba2, cfg.rglru, cfg.mlp, cfg.shared_block
    col = -1 if leaf == "kernel" else 0  # a Linear's output axis (kernel [i, o], bias [o])
    if top == "embed":
        return (0, None) if vocab_split(cfg, n) else None
    if top == "lm_head":
        return (col, None) if vocab_split(cfg, n) else None
    if top == "mtp" and owner == "fc":  # the MTP head's [embedding | hidden] -> d: both whole
        return None
    if "moe" in names:
        return _moe_rule(names, cfg)
    if leaf == "weight" and "norm" in owner:  # RMSNorm / q-k norms (Mamba2's gated norm below)
        if mod == "mamba" and owner == "norm":
            return 0, [(m.d_inner, m.num_heads)]
        return None
    if mod == "gdn" or owner == "gdn":  # before attention's q/k/v: KDA has its own q/k/v_proj
        return _gdn_rule(leaf, owner, cfg, col)
    if cfg.mla is not None and mod == "attention" and owner in _MLA_OWNERS:
        return _mla_rule(owner, cfg, col)
    heads = {"q_proj": a and a.num_heads, "k_proj": a and a.num_kv_heads, "v_proj": a and a.num_kv_heads}
    if owner in heads:  # attention or shared-block q/k/v (gated q_proj: [query | gate] per head)
        e = a.head_dim
        cnt = heads[owner]
        return col, [(a.q_width if owner == "q_proj" and mod == "attention" else cnt * e, cnt)]
    if owner in ROW_PARALLEL and mod != "depth":
        return (0, None) if leaf == "kernel" else None
    if mod == "mamba1" or owner == "mamba1":
        return _mamba1_rule(leaf, owner, cfg, col)
    if mod == "mamba" or owner == "mamba":
        gn, h = m.n_groups * m.state_size, m.num_heads
        xbc = [(m.d_inner, h), (gn, m.n_groups), (gn, m.n_groups)]
        if owner == "in_proj":
            return col, [(m.d_inner, h), *xbc, (h, h)]
        if leaf in ("conv_weight", "conv_bias"):
            return 0, xbc
        if leaf in ("A_log", "D", "dt_bias"):
            return 0, [(h, h)]
    if mod == "recurrent" or owner == "recurrent":
        if owner in ("linear_x", "linear_y"):
            return col, [(r.width, r.num_heads)]
        if leaf in ("conv_weight", "conv_bias", "recurrent_param") or "gate" in leaf:
            return 0, [(r.width if leaf in ("conv_weight", "conv_bias", "recurrent_param")
                        else r.num_heads, r.num_heads)]
    if mod == "conv" or owner == "conv":  # LFM2 short conv: in_proj [B | C | x]
        d = cfg.hidden_size
        if owner == "in_proj":
            return col, [(d, d)] * 3
        if leaf in ("conv_weight", "conv_bias"):
            return 0, [(d, d)]
    if owner in ("gate_proj", "up_proj") and mlp is not None:
        f = mlp.intermediate_size
        return col, [(f, f)]
    if owner == "gate_up_proj":
        f = sb.intermediate_size if top == "shared_blocks" else mlp.intermediate_size
        return col, [(f, f), (f, f)]
    if mod == "depth" or (len(names) > 3 and names[-4] == "depth"):  # shared-block adapters
        lora = names[-3]
        if owner == "up" and lora in ("q", "k", "v"):
            return col, [(a.num_heads * a.head_dim, a.num_heads)]
        if owner == "up" and lora == "gate_up":
            f = sb.intermediate_size
            return col, [(f, f), (f, f)]
        return None  # down LoRAs and the per-depth `linear`
    raise ValueError(f"tensor parallelism: no sharding rule for parameter {'.'.join(map(str, names))}")


def _mamba1_rule(leaf: str, owner: str, cfg: ModelConfig, col: int):
    """Mamba1 by channel (of d_inner): in_proj's xs and z halves, the conv, dt_proj's outputs,
    dt_bias, A_log, D. x_proj contracts the channels into dt, B, C (shared by all channels):
    row-parallel, its partial products summed on every device (`mark_local_model`), so
    Falcon-Mamba's and Jamba's dt/B/C norms (replicated weights) see the whole vector."""
    c = cfg.mamba1.d_inner
    if owner == "in_proj":
        return col, [(c, c), (c, c)]
    if owner == "x_proj":
        return (0, None) if leaf == "kernel" else None
    if owner == "dt_proj":
        return col, [(c, c)]
    if leaf in ("conv_weight", "conv_bias", "dt_bias", "A_log", "D"):
        return 0, [(c, c)]
    raise ValueError(f"tensor parallelism: no sharding rule for Mamba1 parameter {owner}.{leaf}")


_MLA_OWNERS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _mla_rule(owner: str, cfg: ModelConfig, col: int):
    """MLA by head: q_b_proj and kv_b_proj (each head's [k_nope | v] block) column-parallel;
    the latent projections (q_a_proj, kv_a_proj_with_mqa: the latent and the shared key
    slice every head reads) replicated. q_proj and o_proj follow attention's rules."""
    m = cfg.mla
    if owner == "q_b_proj":
        return col, [(m.num_heads * m.qk_head_dim, m.num_heads)]
    if owner == "kv_b_proj":
        return col, [(m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.num_heads)]
    return None


def _gdn_rule(leaf: str, owner: str, cfg: ModelConfig, col: int):
    """Gated DeltaNet by key head: q, k by key head, v, z, b, a, A_log, dt_bias by value head
    (a device's value heads read its key heads); the output norm weight (per head_v_dim,
    shared by the heads) replicated. Qwen3-Next's grouped projections hold whole key-head
    groups, so they split by group. KDA (hk = hv): q/k/v_proj, the forget gate's f_b_proj
    and dt_bias (h dk), the output gate's g_b_proj, b_proj, A_log by head; the low-rank
    f_a_proj and g_a_proj replicated. out_proj / o_proj row-parallel."""
    g = cfg.gated_deltanet
    hk, hv = g.num_k_heads, g.num_v_heads
    if owner in ROW_PARALLEL:
        return (0, None) if leaf == "kernel" else None
    qkv = [(g.key_dim, hk), (g.key_dim, hk), (g.value_dim, hv)]
    if g.kimi_delta:
        kda = {"q_proj": (col, [(g.key_dim, hk)]), "k_proj": (col, [(g.key_dim, hk)]),
               "v_proj": (col, [(g.value_dim, hv)]), "f_b_proj": (col, [(g.key_dim, hk)]),
               "g_b_proj": (col, [(g.value_dim, hv)]), "b_proj": (col, [(hv, hv)]),
               "f_a_proj": None, "g_a_proj": None, "conv_weight": (0, qkv),
               "A_log": (0, [(hv, hv)]), "dt_bias": (0, [(g.key_dim, hk)]), "norm_weight": None}
        key = leaf if owner == "gdn" else owner
        if key not in kda:
            raise ValueError(f"tensor parallelism: no sharding rule for KDA parameter {owner}.{leaf}")
        return kda[key]
    rules = {"in_proj_qkv": (col, qkv), "in_proj_z": (col, [(g.value_dim, hv)]),
             "in_proj_b": (col, [(hv, hv)]), "in_proj_a": (col, [(hv, hv)]),
             "in_proj_qkvz": (col, [(g.conv_dim + g.value_dim, hk)]), "in_proj_ba": (col, [(2 * hv, hk)]),
             "conv_weight": (0, qkv), "A_log": (0, [(hv, hv)]), "dt_bias": (0, [(hv, hv)]),
             "norm_weight": None}
    key = owner if owner.startswith("in_proj") else leaf
    if key not in rules:
        raise ValueError(f"tensor parallelism: no sharding rule for Gated DeltaNet parameter {owner}.{leaf}")
    return rules[key]


def _moe_rule(names: tuple, cfg: ModelConfig):
    """Experts split by their width f (the routed sum is then a partial sum per device);
    the shared expert like the MLP; router, expert bias and shared-expert gate replicated."""
    leaf, owner = names[-1], names[-2]
    if owner == "moe":
        f = cfg.moe.intermediate_size
        if leaf in MOE_SCALES:
            raise AssertionError(f"{leaf}: block scales split by their shape (_moe_scale_rule)")
        return {"gate_up": (-1, [(f, f), (f, f)]), "up": (-1, [(f, f)]),
                "down": (1, None)}.get(leaf)  # None: router, expert_bias, shared_gate
    f = cfg.moe.shared_expert.intermediate_size
    col = -1 if leaf == "kernel" else 0
    if owner in ("gate_proj", "up_proj"):
        return col, [(f, f)]
    if owner == "gate_up_proj":
        return col, [(f, f), (f, f)]
    if owner == "down_proj":
        return (0, None) if leaf == "kernel" else None
    raise ValueError(f"tensor parallelism: no sharding rule for parameter {'.'.join(map(str, names))}")


def _names(path) -> tuple:
    out = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if name != "value":
            out.append(name)
    return tuple(out)


def _moe_scale_rule(leaf: str, shape: tuple[int, ...]):
    """The rule of an FP8 expert stack's block scales [e, in blocks, out blocks], read off
    their shape (units: blocks): gate/up's two halves by columns, down by rows, like their
    stacks (`_moe_rule`); whole blocks per device (`check_weights_shardable`)."""
    if leaf == "gate_up_scale":
        h = shape[-1] // 2
        return -1, [(h, h), (h, h)]
    return (-1, [(shape[-1], shape[-1])]) if leaf == "up_scale" else (1, None)


def _is_moe_scale(names: tuple) -> bool:
    return names[-1] in MOE_SCALES and len(names) > 1 and names[-2] == "moe"


def shard_param(names: tuple, x: np.ndarray, cfg: ModelConfig, n: int, d: int) -> np.ndarray:
    """Device d's shard of the global parameter x at `names` (a path in the model)."""
    rule = _moe_scale_rule(names[-1], x.shape) if _is_moe_scale(names) else _rule(names, cfg, n)
    if rule is None:
        return x
    axis, parts = rule
    axis %= x.ndim
    if parts is None:  # contiguous split (vocabulary, row-parallel inputs)
        return _units(x, axis, n, n, d)
    return _segments(x, axis, parts, n, d)


def shard_shape(names: tuple, shape: tuple[int, ...], cfg: ModelConfig, n: int) -> tuple[int, ...]:
    """The shape of every device's shard of a parameter of `shape` (no data touched)."""
    rule = _moe_scale_rule(names[-1], shape) if _is_moe_scale(names) else _rule(names, cfg, n)
    if rule is None:
        return tuple(shape)
    axis, parts = rule
    axis %= len(shape)
    if parts is None:
        size = shape[axis] // n
    else:
        size = sum(s // c * (c // n if c % n == 0 else 1) for s, c in parts)
    return tuple(size if i == axis else d for i, d in enumerate(shape))


def _scale_shard(names: tuple, scale: np.ndarray, block: int, cfg: ModelConfig, n: int, d: int
                 ) -> np.ndarray:
    """Device d's block scales of the FP8 kernel at names[:-1]: the blocks of the kernel
    rows / columns it holds (aligned: `check_weights_shardable`)."""
    kernel = (*names[:-1], "kernel")
    rule = _rule(kernel, cfg, n)
    if rule is None:
        return scale
    axis = rule[0] % 2
    idx = _held_index(kernel, scale.shape[axis] * block, axis, cfg, n, d)
    return np.take(scale, idx[::block] // block, axis=axis)


def shard_params(cfg: ModelConfig, state, n: int, d: int, local_state,
                 fp8: Fp8Layout | None = None) -> list[np.ndarray]:
    """Device d's parameters (leaves in `local_state` order), checked against its shapes.
    FP8 kernels split as any kernel (their block scales with them: `fp8`, the model's
    `fp8_layout`)."""
    glob = jax.tree_util.tree_flatten_with_path(state)[0]
    loc = jax.tree.leaves(local_state)
    out = []
    for (path, x), want in zip(glob, loc, strict=True):
        names = _names(path)
        if names[-1] == "scale" and (key := ".".join(map(str, names[:-1]))) in (fp8 or {}):
            shard = _scale_shard(names, np.asarray(x), fp8[key][0], cfg, n, d)
        else:
            shard = shard_param(names, np.asarray(x), cfg, n, d)
        if shard.shape != tuple(want.shape):
            raise AssertionError(f"{'.'.join(map(str, names))}: shard {shard.shape} != local {want.shape}")
        out.append(shard)
    return out


# -- FP8 weights: split on their scale blocks ---------------------------------------------

def fp8_layout(model: nnx.Module) -> Fp8Layout:
    """The model's FP8 Linears: path ("layers.0.mlp.down_proj") -> (block, scale dtype), and
    its FP8 expert stacks: path ("layers.0.moe.gate_up") -> (block, scale dtype)."""
    from hybrid_jax.layers.linear import Linear
    from hybrid_jax.layers.moe import MoE

    out = {".".join(map(str, p)): (m.block, m.scale[...].dtype) for p, m in nnx.iter_graph(model)
           if isinstance(m, Linear) and m.quantized}
    for p, m in nnx.iter_graph(model):
        if isinstance(m, MoE) and m.quantized:
            out |= {".".join(map(str, (*p, name))): (m.block, getattr(m, f"{name}_scale")[...].dtype)
                    for name in MoE.STACKS if getattr(m, name) is not None}
    return out


def _held_index(names: tuple, dim: int, axis: int, cfg: ModelConfig, n: int, d: int) -> np.ndarray:
    """The indices along `axis` (0 or -1 of a 2-D kernel) of the parameter at `names` that
    device d holds, in its order (`shard_param` applied to the positions)."""
    x = np.arange(dim).reshape((dim, 1) if axis % 2 == 0 else (1, dim))
    return shard_param(names, x, cfg, n, d).ravel()


def unaligned_fp8_linears(model: nnx.Module, n: int) -> list[tuple[str, nnx.Module]]:
    """(path, Linear) of the FP8 Linears whose split over n devices cuts a scale block."""
    from hybrid_jax.layers.linear import Linear

    cfg, out = model.cfg, []
    for path, m in nnx.iter_graph(model):
        if not (isinstance(m, Linear) and m.quantized) or n == 1:
            continue
        names = (*path, "kernel")
        rule = _rule(names, cfg, n)
        if rule is None:
            continue
        axis, block = rule[0], m.block
        dim = m.kernel[...].shape[axis]
        aligned = dim % block == 0 and all(
            len(idx) % block == 0 and (idx.reshape(-1, block) == idx.reshape(-1, block)[:, :1]
                                      + np.arange(block)).all() and (idx[::block] % block == 0).all()
            for idx in (_held_index(names, dim, axis, cfg, n, d) for d in range(n)))
        if not aligned:
            out.append((".".join(map(str, path)), m))
    return out


def dequantize_unaligned(model: nnx.Module, n: int) -> list[str]:
    """Hold in the compute dtype, in place, every FP8 Linear whose split over n devices would
    cut a scale block (small projections such as Qwen3.5's in_proj_a / in_proj_b, 32 value
    heads wide, or a one-KV-head k_proj of 64 rows): exactly the values the FP8 product
    computes with (its kernel dequantized), so outputs are unchanged; -> their paths."""
    paths = []
    for path, m in unaligned_fp8_linears(model, n):
        m.set_dense(m.weight())
        paths.append(path)
    return paths


def check_weights_shardable(model: nnx.Module, n: int) -> None:
    """ValueError naming `tensor_parallel_size` unless every FP8 Linear splits on its block
    boundaries: each device's share of the split axis must be whole B x B blocks (then its
    block scales split with it: `shard_params`). The engine first dequantizes the Linears
    that do not (`dequantize_unaligned`); FP8 expert stacks must split whole."""
    from hybrid_jax.layers.moe import MoE

    cfg = model.cfg
    for path, m in nnx.iter_graph(model):
        if isinstance(m, MoE) and m.quantized and n > 1 and (cfg.moe.intermediate_size // n) % m.block:
            raise ValueError(f"tensor_parallel_size={n}: the FP8 experts of {'.'.join(map(str, path))} "
                             f"(width {cfg.moe.intermediate_size}) do not split on their {m.block} x "
                             f"{m.block} scale blocks (each device's {cfg.moe.intermediate_size // n} "
                             "columns must be whole blocks); serve them on one device or with another "
                             "tensor_parallel_size")
    for path, m in unaligned_fp8_linears(model, n):
        raise ValueError(f"tensor_parallel_size={n}: the FP8 weight {path} "
                         f"{m.kernel[...].shape} does not split on its {m.block} x {m.block} scale "
                         "blocks (each device's share must be whole blocks); serve it on one device "
                         "or with another tensor_parallel_size")
