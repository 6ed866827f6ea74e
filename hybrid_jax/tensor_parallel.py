"""Tensor parallelism by heads (Megatron style) over a 1-D mesh axis of N devices.

Every device runs the same *local* model: `local_config(cfg, n)` is the model with
1/N of the heads, channels and vocabulary, and `shard_params` cuts each device's
parameters out of the global ones. The serving step runs the local model under
`shard_map`, so every kernel (paged attention, SSD, conv, scans) sees only its
device's heads; the few sums that cross devices are JAX collectives on the mesh
axis, placed by marking layers of the local model (`mark_local_model`):

| what | split | across devices |
|---|---|---|
| attention q | column-parallel by head | - |
| attention k, v, KV pages | by KV head; a KV head is replicated on N/K devices when K < N | - |
| o_proj, MLP down, Mamba2/1 out_proj, RG-LRU linear_out, short-conv out | row-parallel | psum, then bias |
| MLP gate/up (fused or not) | column-parallel; a fused [gate, up] matrix is cut per part | - |
| MoE experts' gate/up, down | each expert by its width f (gate/up per part) | psum of the routed sum |
| FP8 experts' block scales | with their blocks (a device's width share is whole blocks) | - |
| MoE shared expert | as the MLP | psum (its down_proj) |
| MoE router, expert bias, shared-expert gate | replicated | - |
| Mamba2 in_proj | per part: z, x, dt by head; B, C by group (replicated when G < N) | - |
| Mamba2 conv weights and conv state | by channel (x by head, B/C by group) | - |
| Mamba2 A, D, dt_bias, SSM state | by head | - |
| Mamba2 gated norm | by head; a group spread over devices | all_gather of its sums of squares |
| Mamba1 in_proj (xs, z halves), conv, dt_proj out, dt_bias, A_log, D, states | by channel (d_inner) | - |
| Mamba1 x_proj (d_inner -> dt, B, C) | row-parallel | psum (dt, B, C whole on every device) |
| Mamba1 dt/B/C norms (Jamba's weights) | replicated, after the psum | - |
| RG-LRU (linears, conv, gates, state) | by channel block (head) | - |
| Gated DeltaNet q, k (projection, conv, conv state) | by key head | - |
| Gated DeltaNet v, z, b, a, A_log, dt_bias, delta-rule state | by value head (those of the key heads) | - |
| Qwen3-Next's grouped in_proj_qkvz / in_proj_ba | by key-head group | - |
| gated attention's q_proj (query and gate per head) | by head, with its gate | - |
| KDA q/k/v_proj, conv, f_b_proj, dt_bias, g_b_proj, b_proj, A_log, states | by head | - |
| KDA low-rank f_a_proj, g_a_proj; output norm | replicated | - |
| MLA q_proj / q_b_proj, kv_b_proj (k_nope and v per head: W_uk / W_uv absorbed per device) | by head | - |
| MLA latent pages (one row per token that every head reads) | a copy per device on axis 0 | - |
| MLA latent projections q_a_proj, kv_a_proj_with_mqa (+ their norms) | replicated | - |
| embeddings, LM head | by vocabulary (replicated when V % N != 0) | psum / all_gather of logits |
| norms, q/k norms, shared-block adapters' down LoRAs | replicated | - |

A device's shard of a fused matrix is itself laid out as the local model expects
([z | x B C | dt] of the local heads), so the local model's code is the model's code.
This module knows nothing of serving: it maps configs, parameters and cache shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from hybrid_jax.config import LayerKind, ModelConfig

AXIS = "tp"


def _divides(n: int, count: int, replicable: bool) -> bool:
    return count % n == 0 or (replicable and n % count == 0)


def check_shardable(cfg: ModelConfig, n: int) -> None:
    """ValueError naming `tensor_parallel_size` and the dimension that cannot be split."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size={n} must be >= 1")
    if n == 1:
        return
    dims: list[tuple[str, int, bool]] = []  # (what, count, may replicate when count < n)
    kinds = {s.kind for s in cfg.layers}
    if cfg.attention is not None and any(k.has_attention for k in kinds):
        a = cfg.attention
        dims += [("attention heads (num_heads)", a.num_heads, False),
                 ("attention KV heads (num_kv_heads)", a.num_kv_heads, True)]
    if cfg.mamba2 is not None and any(k.has_mamba2 for k in kinds):
        dims += [("SSM heads (mamba2.num_heads)", cfg.mamba2.num_heads, False),
                 ("SSM groups (mamba2.n_groups)", cfg.mamba2.n_groups, True)]
    if cfg.mamba1 is not None and LayerKind.MAMBA1 in kinds:
        dims.append(("Mamba1 channels (mamba1.d_inner)", cfg.mamba1.d_inner, False))
    if cfg.rglru is not None and LayerKind.RGLRU in kinds:
        dims.append(("RG-LRU heads (rglru.num_heads)", cfg.rglru.num_heads, False))
    if cfg.short_conv is not None and LayerKind.SHORT_CONV in kinds:
        dims.append(("short-conv channels (hidden_size)", cfg.hidden_size, False))
    if cfg.gated_deltanet is not None and LayerKind.GATED_DELTANET in kinds:
        # Value head i reads key head i // (hv / hk): splitting the key heads splits both.
        dims.append(("Gated DeltaNet key heads (gated_deltanet.num_k_heads)",
                     cfg.gated_deltanet.num_k_heads, False))
    if cfg.mlp is not None:
        dims.append(("MLP intermediate size (mlp.intermediate_size)", cfg.mlp.intermediate_size, False))
    if cfg.shared_block is not None and LayerKind.SHARED_BLOCK in kinds:
        dims.append(("shared-block MLP intermediate size", cfg.shared_block.intermediate_size, False))
    if cfg.moe is not None:
        dims.append(("MoE expert width (moe.intermediate_size)", cfg.moe.intermediate_size, False))
        if cfg.moe.shared_expert is not None:
            dims.append(("MoE shared-expert width (moe.shared_expert.intermediate_size)",
                         cfg.moe.shared_expert.intermediate_size, False))
    for what, count, replicable in dims:
        if not _divides(n, count, replicable):
            also = " (or be a divisor of it: replicated)" if replicable else ""
            raise ValueError(f"tensor_parallel_size={n} cannot split the {count} {what}: it must "
                             f"divide them{also}; choose a tensor_parallel_size that does")
    # With heads divisible by n and n by the KV heads (groups), a device's heads share one
    # KV head (SSM group): heads per KV head = (heads per device) * (n / KV heads).


Fp8Layout = dict[str, tuple[int, object]]  # FP8 Linear's / expert stack's path -> (block, scale dtype)
MOE_SCALES = ("gate_up_scale", "up_scale", "down_scale")


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


def vocab_split(cfg: ModelConfig, n: int) -> bool:
    """Whether embeddings and the LM head are split by vocabulary (else replicated)."""
    return n > 1 and cfg.vocab_size % n == 0


def _local(count: int, n: int) -> int:
    return max(count // n, 1)


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one of n devices runs: its share of heads, channels and vocabulary."""
    check_shardable(cfg, n)
    if n == 1:
        return cfg
    subs: dict[str, object] = {}
    if cfg.attention is not None:
        a = cfg.attention
        subs["attention"] = dataclasses.replace(a, num_heads=a.num_heads // n,
                                                num_kv_heads=_local(a.num_kv_heads, n))
    if cfg.mla is not None:  # MLA: its query heads (the latent pages are whole on every device)
        subs["mla"] = dataclasses.replace(cfg.mla, num_heads=cfg.mla.num_heads // n)
    if cfg.mamba2 is not None:
        m = cfg.mamba2
        subs["mamba2"] = dataclasses.replace(m, num_heads=_local(m.num_heads, n),
                                             n_groups=_local(m.n_groups, n))
    if cfg.mamba1 is not None:
        subs["mamba1"] = dataclasses.replace(cfg.mamba1, d_inner=cfg.mamba1.d_inner // n)
    if cfg.rglru is not None:
        r = cfg.rglru
        subs["rglru"] = dataclasses.replace(r, width=r.width // n, num_heads=_local(r.num_heads, n))
    if cfg.short_conv is not None:
        subs["short_conv"] = dataclasses.replace(cfg.short_conv, channels=cfg.hidden_size // n)
    if cfg.gated_deltanet is not None:
        g = cfg.gated_deltanet
        subs["gated_deltanet"] = dataclasses.replace(g, num_k_heads=_local(g.num_k_heads, n),
                                                     num_v_heads=_local(g.num_v_heads, n))
    if cfg.mlp is not None:
        subs["mlp"] = dataclasses.replace(cfg.mlp, intermediate_size=_local(cfg.mlp.intermediate_size, n))
    if cfg.shared_block is not None:
        sb = cfg.shared_block
        subs["shared_block"] = dataclasses.replace(sb, intermediate_size=sb.intermediate_size // n)
    if cfg.moe is not None:
        moe, shared = cfg.moe, cfg.moe.shared_expert
        if shared is not None:
            shared = dataclasses.replace(shared, intermediate_size=shared.intermediate_size // n)
        subs["moe"] = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // n,
                                          shared_expert=shared)
    if vocab_split(cfg, n):
        subs["vocab_size"] = cfg.vocab_size // n
        subs["eos_token_ids"] = ()  # ids of the global vocabulary
    return dataclasses.replace(cfg, **subs)


ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "linear_out")


def mark_local_model(model: nnx.Module, cfg: ModelConfig, n: int) -> nnx.Module:
    """Set the collectives of a local model (built from `local_config`) on `AXIS`."""
    from hybrid_jax.layers.linear import Embed, Linear
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.layers.norms import GatedRMSNorm

    g = cfg.mamba2.n_groups if cfg.mamba2 is not None else 1
    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, Linear) and path and (path[-1] in ROW_PARALLEL
                                                 or tuple(path[-2:]) == ("mamba1", "x_proj")):
            mod.reduce_axis = AXIS
        elif isinstance(mod, Linear) and path and path[-1] == "lm_head" and vocab_split(cfg, n):
            mod.gather_axis = AXIS
        elif isinstance(mod, Embed) and vocab_split(cfg, n):
            mod.shard_axis = AXIS
        elif isinstance(mod, GatedRMSNorm) and g < n:
            mod.axis, mod.group_devices = AXIS, n // g
        elif isinstance(mod, MoE):
            mod.reduce_axis = AXIS
    return model


def local_abstract_model(cfg: ModelConfig, n: int, dtype, fp8: Fp8Layout | None = None) -> nnx.Module:
    """The marked local model with abstract (shape-only) parameters; the Linears and expert
    stacks named in `fp8` (`fp8_layout` of the global model) hold FP8 weights and their
    block scales."""
    from hybrid_jax.layers.fp8 import FP8, scale_shape
    from hybrid_jax.layers.linear import Linear
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.model import CausalLM
    from pallas_kernels.grouped_gemm import scale_blocks

    local = local_config(cfg, n)
    model = nnx.eval_shape(lambda: CausalLM(local, dtype=dtype, rngs=nnx.Rngs(0)))
    for path, m in nnx.iter_graph(model):
        if isinstance(m, MoE):
            for name in MoE.STACKS:
                if (key := ".".join(map(str, (*path, name)))) in (fp8 or {}):
                    block, scale_dtype = fp8[key]
                    e, k, nw = shape = tuple(getattr(m, name).value.shape)
                    m.set_fp8(name, jax.ShapeDtypeStruct(shape, FP8), jax.ShapeDtypeStruct(
                        (e, *scale_blocks(k, nw, block, name == "gate_up")), scale_dtype), block)
        if isinstance(m, Linear) and (key := ".".join(map(str, path))) in (fp8 or {}):
            block, scale_dtype = fp8[key]
            shape = tuple(m.kernel.value.shape)
            m.set_fp8(jax.ShapeDtypeStruct(shape, FP8),
                      jax.ShapeDtypeStruct(scale_shape(shape, block), scale_dtype), block)
    return mark_local_model(model, cfg, n)


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


# -- caches ---------------------------------------------------------------------------------

def cache_axes(caches) -> object:
    """Per cache leaf: the axis split over devices (KV pages by KV head, states by head/channel;
    the stacks of hybrid_jax/cache.py: K/V [k, n, P, s, e], states [n, S, ...])."""
    from hybrid_jax.cache import GDNState, KVCache, Mamba1State, Mamba2State, RGLRUState, ShortConvState

    def axes(c):
        if isinstance(c, KVCache):  # FP8 pages' scales [k, n] split with their KV heads
            return KVCache(0, 0) if c.k_scale is None else KVCache(0, 0, 0, 0)
        if isinstance(c, GDNState):
            return GDNState(3, 2)
        if isinstance(c, Mamba2State):
            return Mamba2State(3, 2)
        if isinstance(c, Mamba1State):  # conv [n, S, k-1, c], ssm [n, S, c, N]: by channel
            return Mamba1State(3, 2)
        if isinstance(c, RGLRUState):
            return RGLRUState(3, 2)
        if isinstance(c, ShortConvState):
            return ShortConvState(3)
        return None

    is_leaf = lambda c: isinstance(c, KVCache | Mamba2State | Mamba1State | RGLRUState | ShortConvState
                                   | GDNState)
    return jax.tree.map(axes, caches, is_leaf=is_leaf)


def shard_kv_scales(cfg: ModelConfig, scales: tuple[tuple[np.ndarray, np.ndarray], ...], n: int
                    ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """FP8 KV scales of the whole model (hybrid_jax/kv_quant.py: per window group (k_scale,
    v_scale), each [k, n_g]) -> the global arrays of the sharded caches: device d's share of
    the KV heads (the heads its K/V pages hold, replicated when k < n) stacked in device
    order along axis 0, [n * k_local, n_g], as `cache_axes` splits them."""
    k = cfg.attention.num_kv_heads
    return tuple(tuple(np.concatenate([_units(np.asarray(x), 0, k, n, d) for d in range(n)])
                       for x in pair) for pair in scales)


# -- devices ---------------------------------------------------------------------------------

def make_mesh(n: int):
    """A 1-D mesh over the first n local devices; ValueError naming the setting if too few."""
    from jax.sharding import Mesh

    if n < 1:
        raise ValueError(f"tensor_parallel_size={n} must be >= 1")
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"tensor_parallel_size={n} needs {n} devices, but this host has "
                         f"{len(devices)} {devices[0].platform} device(s) (more hosts, see "
                         "docs/tensor_parallel.md): lower tensor_parallel_size")
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def host_device():
    """Where to load a model that will be sharded: the host, never one accelerator whole."""
    return jax.devices("cpu")[0]


def param_bytes_per_device(cfg: ModelConfig, n: int, dtype, fp8: Fp8Layout | None = None) -> int:
    """Parameter bytes one device holds with tensor_parallel_size=n (exact shard shapes)."""
    local = local_abstract_model(cfg, n, dtype, fp8)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(local)))
